#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The example trainers resume bit-identically (ctest resume_trainers):
#   resume_trainers.sh <build dir> <python3>
# For train_charlm (text from base-files, always present) and, when the
# dataset-fashion-mnist package is installed, train_fashion_mnist:
#   1. one uninterrupted run with --save;
#   2. a run stopped by --stop-after N (exit 130, checkpoint saved), resumed
#      with --resume to the end;
#   3. a run stopped by a real SIGINT in mid-run, resumed likewise.
#   4. a run stopped with --compiled-autograd, resumed with --compiled-step:
#      every mode computes eager's bits, so it must end where 1. ended.
#   5. the precision is the checkpoint's: a --bf16 checkpoint resumed
#      without --bf16, and an f32 one resumed with it, are refused with a
#      message naming both precisions and the flag to resume with; another
#      --lr is refused likewise; a --bf16 run stopped and resumed with
#      --bf16 ends where an unbroken --bf16 run ends. A checkpoint of an
#      older version (without these records) resumes as the command line
#      says, with a note, and bit for bit when that is how it was trained.
# The loss curves (CSV) must be identical, and the final checkpoints must
# hold the same bytes for every tensor (model, AdamW state, losses) and the
# same metadata (RNG, step), timings excepted.
set -uo pipefail
build=$1 py=$2
work=$build/test-resume
rm -rf "$work" && mkdir -p "$work" && cd "$work" || exit 1
status=0

