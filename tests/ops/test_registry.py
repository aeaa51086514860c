"""The op registry (ops/_registry.py): CPU kernels are immune to an enclosing autocast region."""
import pytest
import torch

import hf_attention_backends as hfab
from tests.inputs import make_padding


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, 37, 16, generator=g).requires_grad_(True) for _ in range(3)]


def _kwargs(backend):
    if backend == "nystrom":
        return {"num_landmarks": 8, "newton_iter": 6, "conv_weight": torch.full((4, 3), 0.1, requires_grad=True)}
    if backend == "race":
        return {"planes": hfab.make_planes(2, 3, 16), "beta": torch.full((4,), 0.5, requires_grad=True),
                "causal": True}
    return {"causal": True}


@pytest.mark.parametrize("backend", ["exact", "nystrom", "race", "stieltjes"])
def test_cpu_kernels_ignore_an_enclosing_autocast_region(backend):
    """Inside torch.autocast("cpu", bfloat16) the fp32 op gives the same bits (its matmuls stay fp32)."""
    fn = getattr(hfab, f"{backend}_attention")
    q, k, v = _qkv()
    kwargs = _kwargs(backend)
    mask = make_padding(2, 37, seed=1)
    leaves = [q, k, v] + [t for t in kwargs.values() if isinstance(t, torch.Tensor) and t.requires_grad]

    def run():
        out = fn(q, k, v, key_padding_mask=mask, **kwargs)
        return [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = run()
    for got, want in zip(cast, plain):
        assert got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want)
