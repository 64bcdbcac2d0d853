#!/usr/bin/env bash
# The CUDA backend's checks, run on a machine with an NVIDIA GPU (sm_90):
#   1. a Release build with the CUDA backend into build-cuda;
#   2. ctest -R cuda (test_cuda: every op against the CPU backend and the
#      default model on both backends; test_cuda_matmul: the matrix products);
#   3. compute-sanitizer memcheck over the whole of test_cuda;
#   4. compute-sanitizer racecheck over a reduced run (LUMA_CUDA_QUICK=1),
#      and memcheck over test_cuda_normq (the joined norm and quantizer on
#      three synthetic models; racecheck there reports only cuBLAS's own
#      kernels, which synchronize in ways it does not follow);
#   5. both tools over test_cuda_mmq's small shapes (LUMA_CUDA_QUICK=1):
#      the tensor-core kernels with their copy rings and cluster splits,
#      whose results the test checks (racecheck's slower warps can show a
#      ring handed back too early as wrong results, not as hazards);
#   6. both tools over test_cuda_logits's top-k kernels (LUMA_CUDA_QUICK=1:
#      the checks without the timings; both batch top-k kernels, the
#      default topk_stream_kernel and LUMA_CUDA_TOPK=0's topk_small_kernel);
# then a summary table, and the table of ops, errors and GPU times that
# test_cuda printed. Exits non-zero when a step fails.
#
# Lua is not needed: without it the binding is not built, only the library
# and the native tests. The model comes from $LUMA_MODEL, else
# ~/.cache/luma/models/gemma-3-270m-q4_k_m.gguf (test_cuda fails without it).
# BUILD (build-cuda), JOBS (all cores) and LUMA_CMAKE_ARGS (extra arguments
# for cmake, e.g. where Lua is) may be set in the environment; test_cuda_graphs
# reads its vocabulary from LUMA_VOCAB, ../shared or the default model.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-cuda}
JOBS=${JOBS:-$(nproc)}
export PATH="$PATH:/usr/local/cuda/bin"

names=()
states=()
times=()
failed=0

# step NAME COMMAND...: runs it, recording pass/fail and seconds.
step() {
    local name=$1 start rc
    shift
    echo
    echo "==== $name"
    start=$(date +%s)
    "$@"
    rc=$?
    names+=("$name")
    times+=($(($(date +%s) - start)))
    if [ $rc -eq 0 ]; then
        states+=(pass)
    else
        states+=("FAIL ($rc)")
        failed=1
    fi
    return $rc
}

configure() {
    # shellcheck disable=SC2206 # LUMA_CMAKE_ARGS: extra arguments, split on spaces
    local common=(-S . -B "$BUILD" -DLUMA_CUDA=ON -DCMAKE_BUILD_TYPE=Release ${LUMA_CMAKE_ARGS:-})
    if cmake "${common[@]}"; then
        return 0
    fi
    echo "cuda-check: configuring with Lua failed; building the library and native tests without the binding"
    cmake "${common[@]}" -DLUA_INCLUDE_DIR=/nonexistent/lua -DLUA_LIBRARY=/nonexistent/liblua.a
}

build() {
    local targets=()
    for f in spec/native/test_*cuda*.c; do
        targets+=(--target "$(basename "$f" .c)")
    done
    cmake --build "$BUILD" -j "$JOBS" "${targets[@]}"
}

sanitizer() {
    local tool
    tool=$(command -v compute-sanitizer) || {
        echo "cuda-check: compute-sanitizer not found"
        return 127
    }
    "$tool" --error-exitcode 99 "$@"
}

memcheck() { sanitizer --tool memcheck "./$BUILD/test_cuda"; }
racecheck() { LUMA_CUDA_QUICK=1 sanitizer --tool racecheck "./$BUILD/test_cuda"; }
memcheck_normq() { sanitizer --tool memcheck "./$BUILD/test_cuda_normq"; }
memcheck_mmq() { LUMA_CUDA_QUICK=1 sanitizer --tool memcheck "./$BUILD/test_cuda_mmq"; }
racecheck_mmq() { LUMA_CUDA_QUICK=1 sanitizer --tool racecheck "./$BUILD/test_cuda_mmq"; }
# (the test allocates 2^40 rows on purpose: API errors are not its failures)
memcheck_topk() {
    LUMA_CUDA_QUICK=1 sanitizer --tool memcheck --report-api-errors no --kernel-name kns=topk_ \
        "./$BUILD/test_cuda_logits"
}
racecheck_topk() { LUMA_CUDA_QUICK=1 sanitizer --tool racecheck --kernel-name kns=topk_ "./$BUILD/test_cuda_logits"; }

if [ -n "${LUMA_MODEL:-}" ]; then
    echo "cuda-check: model $LUMA_MODEL"
else
    echo "cuda-check: LUMA_MODEL is not set; test_cuda looks in ~/.cache/luma/models/"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null

if step "configure" configure && step "build" build; then
    step "ctest -R cuda" ctest --test-dir "$BUILD" -R cuda --output-on-failure
    step "memcheck test_cuda" memcheck
    step "racecheck test_cuda (quick)" racecheck
    step "memcheck test_cuda_normq" memcheck_normq
    step "memcheck test_cuda_mmq (quick)" memcheck_mmq
    step "racecheck test_cuda_mmq (quick)" racecheck_mmq
    step "memcheck top-k (quick)" memcheck_topk
    step "racecheck top-k (quick)" racecheck_topk
fi

log="$BUILD/Testing/Temporary/LastTest.log"
if [ -f "$log" ] && grep -q '^op .*rel err' "$log"; then
    echo
    echo "==== test_cuda's table (from the ctest run)"
    sed -n '/^op .*rel err/,/^test_cuda:/p' "$log"
fi

echo
echo "==== summary"
printf '%-32s %-10s %8s\n' step result seconds
for i in "${!names[@]}"; do
    printf '%-32s %-10s %8s\n' "${names[$i]}" "${states[$i]}" "${times[$i]}"
done
exit $failed
