"""Offline model loaders for the recipes: ``(model, tokenizer, causal)`` with attention dropout off.

Names: ``smollm2`` and ``minilm`` (``hf_attention_backends.models``), ``tiny_llama`` / ``tiny_bert`` (random
2-layer models with the :class:`~finetune.data.ByteTokenizer`, for smoke tests), or a local folder holding
a transformers checkpoint and tokenizer (causal LM when its family is causal, else the base model).
The hfab adapters implement no attention dropout and refuse a training-mode call with dropout > 0, so the
attention modules' dropout is set to 0 here.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, BertConfig, BertModel,
                          LlamaConfig, LlamaForCausalLM)

from hf_attention_backends import integrations
from hf_attention_backends.models import load_minilm, load_smollm2

from .data import ByteTokenizer

BUILTIN = ("smollm2", "minilm", "tiny_llama", "tiny_bert")
_DROPOUT_KEYS = ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop")


def load_model(name: str, dtype: str = "float32", seed: int = 0):
    """(model in eval mode, tokenizer, causal: bool) for a recipe's ``model.name`` (see the module doc)."""
    torch_dtype = getattr(torch, dtype)
    if name == "smollm2":
        model, tokenizer = load_smollm2(dtype=torch_dtype, attn_implementation="sdpa")
    elif name == "minilm":
        model, tokenizer = load_minilm(dtype=torch_dtype, attn_implementation="sdpa")
    elif name in ("tiny_llama", "tiny_bert"):
        tokenizer = ByteTokenizer()
        torch.manual_seed(seed)
        common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      vocab_size=tokenizer.vocab_size, max_position_embeddings=512,
                      pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa")
        if name == "tiny_llama":
            model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, bos_token_id=1, eos_token_id=2, **common))
        else:
            model = BertModel(BertConfig(**common), add_pooling_layer=False)
        model = model.to(torch_dtype).eval()
    elif Path(name).is_dir():
        config = AutoConfig.from_pretrained(name, local_files_only=True)
        cls = AutoModelForCausalLM if integrations.is_causal(config) else AutoModel
        model = cls.from_pretrained(name, dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        raise ValueError(f"model.name={name!r} is not supported; supported: {', '.join(BUILTIN)} or a local "
                         "model folder")
    disable_attention_dropout(model)
    return model, tokenizer, integrations.is_causal(model)


def disable_attention_dropout(model) -> None:
    """Set every attention module's dropout (``dropout`` module / ``attention_dropout`` float) and the config's to 0."""
    for key in _DROPOUT_KEYS:
        if hasattr(model.config, key):
            setattr(model.config, key, 0.0)
    for _, module in integrations.attention_layers(model):
        if isinstance(getattr(module, "dropout", None), nn.Dropout):
            module.dropout.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
