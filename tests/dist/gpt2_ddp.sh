#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# train_gpt2 --ddp on a tiny llm.c model: 2 ranks at --batch 2 train what
# one process at --batch 4 trains (llm.c's DDP reading order: each rank its
# slice of every 2 x 2 x 16 token chunk), so every printed train and val
# loss agrees within f32 reduction-order rounding; and on 2 ranks the
# compiled step (its gradients averaged inside the program) prints the
# eager step's losses exactly, with no fallback.
#   gpt2_ddp.sh <mpiexec> <train_gpt2>
set -uo pipefail
mpiexec=$1 prog=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cd "$dir" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
lic=/usr/share/common-licenses
[ -r $lic/GPL-3 ] && [ -r $lic/Apache-2.0 ] || fail "base-files' $lic/GPL-3 and Apache-2.0 are needed"
"$prog" --init-model tiny.bin --layers 2 --channels 32 --heads 2 --vocab 257 --max-seq 32 \
  --seed 5 > /dev/null || fail "--init-model"
"$prog" --make-tokens $lic/GPL-3 train.bin > /dev/null || fail "--make-tokens train"
"$prog" --make-tokens $lic/Apache-2.0 val.bin > /dev/null || fail "--make-tokens val"
args=(--model tiny.bin --train train.bin --val val.bin --seq 16 --steps 12 --lr 3e-3
      --sample 0 --threads 1)
GRADJIT_CACHE_DIR=off "$prog" "${args[@]}" --batch 4 > one.out 2>&1 || { cat one.out; fail "1 process"; }
ddp() { # <out> [flags]
  local out=$1; shift
  GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 2 --oversubscribe \
    "$prog" "${args[@]}" --batch 2 --ddp "$@" > "$out" 2>&1 || { cat "$out"; fail "2 ranks $*"; }
}
ddp eager.out
ddp compiled.out --compiled-step
losses() { grep -E "^(step [0-9]+: train loss|val loss)" "$1" | sed -E 's/ \(took.*//'; }
[ "$(losses one.out | wc -l)" -eq 14 ] || { cat one.out; fail "1 process printed $(losses one.out | wc -l) losses"; }
grep -q "DDP over 2 MPI ranks: 2 sequences per rank, 4 per step" eager.out ||
  fail "the 2-rank run does not say how it splits the batch"
# 1 process at B 4 against 2 ranks at B 2: within f32 rounding of the sums
paste <(losses one.out | awk '{print $NF}') <(losses eager.out | awk '{print $NF}') |
  awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-5) { print "differ: " $0; bad = 1 } }
       END { exit bad }' || fail "2 ranks at --batch 2 differ from 1 process at --batch 4"
# the compiled step under DDP: the eager step's bits (as printed) and no fallback
diff <(losses eager.out) <(losses compiled.out) || fail "the compiled DDP step's losses differ"
grep -q "compiled step: 12 steps, .* 0 fallbacks" compiled.out ||
  { grep "compiled step" compiled.out; fail "the compiled DDP step fell back"; }
# ZeRO-1, compiled: the same allreduce, AdamW on each rank's shards: the
# DDP step's losses exactly, no fallback
ddp zero.out --compiled-step --zero 1
diff <(losses eager.out) <(losses zero.out) || fail "ZeRO-1's compiled step changed the losses"
grep -q "compiled step: 12 steps, .* 0 fallbacks" zero.out || fail "ZeRO-1's compiled step fell back"
grep -q "rank 1 model state: .*(its shard)" zero.out || fail "no model-state line for rank 1"
# a ZeRO checkpoint of 2 ranks resumed by 1 rank at twice the batch (the
# same global batches): the last 6 losses within 2e-5 of the unbroken run
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 2 --oversubscribe "$prog" "${args[@]}" --batch 2 \
  --ddp --zero 1 --stop-after 6 --save ck.safetensors > stop.out 2>&1 # (status 130: stopped)
[ -s ck.safetensors ] && [ -s ck.safetensors.rank0 ] && [ -s ck.safetensors.rank1 ] ||
  { cat stop.out; fail "the 2-rank ZeRO run stopped without its checkpoint and shard files"; }
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 1 "$prog" "${args[@]}" --batch 4 --ddp --zero 1 \
  --compiled-step --resume ck.safetensors > resumed.out 2>&1 || { cat resumed.out; fail "1 rank could not resume"; }
paste <(losses eager.out | tail -7 | awk '{print $NF}') <(losses resumed.out | tail -7 | awk '{print $NF}') |
  awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-5 || NF != 2) { print "differ: " $0; bad = 1 } }
       END { exit bad }' || fail "the resumed run left the unbroken one"
