#!/usr/bin/env bash
# Compile one csrc/*.cu file to an object with the extension's nvcc flags and print the ptxas report
# (registers, spills, shared memory): a fast check on a machine without a GPU.
#   bash scripts/nvcc_one.sh csrc/race/race_fwd.cu [archs, default "80;90a"]
# Env: HFAB_CUDA_VENV (a venv with a CUDA build of torch, default .venv-cuda), CUDA_HOME (default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:?usage: scripts/nvcc_one.sh csrc/<backend>/<file>.cu [archs]}
ARCHS=${2:-80;90a}
VENV=${HFAB_CUDA_VENV:-$PWD/.venv-cuda}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
read -r ABI INCLUDES < <("$VENV/bin/python" - <<'PY'
import torch
from torch.utils.cpp_extension import include_paths
print(int(torch._C._GLIBCXX_USE_CXX11_ABI), " ".join("-I" + p for p in include_paths(device_type="cuda")))
PY
) 2>/dev/null
GENCODE=()
IFS=';' read -ra LIST <<<"$ARCHS"
for a in "${LIST[@]}"; do GENCODE+=("-gencode=arch=compute_$a,code=sm_$a"); done
OBJ=/tmp/nvcc_one_$(basename "$SRC" .cu)_$$.o
# shellcheck disable=SC2086
"$CUDA_HOME/bin/nvcc" -c "$SRC" -o "$OBJ" -Icsrc $INCLUDES -std=c++20 -O3 --use_fast_math -lineinfo \
  --expt-relaxed-constexpr -D_GLIBCXX_USE_CXX11_ABI="$ABI" -Xcompiler -fPIC -Xptxas=-v "${GENCODE[@]}" 2>&1 \
  | grep -E "error|warning|Compiling entry|Used [0-9]+ registers|spill|Performance Loss" | sed -E "s/^ptxas info *: //"
status=${PIPESTATUS[0]}
rm -f "$OBJ"
exit "$status"
