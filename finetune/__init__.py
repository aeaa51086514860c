"""Fine-tuning recipes that win back quality after converting a softmax checkpoint to an hfab backend.

Run ``accelerate launch finetune/train.py --config configs/finetune/<name>.yaml`` (or plain ``python``
on one CPU). Modules: :mod:`finetune.config` (the YAML recipe, validated), :mod:`finetune.data` (local
text, tokenised into rows that never mix documents), :mod:`finetune.models` (offline model loaders),
:mod:`finetune.train` (attention transfer, then LoRA/full fine-tuning), :mod:`finetune.checkpoint` (exact
resume), :mod:`finetune.logs` (CSV/JSONL/TensorBoard logs, curves.png). See finetune/README.md.
"""
