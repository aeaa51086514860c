import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hf_attention_backends as hfab
from hf_attention_backends.ops.nystrom.op import reference_attention
from tests.inputs import make_padding, make_qkv
from tests.tolerance import assert_close_to_oracle


def _row_softmax(s):
    e = torch.exp(s - s.max(dim=1, keepdim=True).values)
    return e / e.sum(dim=1, keepdim=True)


def _norm_product(a):
    return torch.linalg.matrix_norm(a, ord=1) * torch.linalg.matrix_norm(a, ord=float("inf"))


def _ns_pinv(a, iters):
    """Newton–Schulz in the expanded form Z ← (13Z − 15ZM + 7ZM² − ZM³)/4, M = aZ."""
    z = a.T / _norm_product(a)
    for _ in range(iters):
        mz = a @ z
        z = (13 * z - 15 * z @ mz + 7 * z @ torch.linalg.matrix_power(mz, 2)
             - z @ torch.linalg.matrix_power(mz, 3)) / 4
    return z


def _landmark_kernels(qs, ks, real, m):
    """K1 (N, m), K2 (m, m), K3 (m, n) of one (b, h) from the real rows, segment by segment."""
    n = len(real)
    seg = n // m
    bounds = [(l * seg, (l + 1) * seg if l < m - 1 else n) for l in range(m)]
    qr = qs[real]
    q_land = torch.stack([qr[s:e].mean(dim=0) for s, e in bounds])
    k_land = torch.stack([ks[s:e].mean(dim=0) for s, e in bounds])
    return _row_softmax(qs @ k_land.T), _row_softmax(q_land @ k_land.T), _row_softmax(q_land @ ks.T)


def oracle_nystrom(q, k, v, *, m, iters, kappa=0.0, conv_weight=None, scale=None, mask=None):
    """Per-(b, h) float64 loops written from DESIGN.md; differentiable (λ detached) for gradient checks."""
    bsz, hq, n_all, d = q.shape
    hkv = k.shape[1]
    root = math.sqrt(d ** -0.5 if scale is None else scale)
    q, k, v = q.double(), k.double(), v.double()
    out = []
    for b in range(bsz):
        real = [j for j in range(n_all) if mask is None or bool(mask[b, j])]
        n = len(real)
        heads = []
        for h in range(hq):
            g = h // (hq // hkv)
            qs, ks, vr = q[b, h] * root, k[b, g, real] * root, v[b, g, real]
            if n == 0:
                att = torch.zeros(n_all, d, dtype=torch.float64)
            elif m >= n:
                att = _row_softmax(qs @ ks.T) @ vr
            else:
                k1, k2, k3 = _landmark_kernels(qs, ks, real, m)
                if kappa == 0:
                    z = _ns_pinv(k2, iters)
                else:
                    lam = float(_norm_product(k2.detach())) / kappa
                    z = _ns_pinv(k2.T @ k2 + lam * torch.eye(m, dtype=torch.float64), iters) @ k2.T
                att = k1 @ z @ k3 @ vr
            if conv_weight is not None:
                w = conv_weight[h].double()
                half = w.shape[0] // 2
                keep = torch.tensor([mask is None or bool(mask[b, j]) for j in range(n_all)], dtype=torch.float64)
                vz = v[b, g] * keep[:, None]
                res = [sum((w[t] * vz[i + t - half] for t in range(w.shape[0]) if 0 <= i + t - half < n_all),
                           torch.zeros(d, dtype=torch.float64)) for i in range(n_all)]
                att = att + torch.stack(res)
            heads.append(att)
        out.append(torch.stack(heads))
    return torch.stack(out)


def _tolerance(dtype):
    """rtol vs max|oracle|: fp64 compute for fp64; fp32 compute (measured <= 1e-5) plus output rounding."""
    if dtype == torch.float64:
        return 1e-11
    return 1e-4 + 2 * torch.finfo(dtype).eps


