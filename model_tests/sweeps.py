"""Quality against a backend's knobs and against sequence length, so settings can be picked from a plot.

Each point is :func:`model_tests.common.parity` of the model's output under the backend (one knob changed
from the backend's defaults) against its softmax output on the same batch.

    python -m model_tests.sweeps --model minilm --backend nystrom --seq-len 256
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from hf_attention_backends.integrations import head_dims

from . import common


def default_knobs(backend: str, head_dim: int) -> dict:
    """{knob: values} swept for ``backend`` (beta as multiples of the default head_dim**-0.5)."""
    beta = head_dim ** -0.5
    return {
        "nystrom": {"num_landmarks": [8, 16, 32, 64], "newton_iter": [1, 2, 4, 6]},
        "stieltjes": {"order": [2.0, 4.0, 8.0, 16.0], "newton_iter": [1, 2, 3, 5]},
        "race": {"num_planes": [2, 4, 6], "num_tables": [1, 4, 8], "beta": [beta / 2, beta, 2 * beta, 4 * beta]},
        "exact": {},
    }[backend]


def sweep_knob(model, inputs: dict, backend: str, knob: str, values: list, base: Optional[dict] = None,
               ref=None) -> list[dict]:
    """[{value, **parity}] with ``knob`` set to each value on top of ``base`` (the other options)."""
    ref = common.output_of(model, inputs) if ref is None else ref
    points = []
    for value in values:
        with common.backend(model, backend, {**(base or {}), knob: value}):
            out = common.output_of(model, inputs)
        points.append({"value": value, **common.parity(ref, out, inputs, common.is_causal_lm(model))})
    return points


def sweep_knobs(model, inputs: dict, backend: str, knobs: Optional[dict] = None, base: Optional[dict] = None) -> dict:
    """{knob: :func:`sweep_knob` points} for every knob in ``knobs`` (default :func:`default_knobs`)."""
    knobs = default_knobs(backend, head_dims(model)[2]) if knobs is None else knobs
    ref = common.output_of(model, inputs)
    return {knob: sweep_knob(model, inputs, backend, knob, values, base, ref) for knob, values in knobs.items()}


def sweep_length(model, tokenizer, backend: str, lengths: list, num_texts: int = 2,
                 config: Optional[dict] = None) -> list[dict]:
    """[{seq_len, tokens, **parity}]: news articles cut to each length, softmax vs ``backend``."""
    points = []
    for length in lengths:
        inputs = dict(common.text_batch(tokenizer, num_texts, length, device=model.device))
        ref = common.output_of(model, inputs)
        with common.backend(model, backend, config):
            out = common.output_of(model, inputs)
        tokens = int(inputs["attention_mask"].sum())
        quality = common.parity(ref, out, inputs, common.is_causal_lm(model))
        points.append({"seq_len": length, "tokens": tokens, **quality})
    return points


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_tests.sweeps", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser, num_texts=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256], metavar="N")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    model, tokenizer, inputs, _, backends = common.setup_from_args(args)
    result = {name: {"knobs": sweep_knobs(model, inputs, name),
                     "length": sweep_length(model, tokenizer, name, args.lengths, args.num_texts)}
              for name in backends}
    common.emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
