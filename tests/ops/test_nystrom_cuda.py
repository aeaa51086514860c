"""GPU tests of the Nyström CUDA implementation (csrc/nystrom), against the reference run in float64.

The float64 reference (ops/nystrom/reference.py) is exact math for this op; tests/ops/test_nystrom.py checks it
against an independent float64 oracle on CPU. Tolerance (tests/tolerance.py): the kernel's error vs float64 must
be at most FACTOR x the error of the same reference run on the kernel's fp16/bf16 inputs (fp32 compute, result
rounded to the input dtype, as the kernel does). FACTOR is 3, not 2: Newton–Schulz amplifies fp32 rounding by
the condition number of K2, and two fp32 computations in different orders get different (equally large) errors.
Outputs are allocated into NaN-poisoned memory so an element a kernel forgets to write fails the test.
"""

import pytest
import torch

import hf_attention_backends as hfab
from hf_attention_backends.ops.nystrom import reference
from tests.inputs import make_padding
from tests.ops.cuda_helpers import (assert_compiled_matches_eager, assert_kernels_registered, assert_not_drawn_like,
                                    assert_sanitizer_clean, assert_unchanged_by_autocast, cases_in_subprocess,
                                    make_inputs, poison, replay_in_cuda_graph, strided_mask, strided_views)
from tests.tolerance import assert_close_to_oracle

pytestmark = pytest.mark.cuda

DEV = "cuda"
FACTOR = 3.0
STATE_TENSORS = 2  # what the forward saves for the backward: fp32 and int32 (nystrom_host.cuh, StateLayout)
FLOOR = 1e-5  # fp32 residue where the exact value is 0 (e.g. dk of a single real key)


def make_conv(hq, ks, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(hq, ks, device=DEV, generator=g) * 0.3).to(dtype)


def run_kernel(q, k, v, dout, *, m, iters, kappa, conv, mask, scale, recompute=False):
    """out from hfab::nystrom_fwd and (dq, dk, dv, dconv) from hfab::nystrom_bwd given the forward's state (as
    autograd runs them; `recompute`: none, the backward recomputes it), into poisoned memory."""
    poison(q)
    out, state = torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, m, iters, kappa, scale)
    poison(q, k, v)
    grads = torch.ops.hfab.nystrom_bwd(dout, q, k, v, conv, mask, m, iters, kappa, scale, [] if recompute else state)
    return out, grads


def reference_run(q, k, v, conv, dout, **hyper):
    """The reference on these inputs (their dtype) with autograd: out and the gradients of q, k, v (, conv)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    w = None if conv is None else conv.detach().clone().requires_grad_(True)
    out = reference.nystrom_forward(*leaves, w, hyper["mask"], hyper["m"], hyper["iters"], hyper["kappa"],
                                    hyper["scale"])
    grads = torch.autograd.grad(out, leaves + ([w] if w is not None else []), dout)
    return out.detach(), grads


def check(q, k, v, *, m, iters=6, kappa=0.0, conv=None, mask=None, scale=None, seed=1, recompute=False):
    """Kernel vs the float64 reference, with the reference in the kernel's dtype as the baseline."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    hyper = dict(m=m, iters=iters, kappa=kappa, mask=mask, scale=scale)
    g = torch.Generator(device=DEV).manual_seed(seed)
    dout = torch.randn(q.shape, device=DEV, generator=g).to(q.dtype)
    assert_not_drawn_like(dout, q)
    out, grads = run_kernel(q, k, v, dout, conv=conv, recompute=recompute, **hyper)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    conv64 = None if conv is None else conv.double()
    out64, grads64 = reference_run(q.double(), k.double(), v.double(), conv64, dout.double(), **hyper)
    out_ref, grads_ref = reference_run(q, k, v, conv, dout, **hyper)
    assert_close_to_oracle(out, out64, baseline=out_ref, factor=FACTOR, floor=FLOOR, name="out")
    names, likes = ("dq", "dk", "dv", "dconv"), (q, k, v, conv)
    for name, got, want, base, like in zip(names, grads, grads64, grads_ref, likes):
        assert got.shape == like.shape and got.dtype == like.dtype and got.is_contiguous(), name
        assert_close_to_oracle(got, want, baseline=base, factor=FACTOR, floor=FLOOR, name=name)
    if conv is None:
        assert grads[3].numel() == 0, "dconv must be empty without conv_weight"
    return out, grads


