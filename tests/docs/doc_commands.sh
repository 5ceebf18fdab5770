#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The shell commands of README.md and docs/guide.md, kept from rotting
# (ctest doc_commands):
#   doc_commands.sh <source dir> <build dir> <python3>
#
# Nothing is copied from the docs into this script: the commands are read
# from the markdown, so editing a doc edits the test. The rules:
#
#  1. Run. Every line of a fence opened with ```sh cheap (the word "cheap"
#     after the language; GitHub shows it as an ordinary sh block) is run
#     as written with bash, in order, and must exit 0. Mark a fence cheap
#     only when each line takes seconds. The lines run in a scratch
#     directory that holds:
#       build            a link to the build tree (./build/train_charlm ...)
#       trainer.c, fit.c the guide's complete program (its ```c fence that
#                        starts with "/* fit.c")
#     with gradjit installed (cmake --install) into $PREFIX,
#     PKG_CONFIG_PATH and LD_LIBRARY_PATH pointing into it, and
#     GRADJIT_CACHE_DIR inside the scratch directory. A line that runs a
#     Fashion-MNIST trainer is skipped when the dataset-fashion-mnist
#     package is not installed.
#  2. Options. In every line of every sh fence and in every `code span` of
#     both docs, a command that runs one of the built programs (after
#     VAR=value words, "mpirun -np N", "./build/" or "build/") may use only
#     options that the program's --help prints; `bash scripts/x.sh --opt`
#     needs scripts/x.sh to exist and to mention --opt; `ctest -R name`
#     needs a test of that name; `cmake ... -DNAME=...` a CMake option()
#     of that name (or a CMAKE_ variable).
#  3. Environment. Every GRADJIT_* variable either doc names is read
#     somewhere in the sources (appears as "GRADJIT_..." in a .c or .h).
#  4. Log words. README's GRADJIT_LOG=... example lists the words
#     GRADJIT_LOG=help prints (but "help"), no more, no fewer.
#  5. Paths. Every repository path in a code span or a link of README.md,
#     docs/README.md or docs/guide.md (docs/x.md, tests/..., a bare x.md of
#     docs/) exists.
#  6. The GEMM default. gradjit-bench --help says what GRADJIT_GEMM's
#     default does (runtime/gemm_provider.c, "Settings"): f32 GEMMs measured
#     per shape where a cache directory keeps the choices, OpenBLAS where
#     GRADJIT_CACHE_DIR=off; neither doc says that matmuls go to OpenBLAS.
#  7. C snippets. Every ```c fence of README.md is a complete program whose
#     first line is "/* <name>.c": each is compiled with -Wall -Wextra
#     -Werror against the installed library and run in the scratch
#     directory with GRADJIT_LOG=leaks; it must exit 0 and report 0 tensors
#     alive and 0 scopes open at exit.
set -uo pipefail
src=$(cd "$1" && pwd) build=$(cd "$2" && pwd) py=$3
fail=0
docs=("$src/README.md" "$src/docs/guide.md")
programs="train_fashion_mnist train_fashion_cnn train_charlm demo_w1 gradjit-bench gradjit-gemm-split"
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT

