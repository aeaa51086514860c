"""Per-layer parity, teacher-forced: how far each attention module and each block moves under a backend.

The softmax model runs once with hooks recording every block's input hidden states, every attention
module's output and every block's output. The backend model then runs with a pre-hook on every block that
replaces the block's input with the softmax model's input to that block, so layer i sees exactly what it
saw under softmax and errors do not compound: the numbers of layer i are that layer's own error.
(The attention mask and position embeddings are the backend model's own, built for the backend.)

    python -m model_tests.layers --model minilm --backend race
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from hf_attention_backends import integrations

from . import common, metrics


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _record(model, replace: Optional[list] = None):
    """Hooks recording block inputs/outputs and attention outputs; with ``replace``, block i's input
    hidden states become replace[i]. Returns (handles, records)."""
    records = {"block_in": {}, "attention": {}, "block": {}}
    handles = []
    for i, block in enumerate(integrations.blocks(model)):
        def pre(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            records["block_in"][i] = hidden
            if replace is None:
                return None
            if args:
                return (replace[i],) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": replace[i]}

        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(lambda m, a, out, i=i: records["block"].__setitem__(i, _first(out))))
    for i, attention in integrations.attention_layers(model):
        handles.append(attention.register_forward_hook(
            lambda m, a, out, i=i: records["attention"].__setitem__(i, _first(out))))
    return handles, records


def _run(model, inputs: dict, replace: Optional[list] = None) -> dict:
    handles, records = _record(model, replace)
    try:
        common.output_of(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return records


def layer_parity(model, inputs: dict, backend: str, config: Optional[dict] = None) -> list[dict]:
    """Teacher-forced parity of every layer of ``model`` under ``backend`` against its current attention.

    inputs: forward kwargs (input_ids + attention_mask, or pixel_values); metrics use real tokens only.
    Returns one dict per layer: {layer, attention: {rel_error, cosine_mean, cosine_min, max_dev},
    residual: {...same, for the block's output (the residual stream after the block)}}.
    The model is left with its attention implementation unchanged.
    """
    mask = common.real_mask(inputs)
    ref = _run(model, inputs)
    count = len(integrations.blocks(model))
    with common.backend(model, backend, config):
        out = _run(model, inputs, replace=[ref["block_in"][i] for i in range(count)])
    return [{"layer": i, "attention": metrics.tensor_parity(out["attention"][i], ref["attention"][i], mask),
             "residual": metrics.tensor_parity(out["block"][i], ref["block"][i], mask)} for i in range(count)]


def format_table(rows: list[dict]) -> str:
    """One line per layer: attention and residual relative error, cosine, max deviation."""
    lines = [f"{'layer':>5}  {'attn rel':>9}  {'attn cos':>9}  {'attn max':>9}  {'resid rel':>9}  "
             f"{'resid cos':>9}  {'resid max':>9}"]
    for row in rows:
        a, r = row["attention"], row["residual"]
        lines.append(f"{row['layer']:>5}  {a['rel_error']:9.2e}  {a['cosine_mean']:9.6f}  {a['max_dev']:9.2e}  "
                     f"{r['rel_error']:9.2e}  {r['cosine_mean']:9.6f}  {r['max_dev']:9.2e}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_tests.layers", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="also write {backend: rows} as JSON")
    args = parser.parse_args(argv)
    model, _, inputs, _, backends = common.setup_from_args(args)
    result = {}
    for name in backends:
        result[name] = layer_parity(model, inputs, name)
        print(f"{args.model} / {name}\n{format_table(result[name])}\n")
    common.emit_json(result, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