def test_extension_registers_the_cuda_kernels():
    assert_kernels_registered("nystrom")


# (N, m, D): N = 1, N < m, N = m, N = m + 1, ragged tails, m not a multiple of the backward's 16-row tiles,
# long sequences (many query / key splits in the backward) with the most landmarks, segments of 4,096 rows and more
# (the landmark means in blocks of 1,024 threads; the last segment longer)
@pytest.mark.parametrize("n, m, d", [(1, 16, 32), (7, 1, 64), (7, 16, 128), (63, 64, 64), (64, 64, 32),
                                     (65, 64, 128), (65, 16, 64), (333, 32, 64), (333, 1, 32), (300, 100, 128),
                                     (4097, 128, 64), (4097, 32, 128), (8200, 2, 64), (12_302, 3, 32)])
def test_lengths_and_landmarks_gqa(n, m, d):
    b, hq, hkv = (1, 2, 1) if n > 1000 else (2, 4, 2)
    check(*make_inputs(b, hq, hkv, n, n, d), m=m)


@pytest.mark.parametrize("m", [1, 16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_landmark_counts(m, dtype):
    check(*make_inputs(1, 4, 4, 333, 333, 64, dtype=dtype, seed=100 + m), m=m)  # not seed 1: check's dO


@pytest.mark.parametrize("kappa", [0.0, 2.0])
@pytest.mark.parametrize("ks", [None, 1, 3, 7])
def test_kappa_star_and_conv(kappa, ks):
    q, k, v = make_inputs(2, 4, 2, 200, 200, 64)
    conv = None if ks is None else make_conv(4, ks, q.dtype)
    check(q, k, v, m=16, kappa=kappa, conv=conv)


@pytest.mark.parametrize("iters", [0, 1, 20])
def test_newton_iterations(iters):
    check(*make_inputs(2, 2, 1, 100, 100, 32), m=8, iters=iters, kappa=0.0 if iters != 1 else 3.0)


# the m x m kernel's tilings: m <= 32, <= 64, <= 128 (A and Z in global scratch), m not a multiple of 16
@pytest.mark.parametrize("m, iters, kappa", [(33, 6, 0.0), (65, 0, 0.0), (100, 6, 2.0), (127, 3, 0.0)])
def test_inverse_kernel_tilings(m, iters, kappa):
    check(*make_inputs(1, 2, 1, 300, 300, 32, seed=m), m=m, iters=iters, kappa=kappa)


def mixed_mask(b, n, m, seed=0):
    """(B, N) bool: row 0 no real token, row 1 m real (exact path), row 2 scattered m + 1 real, rows >= 3 left
    padding with more than m real; every other shape mixes exact and landmark sequences in one batch."""
    mask = make_padding(b, n, left=True, min_real=min(m + 1, n), seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask[0] = False
    mask[1] = torch.arange(n) >= n - m
    mask[2] = False
    mask[2, torch.randperm(n, generator=g)[:m + 1]] = True
    return mask.to(DEV)


@pytest.mark.parametrize("n, m", [(65, 16), (333, 32), (200, 64)])
@pytest.mark.parametrize("conv_ks", [None, 3])
def test_key_padding_mixed_batch(n, m, conv_ks):
    q, k, v = make_inputs(5, 4, 2, n, n, 64, seed=n)
    mask = mixed_mask(5, n, m, seed=n)
    conv = None if conv_ks is None else make_conv(4, conv_ks, q.dtype)
    out, (dq, dk, dv, _) = check(q, k, v, m=m, conv=conv, mask=mask)
    for t in (out[0], dq[0], dk[0], dv[0]):  # no real token: output and gradients 0
        assert torch.equal(t, torch.zeros_like(t))
    padded = ~mask[:, None, :, None].expand_as(dk)  # padded keys get no gradient
    assert torch.equal(dk[padded], torch.zeros_like(dk[padded]))
    assert torch.equal(dv[padded], torch.zeros_like(dv[padded]))


def test_right_padding_kappa_bf16():
    q, k, v = make_inputs(3, 2, 2, 130, 130, 128, dtype=torch.bfloat16)
    mask = make_padding(3, 130, min_real=40, seed=4).to(DEV)
    check(q, k, v, m=32, kappa=1.5, conv=make_conv(2, 5, q.dtype), mask=mask)


@pytest.mark.parametrize("mult", [0.05, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_input_scales_no_nan(mult, dtype):
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64, dtype=dtype, scale=mult)
    mask = make_padding(2, 333, min_real=100, seed=5).to(DEV)
    check(q, k, v, m=32, mask=mask, conv=make_conv(4, 3, dtype))


def test_blocks_take_several_query_tiles():
    """The tensor-core output and row-statistics kernels run about 4 blocks per SM over all heads, each taking every
    gridDim.x-th query tile of its head: with 64 heads and 17 tiles per head, blocks take one or two tiles, and the
    buffer (64 slots) takes two 32-slot chunks of the online softmax."""
    q, k, v = make_inputs(4, 16, 4, 2049, 2049, 64, seed=3)
    mask = make_padding(4, 2049, min_real=1500, seed=3).to(DEV)
    check(q, k, v, m=64, mask=mask, conv=make_conv(16, 3, q.dtype))


@pytest.mark.parametrize("d, m, groups, dtype", [
    (64, 32, 1, torch.float16),     # the group's landmarks staged once per block, two key-tile stages
    (64, 20, 2, torch.bfloat16),    # the same for two q heads of 20 landmarks (rows padded to 32 each)
    (128, 64, 1, torch.float16),    # staged once, one key-tile stage (D 128)
    (64, 64, 2, torch.float16),     # 128 landmark rows: restaged per key tile
    (128, 100, 1, torch.bfloat16),  # restaged, in passes of 32 landmarks, the last one partial
])
def test_dk_dv_blocks_take_several_key_tiles(d, m, groups, dtype):
    """The dk/dv kernel splits each kv head's keys over at most about two waves of blocks: with more kv heads
    (B Hkv = 288) than two blocks per SM on 132 SMs, every block takes several 64-key tiles in turn (N 1,000: 16
    tiles, the last one partial), loading the next one while it computes this one, with padded keys."""
    hkv = 96
    q, k, v = make_inputs(3, hkv * groups, hkv, 1000, 1000, d, dtype=dtype, seed=d + m)
    mask = make_padding(3, 1000, min_real=700, seed=m).to(DEV)
    check(q, k, v, m=m, mask=mask)


def kernel_path_cases():
    """Forward and backward of the Nyström ops over the buffer sizes and head dims the tensor-core kernels stage
    (slots up to 128, D 32 / 64 / 128), with padding, conv and GQA: per case its inputs, m, out and the gradients."""
    cases = []
    for n, m, d, dtype in [(333, 128, 128, torch.float16), (1000, 64, 128, torch.bfloat16), (700, 100, 64, torch.float16),
                           (129, 7, 32, torch.bfloat16), (50, 64, 64, torch.float16)]:
        q, k, v = make_inputs(2, 4, 2, n, n, d, dtype=dtype, seed=n)
        mask = make_padding(2, n, min_real=min(n, 40), seed=d).to(DEV)
        conv = make_conv(4, 3, dtype)
        dout = torch.randn(q.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(n)).to(dtype)
        out, state = torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, m, 6, 0.0, d ** -0.5)
        grads = torch.ops.hfab.nystrom_bwd(dout, q, k, v, conv, mask, m, 6, 0.0, d ** -0.5, state)
        cases.append(([t.cpu() for t in (q, k, v, conv, mask, dout)], m, [t.cpu() for t in (out, *grads)]))
    return cases


def test_cuda_core_and_tensor_core_kernels_both_match_the_oracle(tmp_path):
    """By default the forward's K3 and output kernels and the backward's row statistics and buffer gradients run on
    tensor cores where the GPU has their shared memory; HFAB_NYSTROM_TC=0 (read once per process, hence a
    subprocess) selects the CUDA-core kernels, which GPUs with less shared memory run. Both within the tolerance rule
    of the float64 reference, output and every gradient."""
    on_cuda_cores = cases_in_subprocess("test_nystrom_cuda", "kernel_path_cases", {"HFAB_NYSTROM_TC": "0"}, tmp_path)
    for case, ((inputs, m, cuda_cores), (_, _, tensor_cores)) in enumerate(zip(on_cuda_cores, kernel_path_cases())):
        q, k, v, conv, mask, dout = (t.to(DEV) for t in inputs)
        hyper = dict(m=m, iters=6, kappa=0.0, mask=mask, scale=q.shape[-1] ** -0.5)
        out64, grads64 = reference_run(q.double(), k.double(), v.double(), conv.double(), dout.double(), **hyper)
        out_ref, grads_ref = reference_run(q, k, v, conv, dout, **hyper)
        for path, results in (("tensor cores", tensor_cores), ("CUDA cores", cuda_cores)):
            for name, got, want, base in zip(("out", "dq", "dk", "dv", "dconv"), results, (out64, *grads64),
                                             (out_ref, *grads_ref)):
                assert_close_to_oracle(got.to(DEV), want, baseline=base, factor=FACTOR, floor=FLOOR,
                                       name=f"case {case} {path} {name}")


def test_side_stream_off_gives_the_same_bits(tmp_path):
    """HFAB_NYSTROM_SIDE_STREAM=0 (read once per process, hence a subprocess) runs the m x m stages on the caller's
    stream in turn instead of beside the N-sized kernels: the same kernels on the same data, so the same bits."""
    in_turn = cases_in_subprocess("test_nystrom_cuda", "kernel_path_cases", {"HFAB_NYSTROM_SIDE_STREAM": "0"},
                                  tmp_path)
    for case, ((_, _, serial), (_, _, overlapped)) in enumerate(zip(in_turn, kernel_path_cases())):
        for name, a, b in zip(("out", "dq", "dk", "dv", "dconv"), serial, overlapped):
            assert torch.equal(a, b), f"case {case} {name}"


def test_deterministic_forward():
    q, k, v = make_inputs(2, 8, 2, 4097, 4097, 64)
    mask = make_padding(2, 4097, min_real=1000, seed=2).to(DEV)
    conv = make_conv(8, 3, q.dtype)
    first = torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, 32, 6, 0.0, 0.125)
    second = torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, 32, 6, 0.0, 0.125)
    assert torch.equal(first[0], second[0])
    assert len(first[1]) == len(second[1]) == STATE_TENSORS
    for a, b in zip(first[1], second[1]):  # the state the backward reads
        assert torch.equal(a, b)


def test_autocast_region_changes_nothing():
    """The fp32 landmark algebra (K2, Newton–Schulz, its VJP) stays fp32 when the op runs inside autocast."""
    q, k, v = make_inputs(2, 8, 2, 1500, 1500, 64, dtype=torch.bfloat16)
    mask = make_padding(2, 1500, min_real=700, seed=3).to(DEV)
    conv = make_conv(8, 3, q.dtype)
    dout = torch.randn_like(q)

    def run():
        out, state = torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, 32, 6, 0.0, 0.125)
        return out, torch.ops.hfab.nystrom_bwd(dout, q, k, v, conv, mask, 32, 6, 0.0, 0.125, state)

    assert_unchanged_by_autocast(run)


