"""Tiny random-weight models of every supported family, built from configs in code (no hub, fp32, eval).

``tiny_model(family)`` returns the family's model with its usual head (causal LM for decoders, masked LM
for encoders, the base ViT), 2 layers, 4 query heads of dim 8 (2 kv heads where GQA exists).
``tiny_inputs(family, batch, length)`` returns forward kwargs.
"""
from __future__ import annotations

import torch
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt2", "bert", "modernbert", "vit")
CAUSAL = ("llama", "qwen2", "qwen3", "mistral", "gpt2")
VOCAB = 97
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_COMMON = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48, vocab_size=VOCAB,
               max_position_embeddings=64)
_EXTRA = {
    "llama": dict(num_key_value_heads=2),
    "qwen2": dict(num_key_value_heads=2),
    "qwen3": dict(num_key_value_heads=2, head_dim=8),
    "mistral": dict(num_key_value_heads=2, sliding_window=None),
    "gpt2": dict(n_positions=64),
    "bert": dict(attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0),
    "modernbert": dict(global_attn_every_n_layers=2, local_attention=128, cls_token_id=1, sep_token_id=2),
    "vit": dict(image_size=8, patch_size=4, num_channels=3, attention_probs_dropout_prob=0.0),
}


def tiny_config(family: str, attn_implementation: str = "sdpa", **overrides):
    kwargs = {**_COMMON, **_TOKENS, **_EXTRA[family], **overrides}
    return AutoConfig.for_model(family, attn_implementation=attn_implementation, **kwargs)


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0, **overrides):
    config = tiny_config(family, attn_implementation, **overrides)
    cls = AutoModelForCausalLM if family in CAUSAL else AutoModel if family == "vit" else AutoModelForMaskedLM
    torch.manual_seed(seed)
    return cls.from_config(config).eval()


def tiny_inputs(family: str, batch: int = 2, length: int = 9, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 3, 8, 8, generator=g)}
    return {"input_ids": torch.randint(3, VOCAB, (batch, length), generator=g)}


def output_of(model, **inputs) -> torch.Tensor:
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state
