#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Every source, build and script file of the repository names its license
# (an SPDX line within its first 3 lines), and LICENSE is the MIT text.
#   check_spdx.sh <source dir>
set -euo pipefail
cd "$1"
grep -q "^MIT License" LICENSE || { echo "LICENSE is missing or not the MIT license"; exit 1; }
missing=0 n=0
while IFS= read -r -d '' f; do
  n=$((n + 1))
  if ! head -n 3 "$f" | grep -q "SPDX-License-Identifier: MIT"; then
    echo "no SPDX line: $f"; missing=$((missing + 1))
  fi
done < <(find runtime autograd jit frontend dist tests bench examples scripts cmake .ci \
              -type f \( -name '*.c' -o -name '*.h' -o -name '*.sh' -o -name '*.py' \
              -o -name '*.cmake' -o -name run \) -print0; printf '%s\0' CMakeLists.txt)
echo "$n files checked, $missing without an SPDX line"
[ "$n" -gt 50 ] && [ "$missing" -eq 0 ]