def test_backward_gqa_groups_of_four_deterministic():
    """dk/dv sum the group's four q heads inside one block; the split partials merge in a fixed order: a second
    forward and backward give the same bits. Without the forward's state (state []) the backward recomputes it and
    takes K1's row statistics from their own kernel, not from the forward (lse1) and k1 (Δ1): it matches the oracle
    too."""
    q, k, v = make_inputs(2, 8, 2, 1500, 1500, 32, seed=8)
    mask = make_padding(2, 1500, min_real=700, seed=8).to(DEV)
    conv = make_conv(8, 3, q.dtype)
    _, first = check(q, k, v, m=16, conv=conv, mask=mask)
    _, second = check(q, k, v, m=16, conv=conv, mask=mask)
    for got, want in zip(second, first):
        assert torch.equal(got, want)
    check(q, k, v, m=16, conv=conv, mask=mask, recompute=True)


def test_backward_memory_is_linear_in_n():
    """No (N, m) matrix and no fp32 copy of q, k, v, dO: the backward's peak is its outputs plus the split partials
    (O(splits m D), splits bounded by the GPU's resident blocks), a few fp32 rows per query (row statistics) and O(m²)
    state: under 24 MiB here, which an (N, m) fp32 matrix or an fp32 copy of q (32 MiB each) alone exceeds."""
    q, k, v = make_inputs(1, 4, 4, 65536, 65536, 64)
    dout = torch.randn_like(q)
    short = (t[:, :, :256] for t in (dout, q, k, v))
    torch.ops.hfab.nystrom_bwd(*short, None, None, 32, 6, 0.0, 0.125, [])  # cuBLAS workspaces exist before we measure
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.ops.hfab.nystrom_bwd(dout, q, k, v, None, None, 32, 6, 0.0, 0.125, [])
    torch.cuda.synchronize()
    outputs = sum(g.nbytes for g in grads)
    assert torch.cuda.max_memory_allocated() - base <= outputs + 24 * 2 ** 20


