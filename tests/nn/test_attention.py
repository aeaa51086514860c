import math

import pytest
import torch

import hf_attention_backends as hfab
from hf_attention_backends.backends.config import NystromConfig, RaceConfig
from hf_attention_backends.nn import (ExactAttention, ExactAttentionConfig, NystromAttention, NystromAttentionConfig,
                                      RACEAttention, RACEAttentionConfig, StieltjesAttention)
from tests.inputs import make_padding
from tests.tolerance import assert_close_to_oracle

# (class, backend knobs) small enough for a CPU test; num_landmarks < N so Nyström really approximates
MODULES = {
    "exact": (ExactAttention, {}),
    "nystrom": (NystromAttention, {"num_landmarks": 4, "conv_kernel_size": 3}),
    "stieltjes": (StieltjesAttention, {"order": 4.0}),
    "race": (RACEAttention, {"num_planes": 2, "num_tables": 3, "per_head_beta": True}),
}
CAUSAL = ["exact", "stieltjes", "race"]


def build(name, *, hidden=24, heads=4, kv_heads=2, causal=False, **extra):
    """A float64 module with frozen parameters (the gradient test unfreezes them)."""
    cls, knobs = MODULES[name]
    torch.manual_seed(0)
    m = cls(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, causal=causal, **{**knobs, **extra})
    return m.double().requires_grad_(False)


