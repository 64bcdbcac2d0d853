#!/usr/bin/env bash
# The CUDA backend's speed on one GPU, the measures of cuda/NOTES.md:
#   1. a Release build with CUDA and Lua into $BUILD (build-cuda);
#   2. a synthetic model of the 7B llama shape (`luma synth -p llama-7b`,
#      Q4_K_M, the llama-spm vocabulary from $LUMA_VOCAB or ../shared);
#   3. `luma bench` on it: prefill of 512 and 4096 tokens, decode at batch
#      1, aggregate decode of 1, 8, 32 and 128 sequences (128-token prompts,
#      128 new tokens each), decode at batch 1 after prompts of 1024 and
#      4096 tokens (--depth), with recorded decode steps (CUDA graphs) and,
#      for comparison, without (LUMA_CUDA_GRAPHS=0);
#   4. the same on the default model when it is present ($LUMA_MODEL or
#      ~/.cache/luma/models/), with the Lua policy chain, on the qwen2
#      model (`luma fetch qwen2.5-coder-0.5b`; $QWEN2) when it is present,
#      and on a synthetic model of Qwen2.5 7B's shape (`luma synth -p
#      qwen2-7b`: biases on q, k and v, NEOX rotation, 28 + 4 heads);
#   5. both models again with float activations (--float-act: prefill of
#      512, decode at batch 1, 8 and 32 sequences);
#   6. the 7B shape with every matrix in Q8_0 (`--mix q8_0`, 7.2 GB: the
#      repacked copies of the matrix-vector kernels): decode at batch 1
#      and 8 sequences, with the copies and without (LUMA_CUDA_X4_MMV=0);
# then every table, and a summary of the lines that matter last.
# PEAK_GBS sets the roofline in GB/s (default `copy`: the GPU's device-to-
# device copy bandwidth, read plus written, measured by luma bench);
# LUMA_CMAKE_ARGS passes extra arguments to cmake (where Lua is).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
PEAK_GBS=${PEAK_GBS:-copy}
VOCAB=${LUMA_VOCAB:-../shared/testdata/tokenizer/ggml-vocab-llama-spm.gguf}
MODEL7=${MODEL7:-/tmp/luma-llama-7b.gguf}
MODEL7Q8=${MODEL7Q8:-/tmp/luma-llama-7b-q8_0.gguf}
MODELQ7=${MODELQ7:-/tmp/luma-qwen2-7b.gguf}
DEFAULT=${LUMA_MODEL:-$HOME/.cache/luma/models/gemma-3-270m-q4_k_m.gguf}
QWEN2=${QWEN2:-$HOME/.cache/luma/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
export PATH="$PATH:/usr/local/cuda/bin"
out=$(mktemp -d)

# shellcheck disable=SC2086 # LUMA_CMAKE_ARGS: extra arguments, split on spaces
cmake -S . -B "$BUILD" -DLUMA_CUDA=ON -DCMAKE_BUILD_TYPE=Release ${LUMA_CMAKE_ARGS:-} >/dev/null || exit 1
cmake --build "$BUILD" -j "$JOBS" --target luma_cli 2>&1 | grep -E "error|warning" 
[ -x "$BUILD/luma" ] || { echo "cuda-bench: $BUILD/luma was not built"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

if [ ! -f "$MODEL7" ]; then
    "$BUILD/luma" synth -p llama-7b --vocab "$VOCAB" -o "$MODEL7" >/dev/null || exit 1
fi
common=(--backend cuda -r 2 -n 128 -b 1,8,32,128 --batch-prompt 128 --peak-gbs "$PEAK_GBS")
echo "==== llama 7B shape, recorded decode steps"
"$BUILD/luma" bench -m "$MODEL7" "${common[@]}" -p 512,4096 -d 1024,4096 --max-rows 4096 --kv-mb 20000 --ctx 8192 |
    tee "$out/l7"
echo "==== llama 7B shape, LUMA_CUDA_GRAPHS=0"
LUMA_CUDA_GRAPHS=0 "$BUILD/luma" bench -m "$MODEL7" "${common[@]}" -p 512 --max-rows 4096 --kv-mb 20000 \
    --ctx 8192 | tee "$out/l7-eager"
if [ -f "$DEFAULT" ]; then
    echo "==== default model, recorded decode steps"
    "$BUILD/luma" bench -m "$DEFAULT" "${common[@]}" -p 512,4096 -d 1024,4096 --max-rows 4096 --kv-mb 8000 --ctx 8192 \
        --policy | tee "$out/gemma"
else
    echo "==== the default model is not at $DEFAULT: its benchmark did not run"
fi
if [ -f "$QWEN2" ]; then
    echo "==== qwen2 model, recorded decode steps"
    "$BUILD/luma" bench -m "$QWEN2" "${common[@]}" -p 512,4096 --max-rows 4096 --kv-mb 8000 --ctx 8192 |
        tee "$out/qwen2"
else
    echo "==== the qwen2 model is not at $QWEN2: its benchmark did not run"
fi
if [ ! -f "$MODELQ7" ]; then
    "$BUILD/luma" synth -p qwen2-7b --vocab "$VOCAB" -o "$MODELQ7" >/dev/null || exit 1
fi
echo "==== qwen2 7B shape, recorded decode steps"
"$BUILD/luma" bench -m "$MODELQ7" "${common[@]}" -p 512,4096 --max-rows 4096 --kv-mb 20000 --ctx 8192 |
    tee "$out/q7"
fa=(--backend cuda -r 2 -n 64 -b 1,8,32 --batch-prompt 128 --peak-gbs "$PEAK_GBS" -p 512 --max-rows 4096 --ctx 8192)
echo "==== llama 7B shape, float activations"
"$BUILD/luma" bench -m "$MODEL7" --float-act "${fa[@]}" --kv-mb 20000 | tee "$out/l7-float"
if [ -f "$DEFAULT" ]; then
    echo "==== default model, float activations"
    "$BUILD/luma" bench -m "$DEFAULT" --float-act "${fa[@]}" --kv-mb 8000 | tee "$out/gemma-float"
fi
if [ ! -f "$MODEL7Q8" ]; then
    "$BUILD/luma" synth -p llama-7b --mix q8_0 --vocab "$VOCAB" -o "$MODEL7Q8" >/dev/null || exit 1
fi
q8=(--backend cuda -r 2 -p 16 -n 128 -b 1,8 --batch-prompt 128 --peak-gbs "$PEAK_GBS" --kv-mb 8000)
echo "==== llama 7B shape, Q8_0"
"$BUILD/luma" bench -m "$MODEL7Q8" "${q8[@]}" | tee "$out/l7-q8_0"
echo "==== llama 7B shape, Q8_0, LUMA_CUDA_X4_MMV=0"
LUMA_CUDA_X4_MMV=0 "$BUILD/luma" bench -m "$MODEL7Q8" "${q8[@]}" | tee "$out/l7-q8_0-file"

echo
echo "==== summary"
for f in l7 l7-eager gemma qwen2 q7 l7-float gemma-float l7-q8_0 l7-q8_0-file; do
    [ -f "$out/$f" ] || continue
    echo "-- $f"
    grep -E "^(copy bandwidth|prefill|time to first|decode|fraction|aggregate|Lua policy cost|achieved bandwidth at)" "$out/$f"
done
rm -rf "$out"
