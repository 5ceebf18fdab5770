#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Checks the layering of gradjit (docs/architecture.md, "Layers" and "The
# compiler's stages") from the #include lines of the sources and from the
# symbols the library's objects use:
#
#   scripts/check_layers.sh OBJDIR [INCLUDE_DIRS]
#
# OBJDIR is the library's object folder (build/CMakeFiles/gj_objs.dir);
# INCLUDE_DIRS the library's include paths, ':'-separated (ctest passes
# gj_objs's INCLUDE_DIRECTORIES; default: the repository's root and
# frontend/). An include is resolved as the compiler does: "x" from the
# including file's folder first, then the include paths; <x> through the
# include paths only. Headers outside the repository are not checked.
#
# The layers, top to bottom: dist -> frontend -> jit -> autograd -> runtime.
# A library file includes headers, and its object uses symbols, of its own
# folder and the folders below it, and besides:
#   - frontend/gradjit.h (the public header, the shared types) is every
#     folder's; frontend/'s other headers are its own;
#   - outside jit/, only jit/jit.h is included, and a symbol of jit/ that
#     another folder uses is declared in jit/jit.h or a jit/ header it
#     includes (jit/base/base.h) (tests/ may include the stages' entries
#     jit/S/S.h);
#   - dist/ uses the public API (gradjit.h: frontend/ and the public
#     functions the runtime implements), of jit/ only the key agreement
#     hook and the reducer registry (DIST_JIT), of the runtime only rt.h's
#     allocator, errors, remote storages, version counter, dtype sizes and
#     names and tensor labels (DIST_RUNTIME) and gj_math.h's scalar math;
#     nothing of autograd/;
#   - inside jit/, a file of stage S (jit/S/) includes headers of S, the
#     entry jit/S'/S'.h of a stage S' below S (the table below) and
#     jit/jit.h, and its object uses symbols of S and the stages below;
#   - <llvm-c/...> only in jit/codegen/ (and tests/).
# Prints one line per violation and exits 1 if there is any, or when it
# reads no source file or no object (nothing would have been checked).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
  echo "usage: scripts/check_layers.sh OBJDIR [INCLUDE_DIRS]" >&2
  exit 2
fi
objdir=$1
incdirs_arg=${2:-}

# ------------------------------------------------------------ the rules

declare -A rank=([runtime]=0 [autograd]=1 [jit]=2 [frontend]=3 [dist]=4)
layers="dist -> frontend -> jit -> autograd -> runtime"
DIST_JIT='^gj_jit_(set_agreement|reducer_register|reducer_unregister)$'
DIST_RUNTIME='^gj_rt_(malloc|calloc|realloc|free|alloc_data|free_data|set_error|null_result|storage_new_remote|storage_release|bump_version|dtype_name|dtype_size|tensor_label)$'
DIST_RUNTIME_HEADERS=" runtime/rt.h runtime/gj_math.h "

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

