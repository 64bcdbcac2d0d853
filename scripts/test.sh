#!/usr/bin/env bash
# Runs every test, in the normal build (build/) and the sanitizer build
# (build-asan/, AddressSanitizer + UndefinedBehaviorSanitizer): native tests
# with ctest, Lua specs with busted run by the luma interpreter of that build;
# then the native tests again in a ThreadSanitizer build (build-tsan/: the
# CPU backend's thread pool; the specs are too slow under it to run whole).
# The models are fetched first, the default one and the qwen2 one that
# spec/qwen2_model_spec.lua checks (a failed download fails the run).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

build() {  # dir, extra cmake flags...
  local dir=$1; shift
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
  cmake --build "$dir" -j"$jobs"
}

build build
build/luma fetch -q
build/luma fetch -q qwen2.5-coder-0.5b
export LUMA_MODEL
LUMA_MODEL=$(build/luma -e 'print(require("luma.fetch").default_model())')
if [ -d ../shared/testdata ]; then
  echo "shared test data: $(cd ../shared/testdata && pwd)"
else
  echo "shared test data: ../shared/testdata is absent; the shared tokenizer suite does not run"
fi

run_suite() {  # dir
  local dir=$1
  echo "== native tests ($dir)"
  (cd "$dir" && ctest --output-on-failure -j"$jobs")
  echo "== Lua specs ($dir)"
  LUMA_BUILD_DIR=$dir "$dir/luma" /usr/bin/busted --lpath='./spec/?.lua' spec
}

run_suite build
build build-asan -DLUMA_SANITIZE=ON
# Lua's own allocations are not leaks of ours; the interpreter exits through
# lua_close, so everything luma allocates is freed and checked.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 run_suite build-asan
build build-tsan -DLUMA_TSAN=ON
echo "== native tests (build-tsan, ThreadSanitizer)"
(cd build-tsan && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j"$jobs")
