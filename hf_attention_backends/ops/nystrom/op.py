"""``hfab::nystrom_fwd`` / ``hfab::nystrom_bwd`` and the public :func:`nystrom_attention`."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._common import check_key_padding_mask, check_positive_int, check_qkv, reference_vjp, resolve_scale
from .._registry import cpu_op, has_cuda_kernel
from . import reference

MAX_LANDMARKS = 1024
MAX_NEWTON_ITER = 100


def _nystrom_fwd(q: Tensor, k: Tensor, v: Tensor, conv_weight: Optional[Tensor], key_padding_mask: Optional[Tensor],
                 num_landmarks: int, newton_iter: int, kappa_star: float,
                 scale: float) -> tuple[Tensor, list[Tensor]]:
    """(out, state): the CUDA kernel's state is what its backward would otherwise recompute (landmarks, K3's
    log-sum-exp, the Newton–Schulz iterates, the output rows' log-sum-exp, ...: ``_state_like``); the reference keeps
    none."""
    out = reference.nystrom_forward(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star,
                                    scale).contiguous()
    return out, []


def _nystrom_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, conv_weight: Optional[Tensor],
                 key_padding_mask: Optional[Tensor], num_landmarks: int, newton_iter: int, kappa_star: float,
                 scale: float, state: list[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Autograd through the reference: the exact gradient through every Newton–Schulz iterate.
    dconv is empty (numel 0) when conv_weight is None. ``state``: nystrom_fwd's second output on the same inputs,
    or [] (the CUDA kernel then recomputes it; the reference always does)."""
    inputs = (q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale)
    dq, dk, dv, dconv = reference_vjp(reference.nystrom_forward, inputs, dout)[:4]
    dconv = q.new_empty(0) if dconv is None else dconv.contiguous()
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dconv


nystrom_fwd = cpu_op("nystrom_fwd", _nystrom_fwd)
nystrom_bwd = cpu_op("nystrom_bwd", _nystrom_bwd)


