"""Models, text batches and switching shared by the model_tests scripts.

Real models: ``minilm`` (all-MiniLM-L6-v2, an encoder compared on last_hidden_state; baseline eager) and
``smollm2`` (SmolLM2-135M-Instruct, a causal LM compared on logits; baseline sdpa), from the offline packages.
Text: the BBC news corpus (``hf_attention_backends.models``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
from typing import Optional

import torch

from hf_attention_backends import disable_backend, enable_backend
from hf_attention_backends import models as assets
from hf_attention_backends.cli import DTYPES, MODELS, parse_backends
from hf_attention_backends.integrations import is_causal

from . import metrics


def load(name: str, *, dtype: torch.dtype = torch.float32, device="cpu"):
    """(model, tokenizer) of the real model ``name`` (minilm or smollm2) with its baseline attention."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is not supported; supported: {', '.join(sorted(MODELS))}")
    loader = assets.load_minilm if name == "minilm" else assets.load_smollm2
    return loader(dtype=dtype, device=device, attn_implementation=MODELS[name].baseline)


def text_batch(tokenizer, n: int, seq_len: int, device="cpu") -> dict:
    """n news articles truncated to ``seq_len`` tokens, right-padded: {input_ids, attention_mask}.

    Articles are picked long enough (~5 characters per token) that most fill ``seq_len``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} must be >= 2")
    texts = assets.news_articles(n, min_chars=5 * seq_len)
    return tokenizer(texts, padding=True, truncation=True, max_length=seq_len, return_tensors="pt").to(device)


def is_causal_lm(model) -> bool:
    """Whether ``model`` is a causal language model (causal attention and an LM head giving logits)."""
    return hasattr(model, "lm_head") and is_causal(model)


def real_mask(inputs: dict) -> Optional[torch.Tensor]:
    """(B, N) bool of real tokens from ``attention_mask``; all True for ids without one; None for pixels."""
    if "attention_mask" in inputs:
        return inputs["attention_mask"].bool()
    if "input_ids" in inputs:
        return torch.ones_like(inputs["input_ids"], dtype=torch.bool)
    return None


def output_of(model, inputs: dict) -> torch.Tensor:
    """Logits when the model has an LM head, else last_hidden_state; (B, N, V or C), no grad, no cache."""
    extra = {"use_cache": False} if getattr(model.config, "use_cache", False) else {}
    with torch.no_grad():
        out = model(**inputs, **extra)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@contextlib.contextmanager
def backend(model, name: str, config: Optional[dict] = None):
    """Run the body with ``name`` enabled on every layer (``config``: its options); always disabled after."""
    enable_backend(model, name, **(config or {}))
    try:
        yield model
    finally:
        disable_backend(model)


def parity(ref: torch.Tensor, out: torch.Tensor, inputs: dict, causal: bool) -> dict:
    """Output parity of a backend's output ``out`` against the softmax model's ``ref`` on ``inputs``.

    Always {rel_error, cosine_mean, cosine_min, max_dev} of the compared tensor over real tokens. Causal LMs
    (logits) add kl (mean KL(softmax ‖ backend), nats), top1 / top5 (agreement with the softmax model's top-1
    token), loss_softmax / loss_backend (next-token NLL on the text), ppl_softmax / ppl_backend. Encoders add
    embedding_cosine_mean / _min (mean-pooled sentence embeddings).
    """
    mask = real_mask(inputs)
    result = metrics.tensor_parity(out, ref, mask)
    if causal:
        ids = inputs["input_ids"]
        loss_ref, loss_out = metrics.next_token_loss(ref, ids, mask), metrics.next_token_loss(out, ids, mask)
        result.update(kl=metrics.kl_divergence(ref, out, mask), top1=metrics.topk_agreement(ref, out, 1, mask),
                      top5=metrics.topk_agreement(ref, out, 5, mask), loss_softmax=loss_ref, loss_backend=loss_out,
                      ppl_softmax=math.exp(loss_ref), ppl_backend=math.exp(loss_out))
    elif mask is not None:
        cos_mean, cos_min = metrics.embedding_cosine(out, ref, mask)
        result.update(embedding_cosine_mean=cos_mean, embedding_cosine_min=cos_min)
    return result


def add_model_arguments(parser: argparse.ArgumentParser, *, seq_len: int = 128, num_texts: int = 4) -> None:
    """--model, --backend, --device, --dtype, --num-texts, --seq-len shared by the scripts."""
    parser.add_argument("--model", choices=sorted(MODELS), default="minilm")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="repeatable (default: every backend that fits the model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--num-texts", type=int, default=num_texts, metavar="N", help="news articles")
    parser.add_argument("--seq-len", type=int, default=seq_len, metavar="N", help="tokens per article")


def setup_from_args(args):
    """(model, tokenizer, inputs, causal, backends) from the shared arguments."""
    model, tokenizer = load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    spec = MODELS[args.model]
    backends = parse_backends(args.backend, args.model)
    inputs = text_batch(tokenizer, args.num_texts, args.seq_len, device=args.device)
    return model, tokenizer, dict(inputs), spec.causal, backends


def emit_json(result: dict, path, *, echo: bool = True) -> None:
    """Print ``result`` as JSON (unless ``echo`` is False) and also write it to ``path`` when given."""
    if echo:
        print(json.dumps(result, indent=2))
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
