#!/usr/bin/env bash
# Builds and runs scripts/cuda-probe.cu on the GPU at hand: the weight loads
# of the one-row Q4_K products (the 7B's down, o, and gate with up) with and
# without the activation loads beside them (from global memory, or from
# shared memory copied once a CTA), 1, 2 or 4 rounds of loads in flight a
# lane, with and without integer work between them: us and GB/s a launch.
# `cuda-probe.sh flat` compares instead a row a warp with the rounds spread
# flat over 8 to 16 CTAs an SM (probe_flat). `cuda-probe.sh f16` builds and
# runs scripts/cuda-probe-f16.cu instead: the Q4_K products at 16 and 32
# activation rows on f16 tensor cores from the tile copy (its header says
# what it measures). `cuda-probe.sh cublas` builds and runs
# scripts/cuda-probe-cublas.cu: cuBLAS's first GEMM of each shape against
# the second, at the row counts of short chunks.
# Needs nvcc and an sm_90 GPU; PROBE_BIN (/tmp/cuda-probe) is the binary.
set -eu
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
BIN=${PROBE_BIN:-/tmp/cuda-probe}
if [ "${1:-}" = f16 ]; then
    nvcc -O3 -std=c++17 -arch=sm_90a -o "$BIN-f16" scripts/cuda-probe-f16.cu
    exec "$BIN-f16"
fi
if [ "${1:-}" = cublas ]; then
    nvcc -O3 -std=c++17 -arch=sm_90a -o "$BIN-cublas" scripts/cuda-probe-cublas.cu -lcublasLt -lcublas
    exec "$BIN-cublas"
fi
nvcc -O3 -std=c++17 -arch=sm_90a -o "$BIN" scripts/cuda-probe.cu
"$BIN" "$@"
