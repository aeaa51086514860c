"""GPU tests of the RACE CUDA kernels (csrc/race), against a float64 oracle and the PyTorch reference.

Tolerance (tests/tolerance.py): the kernel's error vs float64 must be at most 2x the error of the
PyTorch reference (ops/race/reference.py) run on the same fp16/bf16 inputs, which rounds its fp32
result to the input dtype as the kernel does. dbeta is fp32 in both: a sum of B*N*S fp32 terms in
another order, so it gets a floor relative to its size (FP32_SUM_FLOOR). Outputs are allocated into
NaN-poisoned memory so an element a kernel forgets to write fails the test.
"""
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_attention_backends as hfab
from hf_attention_backends.ops.race import reference
from tests.inputs import make_padding
from tests.ops.cuda_helpers import (DEV, assert_compiled_matches_eager, assert_kernels_registered,
                                    assert_not_drawn_like, assert_sanitizer_clean, assert_unchanged_by_autocast,
                                    cases_in_subprocess, make_inputs, poison, replay_in_cuda_graph, strided_mask,
                                    strided_views)
from tests.tolerance import assert_close_to_oracle

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]

NS = [1, 7, 63, 64, 65, 333, 4097]
GRAD_FLOOR = 1e-5      # fp32 residue of G.v - c where the exact gradient is 0 (e.g. one visible key)
FP32_SUM_FLOOR = 1e-4  # x (1 + max|oracle|): fp32 sums in another order (dbeta; float32 inputs)


def make_planes(num_tables, num_planes, d, seed=0, device=DEV):
    return hfab.make_planes(num_tables, num_planes, d, seed=seed).to(device)


def per_head_beta(hq, d, mult=1.0, device=DEV):
    """(Hq,) fp32, a different beta per head around D**-0.5."""
    return (torch.linspace(0.5, 1.5, hq, device=device) * d ** -0.5 * mult).float()


def oracle(q, k, v, planes, beta, *, causal, mask):
    """float64 RACE attention, dense Nq x Nk with explicit masks (softmax over itertools.product corners).

    beta () or (Hq,); differentiable in q, k, v and beta.
    """
    q, k, v, planes = q.double(), k.double(), v.double(), planes.double()
    hq, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    beta = beta.double().expand(hq).view(1, hq, 1, 1, 1)
    corners = torch.tensor(list(itertools.product((-1.0, 1.0), repeat=planes.shape[1])), dtype=torch.float64,
                           device=q.device)  # (R, P)

    def features(x):
        u = torch.tanh(torch.einsum("bhnd,lpd->bhnlp", x, planes))
        return torch.softmax(beta * torch.einsum("bhnlp,rp->bhnlr", u, corners), dim=-1).flatten(-2)

    a = features(q) @ features(k).transpose(-1, -2)  # (B, Hq, Nq, Nk)
    i = torch.arange(nq, device=q.device)[:, None]
    j = torch.arange(nk, device=q.device)[None, :]
    allowed = (j <= i + (nk - nq)) if causal else torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    allowed = allowed[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    a = a * allowed
    den = a.sum(dim=-1, keepdim=True)
    return torch.where(den > 0, (a @ v) / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))


def run_kernel(q, k, v, planes, beta, dout, *, causal, mask):
    """out from hfab::race_fwd and (dq, dk, dv, dbeta) from hfab::race_bwd, into poisoned memory."""
    poison(q)
    out = torch.ops.hfab.race_fwd(q, k, v, planes, beta, mask, causal)
    poison(q, k, v, beta)
    grads = torch.ops.hfab.race_bwd(dout, q, k, v, planes, beta, mask, causal)
    return out, grads