# (B, Hq, Hkv, N, D, m): N = 1, odd N, N < m, N = m, m = 1, GQA/MQA, uneven last segment
CASES = [
    (1, 1, 1, 1, 8, 4),
    (2, 2, 2, 7, 16, 3),
    (1, 4, 2, 13, 8, 4),
    (2, 3, 1, 9, 8, 1),
    (1, 2, 2, 5, 8, 16),
    (2, 4, 4, 21, 8, 6),
    (1, 2, 1, 8, 4, 8),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("kappa", [0.0, 10.0])
@pytest.mark.parametrize("conv", [False, True])
def test_reference_matches_oracle(case, padding, kappa, conv):
    b, hq, hkv, n, d, m = case
    q, k, v = make_qkv(b, hq, hkv, n, n, d, seed=n)
    mask = None if padding is None else make_padding(b, n, left=padding == "left", seed=n)
    w = torch.randn(hq, 3, dtype=torch.float64) if conv else None
    kw = dict(num_landmarks=m, newton_iter=5, kappa_star=kappa, conv_weight=w, scale=0.6, key_padding_mask=mask)
    out = hfab.nystrom_attention(q, k, v, **kw)
    oracle = oracle_nystrom(q, k, v, m=m, iters=5, kappa=kappa, conv_weight=w, scale=0.6, mask=mask)
    assert_close_to_oracle(out, oracle, atol=1e-12, rtol=1e-11)
    assert_close_to_oracle(reference_attention(q, k, v, **kw), out, atol=0, rtol=0, name="reference_attention")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_close_to_oracle(dtype):
    q, k, v = make_qkv(2, 4, 2, 37, 37, 32, dtype=dtype, seed=3)
    w = torch.randn(4, 5).to(dtype)
    mask = make_padding(2, 37, seed=3)
    out = hfab.nystrom_attention(q, k, v, num_landmarks=8, conv_weight=w, key_padding_mask=mask)
    assert out.dtype == dtype
    oracle = oracle_nystrom(q, k, v, m=8, iters=6, conv_weight=w, mask=mask)
    assert_close_to_oracle(out, oracle, atol=0, rtol=_tolerance(dtype))


@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_enough_landmarks_is_softmax_attention(padding):
    q, k, v = make_qkv(2, 4, 2, 11, 11, 16, seed=1)
    mask = None if padding is None else make_padding(2, 11, left=padding == "left", min_real=3, seed=1)
    for m in (11, 64):
        out = hfab.nystrom_attention(q, k, v, num_landmarks=m, key_padding_mask=mask)
        assert_close_to_oracle(out, hfab.exact_attention(q, k, v, key_padding_mask=mask), atol=1e-12, rtol=1e-12)


def test_many_newton_steps_converge_to_pinv():
    q, k, v = make_qkv(1, 2, 2, 13, 13, 16, scale=2.0, seed=1)
    m, root = 4, 16 ** -0.25
    out = hfab.nystrom_attention(q, k, v, num_landmarks=m, newton_iter=40)
    ridge = hfab.nystrom_attention(q, k, v, num_landmarks=m, newton_iter=60, kappa_star=1e3)
    for h in range(2):
        k1, k2, k3 = _landmark_kernels(q[0, h] * root, k[0, h] * root, list(range(13)), m)
        assert float(torch.linalg.cond(k2)) < 1e3  # the setup: K2 well conditioned
        assert_close_to_oracle(out[0, h], k1 @ torch.linalg.pinv(k2) @ k3 @ v[0, h], atol=1e-10, rtol=1e-10)
        lam = float(_norm_product(k2)) / 1e3
        z = torch.linalg.solve(k2.T @ k2 + lam * torch.eye(m, dtype=torch.float64), k2.T)
        assert_close_to_oracle(ridge[0, h], k1 @ z @ k3 @ v[0, h], atol=1e-10, rtol=1e-10, name="ridge")


@pytest.mark.parametrize("left", [False, True])
def test_padding_invariance(left):
    n, real = 17, 12
    q, k, v = make_qkv(1, 2, 1, real, real, 8, seed=5)
    w = torch.randn(2, 3, dtype=torch.float64)
    kw = dict(num_landmarks=5, conv_weight=w)
    unpadded = hfab.nystrom_attention(q, k, v, **kw)
    pad = torch.randn(1, 2, n - real, 8, dtype=torch.float64)
    cat = (lambda t: torch.cat([pad[:, : t.shape[1]], t], dim=2)) if left else (
        lambda t: torch.cat([t, pad[:, : t.shape[1]]], dim=2))
    mask = torch.arange(n)[None] >= n - real if left else torch.arange(n)[None] < real
    out = hfab.nystrom_attention(cat(q), cat(k), cat(v), key_padding_mask=mask, **kw)
    assert torch.isfinite(out).all()
    assert_close_to_oracle(out[:, :, mask[0]], unpadded, atol=1e-12, rtol=1e-12)


def test_gqa_equals_repeated_heads():
    q, k, v = make_qkv(1, 4, 2, 15, 15, 8, seed=2)
    w = torch.randn(4, 3, dtype=torch.float64)
    kw = dict(num_landmarks=4, conv_weight=w)
    rep = lambda t: t.repeat_interleave(2, dim=1)
    assert_close_to_oracle(hfab.nystrom_attention(q, k, v, **kw), hfab.nystrom_attention(q, rep(k), rep(v), **kw),
                           atol=1e-13, rtol=1e-13)


def test_fully_padded_sequence_is_zero_with_zero_grad():
    q, k, v = make_qkv(2, 2, 2, 6, 6, 4, requires_grad=True, seed=0)
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[False] * 6, [True] * 4 + [False] * 2])
    out = hfab.nystrom_attention(q, k, v, num_landmarks=2, conv_weight=w, key_padding_mask=mask)
    assert torch.equal(out[0], torch.zeros(2, 6, 4, dtype=torch.float64))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all() and torch.equal(t.grad[0], torch.zeros_like(t.grad[0]))
    assert w.grad.abs().sum() > 0


