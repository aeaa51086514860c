#!/usr/bin/env bash
# The one GPU-machine check: versions, CUDA build (when csrc/ has .cu files), the cuda-marked tests,
# the benchmarks, then a short summary. Runs from the repository root without pip install
# (PYTHONPATH = repo root) and stays inside TOTAL_BUDGET_S (default 540 s: one 10-minute call).
#
#   OUT=/path/to/folder bash scripts/gpu_check.sh
#   BENCH=exact,race BENCH_QUICK=0 OUT=... bash scripts/gpu_check.sh
#
# Environment (all optional):
#   OUT               folder for the logs and result copies (default ./gpu_check_out). It receives at most
#                     6 files: env.log build.log pytest.log bench.log <gpu>.csv <gpu>.png
#   PYTHON            interpreter (default python3)
#   TOTAL_BUDGET_S    seconds for the whole script (default 540)
#   BUILD             auto (default: when csrc/ has .cu files and they, setup.py, HFAB_CUDA_ARCHS or HFAB_BACKENDS
#                     (setup.py: build only those backends' kernels) changed since the
#                     last build in this tree: a warm GPU machine that receives the tree again keeps build/ and the
#                     extension, but every copied source looks newer than its object, so a plain build redoes all) | 1 | 0
#   BUILD_BUDGET_S    cap on the build (default 300); MAX_JOBS parallel nvcc jobs (default: all cores)
#   RUN_TESTS         1 (default) | 0;  TEST_BUDGET_S cap (default 180);  PYTEST_ARGS extra pytest args (words:
#                     split at spaces);  PYTEST_K a -k expression, which may hold spaces ("grad or phi_tile")
#   PYTEST_PATHS      what pytest collects (default tests; e.g. tests/ops/test_race_cuda.py)
#   PYTEST_MARK       marker expression (default "cuda"; e.g. "cuda and not slow" skips the sanitizer runs)
#   BENCH             backends, comma list | all (default) | none
#   BENCH_CASES       case names, comma list (default: every case of $BENCH; see python3 -m benchmarks.run --list)
#   BENCH_QUICK       1 (default: each case's quick sizes) | 0 (full sweeps; give them the time)
#   BENCH_PROVIDERS   default ours,reference,sdpa;  BENCH_MODES default fwd,fwd+bwd
#   BENCH_SIZE_BUDGET seconds one (case, N, provider, mode) may take (default 20)
#   BENCH_DEVICE      cuda (default) | cpu (tiny shapes: checks this script on a machine without a GPU)
#   BENCH_RESULTS_DIR where the CSV (appended) and PNG go (default benchmarks/results)
#   HFAB_GIT_SHA      the commit the CSV rows name (default: git HEAD here; a copied tree's .git may be stale:
#                     pass HFAB_GIT_SHA=$(git rev-parse --short HEAD) from the machine that sends the tree)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL_BUDGET_S=${TOTAL_BUDGET_S:-540}
BUILD=${BUILD:-auto}
BUILD_BUDGET_S=${BUILD_BUDGET_S:-300}
RUN_TESTS=${RUN_TESTS:-1}
TEST_BUDGET_S=${TEST_BUDGET_S:-180}
PYTEST_ARGS=${PYTEST_ARGS:-}
PYTEST_K=${PYTEST_K:-}
PYTEST_PATHS=${PYTEST_PATHS:-tests}
PYTEST_MARK=${PYTEST_MARK:-cuda}
BENCH=${BENCH:-all}
BENCH_CASES=${BENCH_CASES:-}
BENCH_QUICK=${BENCH_QUICK:-1}
BENCH_PROVIDERS=${BENCH_PROVIDERS:-ours,reference,sdpa}
BENCH_MODES=${BENCH_MODES:-fwd,fwd+bwd}
BENCH_SIZE_BUDGET=${BENCH_SIZE_BUDGET:-20}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}
BENCH_RESULTS_DIR=${BENCH_RESULTS_DIR:-$ROOT/benchmarks/results}
BENCH_RESERVE_S=90     # kept for the benchmarks while testing
FINAL_RESERVE_S=30     # kept for the summary

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset HFAB_REFERENCE_ON_CUDA   # 'ours' must time the kernels, never the reference
MAX_JOBS=${MAX_JOBS:-$(nproc)}
export MAX_JOBS

left() { echo $(( TOTAL_BUDGET_S - SECONDS )); }
cap() { local a=$1 b=$2; (( a < b )) && echo "$a" || echo "$b"; }   # min of two integers
section() { printf '\n==== %s (t=%ss, %ss left) ====\n' "$1" "$SECONDS" "$(left)"; }

build_status="not run"
test_status="not run"
bench_status="not run"