def reference_run(q, k, v, planes, beta, dout, *, causal, mask):
    """The PyTorch reference on the kernel's inputs (fp32 compute, result in the input dtype) and its grads."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, beta)]
    out = reference.race_forward(*leaves[:3], planes, leaves[3], mask, causal)
    return out.detach(), torch.autograd.grad(out, leaves, dout)


def check_against_oracle(q, k, v, planes, beta, *, causal, mask=None, seed=1, run=run_kernel, dout_scale=1.0):
    """The kernels' out, dq, dk, dv, dbeta against float64 with the reference's error as the yardstick.

    run: like run_kernel (the CUDA ops, the default). dout_scale: the upstream gradient is standard normal times this
    (in float32, before the cast: e.g. a mean-reduced loss's tiny gradients)."""
    g = torch.Generator(device=q.device).manual_seed(seed)
    dout = (torch.randn(q.shape, device=q.device, generator=g) * dout_scale).to(q.dtype)
    assert_not_drawn_like(dout, q)
    out, grads = run(q, k, v, planes, beta, dout, causal=causal, mask=mask)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()

    leaves = [t.double().requires_grad_(True) for t in (q, k, v, beta)]
    out64 = oracle(*leaves[:3], planes, leaves[3], causal=causal, mask=mask)
    out_ref, grads_ref = reference_run(q, k, v, planes, beta, dout, causal=causal, mask=mask)
    fp32 = q.dtype == torch.float32
    floor = FP32_SUM_FLOOR * (1.0 + float(out64.detach().abs().max())) if fp32 else 1e-6
    assert_close_to_oracle(out, out64.detach(), baseline=out_ref, floor=floor, name="out")

    grads64 = torch.autograd.grad(out64, leaves, dout.double())
    for name, got, want, base, like in zip(("dq", "dk", "dv", "dbeta"), grads, grads64, grads_ref, (q, k, v, beta)):
        assert got.shape == like.shape and got.dtype == like.dtype and got.is_contiguous(), name
        rel = FP32_SUM_FLOOR * (1.0 + float(want.abs().max()))
        assert_close_to_oracle(got, want, baseline=base, floor=rel if (name == "dbeta" or fp32) else GRAD_FLOOR,
                               name=name)
    return out, grads


def test_extension_registers_the_cuda_kernels():
    assert_kernels_registered("race")


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients_gqa(n, d, causal):
    b, hq, hkv = (1, 2, 1) if n > 1000 else (2, 4, 2)
    q, k, v = make_inputs(b, hq, hkv, n, n, d)
    check_against_oracle(q, k, v, make_planes(4, 4, d), per_head_beta(hq, d), causal=causal)


@pytest.mark.parametrize("num_planes, num_tables", [(1, 1), (2, 3), (3, 8), (4, 4), (5, 2), (6, 1), (6, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_planes_and_tables_grid(num_planes, num_tables, causal):
    q, k, v = make_inputs(2, 4, 2, 97, 97, 64)
    check_against_oracle(q, k, v, make_planes(num_tables, num_planes, 64, seed=num_planes), per_head_beta(4, 64),
                         causal=causal)


@pytest.mark.parametrize("d", [32, 128])
def test_largest_feature_map(d):
    q, k, v = make_inputs(1, 2, 1, 130, 130, d)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(8, 6, d), per_head_beta(2, d), causal=causal)


@pytest.mark.parametrize("hq, hkv", [(3, 3), (6, 1), (8, 2)])
@pytest.mark.parametrize("n", [65, 333])
def test_head_groupings(hq, hkv, n):
    q, k, v = make_inputs(2, hq, hkv, n, n, 64)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(hq, 64), causal=causal)


@pytest.mark.parametrize("nq, nk", [(1, 1), (1, 7), (1, 333), (65, 333), (63, 64), (7, 4097), (64, 65), (130, 200),
                                    (64, 192)])
@pytest.mark.parametrize("causal", [False, True])
def test_fewer_queries_than_keys(nq, nk, causal):
    q, k, v = make_inputs(2, 4, 2, nq, nk, 64)
    check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(4, 64), causal=causal)


@pytest.mark.parametrize("nq, nk", [(70, 33), (200, 65), (65, 1), (128, 64)])
def test_more_queries_than_keys_gives_empty_rows(nq, nk):
    q, k, v = make_inputs(1, 2, 1, nq, nk, 64)
    planes, beta = make_planes(4, 4, 64), per_head_beta(2, 64)
    check_against_oracle(q, k, v, planes, beta, causal=True)
    empty = nq - nk  # causal, bottom-right aligned: queries [0, nq - nk) see no key
    out, (dq, _, _, _) = run_kernel(q, k, v, planes, beta, torch.ones_like(q), causal=True, mask=None)
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.equal(dq[:, :, :empty], torch.zeros_like(dq[:, :, :empty]))
    assert bool((out[:, :, empty:] != 0).any(dim=-1).all()), "rows that see a key must not be 0"


@pytest.mark.parametrize("n", [7, 65, 333])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left", [False, True])
def test_key_padding(n, causal, left):
    q, k, v = make_inputs(3, 4, 2, n, n, 64)
    mask = make_padding(3, n, left=left, seed=n).to(DEV)
    mask[0] = False  # a sequence with no real key: every row empty
    out, (dq, dk, dv, _) = check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(4, 64), causal=causal,
                                                mask=mask)
    for t in (out[0], dq[0], dk[0], dv[0]):
        assert torch.equal(t, torch.zeros_like(t))
    padded = ~mask[:, None, :, None].expand_as(dk)  # padded keys get no gradient
    assert torch.equal(dk[padded], torch.zeros_like(dk[padded])) and torch.equal(dv[padded], torch.zeros_like(dv[padded]))


