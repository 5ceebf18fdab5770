#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# A rank that never joins a collective must not hang the others: rank 1 of
# test_dist stays alive but skips the allreduce rank 0 issues; with
# GRADJIT_DIST_TIMEOUT=1 rank 0 must report the timeout error. mpirun's own
# status is not checked (the ranks leave without MPI_Finalize on purpose).
#   diverge.sh <mpiexec> <test_dist>
set -uo pipefail
mpiexec=$1 exe=$2
out=$(GJT_DIST_DIVERGE=1 GRADJIT_DIST_TIMEOUT=1 timeout 120 "$mpiexec" -np 2 --oversubscribe \
      "$exe" 2>&1)
echo "$out"
if echo "$out" | grep -q "diverge: rank 0 rc -1: .*did not complete within 1 s on rank 0 of 2"; then
  echo "PASS: rank 0 got the timeout error"
  exit 0
fi
echo "FAIL: no timeout error from rank 0"
exit 1
