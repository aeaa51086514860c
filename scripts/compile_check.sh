#!/usr/bin/env bash
# Compile check of csrc/ on a CPU-only machine (no GPU needed); .ci/run calls it when csrc has .cu files.
#  1. builds hf_attention_backends._C with the local CUDA 13 toolkit (CUDA_HOME, default /usr/local/cuda)
#     against torch==2.14.1 (a CUDA build, from local disk) in a second venv, out of tree (a _C.so inside
#     the package would break CPU-only imports), with -Xptxas -v: fails on compile errors, any spill, or a kernel
#     whose wgmma ptxas serialises (benchmarks.ptxas_report --strict);
#  2. loads the built module next to the op schemas exactly as the package defines them (a C++ kernel
#     whose signature does not match its schema fails here);
#  3. scripts/nvrtc_check.py: the exact kernels for sm_60 and sm_70 with CUDA 12's NVRTC + ptxas (PyPI).
# Env: PYTHON (a python with the package installed, default: python3), HFAB_CUDA_VENV (default .venv-cuda),
# MAX_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=${HFAB_CUDA_VENV:-$ROOT/.venv-cuda}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
OUT=${HFAB_COMPILE_CHECK_DIR:-/tmp/hfab-compile-check}

if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  echo "compile_check: no nvcc at $CUDA_HOME/bin/nvcc (set CUDA_HOME to a CUDA 13 toolkit)" >&2
  exit 1
fi

echo "== CUDA venv $VENV: torch 2.14.1 (CUDA build), CUDA 12 NVRTC + ptxas for the sm_60/sm_70 check"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.14.1 numpy setuptools wheel ninja \
  nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
"$CUDA_HOME/bin/nvcc" --version | tail -1

echo "== build hf_attention_backends._C (nvcc, -Xptxas -v) into $OUT"
rm -rf "$OUT"
mkdir -p "$OUT"
start=$SECONDS
if ! HFAB_BUILD_CUDA=1 HFAB_PTXAS_VERBOSE=1 MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py -q build_ext \
    --build-temp "$OUT/build" -b "$OUT/lib" >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40 || true
  tail -40 "$OUT/build.log"
  echo "compile_check: build FAILED (full log: $OUT/build.log)"
  exit 1
fi
echo "built in $((SECONDS - start)) s"
grep -E "Compiling entry function|Used [0-9]+ registers|spill" "$OUT/build.log" \
  | sed -E "s/^ptxas info *: //" >"$OUT/ptxas.txt" || true
echo "kernels compiled (entry functions x archs): $(grep -c "Compiling entry function" "$OUT/ptxas.txt" || true)"
if ! "$PY" -m benchmarks.ptxas_report "$OUT/build.log" --spills --strict; then
  echo "compile_check: register spills or wgmma serialised by ptxas (see above)"
  exit 1
fi
SO=$(find "$OUT/lib" -name "_C*.so" | head -1)
[ -n "$SO" ] || { echo "compile_check: no _C*.so under $OUT/lib"; exit 1; }

echo "== load $SO against the package's op schemas"
"$PY" -c "
import torch, hf_attention_backends
from hf_attention_backends.ops._registry import registered_ops
for qualname in registered_ops():
    print(getattr(torch.ops.hfab, qualname.split('::')[1]).default._schema)
" >"$OUT/schemas.txt"
"$VENV/bin/python" - "$SO" "$OUT/schemas.txt" <<'PYEOF'
import importlib.util
import sys
from pathlib import Path

import torch

so, schemas = sys.argv[1], open(sys.argv[2]).read().split("\n")
spec = importlib.util.spec_from_file_location("hf_attention_backends._C", so)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
lib = torch.library.Library("hfab", "DEF")
with_kernel = []
for schema in filter(None, schemas):
    qualname, rest = schema.split("(", 1)
    lib.define(qualname.split("::")[1] + "(" + rest)  # raises if a registered C++ kernel mismatches
    if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"):
        with_kernel.append(qualname)
print("CUDA kernels registered for:", ", ".join(with_kernel) or "none")
backends = sorted({p.parent.name for p in Path("csrc").glob("*/*.cu")} - {"common"})  # csrc/<backend>/*.cu
missing = {f"hfab::{b}_{d}" for b in backends for d in ("fwd", "bwd")} - set(with_kernel)
no_autograd = [f"hfab::{b}_fwd" for b in backends
               if not torch._C._dispatch_has_kernel_for_dispatch_key(f"hfab::{b}_fwd", "AutogradCUDA")]
print("C++ autograd (AutogradCUDA) registered for:", ", ".join(sorted({f"hfab::{b}_fwd" for b in backends}
                                                                      - set(no_autograd))) or "none")
if missing:
    sys.exit(f"compile_check: no CUDA kernel registered for {sorted(missing)}")
sys.exit(f"compile_check: no C++ autograd (csrc/<backend>/<backend>_autograd.cpp) for {no_autograd}" if no_autograd
         else 0)
PYEOF

echo "== sm_60 / sm_70 with CUDA 12 NVRTC + ptxas"
"$VENV/bin/python" scripts/nvrtc_check.py --archs 60,70
echo "compile_check: OK"
