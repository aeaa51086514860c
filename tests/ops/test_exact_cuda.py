"""GPU tests of the CUDA-core exact attention kernels (csrc/exact), against a float64 oracle.

Tolerance (tests/tolerance.py): the kernel's error vs float64 must be at most 2x the error of the
PyTorch reference run on the same fp16/bf16 inputs. Outputs are allocated into NaN-poisoned memory
so an element a kernel forgets to write fails the test.
"""
import math

import pytest
import torch

import hf_attention_backends as hfab
from benchmarks.bench_exact import fp32_fma_tflops, packed_half_fma_tflops
from hf_attention_backends.ops.exact import reference
from tests.inputs import make_padding
from tests.ops.cuda_helpers import (DEV, assert_compiled_matches_eager, assert_kernels_registered,
                                    assert_not_drawn_like, assert_sanitizer_clean, assert_unchanged_by_autocast,
                                    make_inputs, poison, replay_in_cuda_graph, strided_mask, strided_views)
from tests.tolerance import assert_close_to_oracle

pytestmark = pytest.mark.cuda

NS = [1, 7, 63, 64, 65, 333, 2049]
GRAD_FLOOR = 1e-5  # fp32 residue of dP - delta where the exact gradient is 0 (e.g. one visible key)


def oracle(q, k, v, *, causal, scale, mask):
    """float64 softmax attention with explicit masks; returns (out, lse). Differentiable."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    nq, nk = q.shape[2], k.shape[2]
    s = scale * q @ k.transpose(-1, -2)
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    allowed = (j <= i + (nk - nq)) if causal else torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(s - m)
    z = w.sum(dim=-1, keepdim=True)
    out = (w @ v) / torch.where(z > 0, z, torch.ones_like(z))
    lse = torch.where(z > 0, torch.log(z) + m, torch.full_like(z, float("-inf"))).squeeze(-1)
    return out, lse


def lse_like(q):
    return torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)


def run_kernel(q, k, v, dout, *, causal, scale, mask):
    """out, lse from hfab::exact_fwd and dq, dk, dv from hfab::exact_bwd, into poisoned memory."""
    poison(q, lse_like(q))
    out, lse = torch.ops.hfab.exact_fwd(q, k, v, mask, causal, scale)
    poison(q, k, v, lse_like(q))
    dq, dk, dv = torch.ops.hfab.exact_bwd(dout, q, k, v, out, lse, mask, causal, scale)
    return out, lse, (dq, dk, dv)


def check_against_oracle(q, k, v, *, causal, mask=None, scale=None, grads=True, seed=1, run=run_kernel):
    """The kernels' out, lse (and dq, dk, dv) against float64 with the reference's error as the yardstick.

    run: (q, k, v, dout, causal=, scale=, mask=) -> (out, lse, (dq, dk, dv)); the CUDA ops by default."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = torch.Generator(device=q.device).manual_seed(seed)
    dout = torch.randn(q.shape, device=q.device, generator=g).to(q.dtype)
    assert_not_drawn_like(dout, q)
    out, lse, kernel_grads = run(q, k, v, dout, causal=causal, scale=scale, mask=mask)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32

    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    out64, lse64 = oracle(*leaves, causal=causal, scale=scale, mask=mask)
    out_ref, lse_ref = reference.exact_forward(q, k, v, mask, causal, scale)
    assert_close_to_oracle(out, out64.detach(), baseline=out_ref, name="out")

    empty = torch.isinf(lse64.detach())
    assert torch.equal(torch.isinf(lse), empty) and bool((lse[empty] < 0).all()), "lse: -inf rows differ"
    finite64 = lse64.detach()[~empty]
    if finite64.numel():  # fp32 rounding of |lse| (up to ~100 for inputs x10) bounds both errors from below
        assert_close_to_oracle(lse[~empty], finite64, baseline=lse_ref[~empty],
                               floor=4e-6 * (1.0 + float(finite64.abs().max())), name="lse")
    if not grads:
        return
    grads64 = torch.autograd.grad(out64, leaves, dout.double())
    grads_ref = reference.exact_backward(dout, q, k, v, out_ref, lse_ref, mask, causal, scale)
    for name, got, want, base in zip(("dq", "dk", "dv"), kernel_grads, grads64, grads_ref):
        assert got.dtype == q.dtype and got.is_contiguous()
        assert_close_to_oracle(got, want, baseline=base, floor=GRAD_FLOOR, name=name)


