import json

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as hf_logging

import hf_attention_backends as hfab
from hf_attention_backends.backends.config import make_config
from hf_attention_backends.integrations import attention_layers

HEAD_DIM = 16  # 64 / 4 in both tiny models
LOAD_LOGGER = hf_logging.get_logger("transformers.modeling_utils")


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=100)).eval()


def tiny_bert():
    torch.manual_seed(0)
    return BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                vocab_size=100, max_position_embeddings=64, attention_probs_dropout_prob=0.0)).eval()


FAMILIES = {"llama": tiny_llama, "bert": tiny_bert}


def run(model, **kwargs):
    """Deterministic eval forward: logits (llama) or last hidden state (bert, with a right-padded row)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 12), generator=g)
    if isinstance(model, BertModel):
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, 8:] = 0
        out = model(input_ids=ids, attention_mask=mask, **kwargs)
        return out if kwargs else out.last_hidden_state
    out = model(input_ids=ids, **kwargs)
    return out if kwargs else out.logits


def train_step(model):
    """One SGD step on every parameter, so the hfab_* parameters leave their initial values."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = run(model)
    direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * direction).sum().backward()  # not a norm: BERT's LayerNorm would make that constant
    opt.step()
    opt.zero_grad()
    model.eval()


def hfab_attrs(module):
    return sorted(n for n in dir(module) if n.startswith("hfab_") and n != "hfab_left_out")


# (family, backend, layers, knobs): race with trained per-head beta, nystrom with a trained conv, hybrid plans
ROUND_TRIPS = [
    ("llama", "race", None, dict(num_planes=2, num_tables=3, per_head_beta=True)),
    ("bert", "race", None, dict(num_planes=2, num_tables=3, per_head_beta=True, seed=5)),
    ("bert", "nystrom", None, dict(num_landmarks=4, conv_kernel_size=3)),
    ("llama", "stieltjes", [1], dict(order=3.0)),
    ("llama", "stieltjes", None, dict(per_head_temperature=True)),
    ("bert", "race", [0], dict(num_planes=3)),
]


@pytest.mark.parametrize("family, backend, layers, knobs", ROUND_TRIPS)
def test_save_load_round_trip_is_bitwise(tmp_path, family, backend, layers, knobs):
    base = FAMILIES[family]()
    model = hfab.convert(base, backend, layers, **knobs)
    train_step(model)
    for idx, module in attention_layers(model):
        if backend == "race" and idx in (layers or [0, 1]):
            default = torch.full_like(module.hfab_beta, HEAD_DIM ** -0.5)
            assert module.hfab_beta.shape == ((4,) if knobs.get("per_head_beta") else ())
            assert not torch.equal(module.hfab_beta, default), "training did not move beta"
        if backend == "nystrom":
            assert module.hfab_conv_weight.shape == (4, 3) and module.hfab_conv_weight.abs().sum() > 0
        if knobs.get("per_head_temperature"):
            assert module.hfab_temperature.shape == (4,) and not torch.equal(module.hfab_temperature, torch.ones(4))
    with torch.no_grad():
        expected = run(model)
    model.save_pretrained(tmp_path)

    with CaptureLogger(LOAD_LOGGER) as log:
        loaded = hfab.from_pretrained(tmp_path)
    assert "hfab_" not in log.out and "UNEXPECTED" not in log.out and "MISSING" not in log.out, log.out
    with torch.no_grad():
        assert torch.equal(run(loaded), expected)
        assert not torch.equal(run(loaded), run(base)), "the loaded model runs plain softmax attention"
    saved = model.state_dict()
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, saved[key]), key
    assert sorted(loaded.state_dict()) == sorted(saved)
    assert loaded.config.hfab_plan == model.config.hfab_plan