@pytest.mark.parametrize("mult", [0.05, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("d", [64, 128])
def test_input_scales_no_nan(mult, d):
    q, k, v = make_inputs(2, 4, 2, 333, 333, d, scale=mult)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(4, 4, d), per_head_beta(4, d), causal=causal)


@pytest.mark.parametrize("beta_mult", [0.05, 3.0, 10.0])
def test_beta_scales(beta_mult):
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64, scale=3.0)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(4, 64, beta_mult), causal=causal)


def test_scalar_beta_gets_a_scalar_gradient():
    q, k, v = make_inputs(2, 4, 2, 65, 65, 64)
    beta = torch.tensor(0.125, device=DEV)
    for causal in (False, True):
        _, grads = check_against_oracle(q, k, v, make_planes(4, 4, 64), beta, causal=causal)
        assert grads[3].shape == () and grads[3].dtype == torch.float32


@pytest.mark.parametrize("n", [65, 4097])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_bfloat16(n, d):
    b, hq, hkv = (1, 2, 1) if n > 1000 else (2, 4, 2)
    q, k, v = make_inputs(b, hq, hkv, n, n, d, dtype=torch.bfloat16)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(4, 4, d), per_head_beta(hq, d), causal=causal)


@pytest.mark.parametrize("n", [7, 333])
def test_float32(n):
    q, k, v = make_inputs(2, 4, 2, n, n, 64, dtype=torch.float32)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(4, 64), causal=causal)


@pytest.mark.parametrize("n", [1, 63, 65, 1100, 4097])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_backward_gqa_padding(n, dtype):
    """fp16/bf16 with S <= 64 (the tensor-core dq kernel's shapes; 1 to 5 groups of 16 key chunks here), GQA,
    left padding with one row fully padded, causal and not."""
    b, hq, hkv = (2, 2, 1) if n > 1000 else (2, 4, 2)
    q, k, v = make_inputs(b, hq, hkv, n, n, 64, dtype=dtype)
    mask = make_padding(b, n, left=True, seed=n).to(DEV)
    mask[1] = False
    for causal in (False, True):
        _, (dq, _, _, _) = check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(hq, 64), causal=causal,
                                                mask=mask)
        assert torch.equal(dq[1], torch.zeros_like(dq[1]))