@pytest.mark.parametrize("b, n", [(2, 5), (1, 0), (0, 5)])
def test_empty_batches_and_sequences_have_zero_output_and_grad(b, n):
    q, k, v = make_qkv(b, 2, 1, n, n, 4, requires_grad=True, seed=0)
    out = hfab.nystrom_attention(q, k, v, num_landmarks=2, key_padding_mask=torch.zeros(b, n, dtype=torch.bool))
    assert out.shape == (b, 2, n, 4) and not out.any()
    for g, t in zip(torch.autograd.grad(out.sum(), (q, k, v)), (q, k, v)):
        assert g.shape == t.shape and not g.any()


@pytest.mark.parametrize("m, conv, padding", [(3, True, "right"), (2, False, "left"), (8, True, "left"),
                                              (1, True, None)])
def test_gradcheck(m, conv, padding):
    q, k, v = make_qkv(2, 2, 1, 7, 7, 3, requires_grad=True, seed=4)
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True) if conv else None
    mask = None if padding is None else make_padding(2, 7, left=padding == "left", min_real=5, seed=4)
    fn = lambda q, k, v, w: hfab.nystrom_attention(q, k, v, num_landmarks=m, newton_iter=4, conv_weight=w,
                                                   key_padding_mask=mask)
    assert torch.autograd.gradcheck(fn, (q, k, v, w), fast_mode=True)


def test_ridge_gradient_treats_lambda_as_constant():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 4, requires_grad=True, seed=6)
    w = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    mask = make_padding(1, 9, min_real=8, seed=6)
    dout = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    ours = torch.autograd.grad(hfab.nystrom_attention(q, k, v, num_landmarks=3, newton_iter=4, kappa_star=5.0,
                                                      conv_weight=w, key_padding_mask=mask), (q, k, v, w), dout)
    theirs = torch.autograd.grad(oracle_nystrom(q, k, v, m=3, iters=4, kappa=5.0, conv_weight=w, mask=mask),
                                 (q, k, v, w), dout)
    for name, a, b in zip("qkvw", ours, theirs):
        assert_close_to_oracle(a, b, atol=1e-11, rtol=1e-10, name=f"d{name}")


@pytest.mark.parametrize("conv", [False, True])
def test_opcheck(conv):
    q, k, v = make_qkv(2, 4, 2, 9, 9, 8, dtype=torch.float32, requires_grad=True, seed=7)
    w = torch.randn(4, 3, requires_grad=True) if conv else None
    mask = make_padding(2, 9, seed=7)
    torch.library.opcheck(torch.ops.hfab.nystrom_fwd.default, (q, k, v, w, mask, 3, 4, 0.0, 0.5))
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    torch.library.opcheck(torch.ops.hfab.nystrom_fwd.default, (q64, k64, v64, w64, None, 4, 2, 2.0, 0.5))
    q, k, v = q.detach(), k.detach(), v.detach()
    w = None if w is None else w.detach()
    dout = torch.randn_like(q)
    torch.library.opcheck(torch.ops.hfab.nystrom_bwd.default, (dout, q, k, v, w, mask, 3, 4, 1.0, 0.5, []))
    dconv = torch.ops.hfab.nystrom_bwd(dout, q, k, v, w, mask, 3, 4, 1.0, 0.5, [])[3]
    assert dconv.shape == ((4, 3) if conv else (0,))


