"""The hfab_* adapters on tiny random models of every family: parity with sdpa, causality, padding,
generate, hybrid plans, enable/disable, from_pretrained, and every guard."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_attention_backends as hfab
from hf_attention_backends import integrations
from hf_attention_backends.backends import ATTENTION_FUNCTIONS, adapters, make_config
from tests.integrations.tiny_models import CAUSAL, FAMILIES, VOCAB, output_of, tiny_inputs, tiny_model

BACKENDS = ("exact", "stieltjes", "race", "nystrom")
OPTIONS = {"exact": {}, "stieltjes": {}, "race": {}, "nystrom": {"num_landmarks": 4}}
TEXT = tuple(f for f in FAMILIES if f != "vit")


def require(backend):
    """Skip (visibly, with the op's message) while a colleague's op is still a placeholder."""
    q = torch.randn(1, 2, 5, 8)
    kwargs = {"planes": torch.randn(1, 1, 8), "beta": 1.0} if backend == "race" else {}
    try:
        getattr(hfab, f"{backend}_attention")(q, q, q, **kwargs)
    except NotImplementedError as e:
        pytest.skip(f"{backend} op not available yet: {e}")


def fitting(families):
    return [(f, b) for f in families for b in BACKENDS if not (b == "nystrom" and f in CAUSAL)]


def padded(family, left, lengths=(9, 6), seed=0):
    """Batch of rows with the given real lengths, padded to the longest, plus the unpadded rows."""
    n = max(lengths)
    ids = tiny_inputs(family, len(lengths), n, seed=seed)["input_ids"]
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for r, length in enumerate(lengths):
        if left:
            mask[r, n - length:] = 1
        else:
            mask[r, :length] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    rows = [ids[r][mask[r].bool()][None] for r in range(len(lengths))]
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}, rows


def enabled(family, backend, **overrides):
    return hfab.enable_backend(tiny_model(family, **overrides), backend, **OPTIONS[backend])


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_matches_sdpa(family):
    if family == "vit":
        inputs, mask = tiny_inputs(family), None
    else:
        inputs, _ = padded(family, left=family in CAUSAL)
        mask = inputs["attention_mask"].bool()
    ref = output_of(tiny_model(family), **inputs)
    out = output_of(enabled(family, "exact"), **inputs)
    if mask is not None:
        ref, out = ref[mask], out[mask]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,backend", fitting(FAMILIES))
def test_forward_backward(family, backend):
    require(backend)
    model = enabled(family, backend)
    if family == "vit":
        inputs, real = tiny_inputs(family), slice(None)
    else:
        inputs, _ = padded(family, left=family in CAUSAL)
        real = inputs["attention_mask"].bool()
    out = output_of(model, **inputs)
    assert torch.isfinite(out).all()
    out[real].square().mean().backward()
    fam = integrations.get_family(model)
    for block in integrations.blocks(model):
        weight = integrations.projection(block, fam, "q" if fam.q else "qkv").weight
        assert weight.grad is not None and torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family,backend", fitting(CAUSAL))
def test_causality_leak(family, backend):
    require(backend)
    model = enabled(family, backend)
    ids = tiny_inputs(family, 2, 10)["input_ids"]
    changed = ids.clone()
    changed[:, 6:] = (changed[:, 6:] + 7) % (VOCAB - 3) + 3
    assert torch.equal(output_of(model, input_ids=ids)[:, :6], output_of(model, input_ids=changed)[:, :6])


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
@pytest.mark.parametrize("family,backend", fitting(TEXT))
def test_padding_invariance(family, backend, left):
    require(backend)
    model = enabled(family, backend)
    inputs, rows = padded(family, left)
    out = output_of(model, **inputs)
    mask = inputs["attention_mask"].bool()
    for r, row in enumerate(rows):
        torch.testing.assert_close(out[r][mask[r]], output_of(model, input_ids=row)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,backend", fitting(CAUSAL))
def test_generate_equals_full_forward(family, backend):
    require(backend)
    model = enabled(family, backend)
    ids = tiny_inputs(family, 1, 6)["input_ids"]
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                               pad_token_id=0)
    assert generated.shape == (1, 11)
    greedy = output_of(model, input_ids=generated[:, :-1]).argmax(-1)[:, 5:]
    assert torch.equal(greedy, generated[:, 6:])
    if backend == "exact":
        sdpa = tiny_model(family).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                           do_sample=False, pad_token_id=0)
        assert torch.equal(generated, sdpa)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_left_padded_exact_equals_sdpa(family):
    inputs, _ = padded(family, left=True, lengths=(7, 4))
    del inputs["position_ids"]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(enabled(family, "exact").generate(**inputs, **kwargs), tiny_model(family).generate(**inputs, **kwargs))


def test_hybrid_plan_left_out_layers_run_sdpa():
    ids = tiny_inputs("llama", 2, 9)["input_ids"]
    hybrid = hfab.enable_backend(tiny_model("llama"), "race", layers=[0])
    (_, first), (_, second) = integrations.attention_layers(hybrid)
    assert first.hfab_backend == "race" and first.hfab_layer == 0 and not hasattr(second, "hfab_backend")
    assert second.hfab_left_out
    # the same plan with layer 1 on the exact backend (= sdpa to 1e-5) instead of left out
    mixed = hfab.enable_backend(tiny_model("llama"), "race")
    second_mixed = integrations.attention_layers(mixed)[1][1]
    second_mixed.hfab_backend, second_mixed.hfab_config = "exact", make_config("exact")
    torch.testing.assert_close(output_of(hybrid, input_ids=ids), output_of(mixed, input_ids=ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(output_of(hybrid, input_ids=ids), output_of(tiny_model("llama"), input_ids=ids), atol=1e-3)
    inputs, _ = padded("llama", left=True)
    exact_second = hfab.enable_backend(tiny_model("llama"), "exact", layers=[1])
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(output_of(exact_second, **inputs)[real], output_of(tiny_model("llama"), **inputs)[real],
                               atol=1e-5, rtol=1e-5)
    generated = hybrid.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(output_of(hybrid, input_ids=generated[:, :-1]).argmax(-1)[:, 8:], generated[:, 9:])


def test_hybrid_keeps_sliding_window_layers_on_sdpa():
    inputs, _ = padded("modernbert", left=False)
    real = inputs["attention_mask"].bool()
    ref = output_of(tiny_model("modernbert", local_attention=4), **inputs)
    model = hfab.enable_backend(tiny_model("modernbert", local_attention=4), "exact", layers=[0])  # layer 1 slides
    torch.testing.assert_close(output_of(model, **inputs)[real], ref[real], atol=1e-5, rtol=1e-5)
    hfab.enable_backend(model, "exact")
    with pytest.raises(NotImplementedError, match="sliding_window=3 with Nk=9"):
        output_of(model, **inputs)


def test_sliding_window_refused_when_it_bites_and_fine_otherwise():
    ids = tiny_inputs("mistral", 1, 9)["input_ids"]
    with pytest.raises(NotImplementedError, match="sliding_window=4"):
        output_of(enabled("mistral", "exact", sliding_window=4), input_ids=ids)
    wide = output_of(enabled("mistral", "exact", sliding_window=16), input_ids=ids)
    torch.testing.assert_close(wide, output_of(tiny_model("mistral", sliding_window=16), input_ids=ids),
                               atol=1e-5, rtol=1e-5)


def test_disable_restores_bitwise():
    inputs, _ = padded("llama", left=True)
    model = tiny_model("llama")
    before = output_of(model, **inputs)
    hfab.enable_backend(model, "race", layers=[1])
    assert not torch.equal(output_of(model, **inputs), before)
    assert hfab.disable_backend(model) is model
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(output_of(model, **inputs), before)
    assert not any(hasattr(m, a) for m in model.modules() for a in ("hfab_backend", "hfab_config", "hfab_left_out"))
    with pytest.raises(ValueError, match="no hfab backend is enabled"):
        hfab.disable_backend(model)


def test_enable_twice_replaces_plan_and_keeps_original_implementation():
    model = tiny_model("bert")
    hfab.enable_backend(model, "exact", layers=[0])
    hfab.enable_backend(model, "race")
    assert model.config._attn_implementation == "hfab_race"
    assert all(m.hfab_backend == "race" and not hasattr(m, "hfab_left_out") for _, m in integrations.attention_layers(model))
    hfab.disable_backend(model)
    assert model.config._attn_implementation == "sdpa"


def test_from_pretrained_with_hfab_implementation(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    ids = tiny_inputs("llama", 2, 8)["input_ids"]
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    exact = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="hfab_exact").eval()
    assert exact.config._attn_implementation == "hfab_exact"
    torch.testing.assert_close(output_of(exact, input_ids=ids), output_of(sdpa, input_ids=ids), atol=1e-5, rtol=1e-5)
    race = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="hfab_race").eval()
    assert torch.equal(output_of(race, input_ids=ids), output_of(hfab.enable_backend(sdpa, "race"), input_ids=ids))
    hfab.disable_backend(race)
    assert race.config._attn_implementation == "sdpa"


def test_dense_mask_refused():
    model = enabled("llama", "exact")
    ids = tiny_inputs("llama", 1, 5)["input_ids"]
    custom = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"attention_mask of shape \(1, 1, 5, 5\).*dense or unknown mask"):
        model(input_ids=ids, attention_mask=custom)


def test_static_cache_prefill_refused():
    model = enabled("llama", "exact")
    ids = tiny_inputs("llama", 1, 5)["input_ids"]
    with pytest.raises(ValueError, match="static-cache prefill"):
        model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static", pad_token_id=0)


def test_packed_position_ids_refused():
    model = enabled("llama", "exact")
    ids = tiny_inputs("llama", 1, 8)["input_ids"]
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(NotImplementedError, match="position_ids restart inside row 0"):
        model(input_ids=ids, position_ids=position_ids)
    with pytest.raises(ValueError, match="packed documents"):
        model(input_ids=ids, position_ids=position_ids, use_cache=False)


def test_packed_check_runs_once_per_forward_and_again_after_a_change(monkeypatch):
    """The position_ids check (a host sync on a GPU) runs at the first layer of a forward only, and a change of
    position_ids in place is still refused."""
    runs = []

    class Counting(adapters.PassedOnce):
        def passes(self, tensors, predicate):
            return super().passes(tensors, lambda: runs.append(1) or predicate())

    monkeypatch.setattr(adapters, "_UNPACKED", Counting())
    model = enabled("llama", "exact")
    assert model.config.num_hidden_layers > 1
    ids = tiny_inputs("llama", 1, 8)["input_ids"]
    position_ids = torch.arange(8)[None]
    model(input_ids=ids, position_ids=position_ids)
    assert len(runs) == 1
    position_ids[0, 4:] = torch.arange(4)
    with pytest.raises(NotImplementedError, match="position_ids restart inside row 0"):
        model(input_ids=ids, position_ids=position_ids)


def test_dropout_in_training_refused():
    model = enabled("bert", "exact", attention_probs_dropout_prob=0.1).train()
    with pytest.raises(NotImplementedError, match=r"dropout=0\.1 is not supported"):
        output_of(model, **tiny_inputs("bert"))
    output_of(model.eval(), **tiny_inputs("bert"))


def test_output_attentions_refused():
    model = enabled("gpt2", "exact")
    with pytest.raises(NotImplementedError, match="output_attentions=True is not supported"):
        model(**tiny_inputs("gpt2"), output_attentions=True)
    with pytest.raises(NotImplementedError, match="output_attentions=True"):
        hfab.enable_backend(tiny_model("gpt2", "eager", output_attentions=True), "exact")


def _call(module, q, k, **kwargs):
    return ATTENTION_FUNCTIONS["hfab_exact"](module, q, k, k, None, **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"softcap": 30.0}, "softcap is not supported"),
    ({"s_aux": torch.zeros(4)}, "s_aux is not supported"),
    ({"position_bias": torch.zeros(1, 4, 5, 5)}, "position_bias is not supported"),
    ({"cu_seq_lens_q": torch.tensor([0, 2, 5])}, "cu_seq_lens_q was passed"),
    ({"dropout": 0.5}, "dropout=0.5"),
])
def test_call_time_guards(kwargs, match):
    module = integrations.attention_layers(enabled("llama", "exact"))[0][1]
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(NotImplementedError, match=match):
        _call(module, q, k, **kwargs)


def test_attention_sinks_refused():
    module = integrations.attention_layers(enabled("llama", "exact"))[0][1]
    module.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(NotImplementedError, match="attention sinks"):
        _call(module, torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8))


def test_op_validation_reaches_the_caller():
    module = integrations.attention_layers(enabled("llama", "exact"))[0][1]
    with pytest.raises(ValueError, match="dtype=torch.int32 is not supported"):
        _call(module, torch.ones(1, 4, 5, 8, dtype=torch.int32), torch.ones(1, 2, 5, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="head dims differ"):
        _call(module, torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 16))


@pytest.mark.parametrize("backend", ["exact", "race", "stieltjes"])
def test_autocast_mixed_dtypes_reach_the_op_in_the_autocast_dtype(backend):
    """Llama under CUDA autocast hands attention fp32 q, k (RoPE) and a bf16 v; sdpa gets them cast by autocast."""
    module = integrations.attention_layers(enabled("llama", backend))[0][1]
    q, k, v = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16).bfloat16()
    fn = ATTENTION_FUNCTIONS[f"hfab_{backend}"]
    with pytest.raises(ValueError, match="must share one dtype"):
        fn(module, q, k, v, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = fn(module, q, k, v, None)
    assert out.dtype == torch.bfloat16
    expected, _ = fn(module, q.bfloat16(), k.bfloat16(), v, None)
    assert torch.equal(out, expected)


def test_causal_nystrom_refused_at_enable_and_call_time():
    with pytest.raises(NotImplementedError, match="name='nystrom' is not supported on the causal model_type='llama'"):
        hfab.enable_backend(tiny_model("llama"), "nystrom")
    with pytest.raises(NotImplementedError, match="causal model_type='bert'"):
        hfab.enable_backend(tiny_model("bert", is_decoder=True), "nystrom")
    module = integrations.attention_layers(enabled("bert", "nystrom"))[0][1]
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(NotImplementedError, match="causal attention is not supported by Nyström"):
        ATTENTION_FUNCTIONS["hfab_nystrom"](module, q, q, q, None, is_causal=True)


def test_enable_validates_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="backend='flash' is not supported"):
        hfab.enable_backend(model, "flash")
    with pytest.raises(ValueError, match="num_planes=99 is not supported"):
        hfab.enable_backend(model, "race", num_planes=99)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['order'\]"):
        hfab.enable_backend(model, "race", order=2.0)
    with pytest.raises(ValueError, match=r"layers contains 2; supported: ints in 0\.\.1"):
        hfab.enable_backend(model, "exact", layers=[0, 2])
    with pytest.raises(ValueError, match="conv_kernel_size=3 needs a learned depthwise conv"):
        hfab.enable_backend(tiny_model("bert"), "nystrom", conv_kernel_size=3)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("model_type,config", [
    ("bloom", dict(hidden_size=32, n_head=4, n_layer=2, vocab_size=VOCAB)),
    ("gpt_neo", dict(hidden_size=32, num_heads=4, num_layers=2, attention_types=[[["global"], 2]], vocab_size=VOCAB)),
])
def test_bypassing_families_refused(model_type, config):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    with pytest.raises(ValueError, match=f"model_type='{model_type}' computes attention in its own code"):
        hfab.enable_backend(model, "exact")


def test_left_out_module_equals_sdpa_call():
    model = hfab.enable_backend(tiny_model("llama"), "exact", layers=[0])
    module = integrations.attention_layers(model)[1][1]
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    kpm = torch.tensor([[True] * 5, [False, False, True, True, True]])
    out, _ = ATTENTION_FUNCTIONS["hfab_exact"](module, q, k, v, kpm[:, None, None, :])
    allowed = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool) & kpm[:, None, :]
    ref, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, allowed[:, None])
    assert torch.equal(out, ref)
