import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import hf_attention_backends as hfab
from hf_attention_backends.ops.race import reference
from hf_attention_backends.ops.race.op import reference_attention
from tests.inputs import SHAPES, make_padding, make_qkv
from tests.tolerance import assert_close_to_oracle

TIGHT = dict(atol=1e-12, rtol=1e-11)


def oracle_features(x, planes, beta):
    """Φ(x) for x (N, D): explicit loop over tables and itertools.product corners, product-of-sigmoids form."""
    num_tables, num_planes, _ = planes.shape
    cols = []
    for l in range(num_tables):
        u = torch.tanh(x @ planes[l].T)  # (N, P)
        for corner in itertools.product((-1.0, 1.0), repeat=num_planes):
            col = torch.ones(x.shape[0], dtype=torch.float64)
            for t, c in enumerate(corner):
                col = col * torch.sigmoid(2.0 * beta * u[:, t] * c)
            cols.append(col)
    return torch.stack(cols, dim=-1)


def oracle_race(q, k, v, planes, beta, *, causal, key_padding_mask):
    """Float64, per (b, h): the dense Nq x Nk kernel matrix with explicit masks."""
    b_, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    q, k, v, planes = q.double(), k.double(), v.double(), planes.double()
    betas = torch.as_tensor(beta, dtype=torch.float64).expand(hq)
    out = torch.zeros(b_, hq, nq, d, dtype=torch.float64)
    for b in range(b_):
        allowed = torch.tensor([[(not causal or j <= i + nk - nq)
                                 and (key_padding_mask is None or bool(key_padding_mask[b, j]))
                                 for j in range(nk)] for i in range(nq)], dtype=torch.bool).reshape(nq, nk)
        for h in range(hq):
            g = h // (hq // hkv)
            kern = oracle_features(q[b, h], planes, float(betas[h])) @ oracle_features(k[b, g], planes, float(betas[h])).T
            kern = kern * allowed
            for i in range(nq):
                if allowed[i].any():
                    out[b, h, i] = kern[i] @ v[b, g] / kern[i].sum()
    return out