def test_non_contiguous_inputs_equal_contiguous():
    q, k, v = make_inputs(2, 4, 2, 65, 65, 64)
    mask = make_padding(2, 65, min_real=20, seed=3).to(DEV)
    conv = make_conv(4, 3, q.dtype)
    dout = torch.randn_like(q)
    hyper = dict(m=16, iters=6, kappa=0.0, conv=conv, scale=0.125)
    out, grads = run_kernel(q, k, v, dout, mask=mask, **hyper)
    for qv, kv, vv in strided_views(q, k, v):
        assert not qv.is_contiguous()
        dout_v = dout.transpose(1, 2).contiguous().transpose(1, 2)
        out_v, grads_v = run_kernel(qv, kv, vv, dout_v, mask=strided_mask(mask), **hyper)
        assert torch.equal(out_v, out)
        for got, want in zip(grads_v, grads):
            assert torch.equal(got, want)


def test_public_function_autograd():
    q, k, v = (t.requires_grad_(True) for t in make_inputs(2, 4, 2, 65, 65, 64))
    conv = make_conv(4, 3, q.dtype).requires_grad_(True)
    mask = make_padding(2, 65, seed=5).to(DEV)
    out = hfab.nystrom_attention(q, k, v, num_landmarks=16, conv_weight=conv, key_padding_mask=mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    _, (dq, dk, dv, dconv) = run_kernel(q.detach(), k.detach(), v.detach(), dout, m=16, iters=6, kappa=0.0,
                                        conv=conv.detach(), mask=mask, scale=64 ** -0.5)
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)
    assert torch.equal(conv.grad, dconv)


