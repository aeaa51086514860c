#!/usr/bin/env bash
# Nsight Compute counters for the kernels of one benchmark call (a GPU machine with ncu; clocks left alone).
#   bash scripts/ncu_profile.sh CASE N [fwd|fwd+bwd] [kernel regex] [out dir]
#   e.g. bash scripts/ncu_profile.sh race_causal 262144 fwd+bwd 'race_' $OUT
# Writes <out>/ncu_<case>_<N>_<mode>.txt: per kernel the speed of light (SM, memory, DRAM %), occupancy, launch
# configuration, warp stall reasons, memory and compute workload; and the same as .csv (raw metrics).
# SOURCE=1: also <out>/ncu_..._sass.csv.gz, the SASS source page (instructions executed and stall samples per
# instruction) that `python -m benchmarks.sass_report <nvdisasm -gi output> KERNEL --lines --ncu FILE` maps to
# source lines with a cubin of the same commit compiled on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
CASE=${1:?usage: scripts/ncu_profile.sh CASE N [mode] [kernel regex] [out dir]}
N=${2:?N}
MODE=${3:-fwd+bwd}
REGEX=${4:-.}
OUT_DIR=${5:-.}
NAME="ncu_${CASE}_${N}_${MODE/+/_}"
SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats)
ncu --profile-from-start off --clock-control none -k "regex:$REGEX" "${SECTIONS[@]}" \
    python3 -m benchmarks.profile "$CASE" "$N" --mode "$MODE" --ncu > "$OUT_DIR/$NAME.txt" 2>&1
ncu --profile-from-start off --clock-control none -k "regex:$REGEX" "${SECTIONS[@]}" --csv --page raw \
    python3 -m benchmarks.profile "$CASE" "$N" --mode "$MODE" --ncu > "$OUT_DIR/$NAME.csv" 2>/dev/null || true
grep -E "^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall" \
    "$OUT_DIR/$NAME.txt" | head -80
if [[ ${SOURCE:-0} == 1 ]]; then
    ncu --profile-from-start off --clock-control none -k "regex:$REGEX" --section SourceCounters --section WarpStateStats \
        --section InstructionStats --import-source yes -f -o "$OUT_DIR/$NAME" \
        python3 -m benchmarks.profile "$CASE" "$N" --mode "$MODE" --ncu > /dev/null 2>&1
    ncu -i "$OUT_DIR/$NAME.ncu-rep" --page source --csv --print-source sass | gzip > "$OUT_DIR/${NAME}_sass.csv.gz"
    rm -f "$OUT_DIR/$NAME.ncu-rep"
fi
