"""The ``hfab_*`` mask function: classify transformers' mask requests into a compact form the adapters read.

transformers builds one mask per forward (``create_causal_mask`` / ``create_bidirectional_mask`` /
sliding variants) by calling the mask function registered under the model's attention implementation,
and hands the returned value unchanged to every attention layer as ``attention_mask`` (checked for
llama, qwen2, qwen3, mistral, gpt2, bert, modernbert, vit). :func:`hfab_mask` returns one of:

- ``None``: no mask beyond the layer's own structure (pure causal, bottom-right aligned, or full);
- a bool tensor (B, 1, 1, Nk), True = real key: key padding on top of that structure;
- a bool tensor (B, 1, Nq, Nk) with Nq > 1: anything else (sliding window that bites, packed documents,
  static-cache slots, custom overlays). Adapters refuse it; sdpa layers of a hybrid plan use it as is.

The structure (causal or not) is the layer's: ``kwargs["is_causal"]`` or ``module.is_causal``, as for
transformers' own sdpa path. With Nq = 1 (decode) a (B, 1, 1, Nk) mask is exactly a key mask, whatever
built it. Outside the fast path (plain causal / bidirectional mask functions, integer offsets) the dense
mask is built with ``sdpa_mask`` (what sdpa would cost) and compared with the compact candidates.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.masking_utils import (
    bidirectional_mask_function,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
)

from ..ops._common import allowed_keys

_STRUCTURE = {causal_mask_function: True, bidirectional_mask_function: False}


def hfab_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
              mask_function=causal_mask_function, attention_mask: Optional[Tensor] = None,
              local_size: Optional[int] = None, **kwargs) -> Optional[Tensor]:
    """``AttentionMaskInterface`` function of every ``hfab_*`` implementation (signature of ``sdpa_mask``).

    attention_mask: the 2D (B, past + Nq) padding mask, True/1 = real token, or None.
    Returns None, a (B, 1, 1, Nk) bool key mask or a dense (B, 1, Nq, Nk) bool mask (see the module doc).
    """
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    causal = _STRUCTURE.get(mask_function)
    aligned = isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset + q_length == kv_offset + kv_length
    if causal is not None and local_size is None and (not causal or aligned):
        return _compact(padding)
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    dense = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function=mask_function,
                      attention_mask=attention_mask, local_size=local_size, allow_is_causal_skip=False,
                      allow_is_bidirectional_skip=False, **kwargs)
    keys = padding if padding is not None else torch.ones(batch_size, kv_length, dtype=torch.bool,
                                                          device=dense.device)
    for structure in (False, True):
        candidate = allowed_keys(q_length, kv_length, causal=structure, key_padding_mask=keys, batch=batch_size,
                                 device=dense.device)
        if torch.equal(dense, candidate.expand_as(dense)):
            return _compact(keys)
    return dense


def _compact(padding: Optional[Tensor]) -> Optional[Tensor]:
    if padding is None or (not torch.compiler.is_compiling() and bool(padding.all())):
        return None
    return padding[:, None, None, :]


def key_padding_from_mask(attention_mask, query: Tensor, key: Tensor, *, what: str) -> Optional[Tensor]:
    """(B, Nk) bool key padding mask from the value an attention layer received, or None.

    Raises ValueError for anything that is not None or a bool (B, 1, 1, Nk) mask (or (B, 1, Nq, Nk)
    with Nq = 1); ``what`` names the caller in the message.
    """
    if attention_mask is None:
        return None
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    if isinstance(attention_mask, Tensor) and attention_mask.dtype == torch.bool and attention_mask.dim() == 4:
        shape = tuple(attention_mask.shape)
        if shape[1] == 1 and shape[2] == 1 and shape[0] == b and shape[3] == nk:
            return attention_mask[:, 0, 0, :]
    shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
    dtype = getattr(attention_mask, "dtype", None)
    raise ValueError(
        f"{what}: attention_mask of shape {shape} and dtype {dtype} is a dense or unknown mask (Nq={nq}, Nk={nk}); "
        "supported: none, causal, causal + key padding, key padding (the masks hfab's mask function builds from "
        "a 2D padding mask). Sliding windows that restrict the keys, packed documents, static-cache prefill, "
        "custom 4D masks and additive float masks are not supported; run those layers on sdpa (a hybrid "
        "plan: enable_backend(..., layers=[...])) or pass a 2D padding mask.")


def sdpa_mask_for(attention_mask, query: Tensor, key: Tensor, causal: bool) -> Optional[Tensor]:
    """The mask transformers' sdpa function needs for a layer left out of an hfab plan.

    sdpa applies ``is_causal`` only without a mask and top-left aligned, so a causal layer with
    key padding, or with 1 < Nq < Nk (chunked prefill), gets the explicit bottom-right mask.
    """
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.shape[2] != 1:
        return attention_mask
    if not causal or nq == 1 or (attention_mask is None and nq == nk):
        return attention_mask
    kpm = None if attention_mask is None else attention_mask[:, 0, 0, :]
    return allowed_keys(nq, nk, causal=True, key_padding_mask=kpm, batch=b, device=query.device)
