#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The example programs' shared command line (examples/args.h): --help shows
# every option with its default, --version the versions, and bad input
# exits 2 with a message naming the option, never runs.
#   args.sh <build dir>
set -uo pipefail
b=$1 fail=0
check() { # name expected-status needle command...
  local name=$1 want=$2 needle=$3; shift 3
  local out; out=$("$@" 2>&1); local st=$?
  if [ "$st" != "$want" ] || ! grep -qF -- "$needle" <<<"$out"; then
    echo "FAIL $name: status $st (want $want), output lacks '$needle':"; echo "$out" | head -5
    fail=1
  else
    echo "ok   $name"
  fi
}
for p in train_fashion_mnist train_charlm train_fashion_cnn demo_w1 train_gpt2; do
  check "$p --help" 0 "--threads N" "$b/$p" --help
  check "$p --version" 0 "(gradjit " "$b/$p" --version
  check "$p --bogus" 2 "unknown option" "$b/$p" --bogus
  check "$p --threads x" 2 "--threads: 'x' is not a whole number" "$b/$p" --threads x
  check "$p stray" 2 "unexpected argument 'stray'" "$b/$p" stray
done
# the compiled modes: one at a time; --both picks its compiled side itself
check "train_gpt2 --help shows --compiled-step" 0 "--compiled-step" "$b/train_gpt2" --help
for p in train_fashion_mnist train_charlm train_fashion_cnn; do
  check "$p --help shows --compiled-step" 0 "--compiled-step" "$b/$p" --help
  check "$p two compiled modes" 2 "two compiled modes; give one" \
        "$b/$p" --compiled-autograd --compiled-step
  check "$p --both --compiled-autograd" 2 "--both already runs compiled autograd" \
        "$b/$p" --both --compiled-autograd
  check "$p --both --compiled-step --compiled-autograd" 2 "two compiled modes" \
        "$b/$p" --both --compiled-step --compiled-autograd
done
check "fashion --zero without --ddp" 2 "--zero shards over the ranks of --ddp" \
      "$b/train_fashion_mnist" --zero 1
check "gpt2 --zero 4" 2 "--zero" "$b/train_gpt2" --zero 4
check "fashion --both --compiled-step --save" 2 "are for one run, not --both" \
      "$b/train_fashion_mnist" --both --compiled-step --save x.st
check "charlm --both --compiled-step --resume" 2 "are for one run, not --both" \
      "$b/train_charlm" --both --compiled-step --resume x.st
check "fashion --help default" 0 "examples per batch [128]" "$b/train_fashion_mnist" --help
check "fashion --batch 0" 2 "--batch: '0' is not a whole number in [1, 60000]" \
      "$b/train_fashion_mnist" --batch 0
check "fashion --lr -1" 2 "--lr: '-1' is not a number" "$b/train_fashion_mnist" --lr -1
check "fashion --lr missing" 2 "missing value: --lr" "$b/train_fashion_mnist" --lr
check "charlm --steps and --epochs" 2 "give --steps or --epochs" \
      "$b/train_charlm" --steps 5 --epochs 2
check "charlm --text twice ok in --help" 0 "repeatable" "$b/train_charlm" --help
g=$b/train_gpt2
check "gpt2 no files" 2 "give --model FILE and --train FILE" "$g"
check "gpt2 --model only" 2 "give --model FILE and --train FILE" "$g" --model m.bin
check "gpt2 --save .txt" 2 "name it FILE.bin" "$g" --model m.bin --train t.bin --save x.txt
check "gpt2 --resume .bin" 2 "takes a FILE.safetensors" "$g" --train t.bin --resume m.bin
check "gpt2 --make-tokens one value" 2 "--make-tokens takes two values" "$g" --make-tokens in.txt
check "gpt2 making and training" 2 "train in a second command" "$g" --init-model m.bin --model m.bin
check "gpt2 two compiled modes" 2 "two compiled modes; give one" \
      "$g" --model m.bin --train t.bin --compiled-autograd --compiled-step
check "gpt2 --batch 0" 2 "--batch: '0' is not a whole number" "$g" --model m.bin --train t.bin --batch 0
check "gpt2 --help shows --make-tokens A B" 0 "--make-tokens A B" "$g" --help
check "gpt2 missing model" 1 "cannot open /nonexistent/m.bin" "$g" --model /nonexistent/m.bin --train t.bin
exit $fail
