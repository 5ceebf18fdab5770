#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The shared library's ABI is its header: libgradjit.so must export exactly
# the functions gradjit.h declares with GJ_API, and nothing else.
#   check_exports.sh <libgradjit.so> <gradjit.h>
set -euo pipefail
lib=$1 hdr=$2
declared=$(grep -E '^GJ_API ' "$hdr" | grep -oE 'gj_[a-z0-9_]+ *\(' | head -n 100000 |
           sed -E 's/ *\($//' | sort -u)
exported=$(nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRVW]$/ && $3 !~ /^_/ {print $3}' | sort -u) # _end, __bss_start: the linker's
missing=$(comm -23 <(echo "$declared") <(echo "$exported"))
extra=$(comm -13 <(echo "$declared") <(echo "$exported"))
nd=$(echo "$declared" | grep -c . || true)
ne=$(echo "$exported" | grep -c . || true)
echo "declared with GJ_API: $nd, exported by $(basename "$lib"): $ne"
status=0
if [ -n "$missing" ]; then echo "declared but not exported:"; echo "$missing" | sed 's/^/  /'; status=1; fi
if [ -n "$extra" ]; then echo "exported but not in gradjit.h:"; echo "$extra" | sed 's/^/  /'; status=1; fi
[ "$nd" -gt 100 ] || { echo "too few declarations parsed from $hdr"; status=1; }
exit $status
