"""Convert a transformers model to a backend, record the plan in its config, and load it back.

``convert(model, "race", layers=[0, 2], per_head_beta=True)`` returns a copy of ``model`` whose listed
attention layers run RACE (the others run transformers' sdpa; enable_backend marks them
``hfab_left_out``), with the backend's tensors added to each converted attention module (see
``nn/parameters.py``; names carry the ``hfab_`` prefix: ``hfab_planes``, ``hfab_beta``, ``hfab_conv_weight``;
plus, for Stieltjes with ``per_head_temperature=True``, the Parameter ``hfab_temperature`` (Hq,) of ones that
multiplies each head's scores, added here).
The plan is stored as ``model.config.hfab_plan``, a JSON dict written to config.json by ``save_pretrained``::

    {"backend": "race", "layers": [0, 2], "config": {...every knob...}, "version": "0.1.0"}

Round trip: ``model.save_pretrained(d)`` then ``hf_attention_backends.from_pretrained(d)`` gives a model
whose outputs are bitwise equal to the saved one's.

A plain ``transformers`` ``from_pretrained(d)`` does NOT restore the backend: it builds the softmax model,
and its load report (a logged warning) lists every ``hfab_*`` tensor as UNEXPECTED, i.e. not loaded.
``config.hfab_plan`` is still present on that model but nothing acts on it: whether a layer runs a backend
is told by its attention module's ``hfab_backend``, never by the config. With
``attn_implementation="hfab_<backend>"`` (package imported) every layer runs that backend with its
default knobs (default beta and planes, no Nyström conv), not the plan's, and the same report lists the
trained ``hfab_*`` tensors as not loaded. Load converted checkpoints with :func:`from_pretrained` of this
package.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Iterable, Optional

import torch
import transformers
from safetensors.torch import load_file
from transformers import GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME

from .backends import enable_backend
from .backends.config import make_config
from .integrations import attention_layers, head_dims
from .nn.parameters import add_backend_parameters

PLAN_KEY = "hfab_plan"
PREFIX = "hfab_"


def convert(model, backend: str, layers: Optional[Iterable[int]] = None, *, inplace: bool = False, **config):
    """Switch the attention of ``model``'s listed layers to ``backend`` and add the backend's tensors.

    Args:
        model: a transformers ``PreTrainedModel`` of a family ``integrations`` supports.
        backend: "nystrom", "stieltjes", "race" or "exact".
        layers: attention layer indices to convert (None = all); the others stay on their current
            implementation (sdpa). An empty list converts nothing (outputs equal the original's).
        inplace: modify ``model`` itself; default False converts a deep copy and leaves ``model`` untouched.
        **config: the backend's knobs (``backends/config.py``), e.g. ``num_landmarks=32``.

    Returns:
        the converted model, with ``model.config.hfab_plan`` recording backend, layers, every knob and the
        package version. New tensors take the device and dtype of each attention module's first parameter.

    Raises:
        ValueError / TypeError for an unknown backend or option, a bad knob value, a layer index out of range
        or repeated, a model already converted, and whatever ``enable_backend`` refuses (e.g. causal Nyström).
    """
    cfg = make_config(backend, **config)
    available = [idx for idx, _ in attention_layers(model)]
    chosen = _check_layers(layers, available)
    converted = sorted(_hfab_tensor_names(model))
    if converted:
        raise ValueError(f"model is already converted (it has {converted[:3]}...); convert the original model")
    if not inplace:
        model = copy.deepcopy(model)
    num_heads, _, head_dim = head_dims(model)
    added = []
    for idx, module in attention_layers(model):
        if idx in chosen:
            ref = next(module.parameters(), None)
            device, dtype = (None, None) if ref is None else (ref.device, ref.dtype)
            names = add_backend_parameters(module, cfg, num_heads=num_heads, head_dim=head_dim, prefix=PREFIX,
                                           seed_offset=idx, device=device, dtype=dtype)
            added += [(module, name) for name in names]
    try:  # after the tensors: enable_backend checks that a Nyström conv has its weight
        enable_backend(model, backend, layers=chosen, **config)
    except Exception:
        for module, name in added:
            delattr(module, name)
        raise
    from . import __version__

    setattr(model.config, PLAN_KEY, {"backend": backend, "layers": chosen, "config": dataclasses.asdict(cfg),
                                     "version": __version__})
    return model


def from_pretrained(path, *, model_class=None, **kwargs):
    """Load a checkpoint written by ``save_pretrained`` of a converted model, with its backend restored.

    Reads ``path/config.json``, takes the model class from ``model_class`` or ``architectures[0]``
    (looked up in ``transformers``), loads the base weights through ``model_class.from_pretrained``
    (from the checkpoint's tensors minus the ``hfab_*`` ones, so transformers' load report has nothing
    to say about them), re-applies the recorded plan (``convert(..., inplace=True)``) and then loads the
    ``hfab_*`` tensors, so outputs are bitwise those of the saved model.

    path: a local folder with config.json and safetensors weights (``model.safetensors`` or a sharded
    index); the whole checkpoint is read once into CPU memory. kwargs go to transformers'
    ``from_pretrained`` (dtype, device_map, ...; ``config=`` replaces the config read from path);
    ``state_dict`` is not accepted. ``generation_config.json`` is loaded when present.

    Raises ValueError if config.json has no ``hfab_plan`` (not a converted checkpoint), if the class
    cannot be resolved, or if the checkpoint's ``hfab_*`` tensors do not match the plan (missing or extra).
    """
    if "state_dict" in kwargs:
        raise TypeError("from_pretrained(state_dict=...) is not supported: the weights are read from path")
    path = os.fspath(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"path={path!r} has no config.json; pass a local folder written by save_pretrained")
    with open(config_file) as f:
        saved = json.load(f)
    plan = saved.get(PLAN_KEY)
    if plan is None:
        raise ValueError(f"{config_file} has no {PLAN_KEY!r}: not a converted checkpoint; load it with transformers")
    if model_class is None:
        name = (saved.get("architectures") or [None])[0]
        model_class = getattr(transformers, name, None) if name else None
        if model_class is None:
            raise ValueError(f"cannot resolve the model class from architectures={saved.get('architectures')!r} "
                             f"in {config_file}; pass model_class=")
    config = kwargs.pop("config", None) or model_class.config_class.from_pretrained(path)
    state = _read_safetensors(path)
    hfab_state = {k: state.pop(k) for k in [k for k in state if _is_hfab(k)]}
    # transformers takes a path or a state dict, not both
    model = model_class.from_pretrained(None, config=config, state_dict=state, **kwargs)
    model.config.name_or_path = path
    if model.can_generate() and os.path.isfile(os.path.join(path, GENERATION_CONFIG_NAME)):
        model.generation_config = GenerationConfig.from_pretrained(path)
    convert(model, plan["backend"], plan["layers"], inplace=True, **plan["config"])
    expected = set(_hfab_tensor_names(model))
    missing, extra = sorted(expected - set(hfab_state)), sorted(set(hfab_state) - expected)
    if missing or extra:
        raise ValueError(f"the hfab_* tensors of {path!r} do not match its plan {plan}: missing {missing}, "
                         f"unexpected {extra}")
    model.load_state_dict(hfab_state, strict=False)
    return model


def _check_layers(layers, available: list[int]) -> list[int]:
    if layers is None:
        return list(available)
    if isinstance(layers, (int, str)) or not isinstance(layers, Iterable):
        raise TypeError(f"layers must be None or a list of layer indices, got {layers!r}")
    chosen = list(layers)
    for idx in chosen:
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise TypeError(f"layers must hold ints, got {idx!r} in {chosen}")
        if idx not in available:
            raise ValueError(f"layer index {idx} is out of range; the model's attention layers are "
                             f"{available[0]}..{available[-1]}" if available else "the model has no attention layers")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"layers={chosen} lists a layer more than once")
    return sorted(chosen)


def _is_hfab(key: str) -> bool:
    return key.rsplit(".", 1)[-1].startswith(PREFIX)


def _hfab_tensor_names(model) -> list[str]:
    return [k for k in model.state_dict() if _is_hfab(k)]


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path!r} has no model.safetensors or model.safetensors.index.json; save the model with "
                         "save_pretrained(..., safe_serialization=True) (the default)")
    state = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    return state