def test_cuda_autograd_graph_gradients_and_double_backward():
    """The C++ autograd of the CUDA op (csrc/nystrom/nystrom_autograd.cpp, checked by assert_kernels_registered): no
    graph under no_grad (the same output), a gradient for q alone, double backward raises like the Python one."""
    q, k, v = make_inputs(1, 2, 2, 70, 70, 64)
    with torch.no_grad():
        plain = hfab.nystrom_attention(q, k, v, num_landmarks=16)
    qg = q.clone().requires_grad_(True)
    out = hfab.nystrom_attention(qg, k, v, num_landmarks=16)
    assert plain.grad_fn is None and out.grad_fn is not None and torch.equal(plain, out)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, qg, dout, create_graph=True)
    _, (want, _, _, _) = run_kernel(q, k, v, dout, m=16, iters=6, kappa=0.0, conv=None, mask=None,
                                     scale=64 ** -0.5)
    assert torch.equal(dq, want)
    with pytest.raises(RuntimeError, match="nystrom_bwd"):
        dq.sum().backward()


def test_launches_on_the_current_stream_and_in_cuda_graphs():
    q, k, v = make_inputs(2, 4, 2, 333, 333, 64)
    mask = make_padding(2, 333, min_real=10, seed=6).to(DEV)
    conv = make_conv(4, 3, q.dtype)

    def fn():
        return torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, 32, 6, 0.0, 0.125)[0]

    assert torch.equal(replay_in_cuda_graph(fn), fn())
    dout = torch.randn_like(q)

    def bwd():
        return torch.cat([g.flatten() for g in torch.ops.hfab.nystrom_bwd(dout, q, k, v, conv, mask, 32, 6, 0.0,
                                                                         0.125, [])])

    assert torch.equal(replay_in_cuda_graph(bwd), bwd())


