#!/usr/bin/env bash
# Fine-tuning recipes on the GPU machine, several variants of one recipe at once (a 135M model leaves most of an
# H200 idle), inside one device call. Builds the CUDA extension first unless it is already built there.
#
#   OUT=/path LIMIT=540 bash scripts/finetune_device.sh RECIPE NAME "--set k=v ..." [NAME "--set ..."]...
#
# RECIPE: configs/finetune/<name>.yaml. Each NAME runs `$LAUNCH finetune/train.py --config RECIPE <its --set
# flags>` with output_dir $RUNS/NAME (RUNS: default runs); after the runs (or LIMIT seconds, default 540)
# $OUT/finetune-<first NAME>.tgz holds each run's log.csv, log.jsonl, summary.json, calibration.json, curves.png and
# stdout (NAME.out); until then they are copied into $OUT as NAME_log.csv etc. every 5 s, so a device call that ends
# first (its budget, its time limit) still returns the evaluations logged so far. LAUNCH defaults to python3 (one
# process); e.g. LAUNCH="accelerate launch --config_file configs/accelerate/multi_gpu.yaml" for DDP. BUILD=0 skips
# the CUDA build. The models come from scripts/device_assets.sh (join / minilm) sourced by the caller before this
# script.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
OUT=${OUT:-$PWD/finetune_out}
LIMIT=${LIMIT:-540}
LAUNCH=${LAUNCH:-python3}
RUNS=${RUNS:-runs}
mkdir -p "$OUT"
if (( $# < 3 || ($# - 1) % 2 )); then
    echo "usage: scripts/finetune_device.sh RECIPE NAME \"--set k=v ...\" [NAME \"...\"]..." >&2
    exit 2
fi
recipe=$1; shift
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [[ ${BUILD:-1} != 0 ]] && ! ls hf_attention_backends/_C*.so >/dev/null 2>&1; then
    echo "== build (CUDA extension, sm_90a)"
    start=$SECONDS
    CXX=/usr/bin/g++ CC=/usr/bin/gcc HFAB_CUDA_ARCHS=90a MAX_JOBS=$(nproc) HFAB_BUILD_CUDA=1 \
        python3 setup.py build_ext --inplace -j "$(nproc)" >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    echo "built in $((SECONDS - start)) s"
fi
python3 -c "import hf_attention_backends.integrations" 2>/dev/null ||  # integrations/ maps into the package
    HFAB_BUILD_CUDA=0 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/build.log" 2>&1
python3 -c "from hf_attention_backends._ext import load_extension as l, extension_error as e; print(\"CUDA extension loaded:\", l(), e() or \"\")" 2>&1 | tail -2

pids=() names=()
while (( $# )); do
    name=$1 flags=$2; shift 2
    # shellcheck disable=SC2086  # the flags are meant to split
    $LAUNCH finetune/train.py --config "$recipe" --output-dir "$RUNS/$name" $flags >"$OUT/$name.out" 2>&1 &
    pids+=($!) names+=("$name")
    echo "started $name: $flags"
done
LOGS=(log.csv log.jsonl summary.json calibration.json curves.png)
copy_logs() {  # every poll: a device call cut short still returns what the runs logged ($OUT/NAME_log.csv, ...)
    local name f
    for name in "${names[@]}"; do
        for f in "${LOGS[@]}"; do [[ -f $RUNS/$name/$f ]] && cp "$RUNS/$name/$f" "$OUT/${name}_$f"; done
    done
}
deadline=$((SECONDS + LIMIT))
while (( SECONDS < deadline )) && pgrep -f "finetune/train.py --config $recipe --output-dir $RUNS/" >/dev/null; do
    copy_logs
    sleep 5
done
for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
wait
copy_logs
files=()
for name in "${names[@]}"; do
    for f in "${LOGS[@]}"; do [[ -f $OUT/${name}_$f ]] && files+=("${name}_$f"); done
    files+=("$name.out")
    echo "== $name"; grep -E '"final"|ppl|cosine' "$RUNS/$name/summary.json" 2>/dev/null | head -5; tail -3 "$OUT/$name.out"
done
tar -C "$OUT" -czf "$OUT/finetune-${names[0]}.tgz" "${files[@]}" && (cd "$OUT" && rm -f "${files[@]}")
