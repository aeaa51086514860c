"""Exact softmax attention, the pure-PyTorch spec of the ``hfab::exact_*`` ops.

out = softmax(scale * q k^T + mask) v with the softmax and the accumulation in fp32 (fp64 for
fp64 inputs). The forward also returns the per-row log-sum-exp (fp32, -inf for rows that may
attend to no key, whose output is 0); the backward recomputes P from it, as FlashAttention-2 does.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._common import allowed_keys, compute_dtype, repeat_kv, sum_kv_groups


def _masked_scores(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], causal: bool, scale: float):
    ct = compute_dtype(q.dtype)
    kf = repeat_kv(k, q.shape[1]).to(ct)
    s = torch.matmul(q.to(ct), kf.transpose(-1, -2)) * scale
    allowed = allowed_keys(q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
                           batch=q.shape[0], device=q.device)
    return s.masked_fill(~allowed, float("-inf")), allowed


def exact_forward(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], causal: bool,
                  scale: float) -> tuple[Tensor, Tensor]:
    """q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D) -> out (B, Hq, Nq, D) in q.dtype, lse (B, Hq, Nq) fp32/fp64."""
    s, allowed = _masked_scores(q, k, key_padding_mask, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    out = torch.matmul(p, repeat_kv(v, q.shape[1]).to(s.dtype))
    return out.to(q.dtype), lse


def exact_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   key_padding_mask: Optional[Tensor], causal: bool, scale: float):
    """FlashAttention-2 backward from the saved log-sum-exp: dS = P * (dP - rowsum(dO * O))."""
    s, _ = _masked_scores(q, k, key_padding_mask, causal, scale)
    ct = s.dtype
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    do = dout.to(ct)
    vf = repeat_kv(v, q.shape[1]).to(ct)
    kf = repeat_kv(k, q.shape[1]).to(ct)
    dp = torch.matmul(do, vf.transpose(-1, -2))
    delta = (do * out.to(ct)).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(ct)) * scale
    dv = torch.matmul(p.transpose(-1, -2), do)
    hkv = k.shape[1]
    return dq.to(q.dtype), sum_kv_groups(dk, hkv).to(k.dtype), sum_kv_groups(dv, hkv).to(v.dtype)