section "environment"
{
    date -u
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc: not found"; fi
    if command -v ninja >/dev/null; then echo "ninja $(ninja --version)"
    else echo "ninja: not found (slow serial build)"; fi
    git -C "$ROOT" log -1 --format='git %h %s' 2>/dev/null || echo "git: no repository"
    "$PY" - <<'EOF'
import platform, sys
import torch
print(f"python {platform.python_version()}  torch {torch.__version__}  CUDA {torch.version.cuda}  "
      f"cuDNN {torch.backends.cudnn.version()}  cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}  sm_{p.major}{p.minor}  {p.total_memory / 2**30:.1f} GiB  "
          f"{p.multi_processor_count} SMs  L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB")
for name in ("transformers", "pytest", "hypothesis", "matplotlib", "numpy"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except ImportError as err:
        print(f"{name}: NOT importable ({err})")
EOF
} 2>&1 | tee "$OUT/env.log"

section "build"
# what the extension is built from: sources, setup.py, the target list
SOURCES_HASH=$( { find csrc -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \) | LC_ALL=C sort \
    | xargs cat; cat setup.py; echo "${HFAB_CUDA_ARCHS:-} ${HFAB_BACKENDS:-}"; } 2>/dev/null | sha256sum | cut -c1-16)
BUILT_HASH_FILE=$ROOT/build/.hfab_sources
skip_reason="BUILD=$BUILD"
if [[ $BUILD == auto ]]; then
    if [[ -z $(find csrc -name '*.cu' 2>/dev/null | head -n 1) ]]; then
        BUILD=0 skip_reason="no .cu files"
    elif [[ -f $BUILT_HASH_FILE && $(cat "$BUILT_HASH_FILE") == "$SOURCES_HASH" ]] \
        && compgen -G "hf_attention_backends/_C*.so" >/dev/null; then
        BUILD=0 skip_reason="built here from these sources before: hash $SOURCES_HASH"
    else
        BUILD=1
    fi
