"""Output parity of a backend against the model's softmax attention, and the exact backend's envelope gates.

Causal LMs are compared on logits (KL(softmax ‖ backend), top-1/top-5 agreement, perplexity on held-out
news text); encoders on last_hidden_state (mean-pooled embedding cosine, relative error, max deviation).
See :func:`model_tests.common.parity` and :func:`model_tests.metrics.envelope_gates`.

    python -m model_tests.outputs --model smollm2 --backend race --seq-len 256
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from . import common, metrics


def output_parity(model, inputs: dict, backend: str, config: Optional[dict] = None,
                  ref=None) -> dict:
    """:func:`common.parity` of ``model`` under ``backend`` against its current attention on ``inputs``.

    ref: the current attention's output on ``inputs`` when already computed (saves a forward).
    """
    ref = common.output_of(model, inputs) if ref is None else ref
    with common.backend(model, backend, config):
        out = common.output_of(model, inputs)
    return common.parity(ref, out, inputs, causal=common.is_causal_lm(model))


def exact_gates(model, inputs: dict) -> dict:
    """The envelope gates of the exact backend on ``model`` (:func:`metrics.envelope_gates`).

    Runs ``model`` with eager, with sdpa and with the exact backend on the same inputs; the loss and
    top-1 gates apply to causal LMs. The model's attention implementation is restored afterwards.
    """
    previous = model.config._attn_implementation
    outputs = {}
    try:
        for name in ("eager", "sdpa"):
            model.set_attn_implementation(name)
            outputs[name] = common.output_of(model, inputs)
        with common.backend(model, "exact"):
            outputs["exact"] = common.output_of(model, inputs)
    finally:
        model.set_attn_implementation(previous)
    causal_lm = common.is_causal_lm(model)
    return metrics.envelope_gates(outputs["eager"], outputs["sdpa"], outputs["exact"], common.real_mask(inputs),
                                  inputs["input_ids"] if causal_lm else None)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_tests.outputs", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    model, _, inputs, _, backends = common.setup_from_args(args)
    ref = common.output_of(model, inputs)
    result = {name: output_parity(model, inputs, name, ref=ref) for name in backends}
    if "exact" in backends:
        result["exact_gates"] = exact_gates(model, inputs)
    common.emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
