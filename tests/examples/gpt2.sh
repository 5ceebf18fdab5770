#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# examples/train_gpt2 end to end (ctest example_gpt2):
#   gpt2.sh <build dir>
# 1. --init-model, --make-tokens and --make-tokenizer write a tiny llm.c
#    checkpoint, train and val token files (the bytes of two license texts
#    of base-files) and the byte-level tokenizer;
# 2. a run prints llm.c's lines: the [GPT-2] preamble, "val loss" at steps
#    0, 10, 20, a sample at step 20 between "generating:" and "---", one
#    "step %d: train loss %f (took %f ms)" line per step;
# 3. --save FILE.bin writes llm.c's format, which --model reads back, and
#    bad files fail with a message naming the file;
# 4. --save FILE.safetensors: a run stopped by --stop-after and one
#    interrupted by SIGINT (exit 130 both) and resumed with --resume print
#    the same losses as an uninterrupted run and end with byte-identical
#    checkpoints;
# 5. the checkpoint's precision: a --bf16 checkpoint resumed without --bf16
#    and an f32 one resumed with it are refused naming both precisions, as
#    is another --lr; resumed with --bf16 it prints the unbroken --bf16
#    run's losses.
set -uo pipefail
build=$1
prog=$build/train_gpt2
work=$build/test-gpt2
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail() { echo "FAIL: $*"; exit 1; }
lic=/usr/share/common-licenses
[ -r $lic/GPL-3 ] && [ -r $lic/Apache-2.0 ] || fail "base-files' $lic/GPL-3 and Apache-2.0 are needed"

"$prog" --init-model tiny.bin --layers 2 --channels 32 --heads 2 --vocab 257 --max-seq 32 \
  --seed 5 > init.out || { cat init.out; fail "--init-model"; }
grep -q "padded_vocab_size 384" init.out || { cat init.out; fail "V 257 pads to 384"; }
[ "$(stat -c %s tiny.bin)" -eq $((1024 + 4 * $(sed -E 's/.*: ([0-9]+) parameters/\1/' init.out))) ] ||
  fail "tiny.bin is not 1024 bytes + 4 per parameter"
"$prog" --make-tokens $lic/GPL-3 train.bin > /dev/null || fail "--make-tokens train"
"$prog" --make-tokens $lic/Apache-2.0 val.bin > /dev/null || fail "--make-tokens val"
"$prog" --make-tokenizer tok.bin > /dev/null || fail "--make-tokenizer"
[ "$(stat -c %s train.bin)" -eq $((1024 + 2 * $(stat -c %s $lic/GPL-3))) ] ||
  fail "train.bin is not 1024 bytes + 2 per byte of GPL-3"
echo "ok   files written"

args=(--model tiny.bin --train train.bin --batch 2 --seq 16 --threads 1)
"$prog" "${args[@]}" --val val.bin --steps 22 --tokenizer tok.bin --lr 3e-3 > run.out 2>&1 ||
  { cat run.out; fail "training run"; }
grep -qx "\[GPT-2\]" run.out && grep -qx "padded_vocab_size: 384" run.out ||
  { cat run.out; fail "llm.c's preamble"; }
[ "$(grep -c '^val loss [0-9]*\.[0-9]\{6\}$' run.out)" -eq 3 ] || { cat run.out; fail "3 val losses"; }
[ "$(grep -c '^step [0-9]*: train loss [0-9]*\.[0-9]\{6\} (took [0-9]*\.[0-9]\{6\} ms)$' run.out)" -eq 22 ] ||
  { cat run.out; fail "22 step lines in llm.c's format"; }
grep -A1 -x "generating:" run.out | grep -qx -- "---" || { cat run.out; fail "a sample at step 20"; }
first=$(sed -n 's/^step 0: train loss \([0-9.]*\).*/\1/p' run.out)
last=$(sed -n 's/^step 21: train loss \([0-9.]*\).*/\1/p' run.out)
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || fail "loss did not fall ($first -> $last)"
echo "ok   22 steps in llm.c's format, loss $first -> $last"

# llm.c's format out and back in
"$prog" "${args[@]}" --steps 3 --save after3.bin > s3.out 2>&1 || { cat s3.out; fail "--save .bin"; }
cmp -s <(head -c 1024 tiny.bin) <(head -c 1024 after3.bin) || fail "after3.bin's header differs"
cmp -s tiny.bin after3.bin && fail "after3.bin holds the initial parameters"
"$prog" "${args[@]}" --model after3.bin --steps 1 > m.out 2>&1 || { cat m.out; fail "--model after3.bin"; }
head -c 2000 after3.bin > cut.bin
"$prog" "${args[@]}" --model cut.bin > cut.out 2>&1
[ $? -eq 1 ] && grep -q "cut.bin.*truncated" cut.out || { cat cut.out; fail "truncated checkpoint"; }
"$prog" --model tiny.bin --train tiny.bin --seq 16 > bad.out 2>&1
[ $? -eq 1 ] && grep -q "tiny.bin.*magic.*model checkpoint magic" bad.out ||
  { cat bad.out; fail "a checkpoint given as tokens"; }