def test_side_stream_work_waits_for_the_callers_stream():
    """The inverse kernel (forward) and the Newton–Schulz VJP (backward) run on a side stream beside K3's kernels:
    with the caller's stream held up by a sleep before the inputs are written, forward and backward still equal a
    plain run bit for bit (a side stream that did not wait would read landmarks, Z or dZ not yet written)."""
    q, k, v = make_inputs(4, 16, 4, 4097, 4097, 64, seed=9)
    mask = make_padding(4, 4097, min_real=3000, seed=9).to(DEV)
    conv = make_conv(16, 3, q.dtype)
    dout = torch.randn_like(q)

    def run(q_in):
        out, state = torch.ops.hfab.nystrom_fwd(q_in, k, v, conv, mask, 64, 6, 0.0, 0.125)
        return [out, *torch.ops.hfab.nystrom_bwd(dout, q_in, k, v, conv, mask, 64, 6, 0.0, 0.125, state)]

    want = run(2 * q)
    run(q)  # the freed blocks a premature read would find hold other values
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)  # ~50 ms of the caller's stream before q_late exists
        q_late = 2 * q
        got = run(q_late)
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv", "dconv"), got, want):
        assert torch.equal(a, b), name


def test_opcheck():
    q, k, v = (t.requires_grad_(True) for t in make_inputs(2, 4, 2, 65, 65, 64))
    conv = make_conv(4, 3, q.dtype).requires_grad_(True)
    mask = make_padding(2, 65, seed=7).to(DEV)
    torch.library.opcheck(torch.ops.hfab.nystrom_fwd.default, (q, k, v, conv, mask, 16, 6, 0.0, 0.125))
    torch.library.opcheck(torch.ops.hfab.nystrom_fwd.default, (q, k, v, None, None, 8, 3, 2.0, 0.125))
    q, k, v, conv = q.detach(), k.detach(), v.detach(), conv.detach()
    state = torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, 16, 6, 0.0, 0.125)[1]
    for saved in ([], state):
        torch.library.opcheck(torch.ops.hfab.nystrom_bwd.default,
                              (torch.randn_like(q), q, k, v, conv, mask, 16, 6, 0.0, 0.125, saved))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph(backend):
    q, k, v = (t.requires_grad_(True) for t in make_inputs(1, 4, 2, 65, 65, 64))
    conv = make_conv(4, 3, q.dtype).requires_grad_(True)

    def fn(q, k, v, conv):
        return hfab.nystrom_attention(q, k, v, num_landmarks=16, conv_weight=conv) * 2.0

    assert_compiled_matches_eager(fn, q, k, v, conv, backend=backend)


def test_unsupported_configurations_raise_clear_errors():
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64)
    fwd = torch.ops.hfab.nystrom_fwd
    with pytest.raises(RuntimeError, match="num_landmarks=129 is not supported; supported: 1..128"):
        fwd(q, k, v, None, None, 129, 6, 0.0, 0.125)
    with pytest.raises(RuntimeError, match="newton_iter=21 is not supported; supported: 0..20"):
        fwd(q, k, v, None, None, 16, 21, 0.0, 0.125)
    for d in (16, 48, 256):
        qd, kd, vd = make_inputs(1, 2, 2, 8, 8, d)
        with pytest.raises(RuntimeError, match=f"head dim D={d} is not supported; supported: 32, 64, 128"):
            fwd(qd, kd, vd, None, None, 4, 6, 0.0, 0.125)
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(RuntimeError, match="is not supported; supported: float16, bfloat16"):
            fwd(*make_inputs(1, 2, 2, 8, 8, 64, dtype=dtype), None, None, 4, 6, 0.0, 0.125)
    with pytest.raises(RuntimeError, match="key_padding_mask must be a CUDA tensor"):
        fwd(q, k, v, None, torch.ones(1, 8, dtype=torch.bool), 4, 6, 0.0, 0.125)
    with pytest.raises(RuntimeError, match="conv_weight.shape=.* is not supported"):
        fwd(q, k, v, make_conv(2, 4, q.dtype), None, 4, 6, 0.0, 0.125)


