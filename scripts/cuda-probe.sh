#!/usr/bin/env bash
# Builds and runs scripts/cuda-probe.cu on the GPU at hand: the weight loads
# of the one-row Q4_K products (the 7B's down, o, and gate with up) with and
# without the activation loads beside them (from global memory, or from
# shared memory copied once a CTA), 1, 2 or 4 rounds of loads in flight a
# lane, with and without integer work between them: us and GB/s a launch.
# `cuda-probe.sh flat` compares instead a row a warp with the rounds spread
# flat over 8 to 16 CTAs an SM (probe_flat).
# Needs nvcc and an sm_90 GPU; PROBE_BIN (/tmp/cuda-probe) is the binary.
set -eu
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
BIN=${PROBE_BIN:-/tmp/cuda-probe}
nvcc -O3 -std=c++17 -arch=sm_90a -o "$BIN" scripts/cuda-probe.cu
"$BIN" "$@"
