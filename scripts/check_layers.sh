#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Checks the layering of jit/ (docs/architecture.md, "The compiler's
# stages") from the #include lines of the tracked sources:
#   - a file of stage S (jit/S/) includes headers of S, the entry jit/T/T.h
#     of a stage T below S (the table below), jit/jit.h, and autograd/ and
#     runtime/ headers; never frontend/ or dist/;
#   - outside jit/, only jit/jit.h (tests/ may include the stages' entries);
#   - <llvm-c/...> only in jit/codegen/ (and tests/).
# With an object directory (scripts/check_layers.sh OBJDIR, e.g.
# build/CMakeFiles/gj_objs.dir) it also checks the calls the includes do
# not show (gradjit.h reaches every file through runtime/rt.h): each
# symbol a jit/S/ object uses must be defined in S, a stage below it,
# autograd/ or runtime/ (or outside the library).
# Prints one line per violation and exits 1 if there is any.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A below=(
  [base]=""
  [ir]="base"
  [capture]="ir base"
  [plan]="ir base"
  [codegen]="plan ir base"
  [cache]="codegen plan capture ir base"
  [run]="cache codegen plan capture ir base"
  [step]="run cache codegen plan capture ir base"
  [top]="step run cache codegen plan capture ir base")

stage_of() { # jit/S/x -> S; jit/x -> top; else the first folder
  case $1 in
  jit/*/*) local s=${1#jit/}; echo "${s%%/*}" ;;
  jit/*) echo top ;;
  *) echo "${1%%/*}" ;;
  esac
}

bad=0
report() { echo "$1"; bad=1; }

while IFS= read -r f; do
  from=$(stage_of "$f")
  while IFS= read -r line; do
    n=${line%%:*}
    inc=$(sed -E 's/^[0-9]+:[[:space:]]*#[[:space:]]*include[[:space:]]*([<"][^>"]*[>"]).*/\1/' <<<"$line")
    case $inc in
    \<llvm-c/*)
      [[ $f == jit/codegen/* || $f == tests/* ]] || report "$f:$n: LLVM's headers are jit/codegen/'s" ;;
    \"*)
      p=${inc//\"/}
      # a path relative to the including file (../jit/jit.h) from the root
      [ -e "${f%/*}/$p" ] && p=$(realpath -m --relative-to=. "${f%/*}/$p")
      case $p in
      frontend/* | dist/*)
        [[ $f == jit/* ]] && report "$f:$n: jit/ includes $p" ;;
      jit/jit.h) ;;
      jit/*/*)
        to=$(stage_of "$p")
        entry=; [ "${p##*/}" = "$to.h" ] && entry=1
        case $f in
        jit/*)
          [ "$from" = "$to" ] && continue
          [ -n "$entry" ] || { report "$f:$n: $p is internal to jit/$to/ (include jit/$to/$to.h)"; continue; }
          [[ " ${below[$from]} " == *" $to "* ]] || report "$f:$n: jit/$from/ may not use jit/$to/ (arrows point down)" ;;
        tests/*)
          [ -n "$entry" ] || report "$f:$n: $p is internal to jit/$to/ (tests use the entry jit/$to/$to.h)" ;;
        *) report "$f:$n: outside jit/ only jit/jit.h is included, not $p" ;;
        esac ;;
      esac ;;
    esac
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include' "$f" || true)
done < <(git ls-files '*.c' '*.h')

if [ $# -ge 1 ]; then # the calls, from the objects
  objdir=$1
  declare -A def_stage=()
  objects() { # the objects of the tracked sources (not stale ones of moved files)
    find "$objdir" -name '*.c.o' | while IFS= read -r o; do
      rel=${o#"$objdir"/}; [ -e "${rel%.o}" ] && echo "$o"; done
  }
  while IFS= read -r o; do
    rel=${o#"$objdir"/}; rel=${rel%.o}
    s=$(stage_of "$rel")
    while read -r sym; do def_stage[$sym]=$s; done < <(nm -g --defined-only "$o" | awk '{print $3}')
  done < <(objects)
  while IFS= read -r o; do
    rel=${o#"$objdir"/}; rel=${rel%.o}
    [[ $rel == jit/* ]] || continue
    from=$(stage_of "$rel")
    while read -r sym; do
      to=${def_stage[$sym]:-}
      [ -z "$to" ] || [ "$to" = "$from" ] || [ "$to" = autograd ] || [ "$to" = runtime ] && continue
      if [ "$to" = frontend ] || [ "$to" = dist ]; then
        report "$rel: jit/ calls $sym of $to/"
      elif [[ " ${below[$from]} " != *" $to "* ]]; then
        report "$rel: jit/$from/ calls $sym of jit/$to/ (arrows point down)"
      fi
    done < <(nm -u "$o" | awk '{print $2}')
  done < <(objects)
fi
exit $bad
