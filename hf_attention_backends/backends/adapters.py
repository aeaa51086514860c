"""``AttentionInterface`` adapters: transformers' call -> guards -> the backend's public op.

Registered at import as ``hfab_nystrom``, ``hfab_stieltjes``, ``hfab_race``, ``hfab_exact`` (attention
function and mask function, :mod:`.masks`). Per module, in this order:

1. ``module.hfab_backend`` set (by :func:`~.enable.enable_backend` or convert): that backend with
   ``module.hfab_config`` and the module's ``hfab_beta`` / ``hfab_planes`` / ``hfab_conv_weight`` /
   ``hfab_temperature`` (Stieltjes: the query of head h is multiplied by ``hfab_temperature[h]``) if any;
2. ``module.hfab_left_out`` True (a layer left out of a hybrid plan): transformers' own sdpa function,
   with the mask it needs (:func:`.masks.sdpa_mask_for`);
3. neither (``from_pretrained(..., attn_implementation="hfab_race")`` without enable_backend): the
   implementation's own backend with its default config.

A RACE call whose ``key`` is the hand-off of a :class:`~.race_cache.RaceCache` layer (``past_key_values=
race_cache(model)``) reads and updates that layer's decode state instead (:func:`.race_cache.attend`).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..ops._common import PassedOnce
from ..ops import exact_attention, make_planes, nystrom_attention, race_attention, stieltjes_attention
from .config import CONFIGS, make_config
from . import race_cache
from ..nn.parameters import temperature_scaled
from .masks import hfab_mask, key_padding_from_mask, sdpa_mask_for

try:  # transformers 5.x records attentions with hooks; output_attentions never reaches the attention function
    from transformers.utils.output_capturing import _active_collector as _COLLECTOR
except ImportError:
    _COLLECTOR = None

BACKENDS = tuple(CONFIGS)
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k")
_PLANES: dict = {}
_UNPACKED = PassedOnce()  # position_ids (and key mask) found without a restart inside a row


def implementation_name(backend: str) -> str:
    """The AttentionInterface / AttentionMaskInterface name of a backend: ``hfab_<backend>``."""
    return f"hfab_{backend}"


_DEFAULTS = {name: make_config(name) for name in BACKENDS}


def module_causal(module, kwargs) -> bool:
    """``kwargs["is_causal"]`` when given (not None), else ``module.is_causal``."""
    flag = kwargs.get("is_causal")
    if flag is None:
        if not hasattr(module, "is_causal"):
            raise ValueError(f"{type(module).__name__} has no is_causal attribute and no is_causal kwarg was "
                             "passed; hfab cannot tell whether the layer is causal")
        flag = module.is_causal
    return bool(flag)


def check_call(what: str, backend: str, module, query: Tensor, key: Tensor, dropout: float, causal: bool,
               kwargs: dict) -> None:
    """Raise for every feature the backend does not implement (see backends/README.md)."""
    if dropout is not None and float(dropout) > 0.0:
        raise NotImplementedError(
            f"{what}: dropout={dropout} is not supported (attention dropout is not implemented); supported: 0.0. "
            "Set the config's attention dropout (attention_dropout / attn_pdrop / attention_probs_dropout_prob) "
            "to 0 before training, or call model.eval()")
    if kwargs.get("output_attentions") or _attentions_requested():
        raise NotImplementedError(f"{what}: output_attentions=True is not supported (no attention matrix is "
                                  "formed); supported: False. Use attn_implementation='eager' to inspect weights")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{what}: {name} is not supported (got a value); supported: None "
                                      "(no logit soft-capping, attention sinks or additive position bias)")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError(f"{what}: attention sinks ({type(module).__name__}.sinks) are not supported")
    for name in _PACKED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{what}: {name} was passed (a packed varlen batch); packed batches are not "
                                      "supported yet: pad the documents into separate rows with a 2D attention_mask")
    window = kwargs.get("sliding_window")
    if window is not None and query.shape[2] > 1 and key.shape[2] > int(window):
        raise NotImplementedError(
            f"{what}: sliding_window={window} with Nk={key.shape[2]} keys is not supported (the window would "
            f"drop keys); supported: no sliding window, or sequences of at most {window} tokens. Leave the "
            "sliding-window layers on sdpa with a hybrid plan (enable_backend(..., layers=[...]))")
    if backend == "nystrom" and causal:
        raise NotImplementedError(f"{what}: causal attention is not supported by Nyström (landmarks mix past and "
                                  "future tokens); supported: non-causal (encoder) layers. Use stieltjes, race or exact")


def _attentions_requested() -> bool:
    collected = _COLLECTOR.get() if _COLLECTOR is not None else None
    return bool(collected) and "attentions" in collected


def check_not_packed(what: str, position_ids: Optional[Tensor], key_padding_mask: Optional[Tensor], nq: int) -> None:
    """Raise if the real query tokens' position_ids restart within a row (several documents packed in one row).

    Padding tokens are ignored (generate gives them arbitrary positions). Skipped while compiling.
    """
    if position_ids is None or nq == 1 or torch.compiler.is_compiling() or position_ids.dim() != 2:
        return
    if position_ids.shape[-1] != nq:
        return

    def restarts() -> Tensor:  # (B, Nq - 1) bool
        bad = position_ids[:, 1:] - position_ids[:, :-1] != 1
        if key_padding_mask is None:
            return bad
        real = key_padding_mask[:, -nq:]
        # a step counts between consecutive real tokens only (padding is contiguous at one end)
        return bad & real[:, 1:] & real[:, :-1]

    # a host sync: once per forward, not per layer (the layers share position_ids and the mask they are views of)
    tensors = (position_ids,) if key_padding_mask is None else (position_ids, key_padding_mask)
    if not _UNPACKED.passes(tensors, lambda: not bool(restarts().any())):
        row = int(restarts().any(dim=-1).nonzero()[0])
        raise NotImplementedError(
            f"{what}: position_ids restart inside row {row} (several documents packed in one row); packed "
            "batches are not supported yet and would attend across documents: put each document in its own "
            "row with a 2D attention_mask")


def _planes(module, config, head_dim: int, device, dtype) -> Tensor:
    planes = getattr(module, "hfab_planes", None)
    if planes is not None:
        return planes
    layer = getattr(module, "hfab_layer", getattr(module, "layer_idx", None))
    if layer is None:
        raise ValueError(f"{type(module).__name__} has no layer index for its RACE planes; call "
                         "hf_attention_backends.enable_backend(model, 'race') or convert() first")
    key = (config.num_tables, config.num_planes, head_dim, config.seed + int(layer), device, dtype)
    if key not in _PLANES:
        _PLANES[key] = make_planes(config.num_tables, config.num_planes, head_dim, seed=key[3], dtype=dtype).to(device)
    return _PLANES[key]


def race_parameters(module, config, query: Tensor):
    """(planes, beta) of a RACE module: ``hfab_planes`` / ``hfab_beta`` when present, else the defaults."""
    beta = getattr(module, "hfab_beta", None)
    if beta is None:
        beta = config.beta if config.beta is not None else query.shape[-1] ** -0.5
    return _planes(module, config, query.shape[-1], query.device, query.dtype), beta


def run_backend(backend: str, config, module, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor], causal: bool, scaling: Optional[float]) -> Tensor:
    """Call the backend's public op; returns (B, Hq, Nq, D)."""
    if backend == "exact":
        return exact_attention(query, key, value, causal=causal, scale=scaling, key_padding_mask=key_padding_mask)
    if backend == "stieltjes":
        query = temperature_scaled(query, getattr(module, "hfab_temperature", None))
        return stieltjes_attention(query, key, value, order=config.order, newton_iter=config.newton_iter,
                                   causal=causal, scale=scaling, key_padding_mask=key_padding_mask)
    if backend == "race":
        planes, beta = race_parameters(module, config, query)
        return race_attention(query, key, value, planes=planes, beta=beta, causal=causal,
                              key_padding_mask=key_padding_mask)
    if backend == "nystrom":
        conv_weight = getattr(module, "hfab_conv_weight", None)
        if config.conv_kernel_size and conv_weight is None:
            raise ValueError(f"conv_kernel_size={config.conv_kernel_size} needs a learned depthwise conv "
                             f"(module.hfab_conv_weight) that {type(module).__name__} lacks; use convert() or "
                             "conv_kernel_size=0")
        if conv_weight is not None:
            conv_weight = conv_weight.to(query.dtype)  # fp32 master weight, low-precision compute (autocast)
        return nystrom_attention(query, key, value, num_landmarks=config.num_landmarks,
                                 newton_iter=config.newton_iter, kappa_star=config.kappa_star,
                                 conv_weight=conv_weight, scale=scaling, key_padding_mask=key_padding_mask)
    raise ValueError(f"backend={backend!r} is not supported; supported: {', '.join(BACKENDS)}")