# Extraction (python: markdown is not line-oriented enough for sed).
extract() { # mode docs... [out dir, for snippets]: prints one item per line
  "$py" - "$@" <<'PYEOF'
import re, sys
mode, paths = sys.argv[1], sys.argv[2:]
def fences(text):
    """(info string, [lines]) of every ``` fence"""
    out, info, body = [], None, []
    for ln in text.split("\n"):
        m = re.match(r"^\s*```(.*)$", ln)
        if info is None and m:
            info, body = m.group(1).strip(), []
        elif info is not None and re.match(r"^\s*```\s*$", ln):
            out.append((info, body)); info = None
        elif info is not None:
            body.append(ln)
    return out
def joined(lines):
    """shell lines with backslash continuations joined, comments dropped"""
    cur = ""
    for ln in lines:
        if ln.rstrip().endswith("\\"):
            cur += ln.rstrip()[:-1] + " "; continue
        cur += ln
        if cur.strip() and not cur.strip().startswith("#"):
            yield cur.strip()
        cur = ""
def prose(text):
    """the text outside fences"""
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", text, flags=re.S | re.M)
out_dir = paths.pop() if mode == "snippets" else None
for p in paths:
    text = open(p).read()
    if mode == "cheap":
        for info, body in fences(text):
            if info.split()[:2] == ["sh", "cheap"]:
                for ln in joined(body):
                    print(ln)
    elif mode == "commands":   # every sh fence line and every code span
        for info, body in fences(text):
            if info.split()[:1] == ["sh"]:
                for ln in joined(body):
                    print(ln)
        for span in re.findall(r"`([^`\n]+)`", prose(text)):
            print(span)
    elif mode == "snippets":   # README's ```c fences into <dir>/<name>.c, one name a line
        for info, body in fences(text):
            if info != "c":
                continue
            m = re.match(r"^/\* ([A-Za-z0-9_]+)\.c\b", body[0] if body else "")
            if not m:
                print("-\t" + (body[0] if body else "(empty)"))
                continue
            open(out_dir + "/" + m.group(1) + ".c", "w").write("\n".join(body) + "\n")
            print(m.group(1))
    elif mode == "fit":
        for info, body in fences(text):
            if info == "c" and body and body[0].startswith("/* fit.c"):
                print("\n".join(body))
    elif mode == "env":
        for v in sorted(set(re.findall(r"\bGRADJIT_[A-Z0-9_]*[A-Z0-9]", text))):
            print(v)
    elif mode == "logwords":
        m = re.search(r"`GRADJIT_LOG=([a-z,]+)`", text)
        if m:
            print("\n".join(m.group(1).split(",")))
    elif mode == "paths":
        cands = re.findall(r"`([^`\s]+)`", prose(text))
        cands += re.findall(r"\]\(([^)\s#]+)", text)
        for c in cands:
            c = c.rstrip(".,:;")
            if re.match(r"^[a-z]+://", c) or c.startswith(("/", "~", "$", "-")):
                continue
            if re.match(r"^(\.\./)*(docs|tests|scripts|examples|bench|frontend|runtime|autograd|jit"
                        r"|dist|cmake)/[\w./-]*$", c) or re.match(r"^[\w-]+\.md$", c):
                print(p + "\t" + c)
PYEOF
}

say() { echo "$@"; }
bad() { echo "FAIL $*"; fail=1; }

# ------------------------------------------------------------ 2. options
declare -A helptext
help_of() { # program -> its --help text (cached), or nothing if not built
  local p=$1
  if [ -z "${helptext[$p]+x}" ]; then
    if [ -x "$build/$p" ]; then helptext[$p]=$("$build/$p" --help 2>&1); else helptext[$p]=""; fi
  fi
  printf '%s' "${helptext[$p]}"
}
tests_known=$( { grep -oE 'add_test\(NAME [A-Za-z0-9_$.{}-]+' "$src/CMakeLists.txt" | awk '{print $2}';
                 for f in "$src"/tests/test_*.c; do basename "$f" .c; done; } | sort -u)
