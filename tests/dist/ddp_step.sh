#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The compiled step under --ddp: the 2-rank Fashion-MNIST trainer run with
# the eager step and with the compiled step (its gradients averaged inside
# the program) prints the same loss at every step of an epoch, and the
# compiled run never falls back (in f32 and in bf16 mixed precision); with
# --zero 1 (AdamW state sharded) the losses are the same again.
#   ddp_step.sh <mpiexec> <train_fashion_mnist>
set -uo pipefail
mpiexec=$1 exe=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
run() { # <csv> [flags]
  local csv=$1; shift
  GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 2 --oversubscribe \
    "$exe" --ddp --epochs 1 --batch 256 --quiet --csv "$csv" --png - "$@" 2>&1
}
eager=$(run "$dir/eager.csv") || fail "the eager run failed: $eager"
compiled=$(run "$dir/compiled.csv" --compiled-step) || fail "the compiled run failed: $compiled"
echo "$compiled" | grep "compiled step:"
echo "$compiled" | grep -q "compiled step: 234 steps, .* 0 fallbacks" ||
  fail "the compiled step did not run all 234 steps without a fallback"
[ "$(wc -l <"$dir/eager.csv")" -eq 235 ] || fail "the eager run wrote $(wc -l <"$dir/eager.csv") lines"
cmp "$dir/eager.csv" "$dir/compiled.csv" || fail "the losses differ: $(diff "$dir/eager.csv" "$dir/compiled.csv" | head -4)"
# bf16 mixed precision under DDP: the compiled step prints the eager
# step's losses (both with --bf16) and never falls back
b16e=$(run "$dir/b16e.csv" --bf16) || fail "the eager --bf16 run failed: $b16e"
b16c=$(run "$dir/b16c.csv" --bf16 --compiled-step) || fail "the compiled --bf16 run failed: $b16c"
echo "$b16c" | grep -q "compiled step: 234 steps, .* 0 fallbacks" ||
  fail "the bf16 compiled step fell back: $(echo "$b16c" | grep -iE 'compiled step|fallback|error' | head -4)"
cmp "$dir/b16e.csv" "$dir/b16c.csv" || fail "bf16: the compiled step's losses differ from eager's"
# ZeRO stage 1: the same allreduce, AdamW on each rank's shards, the shards
# gathered: the same losses again, and each rank holds half the AdamW state
zero=$(run "$dir/zero.csv" --zero 1) || fail "the --zero 1 run failed: $zero"
echo "$zero" | grep "model state"
echo "$zero" | grep -q "rank 1 model state: .*AdamW m and v 2.04 MiB (its shard)" ||
  fail "rank 1 does not hold half of AdamW's 4.09 MiB"
cmp "$dir/eager.csv" "$dir/zero.csv" || fail "--zero 1 changed the losses: $(diff "$dir/eager.csv" "$dir/zero.csv" | head -4)"
# ZeRO stage 2 compiled (a reduce-scatter, another summation order than
# the allreduce): the same losses as stage 2 eager, no fallback
z2e=$(run "$dir/z2e.csv" --zero 2) || fail "the --zero 2 run failed: $z2e"
z2c=$(run "$dir/z2c.csv" --zero 2 --compiled-step) || fail "the --zero 2 --compiled-step run failed: $z2c"
echo "$z2c" | grep -q "compiled step: 234 steps, .* 0 fallbacks" || fail "ZeRO-2's compiled step fell back"
cmp "$dir/z2e.csv" "$dir/z2c.csv" || fail "ZeRO-2 compiled differs from eager: $(diff "$dir/z2e.csv" "$dir/z2c.csv" | head -4)"
# ZeRO stage 3 (the parameters sharded too, gathered per bucket as they are
# read; the compiled step gathers them before its program): stage 2's
# reduce-scatters and updates, so stage 2's losses exactly, eager and
# compiled; each rank holds half the parameters
z3e=$(run "$dir/z3e.csv" --zero 3) || fail "the --zero 3 run failed: $z3e"
echo "$z3e" | grep -q "rank 1 model state: parameters 1.02 MiB (its shard), gradient buckets 0.00 MiB at rest" ||
  fail "rank 1 does not hold half of the 2.04 MiB of parameters under --zero 3: $(echo "$z3e" | grep "model state")"
