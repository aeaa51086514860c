"""Shared pieces of the four ops: boundary validation, GQA expansion and the allowed-key mask.

Everything here is used by the references (the spec) and by the public functions; kernels
never call it.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Optional

import torch
from torch import Tensor

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, same_length: bool = False) -> None:
    """Raise a clear error unless q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) are a valid triple.

    same_length: also require Nq == Nk (self-attention only backends).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={t.dtype} is not supported; supported: "
                             f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    bq, hq, _, dq = q.shape
    bk, hkv, _, dk = k.shape
    if bq != bk:
        raise ValueError(f"batch sizes differ: q has B={bq}, k has B={bk}")
    if dq != dk:
        raise ValueError(f"head dims differ: q has D={dq}, k has D={dk}; supported: equal head dims")
    if dq == 0:
        raise ValueError("head dim D=0 is not supported")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv} (GQA)")
    if same_length and q.shape[2] != k.shape[2]:
        raise ValueError(f"this backend is self-attention only: Nq={q.shape[2]} must equal Nk={k.shape[2]}")


def check_key_padding_mask(mask: Optional[Tensor], k: Tensor) -> Optional[Tensor]:
    """Validate a (B, Nk) bool key padding mask (True = real token); returns it or None."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"key_padding_mask must be a bool Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask.dtype={mask.dtype}; supported: torch.bool (True = real token)")
    expected = (k.shape[0], k.shape[2])
    if tuple(mask.shape) != expected:
        raise ValueError(f"key_padding_mask.shape={tuple(mask.shape)}; expected (B, Nk)={expected}")
    if mask.device != k.device:
        raise ValueError(f"key_padding_mask is on {mask.device}, k on {k.device}; they must match")
    return mask


class PassedOnce:
    """Host-side checks of tensor values (each a host sync on a GPU) run once per tensor state, not once per call.

    ``passes(tensors, predicate)`` returns ``predicate()``, which must depend only on the values of ``tensors``,
    and remembers a True while every tensor is a view of the same live tensor (itself, or its ``_base``) with the
    same place, shape, strides and in-place version counter: a layer's Parameter is checked at its first call and
    again after an optimizer step or a load changed it; a mask or position_ids shared by a model's layers once per
    forward, also when each layer receives a new view of it. Inference tensors keep no version counter, so a
    predicate over them runs every call. Not for use while tracing (checks are skipped there).
    """

    def __init__(self):
        self._passed = {}  # id of the first tensor's base -> (weak references to the bases, the views' states)

    def passes(self, tensors: tuple, predicate: Callable[[], bool]) -> bool:
        if any(t.is_inference() for t in tensors):
            return predicate()
        bases = tuple(t if t._base is None else t._base for t in tensors)
        key = id(bases[0])
        states = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t._version) for t in tensors)
        seen = self._passed.get(key)
        if seen is not None and seen[1] == states and all(r() is b for r, b in zip(seen[0], bases)):
            return True
        if not predicate():
            return False
        table = self._passed

        def forget(_ref):  # the entry dies with any of its bases
            table.pop(key, None)

        table[key] = (tuple(weakref.ref(b, forget) for b in bases), states)
        return True


def resolve_scale(scale: Optional[float], head_dim: int) -> float:
    """``scale`` or D**-0.5 when None; must be a finite positive number."""
    if scale is None:
        return head_dim ** -0.5
    scale = float(scale)
    if not (scale > 0.0 and scale < float("inf")):
        raise ValueError(f"scale={scale} must be a finite positive number (default D**-0.5)")
    return scale


def check_positive_int(name: str, value, *, minimum: int = 1, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ValueError(f"{name}={value} is not supported; supported: >= {minimum}{upper}")
    return value


def repeat_kv(x: Tensor, num_q_heads: int) -> Tensor:
    """(B, Hkv, N, D) -> (B, Hq, N, D): query head h reads kv head h // (Hq / Hkv)."""
    groups = num_q_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def sum_kv_groups(grad: Tensor, num_kv_heads: int) -> Tensor:
    """(B, Hq, N, D) -> (B, Hkv, N, D): sum the gradients of the query heads sharing a kv head."""
    b, hq, n, d = grad.shape
    return grad.view(b, num_kv_heads, hq // num_kv_heads, n, d).sum(dim=2)


def allowed_keys(n_q: int, n_k: int, *, causal: bool, key_padding_mask: Optional[Tensor],
                 batch: int, device) -> Tensor:
    """(B, 1, Nq, Nk) bool: may query i attend to key j.

    Causal masks are bottom-right aligned: query i sees keys j <= i + (Nk - Nq).
    """
    allowed = torch.ones(batch, 1, n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        i = torch.arange(n_q, device=device)[:, None]
        j = torch.arange(n_k, device=device)[None, :]
        allowed = allowed & (j <= i + (n_k - n_q))
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    return allowed


def zero_empty_rows(out: Tensor, allowed: Tensor) -> Tensor:
    """Rows that may attend to no key output exactly 0 (never NaN)."""
    has_key = allowed.any(dim=-1, keepdim=True)
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """References compute in fp32 (fp64 stays fp64, for gradcheck and oracles)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _autograd_dispatch_keys() -> torch._C.DispatchKeySet:
    outside = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._AutoDispatchBelowADInplaceOrView():  # autograd keys and ADInplaceOrView
        return torch._C._dispatch_tls_local_exclude_set() - outside


_AUTOGRAD_KEYS = _autograd_dispatch_keys()


@contextlib.contextmanager
def autograd_dispatch():
    """Re-enable autograd inside a custom op's kernel (torch.library runs it with autograd keys excluded)."""
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                         torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS):
        yield


def reference_vjp(forward, inputs: tuple, grad_output: Tensor) -> tuple:
    """Gradients of ``forward(*inputs)`` w.r.t. every Tensor input, by autograd through the reference.

    Used as the CPU backward of ops whose spec is "the exact gradient of this forward". Non-Tensor
    inputs and Tensors that are None get None.
    """
    with autograd_dispatch(), torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) if isinstance(x, Tensor) and x.is_floating_point() else x
                  for x in inputs]
        out = forward(*leaves)
        wrt = [x for x in leaves if isinstance(x, Tensor) and x.requires_grad]
        if out.requires_grad:
            grads = iter(torch.autograd.grad(out, wrt, grad_output, allow_unused=True))
        else:  # the output depends on no input (e.g. every key padded): all gradients are 0
            grads = iter([None] * len(wrt))
    result = []
    for x in leaves:
        if isinstance(x, Tensor) and x.requires_grad:
            g = next(grads)
            result.append(torch.zeros_like(x) if g is None else g)
        else:
            result.append(None)
    return tuple(result)
