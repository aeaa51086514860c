import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hf_attention_backends as hfab
from hf_attention_backends.ops.stieltjes import reference
from hf_attention_backends.backends.config import StieltjesConfig
from hf_attention_backends.ops.stieltjes.op import default_newton_iter, reference_attention
from tests.inputs import SHAPES, make_padding, make_qkv
from tests.tolerance import assert_close_to_oracle

CONVERGED = 100  # newton_iter that puts lambda at the root (to rounding) for the small shapes here


def oracle_stieltjes(q, k, v, *, order, causal, scale, key_padding_mask):
    """Dense float64: per row, bisection for mu > max_j s_j with sum_j (mu - s_j)^(-order) = 1 over the
    allowed keys; out_i = sum_j (mu_i - s_ij)^(-order) v_j (unnormalised: the weights sum to 1 at the root)."""
    b_, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    kv_head = torch.tensor([h // (hq // hkv) for h in range(hq)])
    kk, vv = k.double()[:, kv_head], v.double()[:, kv_head]
    s = torch.einsum("bhid,bhjd->bhij", q.double(), kk) * scale
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    ok = torch.ones(b_, 1, nq, nk, dtype=torch.bool)
    if causal:
        ok = ok & (j <= i + nk - nq)
    if key_padding_mask is not None:
        ok = ok & key_padding_mask[:, None, None, :]
    ok = ok.expand_as(s)
    n = ok.sum(-1).double()
    smax = s.masked_fill(~ok, -math.inf).amax(-1).masked_fill(n == 0, 0.0)
    lo, hi = smax.clone(), smax + n.clamp_min(1) ** (1 / order) + 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        w = torch.where(ok, (mid[..., None] - s).clamp_min(1e-300) ** -order, 0.0)
        above = w.sum(-1) > 1  # f decreasing in mu: the root is to the right
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    mu = (lo + hi) / 2
    w = torch.where(ok, (mu[..., None] - s) ** -order, 0.0)
    return w @ vv


def run(q, k, v, **kw):
    return hfab.stieltjes_attention(q, k, v, **kw)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("order", [1.0, 2.0, 4.0, 8.0])
def test_reference_matches_oracle(shape, causal, padding, order):
    q, k, v = make_qkv(*shape, seed=1)
    mask = None if padding is None else make_padding(shape[0], shape[4], left=True)
    kw = dict(order=order, causal=causal, scale=0.7, key_padding_mask=mask)
    out = run(q, k, v, newton_iter=CONVERGED, **kw)
    assert_close_to_oracle(out, oracle_stieltjes(q, k, v, **kw), atol=1e-12, rtol=1e-10)


def test_non_integer_order_and_right_padding():
    q, k, v = make_qkv(2, 4, 2, 9, 9, 8, seed=2)
    kw = dict(order=2.5, causal=False, scale=0.4, key_padding_mask=make_padding(2, 9))
    assert_close_to_oracle(run(q, k, v, newton_iter=CONVERGED, **kw), oracle_stieltjes(q, k, v, **kw),
                           atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("order", [1.0, 4.0])
def test_weights_sum_to_one_at_root(order):
    q, k, v = make_qkv(2, 2, 1, 6, 11, 8, seed=3)
    mask = make_padding(2, 11, min_real=7)
    out, rowmax, lam = reference.stieltjes_forward(q, k, v, mask, True, 0.5, order, CONVERGED)
    s = torch.einsum("bhid,bjd->bhij", q, k[:, 0]) * 0.5
    ok = (torch.arange(11)[None, :] <= torch.arange(6)[:, None] + 5) & mask[:, None, None, :]
    assert_close_to_oracle(rowmax, s.masked_fill(~ok, -math.inf).amax(-1), atol=1e-12, rtol=0, name="rowmax")
    p = torch.where(ok, (lam[..., None] - (s - rowmax[..., None])).clamp_min(1e-300) ** -order, 0.0)
    assert_close_to_oracle(p.sum(-1), torch.ones_like(lam), atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_default_solver_within_1e3_of_root(causal):
    """The accuracy contract: defaults (order 4, 3 Newton steps), fp32, N of a few thousand, scores
    scaled x0.05, x1, x3, x10 (one batch entry each)."""
    scales = torch.tensor([0.05, 1.0, 3.0, 10.0], dtype=torch.float64)[:, None, None, None]
    nk, nq = 3001, 32  # causal with Nq < Nk: the last rows of a long prefix
    q, k, v = make_qkv(4, 2, 1, nq, nk, 64, seed=4)
    q, k = q * scales, k * scales
    out = run(q.float(), k.float(), v.float(), causal=causal)
    root = oracle_stieltjes(q, k, v, order=4.0, causal=causal, scale=64 ** -0.5, key_padding_mask=None)
    for b in range(4):
        assert_close_to_oracle(out[b], root[b], atol=0, rtol=1e-3, name=f"output at x{float(scales[b])}")


@pytest.mark.parametrize("order, nk", [(1.0, 333), (2.0, 2049), (3.0, 2049), (8.0, 2049)])
def test_default_steps_per_order_within_1e3_of_root(order, nk):
    """The accuracy contract at the other orders with newton_iter left at its default (default_newton_iter):
    fp32, q, k scaled x0.3, x1, x5, x10, 64 query rows. From start_lambda a fixed 2 steps is 1.4e-2 off (largest
    error over max |out|) at order 1 (x10, N = 333) and 8.4e-3 at order 2 (x5, N = 2049) on these inputs, 3 steps
    2.1e-4 and 2.5e-4, the default 4 steps 9e-7 and 5e-6 (from Jensen's start 3 steps were 3.0e-1 and 1.0e-2 off)."""
    scales = torch.tensor([0.3, 1.0, 5.0, 10.0], dtype=torch.float64)[:, None, None, None]
    q, k, v = make_qkv(4, 1, 1, 64, nk, 64, seed=11)
    q, k = q * scales, k * scales
    out = run(q.float(), k.float(), v.float(), order=order)
    root = oracle_stieltjes(q, k, v, order=order, causal=False, scale=64 ** -0.5, key_padding_mask=None)
    for b in range(4):
        assert_close_to_oracle(out[b], root[b], atol=0, rtol=1e-3, name=f"order {order} output at x{float(scales[b])}")


def test_default_newton_iter_depends_on_order():
    assert [default_newton_iter(o) for o in (1.0, 1.9, 2.0, 2.5, 3.9, 4.0, 16.0)] == [4, 4, 4, 4, 4, 1, 1]
    q, k, v = make_qkv(1, 2, 1, 5, 9, 8, dtype=torch.float32, seed=12)
    assert torch.equal(run(q, k, v, order=2.0), run(q, k, v, order=2.0, newton_iter=4))
    assert not torch.equal(run(q, k, v, order=2.0), run(q, k, v, order=2.0, newton_iter=1))
    assert StieltjesConfig().newton_iter is None and StieltjesConfig(newton_iter=7).newton_iter == 7
    with pytest.raises(ValueError, match="newton_iter"):
        StieltjesConfig(newton_iter=0)


def bisect_decreasing(fn, lo, hi, steps=200):
    """The root of a decreasing fn(lam) - 1 in [lo, hi] (per row), float64."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        above = fn(mid) > 1
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return (lo + hi) / 2


def order4_output_error(x, v, lam, root):
    """Per row: relative error of the order-4 output at lam against the output at root (float64)."""
    p, p_root = (lam[:, None] - x) ** -4.0, (root[:, None] - x) ** -4.0
    out, exact = p @ v / p.sum(-1, keepdim=True), p_root @ v / p_root.sum(-1, keepdim=True)
    return (out - exact).norm(dim=-1) / exact.norm(dim=-1)


def start_rows(n: int) -> torch.Tensor:
    """Score rows x (max 0) of n keys: spread, tied maxima, one dominant key, a few keys just below the max and the
    rest far below, all equal."""
    gen = torch.Generator().manual_seed(n)
    spread = -torch.rand(3, n, generator=gen, dtype=torch.float64) * torch.tensor([[0.3], [3.0], [30.0]])
    ties = spread[1].clone()
    ties[: max(1, n // 3)] = 0.0
    dominant = torch.full((n,), -8.0, dtype=torch.float64)
    cluster = -20.0 - torch.rand(n, generator=gen, dtype=torch.float64)
    cluster[: max(1, n // 50)] = -torch.rand(max(1, n // 50), generator=gen, dtype=torch.float64) * 0.5
    rows = torch.cat([spread, ties[None], dominant[None], cluster[None], torch.zeros(1, n, dtype=torch.float64)])
    rows[:, 0] = 0.0
    return rows


@pytest.mark.parametrize("n", [1, 2, 40, 4096])
@pytest.mark.parametrize("order", [1.0, 2.0, 4.0, 8.0])
def test_start_lambda_is_a_lower_bound_at_least_jensens(n, order):
    """start_lambda stays below the root of f (bisection), is at least Jensen's bound max(1, n^(1/order) + mean x),
    sits at the root of its two-term model lambda^-order + (n - 1) (lambda + d)^-order (d = the other keys' mean
    distance below the max; bisection), and is exact when all scores are equal."""
    x = start_rows(n)
    count = torch.full((x.shape[0],), float(n), dtype=torch.float64)
    lam = reference.start_lambda(count, x.sum(-1), order)
    ones, upper = torch.ones_like(count), count ** (1 / order)
    root = bisect_decreasing(lambda l: ((l[:, None] - x) ** -order).sum(-1), ones, upper)
    assert (lam <= root * (1 + 1e-12)).all()
    assert (lam >= torch.clamp_min(upper + x.mean(-1), 1.0) - 1e-12).all()
    dist = -x.sum(-1) / max(n - 1, 1)
    model = bisect_decreasing(lambda l: l ** -order + (n - 1) * (l + dist) ** -order, ones, upper)
    assert_close_to_oracle(lam, model, atol=0, rtol=1e-5 if order == 1.0 else 1e-10, name="two-term model root")
    assert_close_to_oracle(lam[-1:], upper[-1:], atol=0, rtol=1e-12, name="equal scores")


def test_default_order4_solve_on_a_bimodal_row():
    """The largest key, a quarter of the keys 2.5-3 below it and the rest 8-9 below (N = 4096; SmolLM2's hardest
    real rows look alike): Jensen's start sits at 1, far below the root (~3.2), and two Halley steps from it leave
    the output ~2e-2 off; from start_lambda two steps, and the adaptive default, are within 1e-4."""
    gen = torch.Generator().manual_seed(0)
    x = -(8.0 + torch.rand(1, 4096, generator=gen, dtype=torch.float64))
    x[0, :1024] = -(2.5 + 0.5 * torch.rand(1024, generator=gen, dtype=torch.float64))
    x[0, 0] = 0.0
    v = torch.randn(4096, 8, generator=gen, dtype=torch.float64)
    upper = torch.full((1,), 4096 ** 0.25, dtype=torch.float64)
    root = bisect_decreasing(lambda l: ((l[:, None] - x) ** -4.0).sum(-1), torch.ones(1, dtype=torch.float64), upper)

    def error(lam):
        return float(order4_output_error(x, v, lam, root)[0])

    jensen = torch.clamp_min(upper + x.mean(-1), 1.0)
    assert error(reference.solver_step(x, reference.solver_step(x, jensen, 4.0, upper), 4.0, upper)) > 1e-3
    ok = torch.ones_like(x, dtype=torch.bool)
    assert error(reference.solve_lambda(x, ok, 4.0, 2)) < 1e-4
    assert error(reference.solve_lambda(x, ok, 4.0, -default_newton_iter(4.0))) < 1e-4


def test_adaptive_solve_steps_again_where_the_error_estimate_says_so():
    """newton_iter < 0 (the public functions' default): after -newton_iter steps a row takes another (up to
    MAX_EXTRA_STEPS) where needs_another_step says so, the others keep their lambda. A row of two clusters at N 16,384
    (a quarter of the keys 4-4.5 below the max, the rest 14-15 below), 0.3 off the exact-root output after one Halley
    step and ~1e-2 after two, ends within 1e-6; Gaussian rows beside it keep their one-step lambda."""
    gen = torch.Generator().manual_seed(0)
    hard = -(14.0 + torch.rand(1, 16384, generator=gen, dtype=torch.float64))
    hard[0, :4096] = -(4.0 + 0.5 * torch.rand(4096, generator=gen, dtype=torch.float64))
    easy = torch.randn(3, 16384, generator=gen, dtype=torch.float64)
    x = torch.cat([hard, easy - easy.max(-1, keepdim=True).values])
    x[0, 0] = 0.0
    ok = torch.ones_like(x, dtype=torch.bool)
    v = torch.randn(16384, 8, generator=gen, dtype=torch.float64)
    upper = torch.full((4,), 16384 ** 0.25, dtype=torch.float64)
    root = bisect_decreasing(lambda l: ((l[:, None] - x) ** -4.0).sum(-1), torch.ones(4, dtype=torch.float64), upper)

    def error(lam):
        return order4_output_error(x, v, lam, root)

    one, two = reference.solve_lambda(x, ok, 4.0, 1), reference.solve_lambda(x, ok, 4.0, 2)
    adaptive = reference.solve_lambda(x, ok, 4.0, -1)
    assert torch.equal(adaptive[1:], one[1:]) and not torch.equal(adaptive[:1], two[:1])
    assert error(one)[0] > 0.1 and error(two)[0] > 1e-3 and error(adaptive)[0] < 1e-6
    assert float(error(adaptive)[1:].max()) < 1e-6


def test_halley_error_estimate_lets_long_accurate_steps_stop():
    """Gaussian rows (scores x1.2, N 4,096): from start_lambda one Halley step moves lambda by more than STEP_TOL in
    most rows and still lands within 1e-3 (2e-4) of the exact-root output; the step's error estimate lets them stop (a
    step-length rule would sweep again). A Newton step (new == its Newton iterate) is judged by its length."""
    gen = torch.Generator().manual_seed(3)
    e = torch.randn(64, 4096, generator=gen, dtype=torch.float64) * 1.2
    x = e - e.max(-1, keepdim=True).values
    v = torch.randn(4096, 8, generator=gen, dtype=torch.float64)
    n = torch.full((64,), 4096.0, dtype=torch.float64)
    lam0 = reference.start_lambda(n, x.sum(-1), 4.0)
    new, newton = reference.solver_iterates(x, lam0, 4.0, n ** 0.25)
    assert int(((new - lam0).abs() > reference.STEP_TOL * new).sum()) > 32
    assert not bool(reference.needs_another_step(new, newton, lam0).any())
    root = bisect_decreasing(lambda l: ((l[:, None] - x) ** -4.0).sum(-1), torch.ones(64, dtype=torch.float64),
                             n ** 0.25)
    assert float(order4_output_error(x, v, new, root).max()) < 1e-3
    lam = torch.tensor([2.0, 2.0], dtype=torch.float64)
    newton_step = torch.tensor([2.3, 2.1], dtype=torch.float64)
    assert reference.needs_another_step(newton_step, newton_step, lam).tolist() == [True, False]


@pytest.mark.parametrize("order, newton_iter, expected", [(4.0, None, -1), (2.0, None, -4), (4.0, 3, 3)])
def test_public_default_is_the_adaptive_solve(monkeypatch, order, newton_iter, expected):
    """newton_iter=None reaches the solver as -default_newton_iter(order) (adaptive), an explicit count as itself."""
    seen = []
    solve = reference.solve_lambda
    monkeypatch.setattr(reference, "solve_lambda", lambda x, ok, o, n: seen.append(n) or solve(x, ok, o, n))
    q, k, v = make_qkv(1, 2, 1, 5, 9, 8, dtype=torch.float32, seed=12)
    run(q, k, v, order=order, newton_iter=newton_iter)
    reference_attention(q, k, v, order=order, newton_iter=newton_iter)
    assert seen == [expected, expected]


@pytest.mark.parametrize("order", [4.0, 8.0])
def test_halley_steps_stay_bracketed_and_converge(order):
    """order >= 4: clamped Halley steps stay in [1, n^(1/order)], never fall behind the Newton step from the same
    lambda, reach the root, and with equal scores one step is exact."""
    x = -torch.rand(3, 40, dtype=torch.float64) * 5
    x[:, 0] = 0.0
    ok = torch.ones_like(x, dtype=torch.bool)
    root = reference.solve_lambda(x, ok, order, CONVERGED)
    assert_close_to_oracle(((root[..., None] - x) ** -order).sum(-1), torch.ones(3, dtype=torch.float64),
                           atol=1e-12, rtol=0, name="f(root)")
    for it in range(1, 8):
        before = reference.solve_lambda(x, ok, order, it - 1)
        lam = reference.solve_lambda(x, ok, order, it)
        y = before[..., None] - x
        f, s1 = (y ** -order).sum(-1), (y ** (-order - 1)).sum(-1)
        newton = before + f * (f ** (1 / order) - 1) / s1
        assert (lam >= newton - 1e-12).all() and (lam >= 1).all() and (lam <= 40 ** (1 / order) + 1e-12).all()
    assert_close_to_oracle(reference.solve_lambda(x, ok, order, 3), root, atol=1e-10, rtol=0, name="3 steps")
    flat = torch.zeros(2, 40, dtype=torch.float64)
    assert_close_to_oracle(reference.solve_lambda(flat, ok[:2], order, 1),
                           torch.full((2,), 40 ** (1 / order), dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("order", [1.0, 2.0])
def test_solver_monotone_lower_bound_exact_for_uniform(order):
    """Newton (order < 4) from the start never passes the root; with equal scores one step is exact."""
    x = -torch.rand(3, 40, dtype=torch.float64) * 5
    x[:, 0] = 0.0
    ok = torch.ones_like(x, dtype=torch.bool)
    root = reference.solve_lambda(x, ok, order, CONVERGED)
    previous = torch.ones(3, dtype=torch.float64)
    for it in range(1, 8):
        lam = reference.solve_lambda(x, ok, order, it)
        assert ((lam[..., None] - x) ** -order).sum(-1).ge(1 - 1e-12).all()  # still left of the root
        assert (previous <= lam + 1e-12).all() and (lam <= root + 1e-12).all()
        previous = lam
    flat = torch.zeros(2, 40, dtype=torch.float64)
    assert_close_to_oracle(reference.solve_lambda(flat, ok[:2], order, 1),
                           torch.full((2,), 40 ** (1 / order), dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 1, 4, 6, 4), (2, 2, 2, 5, 5, 3)])
def test_gradcheck(shape, causal):
    q, k, v = make_qkv(*shape, requires_grad=True, seed=5)
    mask = make_padding(shape[0], shape[4], min_real=2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: run(q, k, v, order=3.0, causal=causal, key_padding_mask=mask, newton_iter=CONVERGED),
        (q, k, v))


def test_op_gradient_is_the_root_gradient_not_the_newton_unroll():
    """Converged: IFT gradient = autograd through the converged reference. Few steps: they differ."""
    q, k, v = make_qkv(1, 2, 1, 5, 7, 4, scale=2.0, requires_grad=True, seed=6)
    dout = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    grads = {}
    for name, fn in (("op", run), ("unrolled", reference_attention)):
        for it in (1, CONVERGED):
            grads[name, it] = torch.autograd.grad(fn(q, k, v, causal=True, newton_iter=it), (q, k, v), dout)
    for a, b in zip(grads["op", CONVERGED], grads["unrolled", CONVERGED]):
        assert_close_to_oracle(a, b, atol=1e-10, rtol=1e-8, name="grad")
    assert not torch.allclose(grads["op", 1][0], grads["unrolled", 1][0], atol=1e-6)


def test_reference_attention_equals_op_forward():
    q, k, v = make_qkv(2, 4, 2, 9, 12, 8, dtype=torch.float32, seed=7)
    kw = dict(causal=True, key_padding_mask=make_padding(2, 12))
    assert_close_to_oracle(reference_attention(q, k, v, **kw), run(q, k, v, **kw), atol=0, rtol=0)


def test_query_chunking_is_invisible(monkeypatch):
    q, k, v = make_qkv(2, 2, 1, 13, 13, 8, seed=8, requires_grad=True)
    kw = dict(causal=True, key_padding_mask=make_padding(2, 13))
    whole = run(q, k, v, **kw)
    g_whole = torch.autograd.grad(whole.sum(), (q, k, v))
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 2 * 2 * 13 * 3)  # chunks of 3 query rows
    chunked = run(q, k, v, **kw)
    assert_close_to_oracle(chunked, whole, atol=1e-14, rtol=0)
    for a, b in zip(torch.autograd.grad(chunked.sum(), (q, k, v)), g_whole):
        assert_close_to_oracle(a, b, atol=1e-13, rtol=0, name="grad")
    args = (q, k, v, kw["key_padding_mask"], True, 0.3, 4.0, 3)
    plain, _, _ = reference.stieltjes_forward(*args)
    checkpointed, _, _ = reference.stieltjes_forward(*args, recompute=True)
    for a, b in zip(torch.autograd.grad(checkpointed.sum(), (q, k, v)), torch.autograd.grad(plain.sum(), (q, k, v))):
        assert_close_to_oracle(a, b, atol=1e-14, rtol=0, name="grad")


def test_fully_masked_rows_are_zero_with_zero_grad():
    q, k, v = make_qkv(1, 1, 1, 6, 3, 4, requires_grad=True, seed=9)
    out = run(q, k, v, causal=True)  # Nq > Nk: rows 0..2 see no key
    assert torch.equal(out[0, 0, :3], torch.zeros(3, 4, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0, 0, :3], torch.zeros(3, 4, dtype=torch.float64))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert torch.isfinite(reference_attention(q, k, v, causal=True)).all()


@pytest.mark.parametrize("sc", [0.05, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_nan_at_scales(sc, dtype):
    q, k, v = make_qkv(2, 4, 2, 33, 40, 16, dtype=dtype, scale=sc, requires_grad=True, seed=10)
    mask = make_padding(2, 40, seed=1)
    for fn in (run, reference_attention):
        out = fn(q, k, v, causal=True, key_padding_mask=mask, order=1.0 if fn is run else 8.0)
        assert out.dtype == dtype and torch.isfinite(out).all()
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    q, k, v = make_qkv(2, 4, 2, 9, 11, 8, dtype=dtype, requires_grad=True, seed=11)
    mask = make_padding(2, 11)
    torch.library.opcheck(torch.ops.hfab.stieltjes_fwd.default, (q, k, v, mask, True, 0.5, 4.0, 3))
    torch.library.opcheck(torch.ops.hfab.stieltjes_fwd.default, (q, k, v, None, False, 0.5, 1.5, 7, True))
    q, k, v = q.detach(), k.detach(), v.detach()
    out, rowmax, lam, u, lsum = torch.ops.hfab.stieltjes_fwd(q, k, v, mask, True, 0.5, 4.0, 3, True)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert rowmax.dtype == lam.dtype == u.dtype == lsum.dtype == state_dtype
    assert u.shape == q.shape and lsum.shape == lam.shape
    torch.library.opcheck(torch.ops.hfab.stieltjes_bwd.default,
                          (torch.randn_like(out), q, k, v, rowmax, lam, u, lsum, mask, True, 0.5, 4.0))


def test_forward_state_only_when_asked():
    """backward_state=False (the default, inference) returns empty u and lsum and the same out, rowmax, lam."""
    q, k, v = make_qkv(1, 2, 1, 5, 7, 8, seed=12)
    plain = torch.ops.hfab.stieltjes_fwd(q, k, v, None, True, 0.5, 4.0, 3)
    with_state = torch.ops.hfab.stieltjes_fwd(q, k, v, None, True, 0.5, 4.0, 3, True)
    assert plain[3].numel() == plain[4].numel() == 0
    for a, b in zip(plain[:3], with_state[:3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_state_matches_float64(causal):
    """u = sum r v / sum r (r = (lambda - x)^(-order-1)) and sum P against a float64 computation of their own at the
    root, with key padding (a row with no key: u 0, sum P 0); dO . u is the delta of the reference's backward."""
    q, k, v = make_qkv(2, 4, 2, 6, 9, 8, dtype=torch.float64, seed=13)
    mask = make_padding(2, 9, min_real=3)
    mask[1] = False
    mask[1, 8] = True  # causal: batch 1's first rows see no key
    _, rowmax, lam, u, lsum = reference.stieltjes_forward(q, k, v, mask, causal, 0.5, 4.0, CONVERGED,
                                                          backward_state=True)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, kk) * 0.5
    ok = mask[:, None, None, :] & ((torch.arange(9)[None, :] <= torch.arange(6)[:, None] + 3) if causal else True)
    ok = ok.expand_as(s)
    has = ok.any(-1)
    y = torch.where(ok, lam[..., None] - (s - rowmax[..., None]), math.inf)
    r = y ** -5.0
    want_u = torch.where(has[..., None], (r @ vv) / r.sum(-1, keepdim=True).clamp_min(1e-300), 0.0)
    assert_close_to_oracle(u, want_u, atol=1e-12, rtol=1e-10, name="u")
    assert_close_to_oracle(lsum, has.double(), atol=1e-12, rtol=0, name="sum P (1 at the root)")
    dout = torch.randn_like(q)
    dp = dout @ vv.transpose(-1, -2)
    delta = torch.where(has, (dp * r).sum(-1) / r.sum(-1).clamp_min(1e-300), 0.0)
    assert_close_to_oracle((dout * u).sum(-1), delta, atol=1e-12, rtol=1e-10, name="dO . u")


@pytest.mark.parametrize("bad, match", [
    (dict(order=0.5), r"order=0.5 .*>= 1"),
    (dict(order=float("inf")), "order=inf"),
    (dict(order=float("nan")), "order=nan"),
    (dict(order="4"), "order must be a float"),
    (dict(order=True), "order must be a float"),
    (dict(newton_iter=0), "newton_iter=0"),
    (dict(newton_iter=101), r"newton_iter=101 .*<= 100"),
    (dict(newton_iter=3.0), "newton_iter must be an int"),
    (dict(scale=0.0), "scale=0.0"),
    (dict(key_padding_mask=torch.ones(1, 5)), "torch.bool"),
    (dict(q=torch.randn(1, 3, 5, 8)), "multiple of key/value heads"),
    (dict(q=torch.randn(1, 2, 5, 4)), "head dims differ"),
])
def test_boundary_errors(bad, match):
    args = dict(q=torch.randn(1, 2, 5, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8))
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    for fn in (run, reference_attention):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(q, k, v, **args)


def test_compile_fullgraph():
    q, k, v = make_qkv(1, 2, 1, 9, 9, 8, dtype=torch.float32, requires_grad=True, seed=12)
    f = lambda q, k, v: run(q, k, v, causal=True, order=2.0, newton_iter=5)  # noqa: E731
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    out = compiled(q, k, v)
    assert_close_to_oracle(out, f(q, k, v), atol=0, rtol=0)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(f(q, k, v).sum(), (q, k, v))):
        assert_close_to_oracle(a, b, atol=0, rtol=0, name="grad")


@given(b=st.integers(1, 2), hkv=st.integers(1, 2), groups=st.integers(1, 2), nq=st.integers(1, 9),
       nk=st.integers(1, 9), d=st.sampled_from([1, 4, 8]), causal=st.booleans(), padded=st.booleans(),
       order=st.one_of(st.floats(0.0, 9.0), st.just(1.0)), newton_iter=st.integers(-1, 102),
       sc=st.sampled_from([0.05, 1.0, 3.0]), seed=st.integers(0, 2 ** 16))
def test_property_matches_oracle_or_raises(b, hkv, groups, nq, nk, d, causal, padded, order, newton_iter, sc, seed):
    q, k, v = make_qkv(b, hkv * groups, hkv, nq, nk, d, scale=sc, seed=seed)
    mask = make_padding(b, nk, min_real=0, seed=seed) if padded else None
    kw = dict(order=order, causal=causal, key_padding_mask=mask)
    if order < 1 or not 1 <= newton_iter <= 100:
        with pytest.raises(ValueError, match="order" if order < 1 else "newton_iter"):
            run(q, k, v, newton_iter=newton_iter, **kw)
        return
    out = run(q, k, v, newton_iter=newton_iter, **kw)
    assert torch.isfinite(out).all()
    oracle = oracle_stieltjes(q, k, v, scale=d ** -0.5, **kw)
    # any number of steps gives a convex combination of the values (0 for rows with no key); converged: the oracle
    heads = torch.arange(hkv * groups) // groups
    lo, hi = v.amin(2)[:, heads, None].clamp_max(0), v.amax(2)[:, heads, None].clamp_min(0)
    assert ((out >= lo - 1e-12) & (out <= hi + 1e-12)).all()
    if newton_iter >= 60:
        assert_close_to_oracle(out, oracle, atol=1e-10, rtol=1e-8)
