#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A rank killed in the middle of compiled DDP training (test_dist with
# GJT_DIST_KILL: rank 1 exits at its third step) must not leave the others
# hanging: the job ends within the collective timeout (here 5 s), whether
# mpirun stops the others or their collective times out with an error, and
# the output names the lost rank.
#   killed.sh <mpiexec> <test_dist>
set -uo pipefail
mpiexec=$1 exe=$2
start=$(date +%s)
out=$(GJT_DIST_KILL=1 GRADJIT_DIST_TIMEOUT=5 timeout 120 "$mpiexec" -np 3 --oversubscribe "$exe" 2>&1)
status=$?
took=$(( $(date +%s) - start ))
echo "$out" | grep -E "killed:|exited|aborted|did not complete" | head -8
[ "$status" -ne 124 ] || { echo "FAIL: the job hung (killed by timeout after $took s)"; exit 1; }
[ "$status" -ne 0 ] || { echo "FAIL: the job reported success"; exit 1; }
echo "$out" | grep -q "killed: rank 0 step 1 rc 0" || { echo "FAIL: the steps before the kill did not run"; exit 1; }
# the user learns which rank was lost: mpirun names it (Open MPI: "Process
# name: [[job,1],1]" with rank 1's exit code)
echo "$out" | grep -qE "Process name: \[\[[0-9]+,[0-9]+\],1\]" ||
  { echo "FAIL: nothing names the lost rank 1"; exit 1; }
echo "PASS: the job ended with status $status after $took s, no rank left waiting"