def make_beta(kind, hq, *, dtype=torch.float64, requires_grad=False):
    if kind == "float":
        return 0.6
    if kind == "scalar":
        return torch.tensor(0.8, dtype=dtype, requires_grad=requires_grad)
    return torch.linspace(0.3, 1.5, hq, dtype=dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("shape", SHAPES + [(1, 2, 1, 9, 4, 8)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("beta_kind", ["float", "per_head"])
def test_reference_matches_oracle(shape, causal, padding, beta_kind):
    q, k, v = make_qkv(*shape)
    mask = None if padding is None else make_padding(shape[0], shape[4], left=padding == "left")
    planes = hfab.make_planes(2, 3, shape[5], seed=1, dtype=torch.float64)
    beta = make_beta(beta_kind, shape[1])
    out = hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=causal, key_padding_mask=mask)
    assert_close_to_oracle(out, oracle_race(q, k, v, planes, beta, causal=causal, key_padding_mask=mask), **TIGHT)


@pytest.mark.parametrize("num_tables, num_planes", [(1, 1), (3, 1), (1, 2), (4, 4), (2, 6), (1, 8), (16, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_plane_table_grid(num_tables, num_planes, causal):
    q, k, v = make_qkv(2, 4, 2, 11, 11, 8, seed=3)
    mask = make_padding(2, 11, seed=2)
    planes = hfab.make_planes(num_tables, num_planes, 8, seed=5, dtype=torch.float64)
    beta = make_beta("per_head", 4)
    out = hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=causal, key_padding_mask=mask)
    assert_close_to_oracle(out, oracle_race(q, k, v, planes, beta, causal=causal, key_padding_mask=mask), **TIGHT)


@pytest.mark.parametrize("nq, nk", [(150, 150), (131, 200), (200, 77), (1, 90)])
def test_causal_chunk_size_invariance(nq, nk):
    q, k, v = make_qkv(2, 2, 1, nq, nk, 8, seed=4)
    mask = make_padding(2, nk, left=True, seed=1)
    planes = hfab.make_planes(2, 4, 8, dtype=torch.float64)
    beta = torch.tensor([0.5, 2.0], dtype=torch.float64)
    outs = [reference.race_forward(q, k, v, planes, beta, mask, True, chunk_size=c) for c in (1, 3, 7, 64, 1024)]
    dense = oracle_race(q[:1], k[:1], v[:1], planes, beta, causal=True, key_padding_mask=mask[:1])
    assert_close_to_oracle(outs[0][:1], dense, **TIGHT)
    for out in outs[1:]:
        assert_close_to_oracle(out, outs[0], **TIGHT)


@pytest.mark.parametrize("causal", [False, True])
def test_constant_values_are_returned(causal):
    q, k, _ = make_qkv(2, 4, 2, 13, 13, 8, scale=3.0)
    const = torch.randn(2, 2, 1, 8, dtype=torch.float64)
    v = const.expand(2, 2, 13, 8)
    mask = make_padding(2, 13, left=True, min_real=1)
    planes = hfab.make_planes(3, 5, 8, dtype=torch.float64)
    out = hfab.race_attention(q, k, v, planes=planes, beta=2.0, causal=causal, key_padding_mask=mask)
    expected = const.repeat_interleave(2, dim=1).expand(2, 4, 13, 8)
    if causal:  # left padding: query i sees a real key iff i >= first real position
        has_key = (mask.long().cumsum(-1) > 0)[:, None, :, None]
        expected = expected * has_key
    assert_close_to_oracle(out, expected, **TIGHT)


@pytest.mark.parametrize("num_planes", [1, 3, 8])
def test_feature_tables_sum_to_one(num_planes):
    x = torch.randn(2, 3, 17, 16, dtype=torch.float64) * 4
    planes = hfab.make_planes(5, num_planes, 16, dtype=torch.float64)
    phi = reference.race_features(x, planes, torch.tensor([0.1, 1.0, 30.0], dtype=torch.float64))
    assert phi.shape == (2, 3, 17, 5 * 2 ** num_planes)
    assert (phi > 0).all()
    sums = phi.unflatten(-1, (5, 2 ** num_planes)).sum(-1)
    assert_close_to_oracle(sums, torch.ones_like(sums), **TIGHT)


def test_corner_order_is_itertools_product():
    for p in (1, 2, 5):
        assert torch.equal(reference.corners(p, dtype=torch.float64),
                           torch.tensor(list(itertools.product((-1.0, 1.0), repeat=p)), dtype=torch.float64))


@pytest.mark.parametrize("mask_kind", [None, "right"])
def test_decode_row_equals_noncausal(mask_kind):
    q, k, v = make_qkv(2, 4, 2, 1, 23, 8)
    mask = None if mask_kind is None else make_padding(2, 23)
    planes = hfab.make_planes(4, 4, 8, dtype=torch.float64)
    causal = hfab.race_attention(q, k, v, planes=planes, beta=1.0, causal=True, key_padding_mask=mask)
    full = hfab.race_attention(q, k, v, planes=planes, beta=1.0, causal=False, key_padding_mask=mask)
    assert_close_to_oracle(causal, full, **TIGHT)


def test_beta_forms_agree():
    q, k, v = make_qkv(1, 3, 1, 7, 9, 8)
    planes = hfab.make_planes(2, 3, 8, dtype=torch.float64)
    ref = hfab.race_attention(q, k, v, planes=planes, beta=0.7, causal=True)
    for beta in (torch.tensor(0.7, dtype=torch.float64), torch.full((3,), 0.7, dtype=torch.float64),
                 torch.tensor(0.7, dtype=torch.float32)):
        assert_close_to_oracle(hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=True), ref,
                               atol=1e-7 if beta.dtype == torch.float32 else 1e-14, rtol=0)


def test_reference_attention_equals_op():
    q, k, v = make_qkv(2, 4, 2, 10, 12, 8, requires_grad=True)
    planes = hfab.make_planes(2, 4, 8, dtype=torch.float64)
    beta = make_beta("per_head", 4, requires_grad=True)
    kw = dict(planes=planes, beta=beta, causal=True, key_padding_mask=make_padding(2, 12))
    a = hfab.race_attention(q, k, v, **kw)
    b = reference_attention(q, k, v, **kw)
    assert_close_to_oracle(a, b, atol=0, rtol=0)
    g = torch.randn_like(a)
    ga = torch.autograd.grad(a, (q, k, v, beta), g)
    gb = torch.autograd.grad(b, (q, k, v, beta), g)
    for x, y in zip(ga, gb):
        assert_close_to_oracle(x, y, **TIGHT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_close_to_fp64(dtype):
    q, k, v = make_qkv(2, 4, 2, 37, 37, 32)
    planes = hfab.make_planes(4, 4, 32)
    mask = make_padding(2, 37)
    low = [t.to(dtype) for t in (q, k, v)]
    out = hfab.race_attention(*low, planes=planes.to(dtype), beta=0.5, causal=True, key_padding_mask=mask)
    assert out.dtype == dtype
    oracle = oracle_race(*(t.double() for t in low), planes.to(dtype).double(), 0.5, causal=True, key_padding_mask=mask)
    eps = torch.finfo(dtype).eps
    assert_close_to_oracle(out, oracle, atol=2 * eps if dtype != torch.float32 else 1e-5, rtol=2 * eps)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("beta_kind", ["scalar", "per_head"])
@pytest.mark.parametrize("shape", [(1, 2, 1, 4, 6, 4), (2, 2, 2, 5, 5, 3)])
def test_gradcheck(shape, causal, beta_kind):
    q, k, v = make_qkv(*shape, requires_grad=True)
    mask = make_padding(shape[0], shape[4], min_real=2)
    planes = hfab.make_planes(2, 2, shape[5], dtype=torch.float64)
    beta = make_beta(beta_kind, shape[1], requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, beta: hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=causal,
                                                  key_padding_mask=mask), (q, k, v, beta), fast_mode=True)


def test_fully_masked_rows_are_zero_with_zero_grad():
    q, k, v = make_qkv(1, 2, 1, 6, 3, 4, requires_grad=True)
    planes = hfab.make_planes(2, 3, 4, dtype=torch.float64)
    out = hfab.race_attention(q, k, v, planes=planes, beta=1.0, causal=True)  # Nq > Nk: rows 0..2 see no key
    assert torch.equal(out[0, :, :3], torch.zeros(2, 3, 4, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0, :, :3], torch.zeros(2, 3, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype, beta_kind", [(torch.float32, "per_head"), (torch.float64, "scalar")])
def test_opcheck(dtype, beta_kind):
    q, k, v = make_qkv(2, 4, 2, 9, 11, 8, dtype=dtype, requires_grad=True)
    planes = hfab.make_planes(2, 3, 8, dtype=dtype)
    beta = make_beta(beta_kind, 4, dtype=dtype, requires_grad=True)
    mask = make_padding(2, 11)
    torch.library.opcheck(torch.ops.hfab.race_fwd.default, (q, k, v, planes, beta, mask, True))
    torch.library.opcheck(torch.ops.hfab.race_fwd.default, (q, k, v, planes, beta, None, False))
    args = tuple(t.detach() for t in (q, k, v, planes, beta))
    dout = torch.randn(2, 4, 9, 8, dtype=dtype)
    torch.library.opcheck(torch.ops.hfab.race_bwd.default, (dout, *args, mask, True))


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.randn(2, 3, 4)), "4 dims"),
    (dict(k=torch.randn(1, 3, 5, 8), v=torch.randn(1, 3, 5, 8)), "multiple of key/value heads"),
    (dict(key_padding_mask=torch.ones(1, 5)), "torch.bool"),
    (dict(planes=torch.randn(4, 8)), "3 dims"),
    (dict(planes=torch.randn(2, 3, 4)), r"planes.shape\[2\]=4 must equal the head dim D=8"),
    (dict(planes=torch.randn(2, 9, 8)), "num_planes.*=9"),
    (dict(planes=torch.randn(17, 2, 8)), "num_tables.*=17"),
    (dict(planes=torch.randn(0, 2, 8)), "num_tables.*=0"),
    (dict(planes=torch.ones(2, 2, 8, dtype=torch.int64)), "planes.dtype"),
    (dict(planes=[[[1.0]]]), "planes must be a torch.Tensor"),
    (dict(beta=-1.0), "beta=-1.0"),
    (dict(beta=float("nan")), "beta=nan"),
    (dict(beta=float("inf")), "beta=inf"),
    (dict(beta="1"), "beta must be a float or a Tensor"),
    (dict(beta=torch.ones(3)), r"beta.shape=\(3,\)"),
    (dict(beta=torch.ones(1, 2)), r"beta.shape=\(1, 2\)"),
    (dict(beta=torch.tensor([1.0, float("inf")])), "must be finite"),
    (dict(beta=torch.tensor(float("nan"))), "must be finite"),
    (dict(beta=torch.tensor(1)), "beta.dtype"),
])
def test_boundary_errors(bad, match):
    args = dict(q=torch.randn(1, 2, 5, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8),
                planes=hfab.make_planes(2, 3, 8), beta=0.5)
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    for fn in (hfab.race_attention, reference_attention):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(q, k, v, **args)


def test_beta_finiteness_checked_once_per_tensor_state(monkeypatch):
    """The finiteness check of a tensor beta (a host sync on a GPU) runs once per tensor until it changes in place."""
    calls = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda x: calls.append(1) or isfinite(x))
    q, k, v = make_qkv(1, 2, 2, 5, 5, 8, dtype=torch.float32)
    planes, beta = hfab.make_planes(2, 3, 8), torch.nn.Parameter(torch.tensor(0.5))
    for _ in range(3):
        hfab.race_attention(q, k, v, planes=planes, beta=beta)
    assert len(calls) == 1
    with torch.no_grad():
        beta.fill_(float("nan"))
    with pytest.raises(ValueError, match="must be finite"):
        hfab.race_attention(q, k, v, planes=planes, beta=beta)
    with torch.no_grad():
        beta.fill_(0.25)
    hfab.race_attention(q, k, v, planes=planes, beta=beta)
    assert len(calls) == 3