def test_cuda_core_dq_selected_by_the_environment_meets_the_same_bounds():
    """HFAB_RACE_TC_BACKWARD=0 (read once per process, hence a subprocess) sends fp16/bf16 with S <= 64 to the
    CUDA-core dq kernel instead of the tensor-core one: the tensor-core dq's test, rerun on that path."""
    env = {**os.environ, "HFAB_RACE_TC_BACKWARD": "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "test_half_precision_backward_gqa_padding"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-1000:]


def prefetch_cases():
    """Outputs of the tensor-core forward, causal and not, over D = 32/64/128, fp16 and bf16, GQA, padding, Nq < Nk
    and Nq > Nk."""
    bf16, f16 = torch.bfloat16, torch.float16
    results = []
    for d, dtype, nq, nk in [(32, bf16, 1100, 1100), (64, f16, 1100, 2113), (64, bf16, 2113, 1100),
                             (128, bf16, 1100, 1100)]:
        q, k, v = make_inputs(2, 4, 2, nq, nk, d, dtype=dtype, seed=d)
        mask = make_padding(2, nk, left=True, seed=d).to(DEV)
        planes = make_planes(4, 4, d, seed=d)
        for causal in (False, True):
            results.append(torch.ops.hfab.race_fwd(q, k, v, planes, per_head_beta(4, d), mask, causal).cpu())
    return results


def test_block_wide_causal_prefetch_is_bitwise_the_load_when_needed(tmp_path):
    """HFAB_RACE_WARP_CAUSAL=0 selects the block-wide causal out kernel (GPUs with too little shared memory per block
    for the per-warp one run it), which by default loads the next chunk's rows (cp.async) while the current one
    computes; HFAB_RACE_PREFETCH=0 selects its variant that loads each chunk's rows when it needs them: the same
    outputs, bit for bit (both switches are read once per process, hence subprocesses). The per-warp kernel rounds
    otherwise: its outputs differ from the block-wide ones (so the switch did select the other kernel)."""
    block = {"HFAB_RACE_WARP_CAUSAL": "0"}
    prefetched = cases_in_subprocess("test_race_cuda", "prefetch_cases", block, tmp_path)
    loaded = cases_in_subprocess("test_race_cuda", "prefetch_cases", {**block, "HFAB_RACE_PREFETCH": "0"}, tmp_path)
    per_warp = prefetch_cases()
    for case, (a, b, c) in enumerate(zip(loaded, prefetched, per_warp)):
        assert torch.equal(a, b), f"case {case}: HFAB_RACE_PREFETCH=0 and the default differ"
        if case % 2 == 1:  # causal
            assert not torch.equal(b, c), f"case {case}: HFAB_RACE_WARP_CAUSAL=0 gave the per-warp kernel's output"


def test_block_wide_causal_out_kernel_meets_the_same_bounds():
    """HFAB_RACE_WARP_CAUSAL=0 (a subprocess: read once per process): the causal tests of the forward over head dims,
    lengths, GQA and padding, on the block-wide causal out kernel."""
    env = {**os.environ, "HFAB_RACE_WARP_CAUSAL": "0"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "(test_forward_and_gradients_gqa or test_key_padding or test_fewer_queries_than_keys) "
                           "and True"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-1000:]


@pytest.mark.parametrize("chunks", ["5", "32"])
def test_forward_group_sizes_set_by_the_environment_meet_the_same_bounds(chunks):
    """HFAB_RACE_GROUP_CHUNKS (a subprocess: read once per process) sets the forward's key chunks per group: the
    forward tests over head dims, lengths (up to 65 chunks: 13 groups of 5, 3 of 32), GQA and padding."""
    env = {**os.environ, "HFAB_RACE_GROUP_CHUNKS": chunks}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "test_forward_and_gradients_gqa or test_key_padding or test_fewer_queries_than_keys"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-1000:]