# the same checkpoint resumed by one plain process (no --ddp, no ZeRO): the
# shard files consolidated into one AdamW's state
GRADJIT_CACHE_DIR=off "$prog" "${args[@]}" --batch 4 --resume ck.safetensors > plain.out 2>&1 ||
  { cat plain.out; fail "a plain process could not resume the ZeRO checkpoint"; }
paste <(losses eager.out | tail -7 | awk '{print $NF}') <(losses plain.out | tail -7 | awk '{print $NF}') |
  awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-5 || NF != 2) { print "differ: " $0; bad = 1 } }
       END { exit bad }' || fail "the plain resumed run left the unbroken one"
# ZeRO-3 (the parameters sharded, gathered per bucket as read; every rank
# gathers for the val loss): ZeRO-2's reduce-scatters and updates, so its
# losses exactly, eager and compiled
ddp z2.out --zero 2
ddp z3.out --zero 3
ddp z3c.out --zero 3 --compiled-step
diff <(losses z2.out) <(losses z3.out) || fail "ZeRO-3's losses differ from ZeRO-2's"
diff <(losses z2.out) <(losses z3c.out) || fail "ZeRO-3's compiled step's losses differ from ZeRO-2's"
grep -q "compiled step: 12 steps, .* 0 fallbacks" z3c.out || fail "ZeRO-3's compiled step fell back"
grep -q "rank 1 model state: parameters .* (its shard), gradient buckets 0.00 MiB at rest" z3.out ||
  fail "no stage-3 model-state line for rank 1"
# a ZeRO-3 checkpoint (the leaves gathered into llm.c's tensors on every
# rank, rank 0 writing them) resumed by one plain process
GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 2 --oversubscribe "$prog" "${args[@]}" --batch 2 \
  --ddp --zero 3 --stop-after 6 --save ck3.safetensors > stop3.out 2>&1
[ -s ck3.safetensors ] && [ -s ck3.safetensors.rank1 ] || { cat stop3.out; fail "no ZeRO-3 checkpoint"; }
GRADJIT_CACHE_DIR=off "$prog" "${args[@]}" --batch 4 --resume ck3.safetensors > plain3.out 2>&1 ||
  { cat plain3.out; fail "a plain process could not resume the ZeRO-3 checkpoint"; }
paste <(losses z3.out | tail -7 | awk '{print $NF}') <(losses plain3.out | tail -7 | awk '{print $NF}') |
  awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 2e-5 || NF != 2) { print "differ: " $0; bad = 1 } }
       END { exit bad }' || fail "the plain run resumed from ZeRO-3 left the unbroken one"
# a model that does not fit under a memory limit in one process trains
# with stage 3 on 3 ranks (8 layers of 192 channels, 3.6M parameters; one
# process at batch 6 peaks near 70 MiB, a ZeRO-3 rank at batch 2 near 37)
"$prog" --init-model m8.bin --layers 8 --channels 192 --heads 4 --vocab 257 --max-seq 32 \
  --seed 5 > /dev/null || fail "--init-model m8"
big=(--model m8.bin --train train.bin --seq 16 --steps 3 --lr 3e-3 --sample 0 --threads 1)
GRADJIT_MEM_LIMIT_MB=48 GRADJIT_CACHE_DIR=off "$prog" "${big[@]}" --batch 6 > lim1.out 2>&1 &&
  { cat lim1.out; fail "one process trained under the 48 MiB limit: the check proves nothing"; }
grep -q "out of memory under gradjit's memory limit of 48.0 MiB" lim1.out || { cat lim1.out; fail "no limit error"; }
for m in "" --compiled-step; do
  GRADJIT_MEM_LIMIT_MB=48 GRADJIT_CACHE_DIR=off timeout 300 "$mpiexec" -np 3 --oversubscribe \
    -x GRADJIT_MEM_LIMIT_MB "$prog" "${big[@]}" --batch 2 --ddp --zero 3 $m > lim3.out 2>&1 ||
    { cat lim3.out; fail "3 ZeRO-3 ranks $m could not train under the 48 MiB limit"; }
  grep -q "^step 2: train loss" lim3.out || { cat lim3.out; fail "3 ZeRO-3 ranks $m stopped early"; }
done
echo "PASS: 2 ranks at --batch 2 = 1 process at --batch 4 (12 steps, 2 val losses);"
echo "      under a 48 MiB limit one process fails where 3 ZeRO-3 ranks train;"
echo "      ZeRO-3 eager and compiled = ZeRO-2 eager; its checkpoint resumed by 1 plain process;"
echo "      ZeRO-1 compiled = DDP eager; its checkpoint (per-rank shard files) resumed by"
echo "      1 rank with ZeRO and by 1 plain process follows the unbroken run;"
echo "      the compiled DDP step printed the eager step's losses, 0 fallbacks"
