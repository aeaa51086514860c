"""Metric and gate functions on tensors: the definitions every report number uses.

Shapes: outputs are (B, N, C) (hidden states) or (B, N, V) (logits); ``mask`` is (B, N) bool, True = real
token, or None (every token). All reductions run in float64 and return Python floats.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from hf_attention_backends.cli import mean_pool, perplexity

# the envelope method (issue 8): limits relative to the eager vs sdpa disagreement
GATE_MEAN_FACTOR = 2.0
GATE_TAIL_FACTOR = 4.0
GATE_TAIL_QUANTILE = 0.9999
GATE_LOSS_GAP = 1e-3  # nats
GATE_TOP1_DROP = 0.01  # fraction (1 percentage point)
_ROWS = 1024  # logit rows per float64 chunk


def tokens(x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, N, C) -> (T, C): the rows of real tokens (all B*N rows when mask is None)."""
    return x.reshape(-1, x.shape[-1]) if mask is None else x[mask]


def relative_error(out: torch.Tensor, ref: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """‖out − ref‖_F / ‖ref‖_F over real tokens (inf when ref is all zero and out is not)."""
    o, r = tokens(out, mask).double(), tokens(ref, mask).double()
    num, den = (o - r).norm().item(), r.norm().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def cosine(out: torch.Tensor, ref: torch.Tensor, mask: Optional[torch.Tensor] = None) -> tuple[float, float]:
    """(mean, min) over real tokens of the cosine between out's and ref's token vectors."""
    cos = torch.nn.functional.cosine_similarity(tokens(out, mask).double(), tokens(ref, mask).double(), dim=-1)
    return cos.mean().item(), cos.min().item()


def max_deviation(out: torch.Tensor, ref: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """max |out − ref| over real tokens."""
    return (tokens(out, mask).double() - tokens(ref, mask).double()).abs().max().item()


def tensor_parity(out: torch.Tensor, ref: torch.Tensor, mask: Optional[torch.Tensor] = None) -> dict:
    """{rel_error, cosine_mean, cosine_min, max_dev} of ``out`` against ``ref`` over real tokens."""
    cos_mean, cos_min = cosine(out, ref, mask)
    return {"rel_error": relative_error(out, ref, mask), "cosine_mean": cos_mean, "cosine_min": cos_min,
            "max_dev": max_deviation(out, ref, mask)}


def kl_divergence(ref_logits: torch.Tensor, out_logits: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """Mean over real tokens of KL(softmax(ref) ‖ softmax(out)) in nats (float64, in row chunks)."""
    ref, out = tokens(ref_logits, mask), tokens(out_logits, mask)
    total = 0.0
    for start in range(0, ref.shape[0], _ROWS):
        log_p = torch.log_softmax(ref[start:start + _ROWS].double(), dim=-1)
        log_q = torch.log_softmax(out[start:start + _ROWS].double(), dim=-1)
        total += (log_p.exp() * (log_p - log_q)).sum().item()
    return total / ref.shape[0]


def topk_agreement(ref_logits: torch.Tensor, out_logits: torch.Tensor, k: int = 1,
                   mask: Optional[torch.Tensor] = None) -> float:
    """Fraction of real tokens whose reference top-1 token is among ``out``'s top-k (k=1: same argmax)."""
    ref, out = tokens(ref_logits, mask), tokens(out_logits, mask)
    hit = (out.topk(k, dim=-1).indices == ref.argmax(-1, keepdim=True)).any(-1)
    return hit.double().mean().item()


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean next-token NLL (nats) over positions whose target is a real token."""
    return math.log(perplexity(logits, input_ids, mask))


def next_token_accuracy(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of positions (target a real token) where argmax of the logits is the next token."""
    hit = logits[:, :-1].argmax(-1) == input_ids[:, 1:]
    return hit[mask[:, 1:]].double().mean().item()


def embedding_cosine(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, min) over the batch of the cosine between mean-pooled (sentence) embeddings."""
    cos = torch.nn.functional.cosine_similarity(mean_pool(out, mask), mean_pool(ref, mask), dim=-1)
    return cos.mean().item(), cos.min().item()


def quantile(x: torch.Tensor, q: float) -> float:
    """The q-quantile of all elements (linear interpolation between order statistics; any size)."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q} must be in [0, 1]")
    return float(np.quantile(x.detach().double().reshape(-1).cpu().numpy(), q))


def _gate(value: float, limit: float, passed: bool) -> dict:
    return {"value": value, "limit": limit, "passed": bool(passed)}


def envelope_gates(eager: torch.Tensor, sdpa: torch.Tensor, exact: torch.Tensor, mask: Optional[torch.Tensor] = None,
                   input_ids: Optional[torch.Tensor] = None) -> dict:
    """The exact backend's gates against the eager-vs-sdpa envelope (issue 8).

    eager, sdpa, exact: the same model's outputs (logits, or last hidden states for encoders) under the three
    implementations. |Δ| is taken against eager, over real tokens:
    - ``mean_abs``: mean |exact − eager| ≤ 2 × mean |sdpa − eager|;
    - ``p9999_abs``: 99.99th percentile of |exact − eager| ≤ 4 × that of |sdpa − eager|;
    with ``input_ids`` (causal LM logits) also
    - ``loss_gap``: |NLL(exact) − NLL(eager)| ≤ 1e-3 nats;
    - ``top1_accuracy``: next-token accuracy of exact ≥ eager's − 1 point.
    Returns {gate: {value, limit, passed}} plus ``passed`` (all gates) and the envelope numbers.
    """
    diff = (tokens(exact, mask).double() - tokens(eager, mask).double()).abs()
    env = (tokens(sdpa, mask).double() - tokens(eager, mask).double()).abs()
    env_mean, env_tail = env.mean().item(), quantile(env, GATE_TAIL_QUANTILE)
    mean_abs, tail = diff.mean().item(), quantile(diff, GATE_TAIL_QUANTILE)
    gates = {"mean_abs": _gate(mean_abs, GATE_MEAN_FACTOR * env_mean, mean_abs <= GATE_MEAN_FACTOR * env_mean),
             "p9999_abs": _gate(tail, GATE_TAIL_FACTOR * env_tail, tail <= GATE_TAIL_FACTOR * env_tail)}
    if input_ids is not None:
        real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask
        gap = abs(next_token_loss(exact, input_ids, real) - next_token_loss(eager, input_ids, real))
        gates["loss_gap"] = _gate(gap, GATE_LOSS_GAP, gap <= GATE_LOSS_GAP)
        acc_exact, acc_eager = next_token_accuracy(exact, input_ids, real), next_token_accuracy(eager, input_ids, real)
        gates["top1_accuracy"] = _gate(acc_exact, acc_eager - GATE_TOP1_DROP, acc_exact >= acc_eager - GATE_TOP1_DROP)
    return {**gates, "passed": all(g["passed"] for g in gates.values()),
            "envelope": {"mean_abs": env_mean, "p9999_abs": env_tail}}
