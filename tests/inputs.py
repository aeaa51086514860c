"""Random inputs shared by the op tests: (B, H, N, D) triples, key padding masks, shape grids."""
from __future__ import annotations

import torch

# (B, Hq, Hkv, Nq, Nk, D): N = 1, odd N, Nq < Nk (decode / chunked prefill), GQA, MQA
SHAPES = [
    (1, 1, 1, 1, 1, 8),
    (2, 2, 2, 7, 7, 16),
    (1, 4, 2, 13, 13, 8),
    (2, 3, 1, 5, 9, 8),
    (1, 2, 2, 1, 11, 32),
    (2, 4, 4, 33, 33, 16),
]


def make_qkv(b, hq, hkv, nq, nk, d, *, dtype=torch.float64, scale=1.0, requires_grad=False, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    q = torch.randn(b, hq, nq, d, dtype=torch.float64, generator=g) * scale
    k = torch.randn(b, hkv, nk, d, dtype=torch.float64, generator=g) * scale
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64, generator=g)
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


def make_padding(b, nk, *, left=False, min_real=1, seed=0):
    """(B, Nk) bool, True = real; each row keeps a random count >= min_real of real tokens, contiguous."""
    g = torch.Generator().manual_seed(seed)
    real = torch.randint(min(min_real, nk), nk + 1, (b,), generator=g)
    pos = torch.arange(nk)[None, :]
    return pos >= (nk - real[:, None]) if left else pos < real[:, None]
