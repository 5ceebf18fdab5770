#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds gradjit and runs every test suite (ctest).
#   scripts/test.sh             optimised build (RelWithDebInfo) in build/, all tests
#   scripts/test.sh --sanitize  the same built with ASan + UBSan in build-asan/
#   scripts/test.sh --tsan      the thread suites (ctest -L threads) built with
#                               ThreadSanitizer in build-tsan/
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
dir=build; opts=(-DGJ_WERROR=ON); ctest_opts=()
if [ "${1:-}" = "--sanitize" ]; then
  dir=build-asan
  opts+=(-DGJ_SANITIZE=ON -DGJ_BUILD_BENCH=OFF -DGJ_BUILD_EXAMPLES=OFF)
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  export LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp:print_suppressions=0
elif [ "${1:-}" = "--tsan" ]; then
  dir=build-tsan
  opts+=(-DGJ_TSAN=ON -DGJ_BUILD_BENCH=OFF -DGJ_BUILD_EXAMPLES=OFF)
  # die_after_fork=0: test_jit_compiled forks a child that uses the pool
  # (rebuilt there by its atfork handler), which TSan refuses by default
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:die_after_fork=0
  ctest_opts=(-L threads)
fi
cmake -S . -B "$dir" "${opts[@]}" >/dev/null
cmake --build "$dir" -j"$(nproc)"
ctest --test-dir "$dir" --output-on-failure -j"$(nproc)" "${ctest_opts[@]}"
