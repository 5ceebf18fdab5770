#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the Debian 12 packages gradjit needs (as root, or through sudo).
# Idempotent: does nothing when everything is already installed.
set -euo pipefail
pkgs=(build-essential cmake pkg-config llvm-19-dev clang-19 libopenblas-dev libdnnl-dev libffi-dev
      libcmocka-dev zlib1g-dev dataset-fashion-mnist libopenmpi-dev openmpi-bin python3-numpy)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "gradjit: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