def _state_lengths(b, hq, hkv, n, d, m, newton_iter, masked: bool) -> tuple:
    """Lengths of the CUDA forward's two state vectors (fp32, int32): each a row of regions rounded up to 4 elements
    (csrc/nystrom/nystrom_host.cuh, ``StateLayout``, same order); sizes may be symbolic."""
    landmarks, slots = n > m, min(m, n)

    def when(present, numel):
        return numel if present else 0

    f32 = [when(masked or not landmarks, b * hq * slots * d), b * hq * slots * d, b * hq * n,
           *(when(landmarks, x) for x in (b * hq * m * d, b * hkv * m * d, b * m, b * hq * m * d, b * hq * m * m,
                                          b * hq * m * m, b * hq * m * m, b * hq,
                                          b * hq * (newton_iter + 1) * m * m, b * hq * m))]
    i32 = [-(-b // 4), b, *(when(masked, x) for x in (b * n, b, b * n))]  # exact: b bytes
    return tuple(sum(-(-r // 4) * 4 for r in regions) for regions in (f32, i32))


def _state_like(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], num_landmarks: int,
                newton_iter: int) -> list[Tensor]:
    """Empty tensors shaped like the CUDA forward's state (``_state_lengths``); [] where the reference runs (CPU, or
    CUDA without the compiled kernel) and for an empty q."""
    if q.device.type != "cuda" or q.numel() == 0 or not has_cuda_kernel("hfab::nystrom_fwd"):
        return []
    b, hq, n, d = q.shape
    f32, i32 = _state_lengths(b, hq, k.shape[1], n, d, num_landmarks, newton_iter, key_padding_mask is not None)
    return [q.new_empty(f32, dtype=torch.float32), q.new_empty(i32, dtype=torch.int32)]


@nystrom_fwd.register_fake
def _(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, _state_like(q, k, key_padding_mask, num_landmarks, newton_iter)


@nystrom_bwd.register_fake
def _(dout, q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale, state):
    dconv = q.new_empty(0) if conv_weight is None else torch.empty_like(conv_weight,
                                                                        memory_format=torch.contiguous_format)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format), dconv)


def _setup_context(ctx, inputs, output):
    q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale = inputs
    _, state = output
    ctx.mark_non_differentiable(*state)
    ctx.set_materialize_grads(False)  # no zero gradients for the state
    ctx.save_for_backward(q, k, v, conv_weight, key_padding_mask, *state)
    ctx.has_conv = conv_weight is not None
    ctx.hyper = (num_landmarks, newton_iter, kappa_star, scale)


def _backward(ctx, dout, _dstate):
    q, k, v, conv_weight, key_padding_mask, *state = ctx.saved_tensors
    if dout is None:  # out took no part in the loss
        return None, None, None, None, None, None, None, None, None
    dq, dk, dv, dconv = nystrom_bwd(dout.contiguous(), q, k, v, conv_weight, key_padding_mask, *ctx.hyper, state)
    return dq, dk, dv, (dconv if ctx.has_conv else None), None, None, None, None, None


nystrom_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_args(q, k, v, num_landmarks, newton_iter, kappa_star, conv_weight, scale, key_padding_mask):
    """Validate the public arguments; returns (key_padding_mask, kappa_star, scale) normalised."""
    check_qkv(q, k, v, same_length=True)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    check_positive_int("num_landmarks", num_landmarks, maximum=MAX_LANDMARKS)
    check_positive_int("newton_iter", newton_iter, maximum=MAX_NEWTON_ITER)
    if isinstance(kappa_star, bool) or not isinstance(kappa_star, (int, float)):
        raise TypeError(f"kappa_star must be a float, got {type(kappa_star).__name__} ({kappa_star!r})")
    kappa_star = float(kappa_star)
    if not (kappa_star >= 0.0 and math.isfinite(kappa_star)):
        raise ValueError(f"kappa_star={kappa_star} is not supported; supported: a finite number >= 0 "
                         "(0 = plain Newton–Schulz)")
    if conv_weight is not None:
        if not isinstance(conv_weight, Tensor):
            raise TypeError(f"conv_weight must be a Tensor or None, got {type(conv_weight).__name__}")
        hq = q.shape[1]
        if conv_weight.dim() != 2 or conv_weight.shape[0] != hq or conv_weight.shape[1] % 2 == 0:
            raise ValueError(f"conv_weight.shape={tuple(conv_weight.shape)} is not supported; supported: "
                             f"(Hq, ks) = ({hq}, ks) with ks odd")
        if conv_weight.dtype != q.dtype or conv_weight.device != q.device:
            raise ValueError(f"conv_weight is {conv_weight.dtype} on {conv_weight.device}; it must match q "
                             f"({q.dtype} on {q.device})")
    return key_padding_mask, kappa_star, resolve_scale(scale, q.shape[-1])


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 64, newton_iter: int = 6,
                        kappa_star: float = 0.0, conv_weight: Optional[Tensor] = None, scale: Optional[float] = None,
                        key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """The pure-PyTorch reference with plain autograd (no op, no kernel): the benchmarks' baseline."""
    key_padding_mask, kappa_star, scale = _check_args(q, k, v, num_landmarks, newton_iter, kappa_star, conv_weight,
                                                      scale, key_padding_mask)
    return reference.nystrom_forward(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star,
                                     scale)


def nystrom_attention(q: Tensor, k: Tensor, v: Tensor, *, num_landmarks: int = 64, newton_iter: int = 6,
                      kappa_star: float = 0.0, conv_weight: Optional[Tensor] = None, scale: Optional[float] = None,
                      key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Nyström approximation of non-causal softmax self-attention (Xiong et al. 2021); see ops/nystrom/README.md.

    Args:
        q: (B, Hq, N, D) float16, bfloat16, float32 (float64 on CPU).
        k, v: (B, Hkv, N, D), same dtype and device, same N as q (self-attention only; there is no
            causal variant); Hq must be a multiple of Hkv (GQA/MQA).
        num_landmarks: m, 1..1024. A sequence with n <= m real tokens gets exact softmax attention.
        newton_iter: Newton–Schulz steps for the pseudo-inverse of K2, 1..100.
        kappa_star: 0 = plain Newton–Schulz on K2; > 0 = ridge NS(K2ᵀK2 + λI)·K2ᵀ with
            λ = ‖K2‖₁‖K2‖∞/kappa_star (no gradient through λ).
        conv_weight: optional (Hq, ks), ks odd, q's dtype and device: depthwise conv residual of v
            along the sequence (zero padding, padded tokens count as 0).
        scale: score scale, default D**-0.5.
        key_padding_mask: optional (B, N) bool, True = real token. Landmarks and keys use the real
            tokens only (left or right padding alike); every query row gets a finite output.

    Returns:
        (B, Hq, N, D) in q.dtype, computed in fp32 (fp64 for fp64). Differentiable in q, k, v and
        conv_weight (exact gradient through every Newton–Schulz iterate).

    CUDA tensors run the kernels of csrc/nystrom: float16 and bfloat16, head dims 32/64/128,
    num_landmarks <= 128, newton_iter <= 20 (anything else raises a clear error there).
    """
    key_padding_mask, kappa_star, scale = _check_args(q, k, v, num_landmarks, newton_iter, kappa_star, conv_weight,
                                                      scale, key_padding_mask)
    return nystrom_fwd(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale)[0]
