#!/usr/bin/env bash
# One-command GPU workflow: make the compiled library available (a prebuilt python/flashtile/lib, or
# a build here), install anchor wheels from .whl/ when present, run tests/gpu, then a short benchmark.
#   tools/gpu_check.sh [--build] [--tests "pytest args"] [--bench "bench args"] [--no-tests] [--no-bench]
# Environment: FLASHTILE_KERNEL_SET / FLASHTILE_ARCHS ... for --build; OUT (results folder, optional).
set -uo pipefail
cd "$(dirname "$0")/.."
build=0; tests="tests/gpu -q -x"; bench="--quick"; run_tests=1; run_bench=1
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=1 ;;
    --tests) tests="$2"; shift ;;
    --bench) bench="$2"; shift ;;
    --no-tests) run_tests=0 ;;
    --no-bench) run_bench=0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
out=${OUT:-/tmp/flashtile_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$build" = 1 ] || [ ! -f python/flashtile/lib/libflashtile.so ]; then
  jobs=$(nproc)
  cmake -S . -B build/gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHTILE_PTXAS_VERBOSE=ON >"$out/cmake.log" 2>&1 \
    && cmake --build build/gpu -j"$jobs" >>"$out/cmake.log" 2>&1 \
    && cmake --install build/gpu --prefix python >>"$out/cmake.log" 2>&1 \
    || { tail -50 "$out/cmake.log"; exit 1; }
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import flashtile, json; c = flashtile.build_config(); print('flashtile build:', c['kernel_set'], c['archs'], len(c['kernels']), 'kernels')"
rc=0
if [ "$run_tests" = 1 ]; then
  python3 -m pytest $tests -p no:cacheprovider --junitxml="$out/junit.xml" 2>&1 | tee "$out/tests.log" | tail -40
  rc=${PIPESTATUS[0]}
fi
if [ "$run_bench" = 1 ]; then
  python3 -m flashtile.bench $bench --out "$out/bench" 2>"$out/bench.err" || { rc=1; tail -20 "$out/bench.err"; }
fi
exit $rc
