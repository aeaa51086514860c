"""enable_backend / disable_backend: switch a transformers model's attention in place."""
from __future__ import annotations

from typing import Optional, Sequence

from .. import integrations
from .adapters import implementation_name
from .config import make_config

_ATTRS = ("hfab_backend", "hfab_config", "hfab_layer", "hfab_left_out")
_PREVIOUS = "_hfab_previous_attn_implementation"


def enable_backend(model, name: str, *, layers: Optional[Sequence[int]] = None, **config):
    """Run ``name``'s attention in the chosen layers of ``model`` (in place); returns ``model``.

    Args:
        model: a transformers model of a supported family (``integrations.FAMILIES``); families that
            bypass AttentionInterface and unknown ones raise ValueError.
        name: nystrom, stieltjes, race or exact. Nyström on a causal model raises NotImplementedError.
        layers: layer indices to switch (None = all). The other layers run transformers' sdpa.
        **config: the backend's options (``backends.config``), validated here.

    Sets ``hfab_backend``, ``hfab_config`` and ``hfab_layer`` on the switched attention modules,
    ``hfab_left_out`` on the others, and ``model.set_attn_implementation("hfab_<name>")``. The previous
    implementation is remembered for :func:`disable_backend`. Enabling again replaces the plan.
    """
    family = integrations.get_family(model)
    cfg = make_config(name, **config)
    modules = integrations.attention_layers(model)
    chosen = _check_layers(layers, len(modules))
    if name == "nystrom":
        causal = [i for i, m in modules if i in chosen and getattr(m, "is_causal", False)]
        if integrations.is_causal(model) or causal:
            raise NotImplementedError(
                f"name='nystrom' is not supported on the causal model_type={family.model_type!r} (layers "
                f"{causal or sorted(chosen)} are causal); Nyström is non-causal only: use stieltjes, race or exact")
        if cfg.conv_kernel_size and any(getattr(m, "hfab_conv_weight", None) is None
                                        for i, m in modules if i in chosen):
            raise ValueError(f"conv_kernel_size={cfg.conv_kernel_size} needs a learned depthwise conv per layer "
                             "(module.hfab_conv_weight); use hf_attention_backends.convert() or conv_kernel_size=0")
    if getattr(model.config, "output_attentions", False):
        raise NotImplementedError("model.config.output_attentions=True is not supported by hfab backends (no "
                                  "attention matrix is formed); supported: False")
    if not model._can_set_attn_implementation():
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation "
                         "(it does not use AttentionInterface)")
    previous = getattr(model, _PREVIOUS, None)
    if previous is None:
        previous = model.config._attn_implementation
    _clear(model)
    target = implementation_name(name)
    model.set_attn_implementation(target)
    if model.config._attn_implementation != target:
        model.set_attn_implementation(previous)
        raise ValueError(f"transformers refused attn_implementation={target!r} for {type(model).__name__} "
                         f"(it stays {model.config._attn_implementation!r})")
    for i, module in modules:
        if i in chosen:
            module.hfab_backend, module.hfab_config, module.hfab_layer = name, cfg, i
        else:
            module.hfab_left_out = True
    setattr(model, _PREVIOUS, previous)
    return model


def disable_backend(model):
    """Undo :func:`enable_backend` (in place); returns ``model``.

    Restores the previous attention implementation (``sdpa`` for a model loaded with an ``hfab_*``
    implementation) and removes ``hfab_backend`` / ``hfab_config`` / ``hfab_layer`` / ``hfab_left_out``.
    Parameters added by convert (``hfab_beta``, ``hfab_planes``, ``hfab_conv_weight``) are kept.
    Raises ValueError when no hfab backend is active.
    """
    previous = getattr(model, _PREVIOUS, None)
    current = model.config._attn_implementation
    if previous is None:
        if not str(current).startswith("hfab_"):
            raise ValueError(f"no hfab backend is enabled on {type(model).__name__} "
                             f"(attn_implementation={current!r})")
        previous = "sdpa"
    _clear(model)
    model.set_attn_implementation(previous)
    return model


def _check_layers(layers, count: int) -> set[int]:
    if layers is None:
        return set(range(count))
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be a list of layer indices or None, got {type(layers).__name__}")
    chosen = list(layers)
    for i in chosen:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count:
            raise ValueError(f"layers contains {i!r}; supported: ints in 0..{count - 1} (the model has {count} layers)")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"layers={chosen} repeats an index")
    return set(chosen)


def _clear(model) -> None:
    for module in model.modules():
        for attr in _ATTRS:
            if attr in module.__dict__:
                delattr(module, attr)
    if _PREVIOUS in model.__dict__:
        delattr(model, _PREVIOUS)

