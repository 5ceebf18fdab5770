#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Sets everything up on a fresh Debian 12 machine and runs the main job:
# trains the Fashion-MNIST MLP for one epoch eagerly and with the compiled
# step (forward, backward and AdamW update as one program) from the same
# seed, steps interleaved, and prints both side by side with the paired
# step-time ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target train_fashion_mnist
./build/train_fashion_mnist --both --compiled-step --epochs 1 "$@"
