"""RaceCache: O(1)-state decode for RACE layers. Cached decode (prefill, token by token, continuation chunks)
against full forwards without a cache over the growing sequence, in float64; hybrid plans, GQA with scalar and
per-head beta, left padding, beam search, constant state size, and the refusals."""
import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import hf_attention_backends as hfab
from hf_attention_backends.backends import race_cache as rc
from tests.backends.test_adapters import padded
from tests.integrations.tiny_models import tiny_inputs, tiny_model
from tests.tolerance import assert_close_to_oracle

GREEDY = dict(do_sample=False, pad_token_id=0)


def race_model(family="llama", layers=None, **config):
    return hfab.convert(tiny_model(family).double(), "race", layers=layers, **config)


def full_logits(model, ids):
    """Last-position logits of a forward over the whole sequence without a cache."""
    return model(input_ids=ids, use_cache=False).logits[:, -1]


def cached_greedy(model, ids, steps, cache):
    """Prefill ``ids`` into ``cache``, then decode ``steps`` greedy tokens one at a time; returns (ids, logits)."""
    logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
    for _ in range(steps):
        ids = torch.cat([ids, logits[-1].argmax(-1, keepdim=True)], dim=1)
        logits.append(model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True).logits[:, -1])
    return ids, logits


def check_against_full_forward(model, ids, steps):
    """Cached greedy decode vs full forwards over the growing sequence (float64); returns (ids, cache)."""
    prompt, cache = ids.shape[1], hfab.race_cache(model)
    seq, logits = cached_greedy(model, ids, steps, cache)
    for i, lg in enumerate(logits):
        assert_close_to_oracle(lg, full_logits(model, seq[:, :prompt + i]), atol=1e-12, rtol=1e-10, name=f"step {i}")
    return seq, cache


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decode_equals_full_forward_and_generate(family):
    model = race_model(family)
    ids = tiny_inputs(family, 1, 6)["input_ids"]
    before = model(input_ids=ids).logits
    seq, _ = check_against_full_forward(model, ids, steps=10)
    cache = hfab.race_cache(model)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, past_key_values=cache,
                               **GREEDY)
    assert torch.equal(generated, seq)
    assert all(isinstance(layer, rc.RaceStateLayer) and layer.seen == 15 for layer in cache.layers)
    assert torch.equal(model(input_ids=ids).logits, before)  # a forward without the cache meets no state


@pytest.mark.parametrize("layers", [[0], [1]], ids=["layer0_race", "layer0_sdpa"])
def test_hybrid_plan(layers):
    model = race_model("llama", layers=layers)
    cache = hfab.race_cache(model)
    assert cache.race_layers == layers
    assert type(cache.layers[1 - layers[0]]) is DynamicLayer
    check_against_full_forward(model, tiny_inputs("llama", 1, 5)["input_ids"], steps=6)


def test_gqa_state_is_per_kv_head_and_read_by_the_group():
    model = race_model("llama")  # 4 query heads, 2 kv heads
    _, cache = check_against_full_forward(model, tiny_inputs("llama", 2, 5)["input_ids"], steps=3)
    assert all(layer.num.shape == (2, 2, 4 * 2 ** 4, 8) and layer.den.shape == (2, 2, 64) for layer in cache.layers)
    assert all(layer.num.dtype == torch.float64 for layer in cache.layers)


def test_per_head_beta_keeps_one_state_per_query_head():
    model = race_model("llama", per_head_beta=True, num_planes=3, num_tables=2)
    with torch.no_grad():
        for _, module in hfab.integrations.attention_layers(model):
            module.hfab_beta.mul_(torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64))
    _, cache = check_against_full_forward(model, tiny_inputs("llama", 1, 5)["input_ids"], steps=5)
    assert all(layer.num.shape == (1, 4, 2 * 2 ** 3, 8) for layer in cache.layers)