def cuda_kernels_of(fn):
    """The names of the CUDA kernels that fn() launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("n, d, late", [(300, 64, True), (262_145, 128, False)])
def test_late_key_pass_only_for_small_dk(n, d, late):
    """Up to 64 MiB of dk the dk/dv kernel runs beside the Newton–Schulz VJP and nystrom_segment_add_bwd_kernel adds
    the VJP's part of dk after it; above, the dk/dv kernel waits for the VJP. Both orders match the oracle (GQA,
    padding). With the saved state and m 64 (one k1 slot tile) k1 writes dq's buffer part and no dq kernel runs: the
    segment add puts the landmark part on dq too."""
    q, k, v = make_inputs(1, 2, 1, n, n, d)
    mask = make_padding(1, n, min_real=n - 50, seed=3).to(DEV)
    check(q, k, v, m=64, mask=mask)
    out, state = torch.ops.hfab.nystrom_fwd(q, k, v, None, mask, 64, 6, 0.0, d ** -0.5)
    dout = torch.randn_like(out)
    kernels = cuda_kernels_of(lambda: torch.ops.hfab.nystrom_bwd(dout, q, k, v, None, mask, 64, 6, 0.0, d ** -0.5,
                                                                 state))
    assert len([name for name in kernels if "nystrom_segment_add" in name]) == 1 + late
    assert not [name for name in kernels if "nystrom_dq" in name]


def test_backward_with_the_saved_state_recomputes_nothing():
    """Given the forward's state, the backward launches no landmark, K3 or Newton–Schulz forward kernel, and where the
    buffer fits one k1 slot tile (m <= 64) no row-statistics kernel either (the saved lse1, Δ1 summed in k1); without
    the state it does; a state of the wrong length is refused with a clear error."""
    q, k, v = make_inputs(2, 4, 2, 300, 300, 64)
    mask = make_padding(2, 300, min_real=100, seed=4).to(DEV)
    out, state = torch.ops.hfab.nystrom_fwd(q, k, v, None, mask, 16, 6, 0.0, 0.125)
    dout = torch.randn_like(out)
    kernels = cuda_kernels_of(lambda: torch.ops.hfab.nystrom_bwd(dout, q, k, v, None, mask, 16, 6, 0.0, 0.125, state))
    assert any("nystrom_kv" in name for name in kernels)
    assert not [name for name in kernels
                if any(s in name for s in ("landmark_fwd", "inverse_fwd", "k3_fwd", "k3_tc_fwd", "nystrom_stats"))]
    kernels = cuda_kernels_of(lambda: torch.ops.hfab.nystrom_bwd(dout, q, k, v, None, mask, 16, 6, 0.0, 0.125, []))
    assert any("nystrom_stats" in name for name in kernels)
    with pytest.raises(RuntimeError, match="state does not belong to these inputs.*got 1 tensors"):
        torch.ops.hfab.nystrom_bwd(dout, q, k, v, None, mask, 16, 6, 0.0, 0.125, state[:1])
    with pytest.raises(RuntimeError, match="state does not belong to these inputs"):
        torch.ops.hfab.nystrom_bwd(dout, q, k, v, None, mask, 32, 6, 0.0, 0.125, state)


SANITIZED_RUN = """
import torch, hf_attention_backends
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(3, 2, 70, 32, device="cuda", generator=g).half()
k, v = (torch.randn(3, 1, 70, 32, device="cuda", generator=g).half() for _ in range(2))
conv = torch.randn(2, 3, device="cuda", generator=g).half()
mask = torch.arange(70, device="cuda")[None, :] < torch.tensor([[70], [9], [0]], device="cuda")
for m in (8, 70):
    out, state = torch.ops.hfab.nystrom_fwd(q, k, v, conv, mask, m, 4, 0.0, 0.2)
    grads = torch.ops.hfab.nystrom_bwd(torch.randn_like(out), q, k, v, conv, mask, m, 4, 0.0, 0.2, state)
# 288 kv heads: each dk/dv block takes all 4 key tiles of its head, the next one loading during this one
q, k, v = (torch.randn(1, 288, 200, 32, device="cuda", generator=g).half() for _ in range(3))
for m in (8, 70):
    out, state = torch.ops.hfab.nystrom_fwd(q, k, v, None, None, m, 4, 0.0, 0.2)
    grads = torch.ops.hfab.nystrom_bwd(torch.randn_like(out), q, k, v, None, None, m, 4, 0.0, 0.2, state)
torch.cuda.synchronize()
"""


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool):
    assert_sanitizer_clean(tool, SANITIZED_RUN)