stage_of() { # jit/S/x -> S; jit/x -> top
  case $1 in
  jit/*/*) local s=${1#jit/}; echo "${s%%/*}" ;;
  *) echo top ;;
  esac
}

bad=0
report() { echo "$1"; bad=1; }

# Normalises a path relative to the root (a/./b/../c -> a/c) into REPLY;
# fails when it leaves the repository.
norm() {
  local IFS=/ part
  local -a parts out=()
  read -ra parts <<<"$1"
  for part in "${parts[@]}"; do
    case $part in
    '' | .) ;;
    ..) [ ${#out[@]} -gt 0 ] || return 1; unset 'out[${#out[@]}-1]' ;;
    *) out+=("$part") ;;
    esac
  done
  REPLY="${out[*]}"
}

# ------------------------------------------------------- the sources

sources=()
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  while IFS= read -r f; do [ -f "$f" ] && sources+=("$f"); done \
    < <(git ls-files --cached --others --exclude-standard -- '*.c' '*.h' || true)
fi
if [ ${#sources[@]} -eq 0 ]; then # no git (a release tarball): the folders themselves
  while IFS= read -r f; do sources+=("$f"); done \
    < <(find runtime autograd jit frontend dist tests bench examples -name '*.[ch]' 2>/dev/null | sort)
fi
[ ${#sources[@]} -gt 0 ] || { echo "check_layers: no source file found: nothing checked"; exit 1; }
libfiles=0
for f in "${sources[@]}"; do [ -n "${rank[${f%%/*}]:-}" ] && libfiles=$((libfiles + 1)); done
[ $libfiles -gt 0 ] || { echo "check_layers: no library source (runtime/ ... dist/) found"; exit 1; }

incdirs=()
if [ -n "$incdirs_arg" ]; then
  IFS=: read -ra given <<<"$incdirs_arg"
  for d in "${given[@]}"; do
    [ -d "$d" ] || continue
    r=$(realpath -m --relative-to=. "$d")
    case $r in ..*) continue ;; esac # outside the repository (LLVM's headers, MPI's)
    incdirs+=("$r")
  done
else
  incdirs=(. frontend)
fi
[ ${#incdirs[@]} -gt 0 ] || { echo "check_layers: no include path inside the repository"; exit 1; }

# Resolves include `inc` ("x" or <x>) of file f into REPLY (a path from
# the root); fails when no file of the repository is found.
resolve() {
  local f=$1 inc=$2 p=${2:1:${#2}-2} d
  local -a cands=()
  [ "${inc:0:1}" = '"' ] && cands+=("${f%/*}/$p")
  for d in "${incdirs[@]}"; do cands+=("$d/$p"); done
  for p in "${cands[@]}"; do
    if [ -f "$p" ]; then norm "$p" && return 0; fi
  done
  return 1
}

# ------------------------------------------------------- the includes

# Checks library file f (folder from) including header p (folder to).
check_lib_include() {
  local f=$1 n=$2 p=$3 from=$4 to=$5
  [ "$p" = frontend/gradjit.h ] && return 0 # the public header: every folder's
  if [ -z "${rank[$to]:-}" ]; then
    report "$f:$n: the library includes $p, which is outside it"
    return 0
  fi
  if [ "$from" = "$to" ]; then
    [ "$from" = jit ] && check_stage_include "$f" "$n" "$p"
    return 0
  fi
  if [ "${rank[$to]}" -gt "${rank[$from]}" ]; then
    report "$f:$n: $from/ includes $p of $to/, a layer above it ($layers)"
    return 0
  fi
  case $to in
  frontend) report "$f:$n: $p is internal to frontend/ (other folders include gradjit.h)" ;;
  jit) [ "$p" = jit/jit.h ] || report "$f:$n: outside jit/ only jit/jit.h is included, not $p" ;;
  esac
  if [ "$from" = dist ]; then
    case $to in
    autograd) report "$f:$n: dist/ uses nothing of autograd/ ($p)" ;;
    runtime) [[ $DIST_RUNTIME_HEADERS == *" $p "* ]] ||
      report "$f:$n: dist/ includes of the runtime only rt.h and gj_math.h, not $p" ;;
    esac
  fi
}

# A jit/ file including a header of jit/: the stages' arrows.
check_stage_include() {
  local f=$1 n=$2 p=$3 s t entry=
  [ "$p" = jit/jit.h ] && return 0
  s=$(stage_of "$f")
  t=$(stage_of "$p")
  [ "$s" = "$t" ] && return 0
  [ "${p##*/}" = "$t.h" ] && entry=1
  if [ -z "$entry" ]; then
    report "$f:$n: $p is internal to jit/$t/ (include jit/$t/$t.h)"
  elif [[ " ${below[$s]} " != *" $t "* ]]; then
    report "$f:$n: jit/$s/ may not use jit/$t/ (arrows point down)"
  fi
}

