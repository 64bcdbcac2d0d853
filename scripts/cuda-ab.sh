#!/usr/bin/env bash
# Compares the settings of one of the CUDA backend's switches on one GPU, in
# one run, alternating them so that the machine's drift falls on all alike:
#   1. a Release build with CUDA and Lua into $BUILD (build-cuda);
#   2. the synthetic 7B llama (`luma synth -p llama-7b`, Q4_K_M, the
#      llama-spm vocabulary from $LUMA_VOCAB or ../shared) unless $MODEL
#      names another file;
#   3. ROUNDS (2) rounds of `luma bench -m $MODEL --backend cuda` with the
#      arguments given to this script (default: decode at batch 1 after a
#      16-token prompt, 128 tokens), once for each value of $VALUES set in
#      the environment variable $VAR;
# then a table: one line per run, the value, ms a decode token, tokens/s,
# the fraction of the roofline ($PEAK_GBS GB/s; default `copy`: the GPU's
# device-to-device copy rate, measured by luma bench) and any aggregate
# rates the arguments asked for.
#   VAR=LUMA_CUDA_MMV_PAIRS VALUES="0 1" scripts/cuda-ab.sh -b 1,8
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
PEAK_GBS=${PEAK_GBS:-copy}
ROUNDS=${ROUNDS:-2}
VAR=${VAR:?VAR names the environment variable to vary}
VALUES=${VALUES:?VALUES lists its settings, separated by spaces}
VOCAB=${LUMA_VOCAB:-../shared/testdata/tokenizer/ggml-vocab-llama-spm.gguf}
MODEL=${MODEL:-/tmp/luma-llama-7b.gguf}
export PATH="$PATH:/usr/local/cuda/bin"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(-p 16 -n 128)

# shellcheck disable=SC2086 # LUMA_CMAKE_ARGS: extra arguments, split on spaces
cmake -S . -B "$BUILD" -DLUMA_CUDA=ON -DCMAKE_BUILD_TYPE=Release ${LUMA_CMAKE_ARGS:-} >/dev/null || exit 1
cmake --build "$BUILD" -j "$JOBS" --target luma_cli 2>&1 | grep -E "error|warning"
[ -x "$BUILD/luma" ] || { echo "cuda-ab: $BUILD/luma was not built"; exit 1; }
if [ ! -f "$MODEL" ]; then
    "$BUILD/luma" synth -p llama-7b --vocab "$VOCAB" -o "$MODEL" >/dev/null || exit 1
fi

out=$(mktemp -d)
table=()
for round in $(seq 1 "$ROUNDS"); do
    for v in $VALUES; do
        f="$out/$round-$v"
        env "$VAR=$v" "$BUILD/luma" bench -m "$MODEL" --backend cuda -r 1 --peak-gbs "$PEAK_GBS" --kv-mb 8000 \
            "${args[@]}" >"$f" 2>&1 || { echo "cuda-ab: $VAR=$v failed:"; cat "$f"; exit 1; }
        ms=$(awk '/^decode time per token/ {print $5}' "$f")
        tps=$(awk '/^decode \(argmax\)/ {print $5}' "$f")
        frac=$(awk '/^fraction of the bandwidth roofline/ {print $6}' "$f")
        agg=$(awk '/^aggregate decode, [0-9]+ seqs \(/ {printf "%s:%s ", $3, $6}' "$f")
        table+=("$(printf "%-8s %-6s %-10s %-10s %-8s %s" "$round" "$v" "$ms" "$tps" "$frac" "$agg")")
    done
done
echo
echo "==== $VAR on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), bench ${args[*]}"
printf "%-8s %-6s %-10s %-10s %-8s %s\n" round value "ms/token" tokens/s "% peak" "aggregate (seqs:tokens/s)"
printf "%s\n" "${table[@]}"
rm -rf "$out"
