"""``hfab::exact_fwd`` / ``hfab::exact_bwd`` and the public :func:`exact_attention`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._common import check_key_padding_mask, check_qkv, resolve_scale
from .._registry import cpu_op
from . import reference


def _exact_fwd(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], causal: bool,
               scale: float) -> tuple[Tensor, Tensor]:
    out, lse = reference.exact_forward(q, k, v, key_padding_mask, causal, scale)
    return out.contiguous(), lse.float().contiguous()


def _exact_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               key_padding_mask: Optional[Tensor], causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    lse = lse.double() if q.dtype == torch.float64 else lse
    dq, dk, dv = reference.exact_backward(dout, q, k, v, out, lse, key_padding_mask, causal, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


exact_fwd = cpu_op("exact_fwd", _exact_fwd)
exact_bwd = cpu_op("exact_bwd", _exact_bwd)


@exact_fwd.register_fake
def _(q, k, v, key_padding_mask, causal, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=torch.float32)


@exact_bwd.register_fake
def _(dout, q, k, v, out, lse, key_padding_mask, causal, scale):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
    dq, dk, dv = exact_bwd(dout.contiguous(), q, k, v, out, lse, key_padding_mask, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


exact_fwd.register_autograd(_backward, setup_context=_setup_context)


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
                        key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """The pure-PyTorch reference with plain autograd (no op, no kernel): the benchmarks' baseline."""
    check_qkv(q, k, v)
    out, _ = reference.exact_forward(q, k, v, check_key_padding_mask(key_padding_mask, k), bool(causal),
                                     resolve_scale(scale, q.shape[-1]))
    return out


def exact_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None,
                    key_padding_mask: Optional[Tensor] = None) -> Tensor:
    """Exact softmax attention (FlashAttention-2 algorithm; CUDA-core kernel on GPU).

    Args:
        q: (B, Hq, Nq, D). CPU (reference): float16, bfloat16, float32, float64. CUDA (kernel):
            float16 on any GPU, bfloat16 on sm_80+; head dims 32, 64, 128.
        k, v: (B, Hkv, Nk, D), same dtype and device; Hq must be a multiple of Hkv (GQA/MQA).
        causal: bottom-right aligned causal mask (query i sees keys j <= i + Nk - Nq).
        scale: score scale, default D**-0.5.
        key_padding_mask: optional (B, Nk) bool, True = real key.

    Returns:
        (B, Hq, Nq, D) in q.dtype. Softmax and accumulation in fp32. Rows with no allowed key are 0.
        Differentiable in q, k, v.
    """
    check_qkv(q, k, v)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    scale = resolve_scale(scale, q.shape[-1])
    out, _ = exact_fwd(q, k, v, key_padding_mask, bool(causal), scale)
    return out