def test_convert_leaves_the_original_untouched():
    base = tiny_llama()
    before = {k: t.clone() for k, t in base.state_dict().items()}
    with torch.no_grad():
        out_before = run(base)
    model = hfab.convert(base, "race", per_head_beta=True)
    train_step(model)
    assert sorted(base.state_dict()) == sorted(before)
    assert all(torch.equal(t, before[k]) for k, t in base.state_dict().items())
    assert not any(n.startswith("hfab_") for m in base.modules() for n in dir(m))
    assert not hasattr(base.config, "hfab_plan") and "hfab_plan" not in base.config.to_dict()
    with torch.no_grad():
        assert torch.equal(run(base), out_before)
        assert not torch.equal(run(model), out_before)


def test_plan_is_written_to_config_json(tmp_path):
    model = hfab.convert(tiny_llama(), "race", [1, 0], num_planes=3, beta=0.5)
    model.save_pretrained(tmp_path)
    plan = json.loads((tmp_path / "config.json").read_text())["hfab_plan"]
    assert plan == {"backend": "race", "layers": [0, 1],
                    "config": {"num_planes": 3, "num_tables": 4, "beta": 0.5, "seed": 0, "per_head_beta": False},
                    "version": hfab.__version__}


def test_parameters_added_per_backend():
    model = hfab.convert(tiny_bert(), "race", num_tables=2, num_planes=3, seed=4)
    for idx, module in attention_layers(model):
        assert torch.equal(module.hfab_planes, hfab.make_planes(2, 3, HEAD_DIM, seed=4 + idx))
        assert "hfab_planes" in dict(module.named_buffers()) and "hfab_planes" not in dict(module.named_parameters())
        assert module.hfab_beta.shape == () and module.hfab_beta.item() == pytest.approx(HEAD_DIM ** -0.5)
        assert module.hfab_backend == "race" and module.hfab_config == make_config("race", num_tables=2,
                                                                                     num_planes=3, seed=4)
    nys = hfab.convert(tiny_bert(), "nystrom", conv_kernel_size=5)
    for _, module in attention_layers(nys):
        assert module.hfab_conv_weight.requires_grad and torch.equal(module.hfab_conv_weight, torch.zeros(4, 5))
    plain = hfab.convert(tiny_bert(), "nystrom")
    assert not any(n.split(".")[-1].startswith("hfab_") for n in plain.state_dict())


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_stieltjes_temperature_multiplies_the_scores(family):
    model = hfab.convert(FAMILIES[family](), "stieltjes", per_head_temperature=True)
    plain = hfab.convert(FAMILIES[family](), "stieltjes")
    with torch.no_grad():
        assert torch.equal(run(model), run(plain)), "a temperature of 1 must leave the outputs unchanged"
        for (_, module), (_, ref) in zip(attention_layers(model), attention_layers(plain)):
            assert module.hfab_temperature.requires_grad and torch.equal(module.hfab_temperature, torch.ones(4))
            module.hfab_temperature.fill_(1.7)
            ref.scaling = ref.scaling * 1.7  # the same scores through the module's own scale
        torch.testing.assert_close(run(model), run(plain), rtol=1e-4, atol=1e-5)
        before = run(model)
        next(m for _, m in attention_layers(model)).hfab_temperature[2] = 0.5
        assert not torch.allclose(run(model), before), "one head's temperature must change the output"


def test_hybrid_plan_leaves_other_layers_on_sdpa():
    base = tiny_llama()
    model = hfab.convert(base, "stieltjes", layers=[1])
    (_, first), (_, second) = attention_layers(model)
    assert hfab_attrs(first) == [] and second.hfab_backend == "stieltjes"
    with torch.no_grad():
        ours, theirs = run(model, output_hidden_states=True), run(base, output_hidden_states=True)
    assert torch.equal(ours.hidden_states[1], theirs.hidden_states[1])  # after layer 0: untouched, bitwise
    assert not torch.equal(ours.hidden_states[2], theirs.hidden_states[2])


