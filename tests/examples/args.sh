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
for p in train_fashion_mnist train_charlm train_fashion_cnn demo_w1; do
  check "$p --help" 0 "--threads N" "$b/$p" --help
  check "$p --version" 0 "(gradjit " "$b/$p" --version
  check "$p --bogus" 2 "unknown option" "$b/$p" --bogus
  check "$p --threads x" 2 "--threads: 'x' is not a whole number" "$b/$p" --threads x
  check "$p stray" 2 "unexpected argument 'stray'" "$b/$p" stray
done
check "fashion --help default" 0 "examples per batch [128]" "$b/train_fashion_mnist" --help
check "fashion --batch 0" 2 "--batch: '0' is not a whole number in [1, 60000]" \
      "$b/train_fashion_mnist" --batch 0
check "fashion --lr -1" 2 "--lr: '-1' is not a number" "$b/train_fashion_mnist" --lr -1
check "fashion --lr missing" 2 "missing value: --lr" "$b/train_fashion_mnist" --lr
check "charlm --steps and --epochs" 2 "give --steps or --epochs" \
      "$b/train_charlm" --steps 5 --epochs 2
check "charlm --text twice ok in --help" 0 "repeatable" "$b/train_charlm" --help
exit $fail