def _args(**bad):
    args = dict(q=torch.randn(1, 2, 5, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8))
    args.update(bad)
    return args.pop("q"), args.pop("k"), args.pop("v"), args


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.randn(2, 3, 4)), "4 dims"),
    (dict(k=torch.randn(1, 2, 6, 8), v=torch.randn(1, 2, 6, 8)), "self-attention only"),
    (dict(k=torch.randn(1, 3, 5, 8), v=torch.randn(1, 3, 5, 8)), "multiple of key/value heads"),
    (dict(key_padding_mask=torch.ones(1, 5)), "torch.bool"),
    (dict(num_landmarks=0), "num_landmarks=0"),
    (dict(num_landmarks=1025), "num_landmarks=1025"),
    (dict(num_landmarks=2.0), "num_landmarks must be an int"),
    (dict(newton_iter=0), "newton_iter=0"),
    (dict(newton_iter=101), "newton_iter=101"),
    (dict(kappa_star=-1.0), "kappa_star=-1.0"),
    (dict(kappa_star=float("nan")), "kappa_star=nan"),
    (dict(kappa_star=float("inf")), "kappa_star=inf"),
    (dict(kappa_star="1"), "kappa_star must be a float"),
    (dict(conv_weight=torch.randn(3, 3)), r"conv_weight.shape=\(3, 3\)"),
    (dict(conv_weight=torch.randn(2, 4)), r"conv_weight.shape=\(2, 4\).*ks odd"),
    (dict(conv_weight=torch.randn(2)), r"conv_weight.shape=\(2,\)"),
    (dict(conv_weight=torch.randn(2, 3, dtype=torch.float64)), "must match q"),
    (dict(scale=0.0), "scale=0.0"),
])
def test_boundary_errors(bad, match):
    q, k, v, kw = _args(**bad)
    with pytest.raises((ValueError, TypeError), match=match):
        hfab.nystrom_attention(q, k, v, **kw)
    with pytest.raises((ValueError, TypeError), match=match):
        reference_attention(q, k, v, **kw)


def test_no_causal_argument():
    q, k, v, _ = _args()
    with pytest.raises(TypeError, match="causal"):
        hfab.nystrom_attention(q, k, v, causal=True)


def test_compile_fullgraph():
    q, k, v = make_qkv(2, 2, 1, 9, 9, 8, dtype=torch.float32, requires_grad=True, seed=8)
    w = torch.randn(2, 3, requires_grad=True)
    mask = make_padding(2, 9, left=True, seed=8)
    fn = lambda q, k, v, w: hfab.nystrom_attention(q, k, v, num_landmarks=3, conv_weight=w, kappa_star=4.0,
                                                   key_padding_mask=mask)
    eager = fn(q, k, v, w)
    grads = torch.autograd.grad(eager.sum(), (q, k, v, w))
    compiled = torch.compile(fn, fullgraph=True, backend="eager")(q, k, v, w)
    assert_close_to_oracle(compiled, eager, atol=0, rtol=0)
    for a, b in zip(torch.autograd.grad(compiled.sum(), (q, k, v, w)), grads):
        assert_close_to_oracle(a, b, atol=0, rtol=0, name="grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("input_scale", [0.05, 1.0, 3.0, 10.0])
def test_no_nan_for_scaled_inputs(dtype, input_scale):
    q, k, v = make_qkv(1, 2, 2, 41, 41, 32, dtype=dtype, scale=input_scale, requires_grad=True, seed=9)
    w = torch.randn(2, 3).to(dtype).requires_grad_(True)
    mask = make_padding(1, 41, min_real=30, seed=9)
    for kappa in (0.0, 10.0):
        out = hfab.nystrom_attention(q, k, v, num_landmarks=8, kappa_star=kappa, conv_weight=w, key_padding_mask=mask)
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.float().sum(), (q, k, v, w)))