def test_group_chunks_out_of_range_raise_a_clear_error():
    env = {**os.environ, "HFAB_RACE_GROUP_CHUNKS": "0"}
    code = ("import torch, hf_attention_backends as hfab\n"
            "q = torch.randn(1, 1, 70, 64, device='cuda', dtype=torch.bfloat16)\n"
            "torch.ops.hfab.race_fwd(q, q, q, hfab.make_planes(4, 4, 64).cuda(), torch.tensor(0.1, device='cuda'),"
            " None, True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "HFAB_RACE_GROUP_CHUNKS=0" in proc.stderr, proc.stderr[-2000:]


def phi_tile_cases():
    """(dq, dk, dv, dbeta) of the tensor-core backward over P = 1..6, D = 32/64/128, fp16 and bf16, GQA, padding, causal
    and not."""
    bf16, f16 = torch.bfloat16, torch.float16
    results = []
    for num_planes, num_tables, d, dtype in [(1, 1, 64, bf16), (2, 3, 32, f16), (3, 8, 64, bf16), (4, 4, 128, f16),
                                             (5, 2, 32, bf16), (6, 1, 64, f16)]:
        q, k, v = make_inputs(2, 4, 2, 1100, 1100, d, dtype=dtype, seed=num_planes)
        dout = torch.randn(q.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(7)).to(q.dtype)
        mask = make_padding(2, 1100, left=True, seed=d).to(DEV)
        planes = make_planes(num_tables, num_planes, d, seed=num_planes)
        for causal in (False, True):
            results.append(torch.ops.hfab.race_bwd(dout, q, k, v, planes, per_head_beta(4, d), mask, causal))
    return [[g.cpu() for g in grads] for grads in results]


def test_phi_tile_is_bitwise_the_per_use_rebuild(tmp_path):
    """By default the dq and query-state kernels build each query tile's fp32 phi(q) once, and the dk/dv kernel each key
    chunk's phi(k), with the products of the per-use rebuild (HFAB_RACE_PHI_TILE=0, read once per process, hence a
    subprocess) in the same order: every gradient must be identical, bit for bit."""
    per_use_cases = cases_in_subprocess("test_race_cuda", "phi_tile_cases", {"HFAB_RACE_PHI_TILE": "0"}, tmp_path)
    for case, (per_use, tiled) in enumerate(zip(per_use_cases, phi_tile_cases())):
        for name, a, b in zip(("dq", "dk", "dv", "dbeta"), per_use, tiled):
            assert torch.equal(a, b), f"case {case}: {name} differs between HFAB_RACE_PHI_TILE=0 and the default"


@pytest.mark.parametrize("num_planes, num_tables, d", [(1, 1, 64), (2, 3, 32), (3, 8, 128), (5, 2, 32), (6, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_backward_feature_maps(num_planes, num_tables, d, dtype):
    """Every S <= 64 shape class of the tensor-core kernels (S = 2 .. 64, L * P = 1 .. 24), two key-chunk groups."""
    q, k, v = make_inputs(1, 2, 1, 1100, 1100, d, dtype=dtype, scale=2.0)
    planes = make_planes(num_tables, num_planes, d, seed=num_planes)
    for causal in (False, True):
        check_against_oracle(q, k, v, planes, per_head_beta(2, d), causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dout_scale", [2.0 ** -20, 2.0 ** 13], ids=["tiny", "large"])
def test_half_precision_backward_upstream_gradients_of_any_size(dtype, dout_scale):
    """dO x 2^13: ds' = dO . v - c^ past fp16's range unless each row is scaled by its power of two before its T
    halves; x 2^-20: subnormal fp16 dO (a mean-reduced loss)."""
    q, k, v = make_inputs(1, 2, 1, 1100, 1100, 64, dtype=dtype)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(2, 64), causal=causal,
                             dout_scale=dout_scale)


@pytest.mark.parametrize("nq, nk", [(1100, 4097), (333, 1100), (1100, 333), (200, 65)])
def test_half_precision_backward_unequal_lengths(nq, nk):
    """Nq != Nk: key chunks before the first query tile, and (Nq > Nk) query tiles that no group visits."""
    q, k, v = make_inputs(1, 2, 1, nq, nk, 64, dtype=torch.bfloat16)
    for causal in (False, True):
        check_against_oracle(q, k, v, make_planes(4, 4, 64), per_head_beta(2, 64), causal=causal)


def long_sequence_run(dtype, causal):
    """N = 65,536 (many key-chunk groups of the tensor-core forward), B=1, Hq=2, Hkv=1, D=64: the kernel's out
    and gradients, the reference in float64 (the dense oracle would need N x N) and the reference in fp32."""
    n = 65536
    q, k, v = make_inputs(1, 2, 1, n, n, 64, dtype=dtype)
    planes, beta = make_planes(4, 4, 64), per_head_beta(2, 64)
    dout = torch.randn(q.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)).to(dtype)
    out, grads = run_kernel(q, k, v, planes, beta, dout, causal=causal, mask=None)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, beta)]
    out64 = reference.race_forward(*leaves[:3], planes.double(), leaves[3], None, causal)
    grads64 = torch.autograd.grad(out64, leaves, dout.double())
    out_ref, grads_ref = reference_run(q, k, v, planes, beta, dout, causal=causal, mask=None)
    return (out, out64.detach(), out_ref), zip(("dq", "dk", "dv", "dbeta"), grads, grads64, grads_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_forward(dtype, causal):
    (out, out64, out_ref), _ = long_sequence_run(dtype, causal)
    assert_close_to_oracle(out, out64, baseline=out_ref, name="out")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_gradients(dtype, causal):
    _, grads = long_sequence_run(dtype, causal)
    for name, got, want, base in grads:
        floor = FP32_SUM_FLOOR * (1.0 + float(want.abs().max())) if name == "dbeta" else GRAD_FLOOR
        assert_close_to_oracle(got, want, baseline=base, floor=floor, name=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_in_groups_of_32_chunks(dtype, causal):
    """B=2, Hq=1024, Hkv=256, N=2,113: 34 key chunks in two groups of 32 (the forward takes 32-chunk groups where that
    still makes 4,096 blocks causal, 2,048 non-causal: tc::forward_group_chunks), the second one ragged; float64
    reference as the oracle (the dense one would need 2,048 x N x N)."""
    n, hq = 2113, 1024
    q, k, v = make_inputs(2, hq, 256, n, n, 64, dtype=dtype)
    planes, beta = make_planes(4, 4, 64), per_head_beta(hq, 64)
    out = torch.ops.hfab.race_fwd(q, k, v, planes, beta, None, causal)
    out64 = reference.race_forward(q.double(), k.double(), v.double(), planes.double(), beta.double(), None, causal)
    out_ref = reference.race_forward(q, k, v, planes, beta, None, causal)
    assert_close_to_oracle(out, out64, baseline=out_ref, name="out")


def test_unsupported_configurations_raise_clear_errors():
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64)
    beta = per_head_beta(2, 64)
    for num_tables, num_planes in ((1, 7), (9, 1)):
        with pytest.raises(RuntimeError, match="tables are not supported; supported: 1 <= P <= 6, 1 <= L <= 8"):
            torch.ops.hfab.race_fwd(q, k, v, make_planes(num_tables, num_planes, 64), beta, None, False)
    for d in (16, 48, 256):
        qd, kd, vd = make_inputs(1, 2, 2, 8, 8, d)
        with pytest.raises(RuntimeError, match=f"head dim D={d} is not supported; supported: 32, 64, 128"):
            torch.ops.hfab.race_fwd(qd, kd, vd, make_planes(4, 4, d), beta, None, False)
    with pytest.raises(RuntimeError, match="dtype Double is not supported; supported: float16, bfloat16, float32"):
        torch.ops.hfab.race_fwd(*make_inputs(1, 2, 2, 8, 8, 64, dtype=torch.float64), make_planes(4, 4, 64), beta,
                                None, False)
    with pytest.raises(RuntimeError, match="key_padding_mask must be a CUDA tensor"):
        torch.ops.hfab.race_fwd(q, k, v, make_planes(4, 4, 64), beta, torch.ones(1, 8, dtype=torch.bool), False)


def test_causality_earlier_rows_bitwise_unchanged():
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64)
    planes, beta = make_planes(4, 4, 64), per_head_beta(4, 64)
    out = torch.ops.hfab.race_fwd(q, k, v, planes, beta, None, True)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[:, :, 200:] = torch.randn_like(t[:, :, 200:])
    out2 = torch.ops.hfab.race_fwd(q2, k2, v2, planes, beta, None, True)
    assert torch.equal(out[:, :, :200], out2[:, :, :200])
    assert not torch.equal(out[:, :, 200:], out2[:, :, 200:])


def test_deterministic():
    q, k, v = make_inputs(2, 8, 2, 333, 333, 64)
    planes, beta = make_planes(4, 4, 64), per_head_beta(8, 64)
    mask = make_padding(2, 333, seed=2).to(DEV)
    dout = torch.randn_like(q)
    for causal in (False, True):
        first = run_kernel(q, k, v, planes, beta, dout, causal=causal, mask=mask)
        second = run_kernel(q, k, v, planes, beta, dout, causal=causal, mask=mask)
        assert torch.equal(first[0], second[0])
        for a, b in zip(first[1], second[1]):
            assert torch.equal(a, b)


def test_autocast_region_changes_nothing():
    q, k, v = make_inputs(2, 8, 2, 333, 333, 64, dtype=torch.bfloat16)
    planes, beta = make_planes(4, 4, 64), per_head_beta(8, 64)
    mask = make_padding(2, 333, seed=2).to(DEV)
    dout = torch.randn_like(q)
    for causal in (False, True):
        assert_unchanged_by_autocast(lambda: run_kernel(q, k, v, planes, beta, dout, causal=causal, mask=mask))


@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_inputs_equal_contiguous(causal):
    q, k, v = make_inputs(2, 4, 2, 65, 65, 64)
    planes, beta = make_planes(4, 4, 64), per_head_beta(4, 64)
    mask = make_padding(2, 65, seed=3).to(DEV)
    dout = torch.randn_like(q)
    out, grads = run_kernel(q, k, v, planes, beta, dout, causal=causal, mask=mask)
    for qv, kv, vv in strided_views(q, k, v):
        assert not qv.is_contiguous()
        mask_v = strided_mask(mask)
        dout_v = dout.transpose(1, 2).contiguous().transpose(1, 2)
        out_v, grads_v = run_kernel(qv, kv, vv, planes, beta, dout_v, causal=causal, mask=mask_v)
        assert torch.equal(out_v, out)
        for got, want in zip(grads_v, grads):
            assert torch.equal(got, want)


def test_public_function_autograd():
    q, k, v = (t.requires_grad_(True) for t in make_inputs(2, 4, 2, 65, 65, 64))
    planes = make_planes(4, 4, 64)
    beta = per_head_beta(4, 64).requires_grad_(True)
    mask = make_padding(2, 65, seed=5).to(DEV)
    out = hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=True, key_padding_mask=mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, (dq, dk, dv, dbeta) = run_kernel(q.detach(), k.detach(), v.detach(), planes, beta.detach(), dout, causal=True,
                                        mask=mask)
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)
    assert torch.equal(beta.grad, dbeta) and planes.grad is None