fi
if [[ $BUILD == 1 ]]; then
    cxx=${CXX:-c++}
    if [[ $("$cxx" -print-file-name=libstdc++.so 2>/dev/null) != */* ]] && [[ -x /usr/bin/g++ ]]; then
        echo "$cxx has no libstdc++.so (it would link a static copy into _C.so): building with /usr/bin/g++"
        export CXX=/usr/bin/g++ CC=/usr/bin/gcc
    fi
    t=$(cap "$BUILD_BUDGET_S" $(( $(left) - FINAL_RESERVE_S - 10 )))  # first: tests and benchmarks need the build
    if (( t < 30 )); then
        build_status="skipped (only ${t}s left)"
    else
        echo "HFAB_BUILD_CUDA=1 HFAB_PTXAS_VERBOSE=1 MAX_JOBS=$MAX_JOBS $PY setup.py build_ext --inplace" \
             "(cap ${t}s) > $OUT/build.log"
        start=$SECONDS
        HFAB_BUILD_CUDA=1 HFAB_PTXAS_VERBOSE=1 timeout -k 10 "$t" \
            "$PY" setup.py build_ext --inplace -j "$MAX_JOBS" >"$OUT/build.log" 2>&1
        rc=$?
        case $rc in
            0) build_status="ok ($(( SECONDS - start ))s)"; mkdir -p "$ROOT/build"; echo "$SOURCES_HASH" >"$BUILT_HASH_FILE" ;;
            124|137) build_status="TIMED OUT after ${t}s (partial objects stay in build/; run again)" ;;
            *) build_status="FAILED rc=$rc (see build.log)"; grep -n -m 20 -E "error|Error" "$OUT/build.log" ;;
        esac
        "$PY" -m benchmarks.ptxas_report "$OUT/build.log" | head -n 60
    fi
else
    build_status="skipped ($skip_reason)"
    echo "$build_status" | tee "$OUT/build.log"
fi
echo "build: $build_status"
# the integrations/ folder maps to hf_attention_backends.integrations only through an install
HFAB_BUILD_CUDA=0 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/build.log" 2>&1 \
    || echo "editable install FAILED (see build.log)"
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT/build.log"
import hf_attention_backends as hfab
from hf_attention_backends import _ext
print(f"import hf_attention_backends: ok from {hfab.__file__}")
print(f"extension _C loaded: {_ext.extension_loaded()}" + (f" (error: {_ext.extension_error()})"
                                                        if _ext.extension_error() else ""))
EOF

if [[ $build_status != skipped* && $build_status != "not run" ]] \
    && ! "$PY" -c "from hf_attention_backends import _ext; raise SystemExit(not _ext.extension_loaded())" 2>/dev/null; then
    echo "no CUDA extension after the build ($build_status): skipping the tests and benchmarks"
    RUN_TESTS=0 BENCH=none
fi

section "GPU tests (pytest -m cuda)"
if [[ $RUN_TESTS == 1 ]]; then
    reserve=$BENCH_RESERVE_S; [[ $BENCH == none ]] && reserve=0
    t=$(cap "$TEST_BUDGET_S" $(( $(left) - reserve - FINAL_RESERVE_S )))
    if (( t < 20 )); then
        test_status="skipped (only ${t}s left)"
    else
        # shellcheck disable=SC2086  # PYTEST_PATHS and PYTEST_ARGS are lists of words
        timeout -k 10 "$t" "$PY" -m pytest -q -m "$PYTEST_MARK" -p no:cacheprovider $PYTEST_PATHS $PYTEST_ARGS \
            ${PYTEST_K:+-k "$PYTEST_K"} >"$OUT/pytest.log" 2>&1
        rc=$?
        tail -n 30 "$OUT/pytest.log"
        summary=$(grep -E "passed|failed|error|skipped|no tests ran" "$OUT/pytest.log" | tail -n 1)
        case $rc in
            0) test_status="ok: $summary" ;;
            5) test_status="no tests collected: $summary" ;;
            124|137) test_status="TIMED OUT after ${t}s: $summary" ;;
            *) test_status="FAILED rc=$rc: $summary" ;;
        esac
    fi
else
    test_status="skipped (RUN_TESTS=$RUN_TESTS)"
    echo "$test_status" >"$OUT/pytest.log"
fi
echo "tests: $test_status"

section "benchmarks"
RUN_ID="gpu_check-$(date -u +%Y%m%dT%H%M%S)-$$"
SLUG=$("$PY" -c "import sys, torch; from benchmarks.report import device_slug
print(device_slug(torch.device(sys.argv[1])))" "$BENCH_DEVICE" 2>/dev/null || echo "$BENCH_DEVICE")
CSV=$BENCH_RESULTS_DIR/$SLUG.csv
PNG=$BENCH_RESULTS_DIR/$SLUG.png
if [[ $BENCH != none ]]; then
    t=$(( $(left) - FINAL_RESERVE_S ))
    if (( t < 20 )); then
        bench_status="skipped (only ${t}s left)"
    else
        args=(--backend "$BENCH" --providers "$BENCH_PROVIDERS" --modes "$BENCH_MODES" --device "$BENCH_DEVICE"
              --out "$CSV" --run-id "$RUN_ID" --size-budget "$BENCH_SIZE_BUDGET" --time-budget $(( t - 15 )))
        [[ -n $BENCH_CASES ]] && args+=(--cases "$BENCH_CASES")
        [[ $BENCH_QUICK == 1 ]] && args+=(--quick)
        [[ $BENCH_DEVICE == cpu ]] && args+=(--reps 3 --warmup 1)
        echo "$PY -m benchmarks.run ${args[*]}"
        timeout -k 10 "$t" "$PY" -m benchmarks.run "${args[@]}" 2>&1 | tee "$OUT/bench.log"
        rc=${PIPESTATUS[0]}
        case $rc in
            0) bench_status="ok" ;;
            1) bench_status="done, some rows have status=error" ;;
            124|137) bench_status="TIMED OUT after ${t}s (rows so far are in the CSV)" ;;
            *) bench_status="FAILED rc=$rc (see bench.log)" ;;
        esac
    fi
else
    bench_status="skipped (BENCH=none)"
fi

if [[ $BENCH != none && -s $CSV ]] && [[ $BENCH == all || $BENCH == *exact* ]]; then
    "$PY" -m benchmarks.bench_exact "$CSV" 2>&1 | tee -a "$OUT/bench.log"
fi

section "summary"
echo "build:      $build_status"
echo "tests:      $test_status"
echo "benchmarks: $bench_status"
if [[ -s $CSV ]] && grep -q "$RUN_ID" "$CSV"; then
    "$PY" -m benchmarks.report "$CSV" --run-id "$RUN_ID" --plot "$PNG"
    cp "$CSV" "$PNG" "$OUT/" 2>/dev/null
    echo "results: $CSV (appended; run_id $RUN_ID), $PNG; copied to $OUT"
fi
if [[ $BUILD == 1 && -s $OUT/build.log ]]; then
    "$PY" -m benchmarks.ptxas_report "$OUT/build.log" --spills | head -n 20
fi
echo "total ${SECONDS}s of ${TOTAL_BUDGET_S}s; logs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[[ $build_status == ok* || $build_status == skipped* ]] && [[ $test_status == ok* || $test_status == skipped* ]] \
    && [[ $bench_status == ok || $bench_status == skipped* ]]
