#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Every trainer with --compiled-step (ctest example_compiled_step):
#   compiled_step.sh <build dir>
# A few steps of each trainer eager and with the compiled step side by side
# (--both --compiled-step): the compiled step must run compiled (its
# counters print steps and "0 fallbacks", no WARNING line) and give the
# eager loss curve bit for bit (the line "loss curves (...): identical").
# train_charlm also with --vary-ctx (a new length per step: new variants of
# the step, bound to symbolic kernels). train_gpt2 prints llm.c's lines
# rather than a --both table: its losses with --compiled-step (and with
# --compiled-autograd) must be those of the eager run. The Fashion-MNIST
# trainers are skipped when Debian's dataset-fashion-mnist is not installed.
set -uo pipefail
b=$1
work=$b/test-compiled-step
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
fail=0

# both NAME STEPS COMMAND...: a --both --compiled-step run of STEPS steps
both() {
  local name=$1 steps=$2; shift 2
  "$@" > "$name.out" 2>&1
  local st=$?
  if [ $st -ne 0 ] ||
     ! grep -q "^loss curves (eager vs compiled step, $steps steps): identical$" "$name.out" ||
     ! grep -q "compiled step: $steps steps, .*, 0 fallbacks$" "$name.out" ||
     grep -q WARNING "$name.out"; then
    echo "FAIL $name (exit $st):"; cat "$name.out"; fail=1
  else
    echo "ok   $name: $(grep -o "compiled step: .*" "$name.out")"
  fi
}

both charlm 12 "$b/train_charlm" --both --compiled-step --steps 12 --batch 4 --ctx 16 \
  --sample 20 --quiet --csv - --png -
both charlm-vary-ctx 12 "$b/train_charlm" --both --compiled-step --steps 12 --batch 4 \
  --ctx 16 --vary-ctx --sample 0 --quiet --csv - --png -
if [ -r /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  both fashion-mlp 20 "$b/train_fashion_mnist" --both --compiled-step --epochs 1 \
    --batch 3000 --quiet --csv - --png -
  both fashion-cnn 8 "$b/train_fashion_cnn" --both --compiled-step --epochs 1 --limit 512 \
    --batch 64 --channels 4,8 --cosine --quiet --csv - --png -
else
  echo "skip fashion-mlp, fashion-cnn: dataset-fashion-mnist is not installed"
fi

# train_gpt2 on a tiny model it writes itself (as tests/examples/gpt2.sh)
g=$b/train_gpt2
lic=/usr/share/common-licenses
"$g" --init-model tiny.bin --layers 2 --channels 32 --heads 2 --vocab 257 --max-seq 32 \
  --seed 5 > /dev/null && "$g" --make-tokens $lic/GPL-3 train.bin > /dev/null ||
  { echo "FAIL gpt2: cannot make its files"; exit 1; }
args=(--model tiny.bin --train train.bin --batch 2 --seq 16 --steps 8 --threads 1)
losses() { sed -n 's/^\(step [0-9]*: train loss [0-9.]*\).*/\1/p' "$1"; }
"$g" "${args[@]}" > gpt2-eager.out 2>&1 || { cat gpt2-eager.out; echo "FAIL gpt2 eager"; exit 1; }
for m in compiled-step compiled-autograd; do
  "$g" "${args[@]}" --$m > "gpt2-$m.out" 2>&1
  st=$?
  if [ $st -ne 0 ] || [ "$(losses gpt2-eager.out | wc -l)" -ne 8 ] ||
     ! cmp -s <(losses gpt2-eager.out) <(losses "gpt2-$m.out") ||
     ! grep -q "compiled.*: 8 .*, 0 fallbacks$" "gpt2-$m.out" || grep -q WARNING "gpt2-$m.out"; then
    echo "FAIL gpt2 --$m (exit $st):"; cat "gpt2-$m.out"; fail=1
  else
    echo "ok   gpt2 --$m: 8 losses as eager; $(grep -o "compiled.*: 8 .*" "gpt2-$m.out")"
  fi
done
exit $fail