@given(data=st.data(), b=st.integers(1, 2), hkv=st.integers(1, 2), groups=st.integers(1, 2),
       n=st.integers(1, 10), d=st.integers(1, 6), m=st.integers(0, 12), iters=st.integers(1, 8),
       kappa=st.sampled_from([0.0, 0.5, 100.0]), ks=st.sampled_from([None, 1, 2, 3]),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_property_matches_oracle_or_raises(data, b, hkv, groups, n, d, m, iters, kappa, ks, dtype):
    hq = hkv * groups
    q, k, v = make_qkv(b, hq, hkv, n, n, d, dtype=dtype, seed=data.draw(st.integers(0, 2**16)))
    kind = data.draw(st.sampled_from(["none", "left", "right", "random"]))
    if kind == "random":
        bits = data.draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n))
        mask = torch.tensor(bits).view(b, n)
    else:
        mask = None if kind == "none" else make_padding(b, n, left=kind == "left", min_real=0, seed=n)
    w = None if ks is None else torch.randn(hq, ks).to(dtype)
    kw = dict(num_landmarks=m, newton_iter=iters, kappa_star=kappa, conv_weight=w, key_padding_mask=mask)
    if m == 0 or ks == 2:
        with pytest.raises(ValueError, match="num_landmarks=0" if m == 0 else "ks odd"):
            hfab.nystrom_attention(q, k, v, **kw)
        return
    out = hfab.nystrom_attention(q, k, v, **kw)
    assert out.dtype == dtype
    oracle = oracle_nystrom(q, k, v, m=m, iters=iters, kappa=kappa, conv_weight=w, mask=mask)
    assert_close_to_oracle(out, oracle, atol=1e-12, rtol=_tolerance(dtype))


@pytest.mark.slow
def test_tensor_core_kernels_fragment_indexing_emulated_lane_by_lane(capsys):
    """scripts/nystrom_tc_lanes.py replays every tensor-core Nyström kernel (csrc/nystrom/nystrom_tc*_kernels.cuh) lane by
    lane: ldmatrix and mma.sync from the PTX fragment layouts, the kernels' index arithmetic, masks and online softmax,
    in float64 with exact operand splits; each kernel's result must equal the dense math to rounding (the script
    asserts 1e-12), and with real fp16/bf16/tf32 operand rounding the forward stays far below the output's own
    rounding."""
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        spec = importlib.util.spec_from_file_location("nystrom_tc_lanes", scripts / "nystrom_tc_lanes.py")
        lanes = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(lanes)
        lanes.main()
    finally:
        sys.path.remove(str(scripts))
    out = capsys.readouterr().out
    assert out.count("exact") == 25, out  # output 7, K3 3, k1 4, dq 4, K3 backward 3, dk/dv 4 cases
    rounded = re.findall(r"kernel operands ([0-9.e+-]+), output rounding to the dtype ([0-9.e+-]+)", out)
    assert len(rounded) == 4, out
    for operands, rounding in rounded:
        assert float(operands) < 0.01 * float(rounding), out


def precision_script():
    """scripts/nystrom_tc_precision.py as a module."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "nystrom_tc_precision.py"
    spec = importlib.util.spec_from_file_location("nystrom_tc_precision", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dk_dv_products_need_both_residual_products(dtype):
    """scripts/nystrom_tc_precision.py part 5: the dk/dv kernel's split products (hi hi + hi lo + lo hi) stay within half
    the GPU tests' bound (3x the dtype-rounded fp32 reference's error), while dropping either residual product of
    dv = K3ᵀ dW0 exceeds the bound: the three mma per product are what that accuracy costs."""
    precision = precision_script()
    worst = precision.worst_key_gradient_residual_ratios(dtype)
    for name in ("dv", "dk"):
        assert worst[(name, "hi hi + hi lo + lo hi")] < 0.5, worst
    assert worst[("dv", "x's residual dropped")] > 1 and worst[("dv", "landmark residual dropped")] > 1, worst


@pytest.mark.slow
def test_tensor_core_backward_operand_error_is_far_below_the_dtype_rounding():
    """scripts/nystrom_tc_precision.py: the tensor-core k1 kernel's arithmetic (16-bit halves of the fp32 landmark keys,
    values W, P and dS) stays at least 20x below the rounding of the gradients' dtype, including an ill-conditioned K2
    (|W| / |out| > 100 at 20 Newton-Schulz steps)."""
    precision = precision_script()
    for dtype, rounding in ((torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)):
        ratio, errors = precision.buffer_gradient_errors(dtype, 1, 64, 4097, 20)
        assert ratio > 100
        for _, tensor_core_error in errors:  # (fp32 arithmetic, tensor-core arithmetic) for d vals and d keys
            assert tensor_core_error < rounding / 20, (dtype, errors)