def test_launches_on_the_current_stream_and_in_cuda_graphs():
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64)
    planes, beta = make_planes(4, 4, 64), per_head_beta(4, 64)
    expected = torch.ops.hfab.race_fwd(q, k, v, planes, beta, None, True)
    captured = replay_in_cuda_graph(lambda: torch.ops.hfab.race_fwd(q, k, v, planes, beta, None, True))
    assert torch.equal(captured, expected)


def test_opcheck():
    q, k, v = (t.requires_grad_(True) for t in make_inputs(2, 4, 2, 65, 65, 64))
    planes = make_planes(4, 4, 64)
    beta = per_head_beta(4, 64).requires_grad_(True)
    mask = make_padding(2, 65, seed=7).to(DEV)
    torch.library.opcheck(torch.ops.hfab.race_fwd.default, (q, k, v, planes, beta, mask, True))
    torch.library.opcheck(torch.ops.hfab.race_fwd.default, (q, k, v, planes, beta, None, False))
    q, k, v, beta = q.detach(), k.detach(), v.detach(), beta.detach()
    torch.library.opcheck(torch.ops.hfab.race_bwd.default, (torch.randn_like(q), q, k, v, planes, beta, mask, True))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph(backend):
    q, k, v = (t.requires_grad_(True) for t in make_inputs(1, 4, 2, 65, 65, 64))
    planes = make_planes(4, 4, 64)
    beta = per_head_beta(4, 64).requires_grad_(True)

    def fn(q, k, v, beta):
        return hfab.race_attention(q, k, v, planes=planes, beta=beta, causal=True) * 2.0

    assert_compiled_matches_eager(fn, q, k, v, beta, backend=backend)


SANITIZED_RUN = """
import torch, hf_attention_backends as hfab
g = torch.Generator(device="cuda").manual_seed(0)
# (dtype, D, L, P): the small half-precision case, then the benchmarks' bf16 D 64 P = L = 4 layout
for dtype, d, n_tables, n_planes in ((torch.half, 32, 3, 2), (torch.bfloat16, 64, 4, 4)):
    q = torch.randn(2, 2, 70, d, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(2, 1, 200, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    planes, beta = hfab.make_planes(n_tables, n_planes, d).cuda(), torch.full((2,), 0.3, device="cuda")
    mask = torch.arange(200, device="cuda")[None, :] < torch.tensor([[200], [37]], device="cuda")
    for causal in (False, True):
        out = torch.ops.hfab.race_fwd(q, k, v, planes, beta, mask, causal)
        grads = torch.ops.hfab.race_bwd(torch.randn_like(out), q, k, v, planes, beta, mask, causal)
torch.cuda.synchronize()
"""


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool):
    assert_sanitizer_clean(tool, SANITIZED_RUN)
