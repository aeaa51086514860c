import pytest
import torch
import torch.nn.functional as F

import hf_attention_backends as hfab
from tests.inputs import SHAPES, make_padding, make_qkv
from tests.tolerance import assert_close_to_oracle


def oracle_exact(q, k, v, *, causal, scale, key_padding_mask):
    """Naive loops in float64: for each (b, h, i) a softmax over the allowed keys."""
    b_, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    out = torch.zeros(b_, hq, nq, d, dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for b in range(b_):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(nq):
                js = [j for j in range(nk)
                      if (not causal or j <= i + nk - nq)
                      and (key_padding_mask is None or bool(key_padding_mask[b, j]))]
                if not js:
                    continue
                s = torch.stack([scale * torch.dot(q[b, h, i], k[b, g, j]) for j in js])
                w = torch.exp(s - s.max())
                w = w / w.sum()
                out[b, h, i] = sum(w[t] * v[b, g, j] for t, j in enumerate(js))
    return out


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [None, "right", "left"])
def test_reference_matches_oracle(shape, causal, padding):
    q, k, v = make_qkv(*shape)
    mask = None if padding is None else make_padding(shape[0], shape[4], left=padding == "left")
    scale = 0.7
    out = hfab.exact_attention(q, k, v, causal=causal, scale=scale, key_padding_mask=mask)
    assert_close_to_oracle(out, oracle_exact(q, k, v, causal=causal, scale=scale, key_padding_mask=mask),
                           atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_close_to_fp64(dtype):
    q, k, v = make_qkv(2, 4, 2, 17, 17, 32)
    ref64 = hfab.exact_attention(q, k, v, causal=True)
    out = hfab.exact_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps
    assert_close_to_oracle(out, ref64, atol=8 * eps, rtol=8 * eps)


@pytest.mark.parametrize("causal", [False, True])
def test_equals_torch_sdpa(causal):
    q, k, v = make_qkv(2, 4, 2, 19, 19, 16)
    ours = hfab.exact_attention(q, k, v, causal=causal)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert_close_to_oracle(ours, theirs, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 1, 4, 6, 4), (2, 2, 2, 5, 5, 3)])
def test_gradcheck(shape, causal):
    q, k, v = make_qkv(*shape, requires_grad=True)
    mask = make_padding(shape[0], shape[4], min_real=2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: hfab.exact_attention(q, k, v, causal=causal, key_padding_mask=mask), (q, k, v))


def test_fully_masked_rows_are_zero_with_zero_grad():
    q, k, v = make_qkv(1, 1, 1, 6, 3, 4, requires_grad=True)
    out = hfab.exact_attention(q, k, v, causal=True)  # Nq > Nk: rows 0..2 see no key
    assert torch.equal(out[0, 0, :3], torch.zeros(3, 4, dtype=torch.float64))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0, 0, :3], torch.zeros(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype):
    q, k, v = make_qkv(2, 4, 2, 9, 9, 8, dtype=dtype, requires_grad=True)
    mask = make_padding(2, 9)
    torch.library.opcheck(torch.ops.hfab.exact_fwd.default, (q, k, v, mask, True, 0.5))
    torch.library.opcheck(torch.ops.hfab.exact_fwd.default, (q, k, v, None, False, 0.5))
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = torch.ops.hfab.exact_fwd(q, k, v, mask, True, 0.5)
    torch.library.opcheck(torch.ops.hfab.exact_bwd.default, (torch.randn_like(out), q, k, v, out, lse, mask, True, 0.5))


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.randn(2, 3, 4)), "4 dims"),
    (dict(k=torch.randn(1, 3, 5, 8), v=torch.randn(1, 3, 5, 8)), "multiple of key/value heads"),
    (dict(q=torch.ones(1, 2, 5, 8, dtype=torch.float16)), "share one dtype"),
    (dict(q=torch.randn(1, 2, 5, 4)), "head dims differ"),
    (dict(key_padding_mask=torch.ones(1, 5)), "torch.bool"),
    (dict(key_padding_mask=torch.ones(1, 4, dtype=torch.bool)), r"expected \(B, Nk\)"),
    (dict(scale=-1.0), "scale=-1.0"),
    (dict(q=torch.ones(1, 2, 5, 8, dtype=torch.int32), k=torch.ones(1, 2, 5, 8, dtype=torch.int32),
          v=torch.ones(1, 2, 5, 8, dtype=torch.int32)), "not supported"),
])
def test_boundary_errors(bad, match):
    args = dict(q=torch.randn(1, 2, 5, 8), k=torch.randn(1, 2, 5, 8), v=torch.randn(1, 2, 5, 8))
    args.update(bad)
    kw = {key: args.pop(key) for key in ("key_padding_mask", "scale") if key in args}
    with pytest.raises((ValueError, TypeError), match=match):
        hfab.exact_attention(args["q"], args["k"], args["v"], **kw)


def test_compile_fullgraph():
    q, k, v = make_qkv(1, 2, 2, 9, 9, 8, dtype=torch.float32)
    fn = torch.compile(lambda q, k, v: hfab.exact_attention(q, k, v, causal=True), fullgraph=True, backend="eager")
    assert_close_to_oracle(fn(q, k, v), hfab.exact_attention(q, k, v, causal=True), atol=0, rtol=0)
