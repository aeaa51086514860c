"""``hfab::stieltjes_fwd`` / ``hfab::stieltjes_bwd`` and the public :func:`stieltjes_attention`."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .._common import check_key_padding_mask, check_positive_int, check_qkv, compute_dtype, resolve_scale
from .._registry import cpu_op
from . import reference

MAX_NEWTON_ITER = 100


def _stieltjes_fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], causal: bool,
                   scale: float, order: float, newton_iter: int,
                   backward_state: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, rowmax, lam, u, lsum): u (B, Hq, Nq, D) = sum_j r_ij v_j / sum_j r_ij and lsum (B, Hq, Nq) =
    sum_j P_ij in the compute dtype when ``backward_state`` (the backward's delta is dO . u), else empty (0,)."""
    out, rowmax, lam, *state = reference.stieltjes_forward(q, k, v, key_padding_mask, causal, scale, order,
                                                           newton_iter, backward_state=backward_state)
    u, lsum = state if backward_state else (_no_state(q), _no_state(q))
    return out.contiguous(), rowmax.contiguous(), lam.contiguous(), u.contiguous(), lsum.contiguous()


def _no_state(q: Tensor) -> Tensor:
    return q.new_empty((0,), dtype=compute_dtype(q.dtype))


def _stieltjes_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, rowmax: Tensor, lam: Tensor, u: Tensor,
                   lsum: Tensor, key_padding_mask: Optional[Tensor], causal: bool, scale: float,
                   order: float) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU reference recomputes delta and sum P from the scores (u and lsum, which the CUDA kernels read, may
    be empty here)."""
    dq, dk, dv = reference.stieltjes_backward(dout, q, k, v, rowmax, lam, key_padding_mask, causal, scale, order)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


stieltjes_fwd = cpu_op("stieltjes_fwd", _stieltjes_fwd)
stieltjes_bwd = cpu_op("stieltjes_bwd", _stieltjes_bwd)


@stieltjes_fwd.register_fake
def _(q, k, v, key_padding_mask, causal, scale, order, newton_iter, backward_state=False):
    state_dtype = compute_dtype(q.dtype)
    rows = q.new_empty(q.shape[:3], dtype=state_dtype)
    u, lsum = (q.new_empty(q.shape, dtype=state_dtype), torch.empty_like(rows)) if backward_state \
        else (_no_state(q), _no_state(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), rows, torch.empty_like(rows), u, lsum


@stieltjes_bwd.register_fake
def _(dout, q, k, v, rowmax, lam, u, lsum, key_padding_mask, causal, scale, order):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, causal, scale, order, _newton_iter, *_backward_state = inputs
    _out, rowmax, lam, u, lsum = output
    ctx.save_for_backward(q, k, v, rowmax, lam, u, lsum, key_padding_mask)
    ctx.causal, ctx.scale, ctx.order = causal, scale, order


def _backward(ctx, dout, _drowmax, _dlam, _du, _dlsum):
    q, k, v, rowmax, lam, u, lsum, key_padding_mask = ctx.saved_tensors
    dq, dk, dv = stieltjes_bwd(dout.contiguous(), q, k, v, rowmax, lam, u, lsum, key_padding_mask, ctx.causal,
                               ctx.scale, ctx.order)
    return dq, dk, dv, None, None, None, None, None, None


stieltjes_fwd.register_autograd(_backward, setup_context=_setup_context)


def default_newton_iter(order: float) -> int:
    """The solver steps of the adaptive default (the op's newton_iter = -default_newton_iter(order): these steps,
    then extra ones where ``reference.needs_another_step`` says a row needs them), which keep the output within
    1e-3 (relative) of the exact-root output: 1 clamped Halley step for order >= 4 (its error estimate decides the
    rest: ``csrc/stieltjes/NOTES.md``, "One Halley step and an error estimate"), 4 Newton steps below, from
    ``reference.start_lambda`` (below order 4 at least the most any case of ``python -m benchmarks.stieltjes_solver
    --steps-needed`` needed to reach 3e-4: 3 to 4 Newton steps at orders 1 to 3). A fixed count of 1 Halley step
    is not accurate on its own: pass an explicit newton_iter of 2 or more for a fixed count."""
    return 1 if order >= reference.HALLEY_MIN_ORDER else 4


def _check_args(q, k, v, order, newton_iter, scale, key_padding_mask):
    check_qkv(q, k, v)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    if isinstance(order, bool) or not isinstance(order, (int, float)):
        raise TypeError(f"order must be a float, got {type(order).__name__} ({order!r})")
    if not (math.isfinite(order) and order >= 1.0):
        raise ValueError(f"order={order} is not supported; supported: a finite number >= 1 (default 4.0)")
    if newton_iter is None:
        newton_iter = -default_newton_iter(order)  # the op's adaptive form: the default steps, then extra ones
    else:
        newton_iter = check_positive_int("newton_iter", newton_iter, minimum=1, maximum=MAX_NEWTON_ITER)
    return float(order), newton_iter, resolve_scale(scale, q.shape[-1]), key_padding_mask


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, order: float = 4.0, newton_iter: Optional[int] = None,
                        causal: bool = False, scale: Optional[float] = None,
                        key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """The pure-PyTorch reference with plain autograd (no op, no kernel): the benchmarks' baseline.

    Its gradient is autograd through the ``newton_iter`` Newton steps (not the implicit-function
    gradient of the op). Under autograd each query chunk is checkpointed, so memory stays O(chunk x Nk)
    at long N; the backward recomputes the chunk's forward.
    """
    order, newton_iter, scale, key_padding_mask = _check_args(q, k, v, order, newton_iter, scale, key_padding_mask)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    out, _, _ = reference.stieltjes_forward(q, k, v, key_padding_mask, bool(causal), scale, order, newton_iter,
                                            recompute=recompute)
    return out


def stieltjes_attention(q: Tensor, k: Tensor, v: Tensor, *, order: float = 4.0, newton_iter: Optional[int] = None,
                        causal: bool = False, scale: Optional[float] = None,
                        key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Stieltjes attention: power-law normalisation (lambda - x)^(-order) instead of softmax.

    Args:
        q: (B, Hq, Nq, D) float16, bfloat16, float32 (float64 on CPU).
        k, v: (B, Hkv, Nk, D), same dtype and device; Hq must be a multiple of Hkv (GQA/MQA:
            query head h reads kv head h // (Hq / Hkv)).
        order: the power, a finite number >= 1 (default 4.0).
        newton_iter: solver steps for lambda (clamped Halley at order >= 4, Newton below), 1..100; None
            (default): ``default_newton_iter(order)`` steps (1 at order >= 4, else 4), then up to 2 more for the
            rows whose last step may have left them short of the root (``reference.needs_another_step``: a Halley
            step's error estimate above 3e-4, a Newton step's move above 10%; the CUDA kernel sweeps the keys again
            only for query blocks with such a row). That keeps the output within 1e-3 (relative, fp32 compute)
            of the output at the exact root for scores of q, k up to 10x standard normal and on SmolLM2's
            attention rows (each step is one more pass over the keys in the CUDA kernel).
        causal: bottom-right aligned causal mask (query i sees keys j <= i + Nk - Nq).
        scale: score scale, default D**-0.5.
        key_padding_mask: optional (B, Nk) bool, True = real key.

    Returns:
        (B, Hq, Nq, D) in q.dtype, computed in fp32 (fp64 for fp64). Each row is a convex combination
        of the allowed values; rows with no allowed key are 0. Differentiable in q, k, v; the gradient
        is that of the exact root (implicit function theorem) evaluated at the computed lambda.
    """
    order, newton_iter, scale, key_padding_mask = _check_args(q, k, v, order, newton_iter, scale, key_padding_mask)
    backward_state = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return stieltjes_fwd(q, k, v, key_padding_mask, bool(causal), scale, order, newton_iter, backward_state)[0]
