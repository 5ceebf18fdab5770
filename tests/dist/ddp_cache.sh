#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The disk cache serves data-parallel runs: the 2-rank compiled
# Fashion-MNIST trainer (whose gradients are averaged by gj_ddp's
# post-accumulate hooks, called by the compiled program) started twice on
# one fresh GRADJIT_CACHE_DIR compiles on each rank the first time and
# nothing the second time: both ranks load the program from disk.
#   ddp_cache.sh <mpiexec> <train_fashion_mnist>
set -uo pipefail
mpiexec=$1 exe=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() {
  GRADJIT_CACHE_DIR="$dir/cache" GRADJIT_LOG=cache timeout 300 "$mpiexec" -np 2 --oversubscribe \
    "$exe" --ddp --compiled-autograd --stop-after 4 --quiet --csv - --png - 2>&1
}
fail() { echo "FAIL: $*"; exit 1; }
first=$(run)
echo "$first" | grep -E "gradjit cache|compiled autograd"
compiled=$(echo "$first" | grep -c "\[gradjit cache\] compiled ")
[ "$compiled" -eq 2 ] || fail "the first start compiled $compiled programs, expected one per rank"
ls "$dir/cache"/*.gjc >/dev/null 2>&1 || fail "the first start wrote no disk cache entry"
second=$(run)
echo "$second" | grep -E "gradjit cache|compiled autograd"
compiled=$(echo "$second" | grep -c "\[gradjit cache\] compiled ")
hits=$(echo "$second" | grep -c "\[gradjit cache\] disk hit ")
[ "$compiled" -eq 0 ] || fail "the second start compiled $compiled programs"
[ "$hits" -eq 2 ] || fail "the second start had $hits disk hits, expected one per rank"
echo "$second" | grep -q "0 compiles .* 1 disk hits.* 0 fallbacks" ||
  fail "rank 0's counters do not say 0 compiles, 1 disk hit, 0 fallbacks"
echo "PASS: the second start compiled nothing, both ranks hit the disk cache"