def test_extension_registers_the_cuda_kernels():
    assert_kernels_registered("exact")


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients_gqa(n, d, causal):
    q, k, v = make_inputs(2, 4, 2, n, n, d)
    check_against_oracle(q, k, v, causal=causal)


@pytest.mark.parametrize("hq, hkv", [(3, 3), (6, 1), (8, 2)])
@pytest.mark.parametrize("n", [65, 333])
def test_head_groupings(hq, hkv, n):
    q, k, v = make_inputs(2, hq, hkv, n, n, 64)
    check_against_oracle(q, k, v, causal=True)
    check_against_oracle(q, k, v, causal=False)


@pytest.mark.parametrize("nk", [1, 7, 64, 333, 2049])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_one_query(nk, d, causal):
    q, k, v = make_inputs(3, 6, 2, 1, nk, d)
    check_against_oracle(q, k, v, causal=causal)


@pytest.mark.parametrize("nq, nk", [(65, 333), (63, 64), (7, 2049), (64, 65)])
def test_chunked_prefill_bottom_right_causal(nq, nk):
    q, k, v = make_inputs(2, 4, 2, nq, nk, 64)
    check_against_oracle(q, k, v, causal=True)


def test_more_queries_than_keys_gives_empty_rows():
    q, k, v = make_inputs(1, 2, 1, 70, 33, 64)  # causal: queries 0..36 see no key
    check_against_oracle(q, k, v, causal=True)
    out, lse, (dq, _, _) = run_kernel(q, k, v, torch.ones_like(q), causal=True, scale=0.125, mask=None)
    assert torch.equal(out[:, :, :37], torch.zeros_like(out[:, :, :37]))
    assert bool(torch.isneginf(lse[:, :, :37]).all()) and bool(torch.isfinite(lse[:, :, 37:]).all())
    assert torch.equal(dq[:, :, :37], torch.zeros_like(dq[:, :, :37]))


@pytest.mark.parametrize("n", [7, 65, 333])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left", [False, True])
def test_key_padding(n, causal, left):
    q, k, v = make_inputs(3, 4, 2, n, n, 64)
    mask = make_padding(3, n, left=left, seed=n).to(DEV)
    mask[0] = False  # a sequence with no real key: every row empty
    check_against_oracle(q, k, v, causal=causal, mask=mask)


@pytest.mark.parametrize("mult", [0.05, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("d", [64, 128])
def test_input_scales_no_nan(mult, d):
    q, k, v = make_inputs(2, 4, 2, 333, 333, d, scale=mult)
    check_against_oracle(q, k, v, causal=True)
    check_against_oracle(q, k, v, causal=False)


@pytest.mark.parametrize("n", [65, 2049])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_bfloat16(n, d):
    if torch.cuda.get_device_capability()[0] < 8:
        with pytest.raises(RuntimeError, match="bfloat16 needs an sm_80"):
            torch.ops.hfab.exact_fwd(*make_inputs(1, 2, 2, n, n, d, dtype=torch.bfloat16), None, True, 0.1)
        return
    q, k, v = make_inputs(2, 4, 2, n, n, d, dtype=torch.bfloat16)
    check_against_oracle(q, k, v, causal=True)


def test_float32_and_head_dims_raise_clear_errors():
    with pytest.raises(RuntimeError, match="dtype Float is not supported; supported: float16"):
        torch.ops.hfab.exact_fwd(*make_inputs(1, 2, 2, 8, 8, 64, dtype=torch.float32), None, False, 0.1)
    for d in (16, 48, 256):
        with pytest.raises(RuntimeError, match=f"head dim D={d} is not supported; supported: 32, 64, 128"):
            torch.ops.hfab.exact_fwd(*make_inputs(1, 2, 2, 8, 8, d), None, False, 0.1)


def test_inputs_on_other_devices_raise():
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64)
    with pytest.raises(RuntimeError, match="key_padding_mask must be a CUDA tensor"):
        torch.ops.hfab.exact_fwd(q, k, v, torch.ones(1, 8, dtype=torch.bool), False, 0.1)
    with pytest.raises(RuntimeError, match="v must be a CUDA tensor"):
        torch.ops.hfab.exact_fwd(q, k, v.cpu(), None, False, 0.1)


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs_equal_contiguous(causal):
    q, k, v = make_inputs(2, 4, 2, 65, 65, 64)
    mask = make_padding(2, 65, seed=3).to(DEV)
    dout = torch.randn_like(q)
    out, lse, grads = run_kernel(q, k, v, dout, causal=causal, scale=0.125, mask=mask)
    for qv, kv, vv in strided_views(q, k, v):
        assert not qv.is_contiguous()
        mask_v = strided_mask(mask)
        dout_v = dout.transpose(1, 2).contiguous().transpose(1, 2)
        out_v, lse_v, grads_v = run_kernel(qv, kv, vv, dout_v, causal=causal, scale=0.125, mask=mask_v)
        assert torch.equal(out_v, out) and torch.equal(lse_v, lse)
        for got, want in zip(grads_v, grads):
            assert torch.equal(got, want)


def test_deterministic():
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64)
    dout = torch.randn_like(q)
    first = run_kernel(q, k, v, dout, causal=True, scale=0.125, mask=None)
    second = run_kernel(q, k, v, dout, causal=True, scale=0.125, mask=None)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)


