import pytest
import torch

import hf_attention_backends as hfab
from hf_attention_backends.calibrate import TeacherForcing, calibrate, layer_errors
from hf_attention_backends.integrations import attention_layers
from tests.integrations.tiny_models import output_of, tiny_inputs, tiny_model


def peaked(family="llama"):
    """A tiny random model whose attention is far from uniform (q/k weights scaled), so backends differ."""
    model = tiny_model(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "query.weight", "key.weight")):
                p.mul_(12.0)
    return model


def batches(family="llama", n=2, length=16):
    out = []
    for seed in range(n):
        ids = tiny_inputs(family, 2, length, seed=seed)["input_ids"]
        mask = torch.ones_like(ids)
        mask[1, length - 5:] = 0  # right padding in one row: padded tokens must not count
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def test_exact_backend_has_zero_error():
    model = hfab.convert(peaked(), "exact")
    errors = layer_errors(model, batches())
    assert set(errors) == {0, 1}
    assert max(errors.values()) < 1e-10


def race_student(batch=2):
    """(a peaked tiny llama, its RACE conversion, inputs of ``batch`` rows of 16 tokens)."""
    base = peaked()
    return base, hfab.convert(base, "race", num_planes=2, num_tables=2), tiny_inputs("llama", batch, 16)


def test_teacher_forcing_gives_the_softmax_model_output():
    base, model, inputs = race_student()
    with torch.no_grad():
        expected = output_of(base, **inputs)
        plain = output_of(model, **inputs)
        with TeacherForcing(model) as forcing:
            forced = output_of(model, **inputs, use_cache=False)
    assert not torch.allclose(plain, expected, atol=1e-3), "RACE should move the outputs of a peaked model"
    torch.testing.assert_close(forced, expected, rtol=1e-5, atol=1e-5)
    assert set(forcing.terms) == {0, 1} and all(float(e) > 0 for e, _, _ in forcing.terms.values())


def test_teacher_forcing_follows_the_live_parameter_dtype():
    """FSDP's mixed precision casts the live parameters to bf16 after the fp32 snapshot was taken."""
    base, model, inputs = race_student()
    with torch.no_grad(), TeacherForcing(model):
        model.to(torch.bfloat16)
        forced = output_of(model, **inputs, use_cache=False)
        expected = output_of(base.to(torch.bfloat16), **inputs)
    assert forced.dtype == torch.bfloat16
    torch.testing.assert_close(forced, expected, rtol=0, atol=0)


def test_student_graph_keeps_the_teacher_values_and_the_student_gradient():
    base, model, inputs = race_student()
    with torch.no_grad():
        expected = output_of(base, **inputs)
    with TeacherForcing(model) as forcing:
        detached = output_of(model, **inputs, use_cache=False)
    with TeacherForcing(model, student_graph=True) as forcing:
        linked = output_of(model, **inputs, use_cache=False)
        terms = sum(e for e, _, _ in forcing.terms.values())
    torch.testing.assert_close(linked, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linked, detached, rtol=0, atol=0)
    assert linked.requires_grad
    q_weight = next(p for n, p in model.named_parameters() if "layers.0." in n and "q_proj" in n)
    from_terms = torch.autograd.grad(terms, q_weight, retain_graph=True)[0]
    with_output = torch.autograd.grad(terms + linked.sum(), q_weight)[0]  # layer 1's term: no path to layer 0
    assert from_terms.abs().sum() > 0
    torch.testing.assert_close(with_output, from_terms, rtol=0, atol=0)


def test_paused_teacher_forcing_runs_the_student_alone():
    _, model, inputs = race_student(batch=3)
    with torch.no_grad():
        plain = output_of(model, **inputs)
        with TeacherForcing(model) as forcing:
            forcing.token_mask = torch.ones(5, 7)  # a training batch's mask, stale for this forward
            with forcing.paused():
                paused = output_of(model, **inputs, use_cache=False)
            forcing.token_mask = None
            forced = output_of(model, **inputs, use_cache=False)
    torch.testing.assert_close(paused, plain, rtol=0, atol=0)
    assert not torch.allclose(forced, plain, atol=1e-3), "forcing resumes after the paused block"