"$prog" --model tiny.bin --train train.bin --seq 64 > long.out 2>&1
[ $? -eq 1 ] && grep -q "max_seq_len 32" long.out || { cat long.out; fail "--seq > max_seq_len"; }
echo "ok   --save .bin reads back; bad files refused"

# resuming bit-identically
losses() { sed -n 's/^\(step [0-9]*: train loss [0-9.]*\).*/\1/p' "$1"; }
"$prog" "${args[@]}" --val val.bin --steps 30 --save straight.safetensors > straight.out 2>&1 ||
  { cat straight.out; fail "straight run"; }
"$prog" "${args[@]}" --val val.bin --steps 30 --save stop.safetensors --stop-after 13 > stop.out 2>&1
[ $? -eq 130 ] || { cat stop.out; fail "--stop-after: exit status"; }
"$prog" "${args[@]}" --val val.bin --steps 30 --save resumed.safetensors \
  --resume stop.safetensors > resumed.out 2>&1 || { cat resumed.out; fail "--resume"; }
grep -q "resumed from stop.safetensors at step 13" resumed.out || { cat resumed.out; fail "resume step"; }
cmp <(losses straight.out) <(cat <(losses stop.out) <(losses resumed.out)) ||
  fail "losses differ after --stop-after and --resume"
cmp straight.safetensors resumed.safetensors || fail "checkpoints differ after --resume"
"$prog" "${args[@]}" --steps 30 --seq 8 --resume stop.safetensors > mism.out 2>&1
[ $? -eq 1 ] && grep -q "train.seq_len is 16, this run has 8" mism.out || { cat mism.out; fail "--seq mismatch"; }
echo "ok   --stop-after 13 + --resume: 30 losses and the checkpoint bit-identical"

"$prog" "${args[@]}" --steps 12 --bf16 > b-straight.out 2>&1 || { cat b-straight.out; fail "--bf16 run"; }
"$prog" "${args[@]}" --steps 12 --bf16 --save b-stop.safetensors --stop-after 5 > b-stop.out 2>&1
[ $? -eq 130 ] || { cat b-stop.out; fail "--bf16 --stop-after: exit status"; }
"$prog" "${args[@]}" --steps 12 --resume b-stop.safetensors > b-as-f32.out 2>&1
[ $? -eq 1 ] && grep -q "trained in bf16 mixed precision (--bf16), this run would train in f32 (without --bf16).*add --bf16" b-as-f32.out ||
  { cat b-as-f32.out; fail "a --bf16 checkpoint resumed without --bf16 was not refused naming both"; }
"$prog" "${args[@]}" --steps 30 --bf16 --resume stop.safetensors > f32-as-b.out 2>&1
[ $? -eq 1 ] && grep -q "trained in f32 (without --bf16), this run would train in bf16 mixed precision (--bf16).*drop --bf16" f32-as-b.out ||
  { cat f32-as-b.out; fail "an f32 checkpoint resumed with --bf16 was not refused naming both"; }
"$prog" "${args[@]}" --steps 30 --lr 0.25 --resume stop.safetensors > lr.out 2>&1
[ $? -eq 1 ] && grep -q "trained with --lr 0.0001, this run has --lr 0.25" lr.out ||
  { cat lr.out; fail "another --lr was not refused"; }
"$prog" "${args[@]}" --steps 12 --bf16 --resume b-stop.safetensors > b-resumed.out 2>&1 ||
  { cat b-resumed.out; fail "--bf16 --resume"; }
cmp <(losses b-straight.out) <(cat <(losses b-stop.out) <(losses b-resumed.out)) ||
  fail "--bf16 losses differ after --stop-after and --resume"
echo "ok   the precision and --lr are the checkpoint's: others refused, --bf16 resumed bit for bit"

"$prog" "${args[@]}" --val val.bin --steps 3000 --save int.safetensors > int.out 2>&1 &
pid=$!
for i in $(seq 600); do grep -q "^step 40:" int.out && break; sleep 0.05; done
kill -INT $pid
wait $pid
rc=$?
[ $rc -eq 130 ] || { tail -5 int.out; fail "SIGINT: exit $rc, expected 130"; }
grep -q "^interrupted at step [0-9]*: saved int.safetensors" int.out || { tail -3 int.out; fail "SIGINT save"; }
at=$(sed -n 's/^interrupted at step \([0-9]*\).*/\1/p' int.out)
end=$((at + 5))
"$prog" "${args[@]}" --val val.bin --steps $end --resume int.safetensors > int2.out 2>&1 ||
  { cat int2.out; fail "resume after SIGINT"; }
"$prog" "${args[@]}" --val val.bin --steps $end > ref.out 2>&1 || fail "reference run"
cmp <(losses ref.out) <(cat <(losses int.out) <(losses int2.out)) ||
  fail "losses differ after SIGINT and --resume"
echo "ok   SIGINT at step $at + --resume: $end losses bit-identical"
exit 0
