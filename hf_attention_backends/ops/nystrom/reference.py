"""Nyström attention (Xiong et al. 2021), the pure-PyTorch spec of the ``hfab::nystrom_*`` ops.

Non-causal self-attention. Per sequence b with n real tokens (key_padding_mask[b].sum(), all N
without a mask), m = min(num_landmarks, n):

- m == n: exact softmax attention over the real keys (what the factorisation equals in exact
  arithmetic; Newton–Schulz would be a few percent off there).
- m < n: landmarks are segment means of the real rows of q_s = q·√scale and k_s = k·√scale
  (seg = n // m, the last segment takes the remainder); K1 = softmax(q_s K̃ᵀ) for all N queries,
  K2 = softmax(Q̃ K̃ᵀ), K3 = softmax(Q̃ k_sᵀ) over the real keys; out = K1 (Z (K3 v)) with Z the
  Newton–Schulz pseudo-inverse of K2 (ridge variant when kappa_star > 0).
- n == 0: the attention term is 0.

Plus, with conv_weight (Hq, ks), a depthwise convolution of v along the sequence (zero padding,
padded tokens count as 0). Computed in fp32 (fp64 for fp64 inputs); the output is in q.dtype.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._common import compute_dtype, repeat_kv


def segment_means(x: Tensor, m: int) -> Tensor:
    """(..., n, D) -> (..., m, D), 1 <= m <= n: means of rows [l·seg, (l+1)·seg), the last one [(m-1)·seg, n)."""
    seg = x.shape[-2] // m
    head = x[..., : (m - 1) * seg, :].unflatten(-2, (m - 1, seg)).mean(dim=-2)
    tail = x[..., (m - 1) * seg:, :].mean(dim=-2, keepdim=True)
    return torch.cat([head, tail], dim=-2)


def _norm_product(a: Tensor) -> Tensor:
    """(..., m, m) -> (..., 1, 1): ‖a‖₁‖a‖∞ (max column sum times max row sum) per matrix."""
    col = a.abs().sum(dim=-2).amax(dim=-1)
    row = a.abs().sum(dim=-1).amax(dim=-1)
    return (col * row)[..., None, None]


def newton_schulz_pinv(a: Tensor, iters: int) -> Tensor:
    """(..., m, m) -> (..., m, m): Z₀ = aᵀ/(‖a‖₁‖a‖∞), then ``iters`` times Z ← ¼Z(13I − M(15I − M(7I − M))), M = aZ."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    z = a.transpose(-1, -2) / _norm_product(a)
    for _ in range(iters):
        mz = a @ z
        z = 0.25 * z @ (13 * eye - mz @ (15 * eye - mz @ (7 * eye - mz)))
    return z


def k2_inverse(k2: Tensor, newton_iter: int, kappa_star: float) -> Tensor:
    """Z for K2 (..., m, m): NS(K2), or with kappa_star > 0 NS(K2ᵀK2 + λI)·K2ᵀ, λ = ‖K2‖₁‖K2‖∞/κ* (detached)."""
    if kappa_star == 0.0:
        return newton_schulz_pinv(k2, newton_iter)
    lam = _norm_product(k2.detach()) / kappa_star
    k2t = k2.transpose(-1, -2)
    eye = torch.eye(k2.shape[-1], dtype=k2.dtype, device=k2.device)
    return newton_schulz_pinv(k2t @ k2 + lam * eye, newton_iter) @ k2t


def _attend(q_s: Tensor, q_real: Tensor, k_real: Tensor, v_real: Tensor, num_landmarks: int, newton_iter: int,
            kappa_star: float) -> Tensor:
    """q_s (B, Hq, N, D) every query; q_real (B, Hq, n, D), k_real/v_real (B, Hkv, n, D) the n >= 1 real tokens.

    q_s, q_real and k_real are already scaled by √scale. Returns (B, Hq, N, D).
    """
    hq, n = q_s.shape[1], k_real.shape[-2]
    keys, values = repeat_kv(k_real, hq), repeat_kv(v_real, hq)
    if num_landmarks >= n:
        return torch.softmax(q_s @ keys.transpose(-1, -2), dim=-1) @ values
    q_land = segment_means(q_real, num_landmarks)  # (B, Hq, m, D)
    k_land = repeat_kv(segment_means(k_real, num_landmarks), hq)  # landmarks per kv head
    k1 = torch.softmax(q_s @ k_land.transpose(-1, -2), dim=-1)  # (B, Hq, N, m)
    k2 = torch.softmax(q_land @ k_land.transpose(-1, -2), dim=-1)  # (B, Hq, m, m)
    k3 = torch.softmax(q_land @ keys.transpose(-1, -2), dim=-1)  # (B, Hq, m, n)
    return k1 @ (k2_inverse(k2, newton_iter, kappa_star) @ (k3 @ values))


def conv_residual(v: Tensor, conv_weight: Tensor, key_padding_mask: Optional[Tensor], num_q_heads: int) -> Tensor:
    """Depthwise conv of v (B, Hkv, N, D) along N: query head h uses kv head h // (Hq/Hkv) and row h of
    conv_weight (Hq, ks); out[i] = Σ_t w[h, t]·v[i + t − ks//2], zero padding, padded tokens count as 0."""
    v = repeat_kv(v, num_q_heads)
    if key_padding_mask is not None:
        v = v.masked_fill(~key_padding_mask[:, None, :, None], 0.0)
    ks = conv_weight.shape[1]
    return F.conv2d(v, conv_weight.to(v.dtype)[:, None, :, None], padding=(ks // 2, 0), groups=num_q_heads)


def nystrom_forward(q: Tensor, k: Tensor, v: Tensor, conv_weight: Optional[Tensor],
                    key_padding_mask: Optional[Tensor], num_landmarks: int, newton_iter: int, kappa_star: float,
                    scale: float) -> Tensor:
    """q (B, Hq, N, D), k/v (B, Hkv, N, D), conv_weight (Hq, ks) or None, key_padding_mask (B, N) bool or None
    -> (B, Hq, N, D) in q.dtype. Arguments are assumed valid (the public function checks them)."""
    ct = compute_dtype(q.dtype)
    root = scale ** 0.5
    q_s, k_s, vc = q.to(ct) * root, k.to(ct) * root, v.to(ct)
    if key_padding_mask is None:
        out = _attend(q_s, q_s, k_s, vc, num_landmarks, newton_iter, kappa_star)
    else:
        rows = []
        for b in range(q.shape[0]):
            real = key_padding_mask[b].nonzero().squeeze(-1)  # compacted in order: left/right padding alike
            if real.numel() == 0:  # zeros that stay in the autograd graph (the CPU backward differentiates them)
                rows.append(q_s[b:b + 1].masked_fill(~key_padding_mask[b][:, None], 0.0))
            else:
                rows.append(_attend(q_s[b:b + 1], q_s[b:b + 1, :, real], k_s[b:b + 1, :, real], vc[b:b + 1, :, real],
                                    num_landmarks, newton_iter, kappa_star))
        out = torch.cat(rows) if rows else q_s  # B = 0: q_s is the empty output
    if conv_weight is not None and q.shape[2] > 0:  # conv2d rejects an empty sequence
        out = out + conv_residual(vc, conv_weight, key_padding_mask, q.shape[1])
    return out.to(q.dtype)