@pytest.mark.parametrize("factory", [tiny_llama, tiny_bert])
def test_zero_layers_equals_original_bitwise(factory):
    base = factory()
    model = hfab.convert(base, "race", layers=[])
    assert model.config.hfab_plan["layers"] == []
    assert all(hfab_attrs(m) == [] for _, m in attention_layers(model))
    with torch.no_grad():
        assert torch.equal(run(model), run(base))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(backend="softmax"), ValueError, "backend='softmax' is not supported"),
    (dict(backend="race", layers=[2]), ValueError, "layer index 2 is out of range"),
    (dict(backend="race", layers=[-1]), ValueError, "layer index -1 is out of range"),
    (dict(backend="race", layers=[0, 0]), ValueError, "more than once"),
    (dict(backend="race", layers=1), TypeError, "layers must be None or a list"),
    (dict(backend="race", num_landmarks=8), TypeError, r"unknown option\(s\) \['num_landmarks'\]"),
    (dict(backend="race", num_planes=0), ValueError, "num_planes=0"),
    (dict(backend="nystrom"), NotImplementedError, "Nyström is non-causal only"),
])
def test_bad_arguments_raise_and_leave_the_model_untouched(kwargs, error, match):
    base = tiny_llama()
    backend = kwargs.pop("backend")
    with pytest.raises(error, match=match):
        hfab.convert(base, backend, inplace=True, **kwargs)
    assert not any(n.startswith("hfab_") for m in base.modules() for n in dir(m))
    assert not hasattr(base.config, "hfab_plan")


def test_converting_twice_raises():
    model = hfab.convert(tiny_bert(), "race")
    with pytest.raises(ValueError, match="already converted"):
        hfab.convert(model, "race")


def test_plain_transformers_load_reports_hfab_tensors_and_runs_softmax(tmp_path):
    """Documented behaviour: the load report names every hfab_* tensor as unexpected; the model is softmax."""
    base = tiny_llama()
    hfab.convert(base, "race", per_head_beta=True).save_pretrained(tmp_path)
    with CaptureLogger(LOAD_LOGGER) as log:
        plain = LlamaForCausalLM.from_pretrained(tmp_path)
    assert "UNEXPECTED" in log.out and "hfab_beta" in log.out and "hfab_planes" in log.out, log.out
    assert all(hfab_attrs(m) == [] for _, m in attention_layers(plain))
    with torch.no_grad():
        assert torch.equal(run(plain), run(base))


def test_from_pretrained_errors(tmp_path):
    base = tiny_bert()
    base.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="not a converted checkpoint"):
        hfab.from_pretrained(tmp_path / "plain")
    base.config.hfab_plan = hfab.convert(base, "race").config.hfab_plan
    base.save_pretrained(tmp_path / "stripped")  # a plan without its hfab_* tensors
    with pytest.raises(ValueError, match=r"missing \['encoder.layer.0.attention.self.hfab_beta'"):
        hfab.from_pretrained(tmp_path / "stripped")
    with pytest.raises(ValueError, match="has no config.json"):
        hfab.from_pretrained(tmp_path / "nowhere")


def test_from_pretrained_with_explicit_model_class(tmp_path):
    model = hfab.convert(tiny_bert(), "exact")
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["NoSuchModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cannot resolve the model class"):
        hfab.from_pretrained(tmp_path)
    loaded = hfab.from_pretrained(tmp_path, model_class=BertModel)
    with torch.no_grad():
        assert torch.equal(run(loaded), run(model))


@pytest.mark.parametrize("family, backend, knobs", [
    ("bert", "nystrom", dict(num_landmarks=4, conv_kernel_size=3)),
    ("llama", "race", dict(num_planes=2, num_tables=3, per_head_beta=True)),
    ("llama", "stieltjes", dict(per_head_temperature=True)),
])
def test_fp32_parameters_train_under_bf16_autocast(family, backend, knobs):
    """Fine-tuning keeps fp32 master weights and computes in bf16: the added hfab_* parameters must follow."""
    model = hfab.convert(FAMILIES[family](), backend, **knobs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run(model)
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    added = [p for n, p in model.named_parameters() if n.split(".")[-1].startswith("hfab_")]
    assert added and all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
                         for p in added)
