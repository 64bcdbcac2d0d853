#!/usr/bin/env bash
# Prints the memory bandwidth, in GB/s, that the CUDA benchmarks report
# decode against (`luma bench --peak-gbs`): the device-to-device copy
# bandwidth (bytes read plus written) measured on the GPU that nvidia-smi
# names, for the GPUs it was measured on; 3000 (the H100's) for others.
#   H100 80 GB HBM3: 3000 (cuda/NOTES.md: HBM3 copy bandwidth 3.0 TB/s)
#   H200 141 GB HBM3e: 4255 (a 2 GiB device-to-device copy, 2026-11-28)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$name" in
    *H200*) echo 4255 ;;
    *) echo 3000 ;;
esac
