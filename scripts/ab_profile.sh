#!/usr/bin/env bash
# A / B of kernel builds on the GPU machine: each commit's tree (git archive) and the working tree built side by side
# (in parallel, HFAB_BACKENDS / HFAB_CUDA_ARCHS as exported), then `benchmarks.profile` runs alternated between them,
# ROUNDS rounds, into $OUT/ab.txt; each run names the tree and the extension it loaded.
#
#   OUT=... BASE=3d62a44 CASES="race_causal:262144:fwd+bwd nystrom_wide:131072:fwd+bwd" bash scripts/ab_profile.sh
#
# Environment: BASE (commits, space-separated; required), CASES (CASE:N:MODE words; required), ROUNDS (default 2),
# RUN_TIMEOUT_S (one profile run, default 90), BUILD_TIMEOUT_S (default 300), PHASES (default "build profile": e.g.
# PHASES=build, the GPU tests on the working tree, then PHASES=profile). Builds: $OUT/build-<name>.log. Runs import
# each tree without an install: the folders that setup.py maps into the package are linked there for the runs.
# Then $OUT/ab.csv (python -m benchmarks.ab_csv): the working tree named HFAB_GIT_SHA (default: git HEAD here; pass
# the sending machine's HEAD, which a GPU machine's copy of .git may not have).
# A base commit that copy lacks travels as a bundle in .carry/ (in .git/info/exclude, as for scripts/device_assets.sh):
# `git bundle create .carry/ab.bundle <branch>... ^<a commit the copy has>` here; the call carries .carry/ab.bundle
# and starts with `git fetch -q .carry/ab.bundle 'refs/heads/*:refs/remotes/ab/*'`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
: "${OUT:?OUT: the folder for ab.txt and the build logs}" "${BASE:?BASE: the commits to compare with the working tree}"
: "${CASES:?CASES: CASE:N:MODE words, e.g. race_causal:262144:fwd+bwd}"
ROUNDS=${ROUNDS:-2}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-90}
BUILD_TIMEOUT_S=${BUILD_TIMEOUT_S:-300}
PY=${PYTHON:-python3}
PHASES=${PHASES:-build profile}
mkdir -p "$OUT"
if [[ $(${CXX:-c++} -print-file-name=libstdc++.so 2>/dev/null) != */* && -x /usr/bin/g++ ]]; then
    export CXX=/usr/bin/g++ CC=/usr/bin/gcc  # a compiler without libstdc++.so would link a static copy into _C.so
fi
jobs=$(( $(nproc) / ($(wc -w <<<"$BASE") + 1) ))
build() {  # tree name
    (cd "$1" && HFAB_BUILD_CUDA=1 HFAB_PTXAS_VERBOSE=1 timeout -k 10 "$BUILD_TIMEOUT_S" "$PY" setup.py build_ext --inplace -j "$jobs" \
        >"$OUT/build-$2.log" 2>&1; echo "rc=$?" >>"$OUT/build-$2.log")
}
trees=("$ROOT") names=(work)
for c in $BASE; do trees+=("/tmp/ab-$c") names+=("$c"); done
LINKED=()
trap 'rm -f "${LINKED[@]}"' EXIT
link_subpackages() {  # tree: setup.py maps these folders into the package; without an install, links do
    local d
    for d in integrations model_tests finetune; do
        if [[ -d "$1/$d" && ! -e "$1/hf_attention_backends/$d" ]]; then
            ln -s "../$d" "$1/hf_attention_backends/$d" && LINKED+=("$1/hf_attention_backends/$d")
        fi
    done
}
if [[ $PHASES == *build* ]]; then
    for c in $BASE; do
        rm -rf "/tmp/ab-$c" && mkdir -p "/tmp/ab-$c" && git archive "$c" | tar -x -C "/tmp/ab-$c" \
            || { rm -rf "/tmp/ab-$c"; echo "ab_profile: no commit $c in this copy's .git (a GPU machine's copy may" \
                 "lack the latest commits: name an older one with the same kernels)"; exit 2; }
    done
    for i in "${!trees[@]}"; do build "${trees[$i]}" "${names[$i]}" & done
    wait
    for n in "${names[@]}"; do echo "build $n: $(tail -n 1 "$OUT/build-$n.log")"; done
fi
[[ $PHASES == *profile* ]] || exit 0
for t in "${trees[@]}"; do link_subpackages "$t"; done
for r in $(seq "$ROUNDS"); do
    for spec in $CASES; do
        IFS=: read -r case n mode <<<"$spec"
        for i in "${!trees[@]}"; do
            {
                echo "== round $r, tree ${names[$i]}: $case $n $mode"
                (cd "${trees[$i]}" && PYTHONPATH=${trees[$i]} timeout -k 5 "$RUN_TIMEOUT_S" "$PY" -c \
                    "import hf_attention_backends._C as c; print('extension', c.__file__)" \
                    && PYTHONPATH=${trees[$i]} timeout -k 5 "$RUN_TIMEOUT_S" "$PY" -m benchmarks.profile "$case" "$n" \
                    --mode "$mode") 2>&1 | grep -v "UserWarning\|_warn_once"
            } >>"$OUT/ab.txt"
        done
    done
done
grep "^==\|ms of GPU time" "$OUT/ab.txt"
PYTHONPATH=$ROOT "$PY" -m benchmarks.ab_csv "$OUT/ab.txt" --sha "work=${HFAB_GIT_SHA:-$(git rev-parse --short HEAD)}"
