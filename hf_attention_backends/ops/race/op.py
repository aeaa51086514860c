"""``hfab::race_fwd`` / ``hfab::race_bwd``, the public :func:`race_attention` and :func:`make_planes`."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from .._common import (PassedOnce, check_key_padding_mask, check_positive_int, check_qkv, compute_dtype,
                       reference_vjp)
from .._registry import cpu_op
from . import reference

MAX_PLANES = 8
MAX_TABLES = 16


def make_planes(num_tables: int, num_planes: int, head_dim: int, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> Tensor:
    """The fixed random hyperplanes W of RACE: (L, P, D) = (num_tables, num_planes, head_dim) in ``dtype``.

    Rows are i.i.d. uniform directions on the unit sphere (Gaussian draws divided by their norm), drawn
    in float64 on the CPU from ``torch.Generator().manual_seed(seed)`` and then cast, so one seed gives
    the same planes on every machine and device. Unit norm keeps tanh(W x) graded rather than saturated:
    for a random direction w, ⟨w, x⟩ has standard deviation ‖x‖/√D, the RMS entry of x, which is O(1) for
    typical queries and keys; N(0, 1) rows would give ‖x‖ ≈ √D and tanh would collapse to a hard sign
    hash with vanishing gradients. Move the result to the device with ``.to(device)``.
    """
    check_positive_int("num_tables", num_tables, maximum=MAX_TABLES)
    check_positive_int("num_planes", num_planes, maximum=MAX_PLANES)
    check_positive_int("head_dim", head_dim)
    check_positive_int("seed", seed, minimum=0, maximum=2 ** 64 - 1)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype={dtype} is not supported; supported: a floating torch.dtype")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(num_tables, num_planes, head_dim, generator=gen, dtype=torch.float64)
    return (w / torch.linalg.vector_norm(w, dim=-1, keepdim=True)).to(dtype)


def _race_fwd(q: Tensor, k: Tensor, v: Tensor, planes: Tensor, beta: Tensor, key_padding_mask: Optional[Tensor],
              causal: bool) -> Tensor:
    return reference.race_forward(q, k, v, planes, beta, key_padding_mask, causal).contiguous()


def _race_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, planes: Tensor, beta: Tensor,
              key_padding_mask: Optional[Tensor], causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    def forward(q, k, v, beta):
        return reference.race_forward(q, k, v, planes, beta, key_padding_mask, causal)

    grads = reference_vjp(forward, (q, k, v, beta), dout)
    return tuple(g.contiguous() for g in grads)


race_fwd = cpu_op("race_fwd", _race_fwd)
race_bwd = cpu_op("race_bwd", _race_bwd)


@race_fwd.register_fake
def _(q, k, v, planes, beta, key_padding_mask, causal):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@race_bwd.register_fake
def _(dout, q, k, v, planes, beta, key_padding_mask, causal):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, beta))


def _setup_context(ctx, inputs, output):
    q, k, v, planes, beta, key_padding_mask, causal = inputs
    ctx.save_for_backward(q, k, v, planes, beta, key_padding_mask)
    ctx.causal = causal


def _backward(ctx, dout):
    q, k, v, planes, beta, key_padding_mask = ctx.saved_tensors
    dq, dk, dv, dbeta = race_bwd(dout.contiguous(), q, k, v, planes, beta, key_padding_mask, ctx.causal)
    return dq, dk, dv, None, dbeta, None, None


race_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_planes(planes, q: Tensor) -> Tensor:
    if not isinstance(planes, Tensor):
        raise TypeError(f"planes must be a torch.Tensor of shape (L, P, D) (see make_planes), got {type(planes).__name__}")
    if planes.dim() != 3:
        raise ValueError(f"planes must have 3 dims (L, P, D), got shape {tuple(planes.shape)}")
    if not planes.is_floating_point():
        raise ValueError(f"planes.dtype={planes.dtype} is not supported; supported: a floating dtype")
    if planes.device != q.device:
        raise ValueError(f"planes is on {planes.device}, q on {q.device}; they must match")
    num_tables, num_planes, d = planes.shape
    check_positive_int("num_tables (planes.shape[0])", num_tables, maximum=MAX_TABLES)
    check_positive_int("num_planes (planes.shape[1])", num_planes, maximum=MAX_PLANES)
    if d != q.shape[-1]:
        raise ValueError(f"planes.shape[2]={d} must equal the head dim D={q.shape[-1]}")
    return planes


_FINITE_BETAS = PassedOnce()


def _check_beta(beta, q: Tensor) -> Tensor:
    """A finite python float > 0, or a finite floating Tensor of shape () or (Hq,); returns a Tensor."""
    hq = q.shape[1]
    if isinstance(beta, (int, float)) and not isinstance(beta, bool):
        beta = float(beta)
        if not (beta > 0.0 and math.isfinite(beta)):
            raise ValueError(f"beta={beta} must be a finite positive number")
        return torch.full((), beta, dtype=compute_dtype(q.dtype), device=q.device)
    if not isinstance(beta, Tensor):
        raise TypeError(f"beta must be a float or a Tensor of shape () or (Hq,)=({hq},), got {type(beta).__name__}")
    if tuple(beta.shape) not in ((), (hq,)):
        raise ValueError(f"beta.shape={tuple(beta.shape)} is not supported; supported: () or (Hq,)=({hq},)")
    if not beta.is_floating_point():
        raise ValueError(f"beta.dtype={beta.dtype} is not supported; supported: a floating dtype")
    if beta.device != q.device:
        raise ValueError(f"beta is on {beta.device}, q on {q.device}; they must match")
    # a host sync, once per beta tensor and state; skipped when traced (data-dependent checks would break the graph)
    if not torch.compiler.is_compiling() and not _FINITE_BETAS.passes((beta,),
                                                                       lambda: bool(torch.isfinite(beta).all())):
        raise ValueError(f"beta={beta.detach().cpu().tolist()} must be finite")
    return beta


def _check_inputs(q, k, v, planes, beta, key_padding_mask):
    check_qkv(q, k, v)
    return (_check_planes(planes, q), _check_beta(beta, q), check_key_padding_mask(key_padding_mask, k))


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, planes: Tensor, beta: Union[float, Tensor],
                        causal: bool = False, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """The pure-PyTorch reference with plain autograd (no op, no kernel): the benchmarks' baseline."""
    planes, beta, key_padding_mask = _check_inputs(q, k, v, planes, beta, key_padding_mask)
    return reference.race_forward(q, k, v, planes, beta, key_padding_mask, bool(causal))