def test_continuation_chunk_after_prefill(monkeypatch):
    monkeypatch.setattr(rc, "CHUNK", 2)  # the 5-token continuation runs as chunks of 2, 2, 1
    model = race_model("qwen2")
    ids = tiny_inputs("qwen2", 2, 11)["input_ids"]
    cache = hfab.race_cache(model)
    model(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)
    out = model(input_ids=ids[:, 6:], past_key_values=cache, use_cache=True).logits
    assert_close_to_oracle(out, model(input_ids=ids, use_cache=False).logits[:, 6:], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("layers", [None, [0]], ids=["all_race", "hybrid"])
def test_left_padded_batch_equals_each_sequence_alone(layers):
    model = race_model("llama", layers=layers)
    inputs, rows = padded("llama", left=True, lengths=(7, 4))
    del inputs["position_ids"]
    kwargs = dict(max_new_tokens=6, output_logits=True, return_dict_in_generate=True, **GREEDY)
    batch = model.generate(**inputs, past_key_values=hfab.race_cache(model), **kwargs)
    for r, row in enumerate(rows):
        alone = model.generate(row, attention_mask=torch.ones_like(row), past_key_values=hfab.race_cache(model),
                               **kwargs)
        assert torch.equal(batch.sequences[r, -6:], alone.sequences[0, -6:])
        for step, (b, a) in enumerate(zip(batch.logits, alone.logits)):
            torch.testing.assert_close(b[r], a[0], atol=1e-6, rtol=1e-6, msg=f"row {r}, step {step}")


def _numel(cache):
    return sum(t.numel() for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))


def test_state_size_constant_in_context():
    model = race_model("llama")
    ids = tiny_inputs("llama", 1, 4)["input_ids"]
    sizes = {}
    for cls in ("race", "dynamic"):
        for new in (6, 36):  # 10 and 40 tokens in context
            cache = hfab.race_cache(model) if cls == "race" else DynamicCache(config=model.config)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, past_key_values=cache,
                           min_new_tokens=new, **GREEDY)
            assert cache.get_seq_length() == 4 + new - 1
            sizes[cls, new] = _numel(cache)
    assert sizes["race", 6] == sizes["race", 36] == 2 * 2 * 64 * (8 + 1)
    assert sizes["dynamic", 36] > sizes["dynamic", 6]


def test_beam_search_matches_the_uncached_race_model():
    model = race_model("llama")
    ids = tiny_inputs("llama", 2, 5)["input_ids"]
    kwargs = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, attention_mask=torch.ones_like(ids), **GREEDY)
    with_state = model.generate(ids, past_key_values=hfab.race_cache(model), **kwargs)
    assert torch.equal(with_state, model.generate(ids, **kwargs))  # default DynamicCache: RACE over all keys


def test_batch_select_and_repeat_index_the_state():
    model = race_model("llama")
    cache = hfab.race_cache(model)
    model(input_ids=tiny_inputs("llama", 2, 5)["input_ids"], past_key_values=cache, use_cache=True)
    num = cache.layers[0].num.clone()
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.layers[0].num, num.repeat_interleave(2, dim=0))
    cache.batch_select_indices(torch.tensor([3, 0]))
    assert torch.equal(cache.layers[0].num, num[[1, 0]])
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.layers[0].num is None


def test_crop_refused_except_zero():
    model = race_model("llama")
    cache = hfab.race_cache(model)
    model(input_ids=tiny_inputs("llama", 1, 5)["input_ids"], past_key_values=cache, use_cache=True)
    cache.crop(0)
    with pytest.raises(NotImplementedError, match=r"crop\(-2\) is not supported"):
        cache.crop(-2)


def test_models_without_race_layers_refused():
    with pytest.raises(ValueError, match="no layer running RACE"):
        hfab.race_cache(tiny_model("llama"))
    with pytest.raises(ValueError, match="no layer running RACE"):
        hfab.race_cache(hfab.enable_backend(tiny_model("llama"), "stieltjes"))
    with pytest.raises(ValueError, match="needs a causal"):
        hfab.race_cache(hfab.enable_backend(tiny_model("bert"), "race"))


def test_sliding_window_race_layer_refused():
    model = hfab.enable_backend(tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
                                "race")
    with pytest.raises(NotImplementedError, match="layer 1 is a sliding-window layer"):
        hfab.race_cache(model)


def test_plan_changed_after_the_cache_was_built_refused():
    model = race_model("llama")
    cache = hfab.race_cache(model)
    hfab.disable_backend(model)
    ids = tiny_inputs("llama", 1, 5)["input_ids"]
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="never read by a RACE attention call"):
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


def test_non_causal_call_refused():
    layer = rc.RaceStateLayer(0)
    q = torch.randn(1, 2, 1, 8)
    k, v = layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    with pytest.raises(NotImplementedError, match="non-causal layer is not supported"):
        rc.attend(layer, q, k, v, planes=hfab.make_planes(1, 2, 8), beta=1.0, key_padding_mask=None, causal=False,
                  sliding_window=None, what="test")