def autocast_inputs(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in the autocast dtype when autocast is on for their device (as torch SDPA gets them), else as given.

    Under autocast, models hand attention mixed dtypes (Llama: fp32 q, k after RoPE's fp32 cos/sin, low-precision
    v); our ops are custom ops that autocast does not see, so the cast happens here.
    """
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _make_attention(default_backend: str):
    name = implementation_name(default_backend)

    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
                  scaling: Optional[float] = None, **kwargs):
        backend = getattr(module, "hfab_backend", None)
        if backend is None and getattr(module, "hfab_left_out", False):
            causal = module_causal(module, kwargs)
            mask = sdpa_mask_for(attention_mask, query, key, causal)
            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, dropout=dropout,
                                                   scaling=scaling, **kwargs)
        config = _DEFAULTS[default_backend] if backend is None else module.hfab_config
        backend = backend or default_backend
        what = f"{name} ({type(module).__name__}, backend {backend!r})"
        causal = module_causal(module, kwargs)
        check_call(what, backend, module, query, key, dropout, causal, kwargs)
        state = race_cache.pending_layer(key) if backend == "race" else None  # a RaceCache layer's new keys
        if state is not None:
            attention_mask = race_cache.new_key_mask(state, attention_mask, key, what)
        key_padding_mask = key_padding_from_mask(attention_mask, query, key, what=what)
        check_not_packed(what, kwargs.get("position_ids"), key_padding_mask, query.shape[2])
        query, key, value = autocast_inputs(query, key, value)
        with torch.autocast(query.device.type, enabled=False):  # the ops choose their own internal precision
            if state is None:
                out = run_backend(backend, config, module, query, key, value, key_padding_mask, causal, scaling)
            else:
                planes, beta = race_parameters(module, config, query)
                out = race_cache.attend(state, query, key, value, planes=planes, beta=beta,
                                        key_padding_mask=key_padding_mask, causal=causal,
                                        sliding_window=kwargs.get("sliding_window"), what=what)
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = attention.__qualname__ = f"{name}_attention"
    attention.__doc__ = (f"AttentionInterface function ``{name}``: query (B, Hq, Nq, D), key/value (B, Hkv, Nk, D) "
                         "-> ((B, Nq, Hq, D) contiguous, None). See hf_attention_backends.backends.adapters.")
    return attention


ATTENTION_FUNCTIONS = {implementation_name(b): _make_attention(b) for b in BACKENDS}


def register() -> None:
    """Register every ``hfab_*`` attention and mask function with transformers (idempotent)."""
    for name, fn in ATTENTION_FUNCTIONS.items():
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, hfab_mask)
