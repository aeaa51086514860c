"""RACE attention, the pure-PyTorch spec of the ``hfab::race_*`` ops (see README.md for the math).

Feature map: u_l = tanh(W_l x) (P soft hyperplane signs per table l), φ_{l,r}(x) = softmax_r(β⟨u_l, c_r⟩)
over the 2^P corners c_r ∈ {-1,+1}^P (itertools.product order: plane 0 is the most significant bit),
Φ(x) = concat_l φ_l(x) ∈ R^S, S = L·2^P. Kernel k_ij = ⟨Φ(q_i), Φ(k_j)⟩ over allowed keys j;
O_i = Σ_j k_ij v_j / Σ_j k_ij, and 0 for rows whose denominator is 0 (no allowed key).

Non-causal: one global sum Σ_j Φ(k_j) v_jᵀ, Σ_j Φ(k_j). Causal (bottom-right aligned): chunked prefix
sums, a masked Φ(q)Φ(k)ᵀ product inside each chunk of ``chunk_size`` queries plus the running states
of the earlier chunks, so memory is O(N·S + N·C + (N/C)·S·D) per head, never N×N.
Compute in fp32 (fp64 for fp64 inputs); the output is cast to q.dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._common import compute_dtype, repeat_kv

DEFAULT_CHUNK = 64


def corners(num_planes: int, *, dtype=torch.float32, device=None) -> Tensor:
    """(2^P, P) ±1 corners in itertools.product((-1, 1), repeat=P) order (plane 0 = most significant bit)."""
    r = torch.arange(2 ** num_planes, device=device)[:, None]
    shift = torch.arange(num_planes - 1, -1, -1, device=device)[None, :]
    return (((r >> shift) & 1) * 2 - 1).to(dtype)


def race_features(x: Tensor, planes: Tensor, beta: Tensor) -> Tensor:
    """Φ(x): x (B, H, N, D), planes (L, P, D), beta () or (H,) -> (B, H, N, L·2^P), in x.dtype.

    Each table's 2^P entries are a softmax, so they are positive and sum to 1.
    """
    num_tables, num_planes, d = planes.shape
    u = torch.tanh(torch.matmul(x, planes.reshape(num_tables * num_planes, d).transpose(0, 1)))
    u = u.unflatten(-1, (num_tables, num_planes))  # (B, H, N, L, P)
    logits = torch.matmul(u, corners(num_planes, dtype=x.dtype, device=x.device).transpose(0, 1))  # (B, H, N, L, R)
    beta = beta.to(x.dtype)
    logits = logits * (beta if beta.dim() == 0 else beta.view(1, -1, 1, 1, 1))
    return torch.softmax(logits, dim=-1).flatten(-2)


def _safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and exactly 0 where den == 0 (rows with no allowed key), with finite gradients."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def _causal_sums(phq: Tensor, phk: Tensor, v: Tensor, state: Tensor, z: Tensor, chunk: int):
    """Aligned causal sums: query i sees keys j <= i, plus the initial (state, z) of earlier keys.

    phq, phk (B, H, n, S), v (B, H, n, D), state (B, H, S, D), z (B, H, S) -> num (B, H, n, D), den (B, H, n, 1).
    """
    n = phq.shape[2]
    pad = (-n) % chunk
    # zero-padded keys add nothing; padded query rows are dropped at the end
    phq, phk, v = (F.pad(t, (0, 0, 0, pad)).unflatten(2, (-1, chunk)) for t in (phq, phk, v))  # (B, H, nc, C, ·)
    a = torch.tril(torch.matmul(phq, phk.transpose(-1, -2)))  # (B, H, nc, C, C)
    num = torch.matmul(a, v)
    den = a.sum(dim=-1, keepdim=True)
    kv = torch.matmul(phk.transpose(-1, -2), v)  # (B, H, nc, S, D)
    ks = phk.sum(dim=-2)  # (B, H, nc, S)
    kv_before = state[:, :, None] + torch.cumsum(F.pad(kv[:, :, :-1], (0, 0, 0, 0, 1, 0)), dim=2)
    ks_before = z[:, :, None] + torch.cumsum(F.pad(ks[:, :, :-1], (0, 0, 1, 0)), dim=2)
    num = num + torch.matmul(phq, kv_before)
    den = den + torch.matmul(phq, ks_before[..., None])
    return num.flatten(2, 3)[:, :, :n], den.flatten(2, 3)[:, :, :n]


def race_forward(q: Tensor, k: Tensor, v: Tensor, planes: Tensor, beta: Tensor,
                 key_padding_mask: Optional[Tensor], causal: bool, chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D), planes (L, P, D), beta () or (Hq,) -> (B, Hq, Nq, D) in q.dtype.

    key_padding_mask: (B, Nk) bool, True = real key. causal: query i sees keys j <= i + Nk - Nq.
    chunk_size: queries per chunk of the causal prefix sums (the result does not depend on it).
    """
    ct = compute_dtype(q.dtype)
    hq, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    planes, beta = planes.to(ct), beta.to(ct)
    phq = race_features(q.to(ct), planes, beta)  # (B, Hq, Nq, S)
    phk = race_features(repeat_kv(k, hq).to(ct), planes, beta)  # (B, Hq, Nk, S)
    vf = repeat_kv(v, hq).to(ct)
    if key_padding_mask is not None:
        phk = phk * key_padding_mask[:, None, :, None].to(ct)
    if not causal:
        num = torch.matmul(phq, torch.matmul(phk.transpose(-1, -2), vf))
        den = torch.matmul(phq, phk.sum(dim=-2)[..., None])
        return _safe_divide(num, den).to(q.dtype)
    off = nk - nq
    if off >= 0:
        # keys [0, off) are seen by every query; key off + i pairs with query i
        state = torch.matmul(phk[:, :, :off].transpose(-1, -2), vf[:, :, :off])
        z = phk[:, :, :off].sum(dim=-2)
        num, den = _causal_sums(phq, phk[:, :, off:], vf[:, :, off:], state, z, chunk_size)
    else:
        # queries [0, -off) see no key; query -off + j pairs with key j
        state = phk.new_zeros(*phk.shape[:2], phk.shape[-1], vf.shape[-1])
        num, den = _causal_sums(phq[:, :, -off:], phk, vf, state, phk.new_zeros(state.shape[:-1]), chunk_size)
        num, den = F.pad(num, (0, 0, -off, 0)), F.pad(den, (0, 0, -off, 0))
    return _safe_divide(num, den).to(q.dtype)