def test_teacher_forcing_refuses_a_kv_cache():
    model = hfab.convert(peaked(), "race")
    with TeacherForcing(model), pytest.raises(ValueError, match="use_cache=False"):
        model(**tiny_inputs("llama", 1, 8), use_cache=True)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_race_calibration_improves_every_layer(family):
    model = hfab.convert(peaked(family), "race", num_planes=2, num_tables=2, per_head_beta=True)
    grid = [0.05, 0.2, 1.0, 3.0]
    report = calibrate(model, batches(family), race_betas=grid, steps=5, lr=0.05)
    before, after = report["before"], report["after"]
    assert set(before) == set(after) == {0, 1}
    for idx in before:
        assert after[idx] <= before[idx] + 1e-12
    assert sum(after.values()) < 0.95 * sum(before.values())
    assert report["after"] == pytest.approx(layer_errors(model, batches(family)))
    for idx, module in attention_layers(model):
        assert report["choices"]["beta"][idx] in grid
        assert bool((module.hfab_beta >= 1e-4).all())


def test_stieltjes_order_is_chosen_recorded_and_survives_save_load(tmp_path):
    model = hfab.convert(peaked(), "stieltjes", order=16.0)
    data = batches()
    report = calibrate(model, data, stieltjes_orders=[1.0, 2.0, 16.0])
    order = report["choices"]["order"]
    scored = {}
    for candidate in (1.0, 2.0, 16.0):
        scored[candidate] = sum(layer_errors(hfab.convert(peaked(), "stieltjes", order=candidate), data).values())
    assert order == min(scored, key=scored.get)
    assert sum(report["after"].values()) == pytest.approx(scored[order])
    assert model.config.hfab_plan["config"]["order"] == order
    model.save_pretrained(tmp_path)
    loaded = hfab.from_pretrained(tmp_path)
    assert all(m.hfab_config.order == order for _, m in attention_layers(loaded))


def test_calibrate_errors():
    with pytest.raises(ValueError, match="no converted attention layer"):
        calibrate(tiny_model("llama"), batches())
    model = hfab.convert(peaked(), "race")
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate(model, [])
    with pytest.raises(ValueError, match="race_betas"):
        calibrate(model, batches(), race_betas=[0.1, -1.0])
    with pytest.raises(ValueError, match="no hfab_\\* parameters"):
        calibrate(hfab.convert(peaked(), "stieltjes"), batches(), stieltjes_orders=[4.0], steps=2)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_stieltjes_temperature_search_per_head_improves_and_survives_save_load(family, tmp_path):
    model = hfab.convert(peaked(family), "stieltjes", order=4.0, per_head_temperature=True)
    data = batches(family)
    grid = [0.25, 0.5, 2.0, 4.0]
    report = calibrate(model, data, stieltjes_orders=[4.0], temperatures=grid)
    before, after = report["before"], report["after"]
    assert after == pytest.approx(layer_errors(model, data))
    for idx, module in attention_layers(model):
        chosen = report["choices"]["temperature"][idx]
        assert chosen == module.hfab_temperature.tolist() and len(chosen) == 4
        assert all(v in grid + [1.0] for v in chosen)  # a grid value, or the initial 1 when none beats it
        assert after[idx] <= before[idx]
    assert sum(after.values()) < 0.9 * sum(before.values()), (before, after)
    # the last head searched (3) saw every other head at its final value: no grid value of it does better
    for idx, module in attention_layers(model):
        kept = float(module.hfab_temperature.detach()[3])
        for value in grid:
            with torch.no_grad():
                module.hfab_temperature[3] = value
            assert layer_errors(model, data)[idx] >= after[idx] - 1e-12
        with torch.no_grad():
            module.hfab_temperature[3] = kept
    model.save_pretrained(tmp_path)
    loaded = hfab.from_pretrained(tmp_path)
    for (_, a), (_, b) in zip(attention_layers(model), attention_layers(loaded)):
        assert torch.equal(a.hfab_temperature, b.hfab_temperature)


def test_stieltjes_temperature_fit_and_errors():
    model = hfab.convert(peaked(), "stieltjes", per_head_temperature=True)
    report = calibrate(model, batches(), stieltjes_orders=[4.0], temperatures=[1.0], steps=5, lr=0.05)
    assert len(report["choices"]["steps"]) == 5
    assert all(bool((m.hfab_temperature >= 1e-4).all()) and m.hfab_temperature.grad is None
               for _, m in attention_layers(model))
    with pytest.raises(ValueError, match="per_head_temperature=True"):
        calibrate(hfab.convert(peaked(), "stieltjes"), batches(), stieltjes_orders=[4.0], temperatures=[1.0])
    with pytest.raises(ValueError, match="temperatures"):
        calibrate(model, batches(), stieltjes_orders=[4.0], temperatures=[0.0])