same_state() { # a.st b.st: tensors and metadata equal except timings
  "$py" - "$1" "$2" <<'PYEOF'
import json, struct, sys
def rd(p):
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    meta = h.pop("__metadata__", {})
    d = raw[8 + n:]
    return {k: (v["dtype"], v["shape"], d[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in h.items()}, meta
timing = {"train.train_s", "train.bwd_total", "train.t_train", "train.fwd_total",
          "train.epoch_s", "train.bwd_ms", "train.step_total", "train.step_ms"}
(ta, ma), (tb, mb) = rd(sys.argv[1]), rd(sys.argv[2])
bad = sorted(k for k in set(ta) | set(tb) if k not in timing and ta.get(k) != tb.get(k))
bad += sorted(k for k in set(ma) | set(mb) if k not in timing and ma.get(k) != mb.get(k))
if bad:
    sys.exit(f"{sys.argv[2]} differs from {sys.argv[1]} in {bad}")
print(f"  {sys.argv[2]}: {len(ta)} tensors and {len(ma)} metadata entries equal to "
      f"{sys.argv[1]} (timings aside)")
PYEOF
}

old_version() { # in.st out.st: in.st without the records of the precision, --lr, threads
  "$py" - "$1" "$2" <<'PYEOF'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
for k in ("train.precision", "train.lr", "train.threads"):
    del h["__metadata__"][k]
b = json.dumps(h).encode()
b += b" " * (-len(b) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(b)) + b + raw[8 + n:])
PYEOF
}

# check NAME PROGRAM PROGRESS_PATTERN STOP_AFTER ARGS...
check() {
  local name=$1 prog=$2 pattern=$3 stop=$4; shift 4
  echo "== $name: $*"
  "$prog" "$@" --csv straight.csv --save straight.st > straight.out 2>&1 ||
    { echo "straight run failed:"; cat straight.out; return 1; }
  "$prog" "$@" --csv - --save stop.st --stop-after "$stop" > stop.out 2>&1
  local rc=$?
  [ $rc -eq 130 ] || { echo "--stop-after: exit $rc, expected 130"; cat stop.out; return 1; }
  "$prog" "$@" --csv resumed.csv --save resumed.st --resume stop.st > resumed.out 2>&1 ||
    { echo "resumed run failed:"; cat resumed.out; return 1; }
  grep -h "stopped\|resumed from" stop.out resumed.out | sed 's/^/  /'
  cmp straight.csv resumed.csv || { echo "loss curves differ after --stop-after"; return 1; }
  same_state straight.st resumed.st || return 1
  # a real Ctrl-C in mid-run
  "$prog" "$@" --csv - --save int.st > int.out 2>&1 &
  local pid=$! i
  for i in $(seq 600); do grep -q "$pattern" int.out && break; sleep 0.1; done
  kill -INT $pid
  wait $pid; rc=$?
  [ $rc -eq 130 ] || { echo "SIGINT: exit $rc, expected 130"; cat int.out; return 1; }
  "$prog" "$@" --csv int-resumed.csv --save int-resumed.st --resume int.st > int-resumed.out 2>&1 ||
    { echo "resumed run (after SIGINT) failed:"; cat int-resumed.out; return 1; }
  grep -h "interrupted\|resumed from" int.out int-resumed.out | sed 's/^/  /'
  cmp straight.csv int-resumed.csv || { echo "loss curves differ after SIGINT"; return 1; }
  same_state straight.st int-resumed.st || return 1
  echo "  $name: $(($(wc -l < straight.csv) - 1)) losses bit-identical after both resumes"
}

# check_modes NAME PROGRAM STOP_AFTER ARGS...: right after `check NAME`
# (whose straight.csv and straight.st it compares with), a run stopped with
# --compiled-autograd and resumed with --compiled-step.
check_modes() {
  local name=$1 prog=$2 stop=$3; shift 3
  echo "== $name: stopped with --compiled-autograd, resumed with --compiled-step"
  "$prog" "$@" --compiled-autograd --csv - --save mix.st --stop-after "$stop" > mix-stop.out 2>&1
  local rc=$?
  [ $rc -eq 130 ] || { echo "--compiled-autograd --stop-after: exit $rc, expected 130"; cat mix-stop.out; return 1; }
  "$prog" "$@" --compiled-step --csv mix.csv --save mix-resumed.st --resume mix.st > mix-resumed.out 2>&1 ||
    { echo "--compiled-step --resume failed:"; cat mix-resumed.out; return 1; }
  grep -q "compiled step: .*, 0 fallbacks" mix-resumed.out && ! grep -q WARNING mix-resumed.out ||
    { echo "the compiled step did not run compiled:"; cat mix-resumed.out; return 1; }
  cmp straight.csv mix.csv || { echo "loss curves differ after mixing the modes"; return 1; }
  same_state straight.st mix-resumed.st || return 1
  echo "  $name: eager = compiled autograd, then the compiled step after --resume, bit for bit"
}

# check_precision NAME PROGRAM STOP_AFTER ARGS...: right after `check NAME`
# (whose f32 checkpoint stop.st it resumes with --bf16), 5. above.
check_precision() {
  local name=$1 prog=$2 stop=$3; shift 3
  echo "== $name: the checkpoint's precision"
  "$prog" "$@" --bf16 --csv b-straight.csv --save b-straight.st > b-straight.out 2>&1 ||
    { echo "--bf16 straight run failed:"; cat b-straight.out; return 1; }
  "$prog" "$@" --bf16 --csv - --save b-stop.st --stop-after "$stop" > b-stop.out 2>&1
  local rc=$?
  [ $rc -eq 130 ] || { echo "--bf16 --stop-after: exit $rc, expected 130"; cat b-stop.out; return 1; }
  # refused: resuming each precision's checkpoint in the other one
  "$prog" "$@" --csv - --resume b-stop.st > b-as-f32.out 2>&1
  rc=$?
  [ $rc -eq 1 ] && grep -q "trained in bf16 mixed precision (--bf16), this run would train in f32 (without --bf16).*add --bf16" b-as-f32.out ||
    { echo "a --bf16 checkpoint resumed without --bf16: exit $rc, expected 1 naming both precisions:"
      cat b-as-f32.out; return 1; }
  grep -- "--resume" b-as-f32.out | sed "s/^/  /"
  "$prog" "$@" --bf16 --csv - --resume stop.st > f32-as-b.out 2>&1
  rc=$?
  [ $rc -eq 1 ] && grep -q "trained in f32 (without --bf16), this run would train in bf16 mixed precision (--bf16).*drop --bf16" f32-as-b.out ||
    { echo "an f32 checkpoint resumed with --bf16: exit $rc, expected 1 naming both precisions:"
      cat f32-as-b.out; return 1; }
  grep -- "--resume" f32-as-b.out | sed "s/^/  /"
  "$prog" "$@" --lr 0.25 --csv - --resume stop.st > lr.out 2>&1
  rc=$?
  [ $rc -eq 1 ] && grep -q "this run has --lr 0.25; resume with --lr" lr.out ||
    { echo "another --lr: exit $rc, expected 1:"; cat lr.out; return 1; }
  grep -- "--resume" lr.out | sed "s/^/  /"
  # accepted: the same precision, bit for bit
  "$prog" "$@" --bf16 --csv b-resumed.csv --save b-resumed.st --resume b-stop.st > b-resumed.out 2>&1 ||
    { echo "--bf16 resumed with --bf16 failed:"; cat b-resumed.out; return 1; }
  cmp b-straight.csv b-resumed.csv || { echo "--bf16 loss curves differ after --resume"; return 1; }
  cmp -s straight.csv b-straight.csv && { echo "--bf16 trained the f32 losses"; return 1; }
  same_state b-straight.st b-resumed.st || return 1
  # an older version's checkpoint: the command line's precision, with a note
  old_version stop.st old.st || return 1
  "$prog" "$@" --csv old.csv --resume old.st > old.out 2>&1 ||
    { echo "an older version's checkpoint was not resumed:"; cat old.out; return 1; }
  grep -q "does not record its precision.*continuing in f32" old.out ||
    { echo "no note on the older version's checkpoint:"; cat old.out; return 1; }
  cmp straight.csv old.csv || { echo "loss curves differ after resuming the older checkpoint"; return 1; }
  echo "  $name: --bf16 and f32 checkpoints refused in the other precision; --bf16 resumed bit for" \
       "bit; an older version's checkpoint resumed with a note"
}

lm_args=(--steps 60 --batch 8 --ctx 32 --threads 1 --sample 40 --png -)
check train_charlm "$build/train_charlm" "step 12/60" 23 "${lm_args[@]}" &&
  check_precision train_charlm "$build/train_charlm" 23 "${lm_args[@]}" &&
  { "$build/train_charlm" "${lm_args[@]}" --vary-ctx --csv - --resume stop.st > vary.out 2>&1
    [ $? -eq 1 ] && grep -q "train.vary_ctx is 0, this run has 1" vary.out ||
      { echo "train_charlm: a checkpoint resumed with another --vary-ctx was not refused:"
        cat vary.out; false; }; } &&
  check_modes train_charlm "$build/train_charlm" 23 "${lm_args[@]}" || status=1
if [ -r /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  fm_args=(--epochs 1 --batch 1500 --threads 1 --png -)
  check train_fashion_mnist "$build/train_fashion_mnist" "epoch 1/1 \[" 17 "${fm_args[@]}" &&
    check_precision train_fashion_mnist "$build/train_fashion_mnist" 17 "${fm_args[@]}" &&
    check_modes train_fashion_mnist "$build/train_fashion_mnist" 17 "${fm_args[@]}" || status=1
else
  echo "== train_fashion_mnist: skipped (dataset-fashion-mnist is not installed)"
fi
exit $status
