#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A ZeRO checkpoint resumed on another number of ranks: 3 ranks (ZeRO-1,
# compiled steps) train 2 steps and write the parameters and the optimizer
# state gathered from every rank's shards into one file, then train 2
# more; 2 ranks (ZeRO-2) load the file, each its shards' parts, train the
# last 2 steps and must reach the unbroken run's parameters; the file also
# loads into a plain optimizer; the per-rank shard files the 3 ranks also
# wrote consolidate into exactly the gathered state (test_dist,
# GJT_ZERO_CKPT).
#   zero_ckpt.sh <mpiexec> <test_dist>
set -uo pipefail
mpiexec=$1 exe=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
GJT_ZERO_CKPT="save:$dir/ck.safetensors" timeout 300 "$mpiexec" -np 3 --oversubscribe "$exe" ||
  fail "3 ranks could not train and save"
[ -s "$dir/ck.safetensors" ] && [ -s "$dir/ck.safetensors.final" ] || fail "no checkpoint written"
out=$(GJT_ZERO_CKPT="resume:$dir/ck.safetensors" timeout 300 "$mpiexec" -np 2 --oversubscribe "$exe" 2>&1) ||
  { echo "$out"; fail "2 ranks could not resume"; }
echo "$out" | grep "zero_ckpt:"
[ "$(echo "$out" | grep -c "the unbroken run's parameters")" -eq 2 ] || fail "a rank did not reach the unbroken run"
[ "$(echo "$out" | grep -c "the 3 shard files consolidate to the gathered state")" -eq 2 ] ||
  fail "the shard files did not consolidate to the gathered state"
echo "PASS: saved on 3 ranks (ZeRO-1), resumed on 2 (ZeRO-2), the unbroken run's parameters"