def race_attention(q: Tensor, k: Tensor, v: Tensor, *, planes: Tensor, beta: Union[float, Tensor],
                   causal: bool = False, key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """RACE attention: soft-LSH feature-map linear attention, O(N·S·D) with S = L·2^P.

    Args:
        q: (B, Hq, Nq, D) float16, bfloat16, float32 (float64 on CPU).
        k, v: (B, Hkv, Nk, D), same dtype and device; Hq must be a multiple of Hkv (GQA/MQA).
        planes: (L, P, D) fixed hyperplanes (:func:`make_planes`), 1 <= P <= 8, 1 <= L <= 16; no gradient.
        beta: sharpness β, a finite positive float, or a finite Tensor of shape () or (Hq,) (one per query
            head, used for both Φ(q) and Φ(k) of that head); differentiable. No ``scale``: β plays its role.
        causal: bottom-right aligned causal mask (query i sees keys j <= i + Nk - Nq).
        key_padding_mask: optional (B, Nk) bool, True = real key.

    Returns:
        (B, Hq, Nq, D) in q.dtype, computed in fp32 (fp64 for fp64). Rows with no allowed key are 0.
        Differentiable in q, k, v and beta.
    """
    planes, beta, key_padding_mask = _check_inputs(q, k, v, planes, beta, key_padding_mask)
    return race_fwd(q, k, v, planes, beta, key_padding_mask, bool(causal))
