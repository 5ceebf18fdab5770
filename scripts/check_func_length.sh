#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Checks that no function on the compiled path (jit/**/*.c) has a body of
# more than 100 lines (docs/architecture.md, "The compiler's stages": a long
# procedure is a series of stages over one struct with one cleanup exit).
# A function's body is the lines between the line of its opening brace and
# the line of its closing brace. Comments, strings and character literals
# are skipped when braces are counted.
#   scripts/check_func_length.sh [LIMIT]   (default 100)
# Prints one line per function over the limit and exits 1 if there is any;
# exits 2 when it finds no source file or no function (nothing checked).
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${1:-100}

files=()
while IFS= read -r f; do files+=("$f"); done < <(find jit -name '*.c' 2>/dev/null | sort)
[ ${#files[@]} -gt 0 ] || { echo "check_func_length: no jit/ sources found"; exit 2; }

awk -v limit="$limit" '
function strip(s,    out, i, c, n) { # code only: no comments, strings, chars
  out = ""; n = length(s)
  for (i = 1; i <= n; i++) {
    c = substr(s, i, 1)
    if (incomment) {
      if (c == "*" && substr(s, i + 1, 1) == "/") { incomment = 0; i++ }
      continue
    }
    if (inquote) {
      if (c == "\\") { i++; continue }
      if (c == inquote) inquote = ""
      continue
    }
    if (c == "/" && substr(s, i + 1, 1) == "*") { incomment = 1; i++; continue }
    if (c == "/" && substr(s, i + 1, 1) == "/") break
    if (c == "\"" || c == "\x27") { inquote = c; continue }
    out = out c
  }
  return out
}
FNR == 1 { depth = 0; head = ""; infn = 0; incomment = 0; inquote = "" }
{
  line = $0
  if (!incomment && line ~ /^[ \t]*#/) { # preprocessor lines hold no braces of functions
    if (depth == 0) head = ""
    next
  }
  code = strip(line)
  n = length(code)
  for (i = 1; i <= n; i++) {
    c = substr(code, i, 1)
    if (c == "{") {
      if (depth == 0) {
        # a function: its head has a parameter list and is no initializer
        infn = (head ~ /\(/ && head !~ /=[ \t]*$/ && head !~ /(^|[^=!<>])=([^=]|$)/ && \
                head !~ /^[ \t]*(struct|union|enum|typedef)[^(]*$/)
        if (infn) { start = FNR; name = head; sub(/\(.*/, "", name); sub(/.*[ \t*]/, "", name); nfn++ }
      }
      depth++
    } else if (c == "}") {
      depth--
      if (depth == 0) {
        if (infn) {
          body = FNR - start - 1
          if (body > limit) {
            printf "%s:%d: %s has %d body lines (at most %d on the compiled path)\n", FILENAME, start, name, body, limit
            bad = 1
          }
        }
        infn = 0; head = ""
      }
    } else if (c == ";" && depth == 0) {
      head = ""
    } else if (depth == 0) {
      head = head c
    }
  }
  if (depth == 0) head = head " "
}
END {
  if (nfn == 0) { print "check_func_length: no function found in jit/"; exit 2 }
  exit bad
}' "${files[@]}"
