"""model_tests' metric, gate and batching functions on hand-built tensors with answers worked out here."""
import math

import pytest
import torch

from model_tests import metrics
from model_tests.behaviour import pad_batch


def test_relative_error_cosine_max_deviation_over_real_tokens():
    ref = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]]])  # (1, 3, 2)
    out = torch.tensor([[[3.0, 4.0], [0.0, 1.0], [100.0, -7.0]]])
    mask = torch.tensor([[True, True, False]])  # the third token is padding: its huge error must not count
    # ‖Δ‖ = ‖(0,0),(-1,1)‖ = √2 ; ‖ref‖ = ‖(3,4),(1,0)‖ = √26
    assert metrics.relative_error(out, ref, mask) == pytest.approx(math.sqrt(2 / 26), rel=1e-12)
    assert metrics.cosine(out, ref, mask) == pytest.approx((0.5, 0.0), abs=1e-12)  # token cosines 1 and 0
    assert metrics.max_deviation(out, ref, mask) == 1.0
    assert metrics.max_deviation(out, ref) == 100.0
    assert metrics.relative_error(ref * 1.25, ref) == pytest.approx(0.25, rel=1e-12)
    assert metrics.relative_error(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2)) == 0.0
    assert metrics.relative_error(torch.ones(1, 1, 2), torch.zeros(1, 1, 2)) == math.inf
    assert metrics.cosine(-ref[:, :2], ref[:, :2]) == pytest.approx((-1.0, -1.0), abs=1e-12)


def test_kl_divergence_known_value_and_mask():
    ref = torch.tensor([[[0.0, math.log(3.0)], [5.0, -5.0]]], dtype=torch.float64)  # token 0: p = (1/4, 3/4)
    out = torch.tensor([[[2.0, 2.0], [-9.0, 9.0]]], dtype=torch.float64)            # token 0: q = (1/2, 1/2)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert metrics.kl_divergence(ref, out, torch.tensor([[True, False]])) == pytest.approx(expected, rel=1e-12)
    assert metrics.kl_divergence(ref, ref) == pytest.approx(0.0, abs=1e-15)
    assert metrics.kl_divergence(ref, out) > expected  # the second token disagrees strongly


def test_kl_divergence_chunks_agree_with_one_pass():
    g = torch.Generator().manual_seed(1)
    ref, out = torch.randn(3, 700, 11, generator=g), torch.randn(3, 700, 11, generator=g)  # 2,100 rows > one chunk
    p = torch.log_softmax(ref.double(), -1)
    q = torch.log_softmax(out.double(), -1)
    expected = (p.exp() * (p - q)).sum(-1).mean().item()
    assert metrics.kl_divergence(ref, out) == pytest.approx(expected, rel=1e-10)


def test_topk_agreement():
    ref = torch.tensor([[[9.0, 1.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0], [0.0, 9.0, 0.0, 0.0]]])  # top-1: 0, 2, 1
    out = torch.tensor([[[9.0, 1.0, 0.0, 0.0], [0.0, 3.0, 2.0, 1.0], [0.0, 1.0, 2.0, 3.0]]])  # top-1: 0, 1, 3
    # out's top-2 sets: {0,1}, {1,2}, {3,2}: the reference token is in the first two
    assert metrics.topk_agreement(ref, out, 1) == pytest.approx(1 / 3)
    assert metrics.topk_agreement(ref, out, 2) == pytest.approx(2 / 3)
    assert metrics.topk_agreement(ref, out, 4) == 1.0
    assert metrics.topk_agreement(ref, out, 1, torch.tensor([[True, False, False]])) == 1.0


def test_next_token_loss_and_accuracy():
    v = 5
    ids = torch.tensor([[1, 2, 3, 0]])
    mask = torch.tensor([[True, True, True, False]])  # the last token is padding: never a target
    logits = torch.zeros(1, 4, v)
    # the loss is taken from an fp32 log-softmax: agreement to fp32 precision
    assert metrics.next_token_loss(logits, ids, mask) == pytest.approx(math.log(v), rel=1e-6)  # uniform
    logits[0, 0, 2] = 10.0  # predicts the next token (2)
    logits[0, 1, 0] = 10.0  # wrong (next is 3)
    logits[0, 2, 0] = 10.0  # would be right but its target is padding
    assert metrics.next_token_accuracy(logits, ids, mask) == pytest.approx(0.5)
    nll_right = -math.log(math.exp(10) / (math.exp(10) + v - 1))
    nll_wrong = -math.log(1 / (math.exp(10) + v - 1))
    assert metrics.next_token_loss(logits, ids, mask) == pytest.approx((nll_right + nll_wrong) / 2, rel=1e-6)