def test_compile_fullgraph():
    q, k, v = make_qkv(1, 2, 1, 9, 9, 8, dtype=torch.float32, requires_grad=True)
    planes = hfab.make_planes(2, 4, 8)
    beta = torch.tensor([0.4, 0.9], requires_grad=True)

    def f(q, k, v, beta):
        return hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=True)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    out, ref = compiled(q, k, v, beta), f(q, k, v, beta)
    assert_close_to_oracle(out, ref, atol=0, rtol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v, beta), g), torch.autograd.grad(ref, (q, k, v, beta), g)):
        assert_close_to_oracle(a, b, atol=0, rtol=0)
    scalar = torch.compile(lambda q, k, v: hfab.race_attention(q, k, v, planes=planes, beta=0.3), fullgraph=True,
                           backend="eager")
    assert_close_to_oracle(scalar(q, k, v), hfab.race_attention(q, k, v, planes=planes, beta=0.3), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0, 10.0])
def test_no_nan_at_input_scales(dtype, scale):
    q, k, v = make_qkv(2, 4, 2, 70, 70, 32, dtype=dtype, scale=scale, requires_grad=True)
    beta = torch.full((4,), 32 ** -0.5, requires_grad=True)
    planes = hfab.make_planes(4, 4, 32, dtype=dtype)
    mask = make_padding(2, 70, left=True)
    for causal in (False, True):
        out = hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=causal, key_padding_mask=mask)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v, beta))
        assert torch.isfinite(out).all()
        assert all(torch.isfinite(g).all() for g in grads)