def softmax_attention_oracle(m, x, *, causal, key_padding_mask=None):
    """Multi-head softmax attention written out from the module's weights, float64, GQA by head index."""
    c = m.config
    b, n, _ = x.shape
    lin = lambda layer, t: t @ layer.weight.T + (layer.bias if layer.bias is not None else 0)  # noqa: E731
    q = lin(m.q_proj, x).view(b, n, c.num_heads, c.head_dim)
    k = lin(m.k_proj, x).view(b, n, c.num_kv_heads, c.head_dim)
    v = lin(m.v_proj, x).view(b, n, c.num_kv_heads, c.head_dim)
    kv_head = torch.arange(c.num_heads) // (c.num_heads // c.num_kv_heads)
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(c.head_dim)
    allowed = torch.ones(b, 1, n, n, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", p, v).reshape(b, n, c.num_heads * c.head_dim)
    return lin(m.o_proj, out)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_exact_matches_handwritten_softmax_float64(causal, kv_heads):
    m = build("exact", kv_heads=kv_heads, causal=causal)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    mask = make_padding(2, 9, min_real=3)
    out = m(x, key_padding_mask=mask)
    oracle = softmax_attention_oracle(m, x, causal=causal, key_padding_mask=mask)
    assert_close_to_oracle(out, oracle, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", MODULES)
def test_shapes_and_dtype(name):
    m = build(name).float()
    x = torch.randn(3, 7, 24)
    out = m(x, key_padding_mask=make_padding(3, 7))
    assert out.shape == (3, 7, 24) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert m.q_proj.out_features == 4 * 6 and m.k_proj.out_features == 2 * 6 and m.o_proj.in_features == 24


@pytest.mark.parametrize("name", MODULES)
def test_gradients_reach_every_parameter(name):
    m = build(name).requires_grad_(True)
    x = torch.randn(2, 8, 24, dtype=torch.float64, requires_grad=True)
    (m(x) ** 2).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", MODULES)
def test_gqa_equals_mha_with_repeated_kv_projections(name):
    gqa = build(name, kv_heads=2)
    mha = build(name, kv_heads=4)
    mha.load_state_dict({k: t for k, t in gqa.state_dict().items() if not k.startswith(("k_proj", "v_proj"))},
                        strict=False)
    d = gqa.config.head_dim
    for proj in ("k_proj", "v_proj"):
        src, dst = getattr(gqa, proj), getattr(mha, proj)
        with torch.no_grad():  # kv head g serves query heads 2g and 2g + 1
            dst.weight.copy_(src.weight.view(2, d, 24).repeat_interleave(2, dim=0).reshape(4 * d, 24))
            dst.bias.copy_(src.bias.view(2, d).repeat_interleave(2, dim=0).reshape(4 * d))
    x = torch.randn(2, 8, 24, dtype=torch.float64)
    assert_close_to_oracle(gqa(x), mha(x), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_outputs_ignore_future_tokens(name):
    m = build(name, causal=True)
    x = torch.randn(1, 10, 24, dtype=torch.float64)
    y = x.clone()
    y[:, 6:] = torch.randn(1, 4, 24, dtype=torch.float64)
    a, b = m(x), m(y)
    assert_close_to_oracle(a[:, :6], b[:, :6], atol=1e-12, rtol=1e-12)
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", MODULES)
def test_key_padding_hides_padded_tokens(name):
    m = build(name)
    mask = torch.tensor([[True] * 6 + [False] * 3])
    x = torch.randn(1, 9, 24, dtype=torch.float64)
    y = x.clone()
    y[:, 6:] = torch.randn(1, 3, 24, dtype=torch.float64)
    assert_close_to_oracle(m(x, key_padding_mask=mask)[:, :6], m(y, key_padding_mask=mask)[:, :6],
                           atol=1e-12, rtol=1e-12)
    assert (m(x)[:, :6] - m(y)[:, :6]).abs().max() > 1e-3


def test_race_parameters_are_seeded_planes_and_default_beta():
    m = RACEAttention(hidden_size=32, num_heads=2, num_planes=3, num_tables=5, seed=7)
    assert torch.equal(m.planes, hfab.make_planes(5, 3, 16, seed=7))
    assert "planes" in m.state_dict() and not any(n == "planes" for n, _ in m.named_parameters())
    assert m.beta.shape == () and m.beta.item() == pytest.approx(16 ** -0.5)
    per_head = RACEAttention(hidden_size=32, num_heads=2, per_head_beta=True, beta=0.3)
    assert per_head.beta.shape == (2,) and torch.equal(per_head.beta.detach(), torch.full((2,), 0.3))
    other = RACEAttention(hidden_size=32, num_heads=2, num_planes=3, num_tables=5, seed=8)
    assert not torch.equal(m.planes, other.planes)


def test_nystrom_conv_starts_at_zero_so_output_is_plain_nystrom():
    conv = build("nystrom")
    plain = build("nystrom", conv_kernel_size=0)
    plain.load_state_dict({k: t for k, t in conv.state_dict().items() if k != "conv_weight"})
    assert conv.conv_weight.shape == (4, 3) and not conv.conv_weight.any()
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    assert_close_to_oracle(conv(x), plain(x), atol=1e-14, rtol=1e-14)
    with torch.no_grad():
        conv.conv_weight.fill_(0.5)
    assert (conv(x) - plain(x)).abs().max() > 1e-3


def test_stieltjes_temperature_scales_each_heads_scores():
    tempered = build("stieltjes", per_head_temperature=True)
    plain = build("stieltjes")
    plain.load_state_dict({k: t for k, t in tempered.state_dict().items() if k != "temperature"})
    assert torch.equal(tempered.temperature, torch.ones(4, dtype=torch.float64))
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    assert torch.equal(tempered(x), plain(x))
    with torch.no_grad():  # temperature t on every head = the same module with q_proj scaled by t
        tempered.temperature.fill_(1.7)
        plain.q_proj.weight.mul_(1.7)
        plain.q_proj.bias.mul_(1.7)
    assert_close_to_oracle(tempered(x), plain(x), atol=1e-12, rtol=1e-12)


def test_backend_config_is_the_shared_dataclass():
    c = NystromAttentionConfig(hidden_size=16, num_heads=2, num_landmarks=8, conv_kernel_size=5)
    assert c.backend_config == NystromConfig(num_landmarks=8, conv_kernel_size=5)
    r = RACEAttentionConfig(hidden_size=16, num_heads=2, num_planes=2, seed=3)
    assert r.backend_config == RaceConfig(num_planes=2, seed=3)
    assert (r.num_kv_heads, r.head_dim) == (2, 8)


@pytest.mark.parametrize("cls, kwargs, error, match", [
    (ExactAttentionConfig, dict(hidden_size=24, num_heads=4, num_kv_heads=3), ValueError, "multiple of num_kv_heads"),
    (ExactAttentionConfig, dict(hidden_size=25, num_heads=4), ValueError, "not divisible by num_heads"),
    (ExactAttentionConfig, dict(hidden_size=0, num_heads=4), ValueError, "hidden_size=0"),
    (ExactAttentionConfig, dict(hidden_size=24, num_heads=4, head_dim=2.5), TypeError, "head_dim must be an int"),
    (ExactAttentionConfig, dict(hidden_size=24, num_heads=True), TypeError, "num_heads must be an int"),
    (ExactAttentionConfig, dict(hidden_size=24, num_heads=4, causal=1), TypeError, "causal must be a bool"),
    (ExactAttentionConfig, dict(hidden_size=24, num_heads=4, num_planes=2), TypeError, "num_planes"),
    (NystromAttentionConfig, dict(hidden_size=24, num_heads=4, causal=True), ValueError, "causal=True is not"),
    (NystromAttentionConfig, dict(hidden_size=24, num_heads=4, conv_kernel_size=4), ValueError, "must be odd"),
    (RACEAttentionConfig, dict(hidden_size=24, num_heads=4, num_planes=9), ValueError, "num_planes=9"),
    (RACEAttentionConfig, dict(hidden_size=24, num_heads=4, beta=-1.0), ValueError, "beta=-1.0"),
])
def test_config_validation_errors(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(**kwargs)


def test_constructor_and_forward_errors():
    cfg = ExactAttentionConfig(hidden_size=24, num_heads=4)
    with pytest.raises(TypeError, match="not both"):
        ExactAttention(cfg, causal=True)
    with pytest.raises(TypeError, match="must be a RACEAttentionConfig"):
        RACEAttention(cfg)
    m = ExactAttention(cfg)
    with pytest.raises(ValueError, match=r"\(B, N, hidden_size=24\)"):
        m(torch.randn(2, 5, 23))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(torch.randn(2, 5, 24), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