def test_embedding_cosine_pools_real_tokens_only():
    out = torch.tensor([[[1.0, 0.0], [1.0, 2.0], [50.0, 50.0]]])
    ref = torch.tensor([[[1.0, 1.0], [1.0, 1.0], [-50.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])
    # pooled: out (1, 1), ref (1, 1): identical directions
    assert metrics.embedding_cosine(out, ref, mask) == pytest.approx((1.0, 1.0), abs=1e-12)


def test_quantile_interpolates_and_handles_large_inputs():
    assert metrics.quantile(torch.arange(10001.0), 0.9999) == pytest.approx(9999.0)
    assert metrics.quantile(torch.tensor([0.0, 10.0]), 0.25) == pytest.approx(2.5)
    big = torch.zeros(17_000_000)  # more than torch.quantile accepts
    big[-1] = 1.0
    assert metrics.quantile(big, 1.0) == 1.0 and metrics.quantile(big, 0.9999) == 0.0
    with pytest.raises(ValueError, match="q=1.5"):
        metrics.quantile(big, 1.5)


def _envelope_case(scale_mean: float, outlier: float):
    """eager = 0; sdpa = ±0.01 with one 0.1 spike per 1000; exact = scale_mean × sdpa's pattern + an outlier."""
    eager = torch.zeros(1, 1000, 20)
    sdpa = torch.full_like(eager, 0.01)
    sdpa[0, :, 0] = 0.1  # the envelope's tail: 5% of entries
    exact = sdpa * scale_mean
    exact[0, 0, 1] = outlier
    return eager, sdpa, exact


def test_envelope_gates_mean_and_tail():
    eager, sdpa, exact = _envelope_case(1.5, 0.0)
    gates = metrics.envelope_gates(eager, sdpa, exact)
    env_mean = (0.95 * 0.01 + 0.05 * 0.1)
    assert gates["envelope"]["mean_abs"] == pytest.approx(env_mean, rel=1e-6)  # fp32 inputs
    assert gates["envelope"]["p9999_abs"] == pytest.approx(0.1)
    assert gates["mean_abs"]["limit"] == pytest.approx(2 * env_mean, rel=1e-6)
    assert gates["p9999_abs"]["limit"] == pytest.approx(0.4)
    assert gates["passed"] and set(gates) == {"mean_abs", "p9999_abs", "passed", "envelope"}

    gates = metrics.envelope_gates(*_envelope_case(2.5, 0.0))  # mean 2.5x the envelope
    assert not gates["mean_abs"]["passed"] and gates["p9999_abs"]["passed"] and not gates["passed"]

    # a tail of 3 entries of 10 in 20,000: above the 99.99th percentile's rank (index 19,998) only if >= 2 entries
    eager, sdpa, exact = _envelope_case(1.0, 0.0)
    exact[0, 1:4, 2] = 10.0
    gates = metrics.envelope_gates(eager, sdpa, exact)
    assert not gates["p9999_abs"]["passed"] and gates["p9999_abs"]["value"] == pytest.approx(10.0)
    mask = torch.ones(1, 1000, dtype=torch.bool)
    mask[0, 1:4] = False  # the outliers sit on padding: not counted
    assert metrics.envelope_gates(eager, sdpa, exact, mask)["passed"]


def test_envelope_gates_loss_and_top1_for_language_models():
    ids = torch.tensor([[1, 2, 3, 4, 0]])
    eager = torch.zeros(1, 5, 6)
    for t in range(4):
        eager[0, t, ids[0, t + 1]] = 4.0  # eager predicts every next token
    sdpa = eager.clone()
    gates = metrics.envelope_gates(eager, sdpa, eager.clone(), input_ids=ids)
    assert gates["passed"] and gates["loss_gap"]["value"] == 0.0 and gates["top1_accuracy"]["value"] == 1.0
    assert gates["top1_accuracy"]["limit"] == pytest.approx(0.99)

    worse = eager.clone()
    worse[0, 0, 5] = 5.0  # one of 4 predictions now wrong: 25 points below eager, and a higher loss
    gates = metrics.envelope_gates(eager, sdpa, worse, input_ids=ids)
    assert not gates["top1_accuracy"]["passed"] and gates["top1_accuracy"]["value"] == 0.75
    assert not gates["loss_gap"]["passed"] and gates["loss_gap"]["value"] > 1e-3
    slight = eager.clone()
    slight[0, 0, 5] = 1e-4  # a loss change far below 1e-3 nats
    gap = metrics.envelope_gates(eager, sdpa, slight, input_ids=ids)["loss_gap"]
    assert gap["passed"] and 0 < gap["value"] < 1e-4


def test_pad_batch_left_and_right():
    a, b = torch.tensor([5, 6, 7]), torch.tensor([8])
    right = pad_batch([a, b], 0, "right")
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert right["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and "position_ids" not in right
    left = pad_batch([a, b], 0, "left")
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert left["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    with pytest.raises(ValueError, match="side='middle'"):
        pad_batch([a], 0, "middle")