options_known=$(grep -oE '^\s*option\((GJ_[A-Z_]+)' "$src/CMakeLists.txt" | sed -E 's/.*\(//')
n_cmd=0
while IFS= read -r line; do
  # one simple command at a time: split on | ; && || and $( ... )
  while IFS= read -r cmd; do
    read -ra w <<<"$cmd"
    i=0
    while [ $i -lt ${#w[@]} ] && [[ ${w[$i]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do i=$((i+1)); done
    if [ $i -lt ${#w[@]} ] && [[ ${w[$i]} =~ ^(mpirun|mpiexec)$ ]]; then
      i=$((i+1))
      while [ $i -lt ${#w[@]} ] && [[ ${w[$i]} == -* ]]; do
        case ${w[$i]} in -np|-n) i=$((i+2)) ;; *) i=$((i+1)) ;; esac
      done
    fi
    [ $i -lt ${#w[@]} ] || continue
    prog=${w[$i]}; rest=("${w[@]:$((i+1))}")
    prog=${prog#./}; prog=${prog#build/}
    if [[ " $programs " == *" $prog "* ]]; then
      h=$(help_of "$prog")
      if [ -z "$h" ]; then bad "'$cmd': $prog is not built in $build"; continue; fi
      n_cmd=$((n_cmd+1))
      for a in "${rest[@]}"; do
        [[ $a == --* ]] || continue
        o=${a%%=*}
        grep -qE -- "(^|[^A-Za-z0-9-])$o([^A-Za-z0-9-]|\$)" <<<"$h" ||
          bad "'$cmd': $prog --help does not list $o"
      done
    elif [ "$prog" = bash ] && [[ ${rest[0]:-} == scripts/*.sh || ${rest[0]:-} == tests/*.sh ]] ||
         [[ $prog == scripts/*.sh ]]; then
      if [ "$prog" = bash ]; then f=${rest[0]}; rest=("${rest[@]:1}"); else f=$prog; fi
      n_cmd=$((n_cmd+1))
      if [ ! -f "$src/$f" ]; then bad "'$cmd': no $f"; continue; fi
      for a in "${rest[@]}"; do
        [[ $a == --* ]] || continue
        grep -qF -- "$a" "$src/$f" || bad "'$cmd': $f does not handle $a"
      done
    elif [ "$prog" = ctest ]; then
      for ((k=0; k<${#rest[@]}; k++)); do
        [ "${rest[$k]}" = -R ] || continue
        n_cmd=$((n_cmd+1))
        grep -qE -- "${rest[$((k+1))]:-}" <<<"$tests_known" ||
          bad "'$cmd': no test matches ${rest[$((k+1))]:-}"
      done
    elif [ "$prog" = cmake ]; then
      for a in "${rest[@]}"; do
        [[ $a == -D* ]] || continue
        o=${a#-D}; o=${o%%=*}
        [[ $o == CMAKE_* ]] && continue
        n_cmd=$((n_cmd+1))
        grep -qx -- "$o" <<<"$options_known" || bad "'$cmd': no CMake option $o"
      done
    fi
  done < <(sed -E 's/\$\(/;/g; s/\)//g; s/(\|\||&&|\||;)/\n/g' <<<"$line")
done < <(extract commands "${docs[@]}")
say "options: $n_cmd commands checked"

# -------------------------------------------------------- 3. environment
for v in $(extract env "${docs[@]}" | sort -u); do
  grep -rqF --include='*.c' --include='*.h' "\"$v\"" "$src" || bad "$v: no source reads it"
done
say "environment: $(extract env "${docs[@]}" | sort -u | wc -l) GRADJIT_* variables checked"

# ------------------------------------------------------------ 4. log words
help_words=$(cd "$scratch" && GRADJIT_LOG=help GRADJIT_CACHE_DIR=off \
             "$build/train_charlm" --steps 1 --sample 0 --quiet --csv - --png - 2>&1 >/dev/null |
             awk '/^  [a-z]/ {print $1}')
[ -n "$help_words" ] || bad "GRADJIT_LOG=help printed no words"
readme_words=$(extract logwords "$src/README.md")
for w in $readme_words; do
  grep -qx -- "$w" <<<"$help_words" || bad "README's GRADJIT_LOG word '$w' is not in GRADJIT_LOG=help"
done
for w in $help_words; do
  [ "$w" = help ] || grep -qx -- "$w" <<<"$readme_words" ||
    bad "GRADJIT_LOG=help's word '$w' is missing from README's GRADJIT_LOG=... list"
done
say "log words: README's $(wc -w <<<"$readme_words") = GRADJIT_LOG=help's"

# ------------------------------------------------------- 6. the GEMM default
bench_help=$(help_of gradjit-bench | tr '\n' ' ' | tr -s ' ')
grep -q "measured.*cache directory.*OpenBLAS.*GRADJIT_CACHE_DIR=off.*bf16 by oneDNN" <<<"$bench_help" ||
  bad "gradjit-bench --help does not say the default GEMM provider (measured per shape with a cache directory, OpenBLAS without)"
for d in "${docs[@]}"; do
  tr '\n' ' ' <"$d" | tr -s ' ' | grep -q "matmuls go to OpenBLAS)" &&
    bad "$(basename "$d") says that matmuls go to OpenBLAS (the default measures OpenBLAS against oneDNN)"
done
say "GEMM default: gradjit-bench --help and the docs' openings checked"

# ---------------------------------------------------------------- 5. paths
n_path=0
while IFS=$'\t' read -r doc p; do
  n_path=$((n_path+1))
  base=$(dirname "$doc")
  [ -e "$src/$p" ] || [ -e "$base/$p" ] || [ -e "$src/docs/$p" ] || bad "$(basename "$doc"): no $p"
done < <(extract paths "$src/README.md" "$src/docs/README.md" "$src/docs/guide.md")
say "paths: $n_path checked"

# ------------------------------------------------------------------ 1. run
prefix=$scratch/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null || bad "cmake --install into $prefix"
ln -s "$build" "$scratch/build"
extract fit "$src/docs/guide.md" >"$scratch/fit.c"
cp "$scratch/fit.c" "$scratch/trainer.c"
[ -s "$scratch/fit.c" ] || bad "docs/guide.md has no fit.c program"
have_fashion=1; [ -d /usr/share/datasets/fashion-mnist ] || have_fashion=0
n_run=0
while IFS= read -r line; do
  if [[ $have_fashion = 0 && $line == *train_fashion_* ]]; then
    say "skip (no dataset-fashion-mnist): $line"; continue
  fi
  n_run=$((n_run+1))
  out=$(cd "$scratch" && PREFIX="$prefix" PKG_CONFIG_PATH="$prefix/lib/pkgconfig" \
        LD_LIBRARY_PATH="$prefix/lib" GRADJIT_CACHE_DIR="$scratch/cache" \
        timeout 300 bash -c "$line" 2>&1)
  st=$?
  if [ $st -ne 0 ]; then bad "status $st: $line"; echo "$out" | tail -5 | sed 's/^/    /'
  else say "ok   $line"; fi
done < <(extract cheap "${docs[@]}")
[ $n_run -gt 0 ] || bad "no \`\`\`sh cheap fence found"

# ------------------------------------------------------------ 7. C snippets
mkdir -p "$scratch/snippets"
pc=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs gradjit)
n_snip=0
while IFS=$'\t' read -r name first; do
  if [ "$name" = - ]; then bad "README's \`\`\`c fence starting '$first' is not a /* name.c program"; continue; fi
  n_snip=$((n_snip+1))
  out=$(cd "$scratch/snippets" && cc -std=c11 -Wall -Wextra -Werror "$name.c" $pc -o "$name" 2>&1) ||
    { bad "README's $name.c does not compile:"; echo "$out" | head -10 | sed 's/^/    /'; continue; }
  out=$(cd "$scratch/snippets" && LD_LIBRARY_PATH="$prefix/lib" GRADJIT_LOG=leaks \
        GRADJIT_CACHE_DIR="$scratch/cache" timeout 300 "./$name" 2>&1)
  st=$?
  leaks=$(grep "^\[gradjit leaks\]" <<<"$out")
  if [ $st -ne 0 ]; then bad "README's $name.c: status $st"; echo "$out" | tail -5 | sed 's/^/    /'
  elif ! grep -q "^\[gradjit leaks\] at exit: 0 tensors alive (0 bytes of tensor storage), 0 scopes open" <<<"$leaks"; then
    bad "README's $name.c leaks: ${leaks:-no [gradjit leaks] line}"
  else say "ok   README's $name.c: compiles, runs, $leaks"; fi
done < <(extract snippets "$src/README.md" "$scratch/snippets")
[ $n_snip -gt 0 ] || bad "README.md has no \`\`\`c program"
exit $fail