for f in "${sources[@]}"; do
  from=${f%%/*}
  while IFS= read -r line; do
    n=${line%%:*}
    inc=$(sed -E 's/^[0-9]+:[[:space:]]*#[[:space:]]*include[[:space:]]*([<"][^>"]*[>"]).*/\1/' <<<"$line")
    case $inc in
    \<llvm-c/*)
      [[ $f == jit/codegen/* || $f == tests/* ]] || report "$f:$n: LLVM's headers are jit/codegen/'s"
      continue ;;
    \<* | \"*) ;;
    *) continue ;; # a macro
    esac
    resolve "$f" "$inc" || continue # a system header, or one outside the repository
    p=$REPLY
    to=${p%%/*}
    if [ -n "${rank[$from]:-}" ]; then
      check_lib_include "$f" "$n" "$p" "$from" "$to"
    elif [[ $p == jit/*/* ]]; then # tests/, bench/, examples/
      t=$(stage_of "$p")
      if [[ $f == tests/* ]]; then
        [ "${p##*/}" = "$t.h" ] || report "$f:$n: $p is internal to jit/$t/ (tests use the entry jit/$t/$t.h)"
      else
        report "$f:$n: outside jit/ only jit/jit.h is included, not $p"
      fi
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include' "$f" || true)
done

# ---------------------------------------------------------- the calls

[ -d "$objdir" ] || { echo "check_layers: no object folder $objdir: nothing checked"; exit 1; }
objects=()
declare -A obj_src=()
while IFS= read -r o; do
  rel=${o#"$objdir"/}
  rel=${rel%.o}
  case $rel in
  gj_math_bc_data.c) src=runtime/math_bc.c ;; # the runtime's math as bitcode (generated)
  *) src=$rel ;;
  esac
  [ -e "$src" ] || continue # a stale object of a file that moved
  objects+=("$o")
  obj_src[$o]=$src
done < <(find "$objdir" -name '*.c.o' | sort)
[ ${#objects[@]} -gt 0 ] || { echo "check_layers: no object in $objdir: nothing checked"; exit 1; }

declare -A def_file=() public=()
for o in "${objects[@]}"; do
  while read -r sym vis; do
    def_file[$sym]=${obj_src[$o]}
    [ "$vis" = DEFAULT ] && public[$sym]=1
  done < <(readelf -sW "$o" | awk '$7 != "UND" && $7 != "Ndx" && ($5 == "GLOBAL" || $5 == "WEAK") {print $8, $6}')
done
# jit/'s door: jit/jit.h and the jit/ headers it includes (base.h: the
# settings and counters the front end's public functions wrap).
door=(jit/jit.h)
for ((k = 0; k < ${#door[@]}; k++)); do
  while IFS= read -r inc; do
    resolve "${door[$k]}" "$inc" || continue
    [[ $REPLY == jit/* && " ${door[*]} " != *" $REPLY "* ]] && door+=("$REPLY")
  done < <(sed -nE 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*([<"][^>"]*[>"]).*/\1/p' "${door[$k]}")
done
jit_h=$(cat "${door[@]}")

for o in "${objects[@]}"; do
  rel=${obj_src[$o]}
  from=${rel%%/*}
  [ -n "${rank[$from]:-}" ] || continue
  while read -r sym; do
    def=${def_file[$sym]:-}
    [ -n "$def" ] || continue # outside the library (libc, LLVM, MPI, ...)
    to=${def%%/*}
    if [ "$to" = "$from" ]; then
      if [ "$from" = jit ]; then
        s=$(stage_of "$rel")
        t=$(stage_of "$def")
        [ "$s" = "$t" ] || [[ " ${below[$s]} " == *" $t "* ]] ||
          report "$rel: jit/$s/ calls $sym of jit/$t/ (arrows point down)"
      fi
      continue
    fi
    if [ "${rank[$to]}" -gt "${rank[$from]}" ]; then
      report "$rel: $from/ calls $sym of $to/, a layer above it ($layers)"
      continue
    fi
    if [ "$to" = jit ] && ! grep -qw -- "$sym" <<<"$jit_h"; then
      report "$rel: $from/ calls $sym of jit/, which jit/jit.h does not declare (${door[*]})"
      continue
    fi
    if [ "$from" = dist ]; then
      case $to in
      autograd) report "$rel: dist/ calls $sym of autograd/ (dist/ uses nothing of autograd/)" ;;
      jit) [[ $sym =~ $DIST_JIT ]] ||
        report "$rel: dist/ calls $sym of jit/ (only the key agreement hook and the reducer registry)" ;;
      runtime) [ -n "${public[$sym]:-}" ] || [[ $sym =~ $DIST_RUNTIME ]] ||
        report "$rel: dist/ calls $sym of runtime/ (the public API, or rt.h's allocator, errors, storages, versions, dtypes, labels)" ;;
      esac
    fi
  done < <(nm -u "$o" | awk '{print $2}')
done
exit $bad