def test_autocast_region_changes_nothing():
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64, dtype=torch.bfloat16)
    mask = make_padding(2, 333, seed=2).to(DEV)
    dout = torch.randn_like(q)
    for causal in (False, True):
        assert_unchanged_by_autocast(lambda: run_kernel(q, k, v, dout, causal=causal, scale=0.125, mask=mask))


def test_public_function_autograd():
    q, k, v = (t.requires_grad_(True) for t in make_inputs(2, 4, 2, 65, 65, 64))
    mask = make_padding(2, 65, seed=5).to(DEV)
    out = hfab.exact_attention(q, k, v, causal=True, key_padding_mask=mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, _, (dq, dk, dv) = run_kernel(q.detach(), k.detach(), v.detach(), dout, causal=True, scale=0.125, mask=mask)
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)


def test_launches_on_the_current_stream_and_in_cuda_graphs():
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64)
    expected = torch.ops.hfab.exact_fwd(q, k, v, None, True, 0.125)[0]
    captured = replay_in_cuda_graph(lambda: torch.ops.hfab.exact_fwd(q, k, v, None, True, 0.125)[0])
    assert torch.equal(captured, expected)


def test_opcheck():
    q, k, v = make_inputs(2, 4, 2, 65, 65, 64)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    mask = make_padding(2, 65, seed=7).to(DEV)
    torch.library.opcheck(torch.ops.hfab.exact_fwd.default, (q, k, v, mask, True, 0.125))
    torch.library.opcheck(torch.ops.hfab.exact_fwd.default, (q, k, v, None, False, 0.125))
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = torch.ops.hfab.exact_fwd(q, k, v, mask, True, 0.125)
    torch.library.opcheck(torch.ops.hfab.exact_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, mask, True, 0.125))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph(backend):
    q, k, v = (t.requires_grad_(True) for t in make_inputs(1, 4, 2, 65, 65, 64))

    def fn(q, k, v):
        return hfab.exact_attention(q, k, v, causal=True) * 2.0

    assert_compiled_matches_eager(fn, q, k, v, backend=backend)


def test_scale_argument_is_used():
    q, k, v = make_inputs(1, 2, 2, 65, 65, 64)
    for scale in (0.01, 0.125, 1.0 / math.sqrt(7.0), 2.0):
        check_against_oracle(q, k, v, causal=True, scale=scale, grads=False)


@pytest.mark.parametrize("probe, flops_per_lane_clock", [(packed_half_fma_tflops, 4), (fp32_fma_tflops, 2)])
def test_fma_probes_report_a_rate(probe, flops_per_lane_clock):
    rate = probe(blocks_per_sm=2, iters=64)
    peak = torch.cuda.get_device_properties(0).multi_processor_count * 2.5e9 * 128 * flops_per_lane_clock / 1e12
    assert 0.1 < rate < peak, f"{probe.__name__}: {rate:.2f} TFLOP/s outside (0.1, {peak:.0f})"


SANITIZED_RUN = """
import torch, hf_attention_backends
g = torch.Generator(device="cuda").manual_seed(0)
mask = torch.arange(70, device="cuda")[None, :] < torch.tensor([[70], [9]], device="cuda")
for d in (32, 64, 128):
    q = torch.randn(2, 4, 70, d, device="cuda", generator=g).half()
    k, v = (torch.randn(2, 2, 70, d, device="cuda", generator=g).half() for _ in range(2))
    for causal in (False, True):
        out, lse = torch.ops.hfab.exact_fwd(q, k, v, mask, causal, d ** -0.5)
        grads = torch.ops.hfab.exact_bwd(torch.randn_like(out), q, k, v, out, lse, mask, causal, d ** -0.5)
torch.cuda.synchronize()
"""


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool):
    assert_sanitizer_clean(tool, SANITIZED_RUN)