cmp "$dir/z2e.csv" "$dir/z3e.csv" || fail "ZeRO-3 differs from ZeRO-2: $(diff "$dir/z2e.csv" "$dir/z3e.csv" | head -4)"
z3c=$(run "$dir/z3c.csv" --zero 3 --compiled-step) || fail "the --zero 3 --compiled-step run failed: $z3c"
echo "$z3c" | grep -q "compiled step: 234 steps, .* 0 fallbacks" || fail "ZeRO-3's compiled step fell back"
cmp "$dir/z2e.csv" "$dir/z3c.csv" || fail "ZeRO-3 compiled differs from ZeRO-2: $(diff "$dir/z2e.csv" "$dir/z3c.csv" | head -4)"
# a ZeRO checkpoint resumed on another number of ranks: 2 ranks (ZeRO-1)
# stop after 40 steps and save (each rank its own shards of the AdamW state,
# rank 0 the rest; nothing gathered), 3
# ranks (ZeRO-2, compiled) resume it; an unbroken 2-rank run is the
# reference: the first 40 losses equal, the rest within 1e-5 (f32 sums in
# another order), the same test accuracy
args=(--ddp --epochs 1 --batch 126 --png - --quiet)
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 2 --oversubscribe "$exe" "${args[@]}" --zero 1 \
  --stop-after 40 --save "$dir/ck.st" --csv - >/dev/null 2>&1
[ -s "$dir/ck.st" ] && [ -s "$dir/ck.st.rank0" ] && [ -s "$dir/ck.st.rank1" ] ||
  fail "the ZeRO run stopped without its checkpoint and the shard files of both ranks"
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 3 --oversubscribe "$exe" "${args[@]}" --zero 2 \
  --compiled-step --resume "$dir/ck.st" --csv "$dir/resumed.csv" >"$dir/resumed.out" 2>&1 ||
  { cat "$dir/resumed.out"; fail "3 ranks could not resume the 2-rank ZeRO checkpoint"; }
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 2 --oversubscribe "$exe" "${args[@]}" --zero 1 \
  --csv "$dir/unbroken.csv" >"$dir/unbroken.out" 2>&1 || fail "the unbroken run failed"
paste -d, "$dir/resumed.csv" "$dir/unbroken.csv" | awk -F, 'NR > 1 {
    d = $2 - $4; if (d < 0) d = -d
    if ((NR <= 41 && d != 0) || d > 1e-5) { print "step " $1 ": " $2 " resumed, " $4 " unbroken"; bad = 1 } }
    END { exit bad }' || fail "the resumed run left the unbroken one"
[ "$(grep "final test accuracy" "$dir/resumed.out")" = "$(grep "final test accuracy" "$dir/unbroken.out")" ] ||
  fail "another final accuracy after resuming"
# the same with stage 3 on both sides: the parameters gathered on every rank
# for the save and scattered back into the shards on load; the 2-rank save
# used reduce-scatters (stage 2's order), so every loss within 1e-5
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 2 --oversubscribe "$exe" "${args[@]}" --zero 3 \
  --stop-after 40 --save "$dir/ck3.st" --csv - >/dev/null 2>&1
[ -s "$dir/ck3.st" ] && [ -s "$dir/ck3.st.rank1" ] || fail "the ZeRO-3 run stopped without its checkpoint"
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 3 --oversubscribe "$exe" "${args[@]}" --zero 3 \
  --compiled-step --resume "$dir/ck3.st" --csv "$dir/resumed3.csv" >"$dir/resumed3.out" 2>&1 ||
  { cat "$dir/resumed3.out"; fail "3 ranks could not resume the 2-rank ZeRO-3 checkpoint"; }
paste -d, "$dir/resumed3.csv" "$dir/unbroken.csv" | awk -F, 'NR > 1 {
    d = $2 - $4; if (d < 0) d = -d
    if (d > 1e-5) { print "step " $1 ": " $2 " resumed, " $4 " unbroken"; bad = 1 } }
    END { exit bad }' || fail "the resumed ZeRO-3 run left the unbroken one"
echo "PASS: 234 steps on 2 ranks, the compiled step's and ZeRO-1's losses are the eager step's;"
echo "      a 2-rank ZeRO-1 checkpoint resumed on 3 ranks (ZeRO-2) follows the unbroken run;"
echo "      ZeRO-2 compiled and ZeRO-3 eager and compiled print ZeRO-2 eager's losses;"
echo "      a 2-rank ZeRO-3 checkpoint resumed on 3 ranks (ZeRO-3 compiled) follows it too"
