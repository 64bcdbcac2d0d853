#!/usr/bin/env bash
# From a fresh Debian machine to generated text: installs what is missing,
# builds luma (Release), fetches the default model and streams a completion.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$(nproc)"
build/luma fetch
build/luma generate -p "The three most useful things to pack for a week of hiking are" -n 64 --temp 0.7 --stats
