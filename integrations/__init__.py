"""Per-model-family knowledge: where the attention modules are, what they are called, causal or not.

Installed as ``hf_attention_backends.integrations``. Supported families (checked on transformers 5.17/5.18
to route every attention call through ``AttentionInterface``): llama, qwen2, qwen3, mistral, gpt2, bert,
modernbert, vit. Paths are dotted attribute paths:

- ``layers``: from ``model.base_model`` to the ``nn.ModuleList`` of blocks (layer i = block i);
- ``attention``: from a block to the module that calls the attention function (it carries ``is_causal``
  and, once enabled, ``hfab_backend`` / ``hfab_config``);
- ``q``, ``k``, ``v`` (or fused ``qkv``) and ``o``: from a block to the projection layers.

A path may list alternatives separated by ``|`` (the first that exists wins): ViT's layout changed
between transformers 5.17 (``encoder.layer[i].attention.attention.query``) and 5.18
(``layers[i].attention.q_proj``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

__all__ = ["Family", "FAMILIES", "BYPASSING", "get_family", "blocks", "attention_layers", "projection", "is_causal",
           "head_dims"]


@dataclass(frozen=True)
class Family:
    """One model family. ``causal`` None means "from ``config.is_decoder``" (BERT can be a decoder)."""
    model_type: str
    causal: Optional[bool]
    layers: str
    attention: str
    o: str
    q: Optional[str] = None
    k: Optional[str] = None
    v: Optional[str] = None
    qkv: Optional[str] = None


def _llama_like(model_type):
    return Family(model_type, True, "layers", "self_attn", "self_attn.o_proj",
                  q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj")


FAMILIES = {f.model_type: f for f in [
    _llama_like("llama"), _llama_like("qwen2"), _llama_like("qwen3"), _llama_like("mistral"),
    Family("gpt2", True, "h", "attn", "attn.c_proj", qkv="attn.c_attn"),
    Family("bert", None, "encoder.layer", "attention.self", "attention.output.dense",
           q="attention.self.query", k="attention.self.key", v="attention.self.value"),
    Family("modernbert", False, "layers", "attn", "attn.Wo", qkv="attn.Wqkv"),
    Family("vit", False, "layers|encoder.layer", "attention.attention|attention",
           "attention.o_proj|attention.output.dense", q="attention.q_proj|attention.attention.query",
           k="attention.k_proj|attention.attention.key", v="attention.v_proj|attention.attention.value"),
]}

# Families whose modeling code computes attention itself instead of calling AttentionInterface.
BYPASSING = ("bloom", "codegen", "deberta", "deberta-v2", "falcon", "gpt_neo", "gptj", "mpt")


def _config_of(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "model_type"):
        raise TypeError(f"expected a transformers model or config, got {type(model_or_config).__name__}")
    return config


def get_family(model_or_config) -> Family:
    """The :class:`Family` of a model or config; raises ValueError for bypassing or unknown model types."""
    model_type = _config_of(model_or_config).model_type
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = ", ".join(FAMILIES)
    if model_type in BYPASSING:
        raise ValueError(
            f"model_type={model_type!r} computes attention in its own code and bypasses transformers' "
            f"AttentionInterface, so an hfab backend would be silently ignored; supported: {supported}")
    raise ValueError(f"model_type={model_type!r} is not supported (not checked to route through "
                     f"AttentionInterface); supported: {supported}")


def is_causal(model_or_config) -> bool:
    """Whether the family's self-attention is causal for this config."""
    config = _config_of(model_or_config)
    family = get_family(config)
    return bool(config.is_decoder) if family.causal is None else family.causal


def head_dims(model_or_config) -> tuple[int, int, int]:
    """(query heads Hq, key/value heads Hkv, head dim D) of the attention modules."""
    config = _config_of(model_or_config)
    get_family(config)
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    return hq, hkv, d


def _resolve(root: nn.Module, paths: str) -> nn.Module:
    for path in paths.split("|"):
        module = root
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if module is not None:
            return module
    raise ValueError(f"{type(root).__name__} has none of {paths!r}; this transformers version lays the family out "
                     "differently than hf_attention_backends.integrations expects")


def blocks(model: nn.Module) -> nn.ModuleList:
    """The blocks (transformer layers) in order, for a base model or any model with a head."""
    return _resolve(getattr(model, "base_model", model), get_family(model).layers)


def attention_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """[(layer index, attention module)] in layer order, for a base model or any model with a head."""
    family = get_family(model)
    layers = [(i, _resolve(block, family.attention)) for i, block in enumerate(blocks(model))]
    for i, module in layers:
        if not hasattr(module, "is_causal"):
            raise ValueError(f"layer {i}: {type(module).__name__} has no is_causal attribute; it is not the module "
                             "that calls AttentionInterface in this transformers version")
    return layers


def projection(block: nn.Module, family: Family, which: str) -> nn.Module:
    """The projection ``which`` (q, k, v, qkv or o) of one block; raises if the family has none."""
    path = getattr(family, which)
    if path is None:
        raise ValueError(f"family {family.model_type!r} has no separate {which!r} projection")
    return _resolve(block, path)