def test_make_planes():
    a = hfab.make_planes(4, 3, 16, seed=7)
    assert a.shape == (4, 3, 16) and a.dtype == torch.float32
    assert torch.equal(a, hfab.make_planes(4, 3, 16, seed=7))
    assert not torch.equal(a, hfab.make_planes(4, 3, 16, seed=8))
    assert torch.equal(hfab.make_planes(4, 3, 16, seed=7, dtype=torch.float64).float(), a)
    norms = torch.linalg.vector_norm(hfab.make_planes(4, 3, 16, seed=7, dtype=torch.float64), dim=-1)
    assert_close_to_oracle(norms, torch.ones_like(norms), **TIGHT)
    torch.manual_seed(123)  # the global RNG must neither matter nor be consumed
    state = torch.get_rng_state()
    assert torch.equal(hfab.make_planes(4, 3, 16, seed=7), a)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("args, match", [
    ((0, 4, 8), "num_tables=0"), ((17, 4, 8), "num_tables=17"), ((4, 9, 8), "num_planes=9"),
    ((4, 4, 0), "head_dim=0"), ((4, 4, 8, -1), "seed=-1"), ((4, 4, 8, 0, torch.int32), "dtype"),
    ((4.0, 4, 8), "num_tables must be an int"),
])
def test_make_planes_errors(args, match):
    with pytest.raises((ValueError, TypeError), match=match):
        hfab.make_planes(*args)


@given(b=st.integers(1, 2), hkv=st.integers(1, 2), groups=st.integers(1, 2), nq=st.integers(1, 9),
       extra=st.integers(0, 6), d=st.sampled_from([1, 4, 8]), num_tables=st.integers(1, 3),
       num_planes=st.integers(1, 4), causal=st.booleans(), padded=st.booleans(), per_head=st.booleans(),
       beta=st.floats(0.05, 8.0), seed=st.integers(0, 2 ** 16))
def test_property_matches_oracle_and_is_convex(b, hkv, groups, nq, extra, d, num_tables, num_planes, causal, padded,
                                                per_head, beta, seed):
    hq, nk = hkv * groups, nq + extra
    q, k, v = make_qkv(b, hq, hkv, nq, nk, d, scale=2.0, seed=seed)
    mask = make_padding(b, nk, seed=seed) if padded else None
    planes = hfab.make_planes(num_tables, num_planes, d, seed=seed, dtype=torch.float64)
    beta = torch.linspace(beta, 2 * beta, hq, dtype=torch.float64) if per_head else beta
    out = hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=causal, key_padding_mask=mask)
    assert_close_to_oracle(out, oracle_race(q, k, v, planes, beta, causal=causal, key_padding_mask=mask), **TIGHT)
    # each output row is a convex combination of the real values: inside their per-coordinate range
    real = v if mask is None else v.masked_fill(~mask[:, None, :, None], float("nan"))
    lo = real.nan_to_num(float("inf")).amin(dim=2, keepdim=True).repeat_interleave(groups, dim=1)
    hi = real.nan_to_num(float("-inf")).amax(dim=2, keepdim=True).repeat_interleave(groups, dim=1)
    assert (out >= lo - 1e-12).all() and (out <= hi + 1e-12).all()
