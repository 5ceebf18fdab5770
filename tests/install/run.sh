#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the build tree BUILD into a temporary prefix and builds a user's
# program against it three ways: CMake shared, CMake static, pkg-config.
set -euo pipefail
build=$1; src=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
cmake -S "$src" -B "$tmp/b" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/b" >/dev/null
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/b/consumer_shared"
"$tmp/b/consumer_static"
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
cc "$src/consumer.c" $(pkg-config --cflags --libs gradjit) -o "$tmp/consumer_pc"
LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/consumer_pc"
