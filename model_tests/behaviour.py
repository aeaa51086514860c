"""Behaviour checks of a model under a backend: what must hold whatever the approximation.

- causality leak (causal models): perturbing tokens at positions >= split leaves earlier outputs bitwise equal;
- padding invariance: each sequence of a left- or right-padded batch gives its unpadded output (relative
  error <= tol over real tokens; left padding passes position_ids counting real tokens only);
- generate (causal LMs): greedy batched (left-padded) generate() gives each sequence's per-sample tokens;
- incremental decode (causal LMs): prefill + one token at a time with the KV cache gives the full
  forward's logits (relative error <= tol).

    python -m model_tests.behaviour --model smollm2 --backend race
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Optional

import torch

from . import common, metrics

DEFAULT_TOL = 1e-4  # relative error, fp32: different shapes change only the summation order


def _check(value: float, limit: float, **extra) -> dict:
    return {"value": value, "limit": limit, "passed": bool(value <= limit), **extra}


def causality_leak(model, input_ids: torch.Tensor, split: Optional[int] = None) -> dict:
    """max |Δ| of the outputs at positions < split when every token at >= split changes; passes at exactly 0.

    input_ids: (B, N), N >= 2; split defaults to N // 2.
    """
    n = input_ids.shape[1]
    split = n // 2 if split is None else split
    if not 0 < split < n:
        raise ValueError(f"split={split} must be in 1..{n - 1} for sequences of {n} tokens")
    perturbed = input_ids.clone()
    perturbed[:, split:] = (input_ids[:, split:] + 1) % model.config.vocab_size
    a = common.output_of(model, {"input_ids": input_ids})[:, :split]
    b = common.output_of(model, {"input_ids": perturbed})[:, :split]
    return _check(metrics.max_deviation(a, b), 0.0, split=split)


def pad_batch(sequences: list, pad_id: int, side: str) -> dict:
    """Forward kwargs of 1-D id tensors padded on ``side`` (left or right): input_ids, attention_mask and,
    for left padding, position_ids counting real tokens only."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} is not supported; supported: left, right")
    n = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), n), pad_id, dtype=torch.long, device=sequences[0].device)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        cols = slice(n - len(seq), n) if side == "left" else slice(0, len(seq))
        ids[row, cols], mask[row, cols] = seq, 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if side == "left":
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return batch


def padding_invariance(model, sequences: list, pad_id: int, side: str, tol: float = DEFAULT_TOL) -> dict:
    """Worst relative error (over sequences, real tokens) of the padded batch's outputs vs each unpadded run."""
    batch = pad_batch(sequences, pad_id, side)
    padded = common.output_of(model, batch)
    worst = 0.0
    for row, seq in enumerate(sequences):
        alone = common.output_of(model, {"input_ids": seq[None]})[0]
        real = batch["attention_mask"][row].bool()
        worst = max(worst, metrics.relative_error(padded[row][real], alone))
    return _check(worst, tol, side=side)


def generate_consistency(model, sequences: list, pad_id: int, max_new_tokens: int = 4) -> dict:
    """Greedy generate(): number of sequences whose batched (left-padded) new tokens differ from per-sample."""
    options = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                   pad_token_id=pad_id)
    batch = pad_batch(sequences, pad_id, "left")
    with torch.no_grad():
        together = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **options)
        mismatched = 0
        for row, seq in enumerate(sequences):
            alone = model.generate(input_ids=seq[None], attention_mask=torch.ones_like(seq[None]), **options)
            mismatched += not torch.equal(alone[0, len(seq):], together[row, batch["input_ids"].shape[1]:])
    return _check(float(mismatched), 0.0, samples=len(sequences), new_tokens=max_new_tokens)


def incremental_decode(model, input_ids: torch.Tensor, prefix: Optional[int] = None, tol: float = DEFAULT_TOL) -> dict:
    """Relative error of prefill(prefix) + token-by-token decode logits against one full forward.

    input_ids: (B, N); prefix defaults to N // 2 (>= 1).
    """
    n = input_ids.shape[1]
    prefix = max(1, n // 2) if prefix is None else prefix
    if not 0 < prefix < n:
        raise ValueError(f"prefix={prefix} must be in 1..{n - 1} for sequences of {n} tokens")
    full = common.output_of(model, {"input_ids": input_ids})
    with torch.no_grad():
        out = model(input_ids=input_ids[:, :prefix], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(prefix, n):
            out = model(input_ids=input_ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    step = torch.cat(steps, dim=1)
    return _check(metrics.relative_error(step, full), tol, prefix=prefix,
                  top1=metrics.topk_agreement(full, step, 1))


def run_behaviour(model, sequences: list, pad_id: int, backend: Optional[str] = None, config: Optional[dict] = None,
                  tol: float = DEFAULT_TOL, max_new_tokens: int = 4) -> dict:
    """Every check that applies to ``model`` under ``backend`` (None: its current attention).

    sequences: 1-D id tensors of different lengths (>= 2 tokens each). Returns {check: {value, limit, passed,
    ...}}: causality_leak, generate and incremental_decode for causal LMs; padding_left / padding_right always.
    """
    causal_lm = common.is_causal_lm(model)
    switch = common.backend(model, backend, config) if backend else contextlib.nullcontext()
    result = {}
    with switch:
        if causal_lm:
            shortest = min(len(s) for s in sequences)
            same_length = torch.stack([s[:shortest] for s in sequences])
            result["causality_leak"] = causality_leak(model, same_length)
        for side in ("left", "right"):
            result[f"padding_{side}"] = padding_invariance(model, sequences, pad_id, side, tol)
        if causal_lm:
            result["generate"] = generate_consistency(model, sequences, pad_id, max_new_tokens)
            result["incremental_decode"] = incremental_decode(model, same_length, tol=tol)
    return result


def text_sequences(tokenizer, n: int, max_len: int, device="cpu") -> list:
    """n unpadded id tensors of real news sentences (different lengths), each cut to ``max_len`` tokens."""
    from hf_attention_backends.models import sentences

    return [torch.tensor(ids[:max_len], device=device) for ids in tokenizer(sentences(n))["input_ids"]]


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_tests.behaviour", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser, num_texts=3, seq_len=48)
    parser.add_argument("--tol", type=float, default=DEFAULT_TOL, help="relative error limit (default 1e-4)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    model, tokenizer, _, _, backends = common.setup_from_args(args)
    sequences = text_sequences(tokenizer, args.num_texts, args.seq_len, device=args.device)
    result = {"softmax": run_behaviour(model, sequences, tokenizer.pad_token_id, tol=args.tol)}
    for name in backends:
        result[name] = run_behaviour(model, sequences, tokenizer.pad_token_id, name, tol=args.tol)
    common.emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
