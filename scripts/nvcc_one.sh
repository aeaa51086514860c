#!/usr/bin/env bash
# Compile one csrc/*.cu file to an object with the extension's nvcc flags and print the ptxas report
# (registers, spills, shared memory, serialised wgmma): a fast check on a machine without a GPU.
#   bash scripts/nvcc_one.sh csrc/race/race_fwd.cu [archs, default "80;90a"]
# Or a kernel header and explicit instantiations of its kernels (no torch headers: seconds instead of minutes):
#   bash scripts/nvcc_one.sh csrc/nystrom/nystrom_tc_bwd_kernels.cuh 90a \
#     'hfab::nystrom::tc::nystrom_kv_tc_bwd_kernel<__half, 128, true, 32>(const hfab::nystrom::BwdParams)'
# Env: HFAB_CUDA_VENV (a venv with a CUDA build of torch, for .cu files; default .venv-cuda), CUDA_HOME (default
# /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:?usage: scripts/nvcc_one.sh csrc/<backend>/<file>.cu [archs] | <file>.cuh archs 'kernel<...>(params)'...}
ARCHS=${2:-80;90a}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
GENCODE=()
IFS=';' read -ra LIST <<<"$ARCHS"
for a in "${LIST[@]}"; do GENCODE+=("-gencode=arch=compute_$a,code=sm_$a"); done
FLAGS=(-Icsrc -std=c++20 -O3 --use_fast_math -lineinfo --expt-relaxed-constexpr -Xcompiler -fPIC -Xptxas=-v)
TMP=$(mktemp -d /tmp/nvcc_one.XXXX)
trap 'rm -rf "$TMP"' EXIT
if [[ $SRC == *.cuh ]]; then
  [[ $# -ge 3 ]] || { echo "nvcc_one: a header needs at least one instantiation after the archs" >&2; exit 2; }
  UNIT=$TMP/instances.cu
  echo "#include \"${SRC#csrc/}\"" >"$UNIT"
  for sig in "${@:3}"; do echo "template __global__ void $sig;" >>"$UNIT"; done
else
  UNIT=$SRC
  VENV=${HFAB_CUDA_VENV:-$PWD/.venv-cuda}
  read -r ABI INCLUDES < <("$VENV/bin/python" - <<'PY'
import torch
from torch.utils.cpp_extension import include_paths
print(int(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join("-I" + p for p in include_paths(device_type="cuda")))
PY
  ) 2>/dev/null
  # shellcheck disable=SC2206
  FLAGS+=($INCLUDES -D_GLIBCXX_USE_CXX11_ABI="$ABI")
fi
"$CUDA_HOME/bin/nvcc" -c "$UNIT" -o "$TMP/unit.o" "${FLAGS[@]}" "${GENCODE[@]}" 2>&1 \
  | grep -E "error|warning|Compiling entry|Used [0-9]+ registers|spill|Performance Loss" | sed -E "s/^ptxas info *: //"
exit "${PIPESTATUS[0]}"
