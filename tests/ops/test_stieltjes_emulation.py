"""The Stieltjes tensor-core kernels on the CPU: csrc/stieltjes/stieltjes_kernels.cuh compiled by g++ with
tests/ops/emulation (CUDA threads as fibers; mma.sync, ldmatrix and cp.async emulated lane by lane from the PTX
fragment layouts) and checked against the float64 oracle exactly as the GPU tests check the real kernels
(tests/ops/test_stieltjes_cuda.py). A fragment, tile or pipeline mistake fails here on any machine; timing and the
memory model beyond barriers stay with the GPU tests.
"""
import ctypes
import functools

import pytest
import torch

from hf_attention_backends.ops.stieltjes import reference
from tests.inputs import make_padding
from tests.ops.emulation import (SCHEDULES, assert_same_under_schedule, build, check_rc, cpu_inputs, nan_like,
                                  ptr)
from tests.ops.test_stieltjes_cuda import CONVERGED, check_against_oracle
from tests.tolerance import assert_close_to_oracle


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build("stieltjes", tmp_path_factory.mktemp("emulation"))


def geometry(q, k, *, order, causal, scale):
    """The leading arguments of the emulation's C functions."""
    b, hq, nq, d = q.shape
    return (int(q.dtype == torch.bfloat16), d, b, hq, k.shape[1], nq, k.shape[2], int(causal), ctypes.c_float(scale),
            ctypes.c_float(order))


def emulated_fwd(lib, q, k, v, mask, *, order, causal, scale, newton_iter, state):
    """(out, rowmax, lam, u, lsum) of the emulated forward kernel: the training variant when ``state``, else the
    inference one (u, lsum None)."""
    rows = q.shape[:3]
    out, rowmax, lam = nan_like(q), nan_like(q, rows, torch.float32), nan_like(q, rows, torch.float32)
    u, lsum = (nan_like(q, q.shape, torch.float32), nan_like(q, rows, torch.float32)) if state else (None, None)
    check_rc(lib.stieltjes_fwd(*geometry(q, k, order=order, causal=causal, scale=scale), newton_iter, ptr(q), ptr(k),
                               ptr(v), ptr(mask), ptr(out), ptr(rowmax), ptr(lam), ptr(u), ptr(lsum)), "stieltjes_fwd")
    return out, rowmax, lam, u, lsum


def emulated(lib):
    """run_kernel for check_against_oracle: ((out, rowmax, lam, u, lsum), (dq, dk, dv)) from the emulated kernels
    (the training forward, then the backward on its state)."""
    def run(q, k, v, dout, *, order, causal, scale, mask, newton_iter=CONVERGED):
        shape = geometry(q, k, order=order, causal=causal, scale=scale)
        m = mask.to(torch.uint8).contiguous() if mask is not None else None
        out, rowmax, lam, u, lsum = emulated_fwd(lib, q, k, v, m, order=order, causal=causal, scale=scale,
                                                 newton_iter=newton_iter, state=True)
        dq, dk, dv, delta = nan_like(q), nan_like(k), nan_like(v), nan_like(q, q.shape[:3], torch.float32)
        check_rc(lib.stieltjes_bwd(*shape, ptr(q), ptr(k), ptr(v), ptr(m), ptr(dout.contiguous()), ptr(rowmax),
                                   ptr(lam), ptr(u), ptr(lsum), ptr(delta), ptr(dq), ptr(dk), ptr(dv)),
                 "stieltjes_bwd")
        return (out, rowmax, lam, u, lsum), (dq, dk, dv)
    return run


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients(emulator, d, causal):
    q, k, v = cpu_inputs(1, 2, 1, 70, 70, d)  # two query tiles, a ragged key tile, GQA 2:1
    check_against_oracle(q, k, v, causal=causal, run=emulated(emulator))


@pytest.mark.parametrize("order", [2.0, 3.0])
def test_other_orders(emulator, order):
    q, k, v = cpu_inputs(1, 2, 2, 40, 40, 64)
    check_against_oracle(q, k, v, order=order, causal=True, run=emulated(emulator))


def test_flat_fp16_rows_keep_their_precision(emulator):
    # order 1 over 200 keys: R ~ 1/(n lam) sits below fp16's normal range unless scaled by lam^(order+1)
    q, k, v = cpu_inputs(1, 1, 1, 200, 200, 64, seed=10)
    check_against_oracle(q, k, v, order=1.0, newton_iter=100, run=emulated(emulator))


@pytest.mark.parametrize("order", [2.0, 2.5])
def test_small_fp16_gradients_keep_their_precision(emulator, order):
    # dO ~ 2^-12: dS = order r (dP - delta) sits below fp16's normal range in the dk product unless scaled (unscaled:
    # dk 3.9x / 2.2x the reference's error)
    q, k, v = cpu_inputs(1, 2, 1, 70, 70, 64, seed=11)
    check_against_oracle(q, k, v, order=order, dout_scale=2.0**-12, run=emulated(emulator))


def test_bfloat16_key_padding_and_bottom_right_causal(emulator):
    q, k, v = cpu_inputs(2, 2, 1, 20, 90, 64, dtype=torch.bfloat16)
    check_against_oracle(q, k, v, causal=True, mask=make_padding(2, 90, seed=4), run=emulated(emulator))


@pytest.mark.parametrize("nq, nk", [(1, 130), (70, 33)])
def test_decode_and_rows_without_keys(emulator, nq, nk):
    q, k, v = cpu_inputs(1, 4, 1, nq, nk, 128)  # GQA 4:1; (70, 33) causal: queries 0..36 see no key
    check_against_oracle(q, k, v, causal=True, run=emulated(emulator))


def solver_inputs(scale):
    """q, k, v over 300 keys (scores x scale, where the start is far from the root) and a key mask."""
    q, k, v = cpu_inputs(1, 2, 1, 40, 300, 64, scale=scale)
    return q, k, v, make_padding(1, 300, seed=9)


def emulated_forward(emulator, q, k, v, mask, *, order, causal, newton_iter):
    """(out, rowmax, lambda) of the emulated forward kernel (the inference variant)."""
    return emulated_fwd(emulator, q, k, v, mask.to(torch.uint8), order=order, causal=causal, scale=0.125,
                        newton_iter=newton_iter, state=False)[:3]


@pytest.mark.parametrize("order", [4.0, 2.5])
def test_training_forward_outputs_equal_inference_forward(emulator, order):
    """The training variant (u and sum P besides) computes out, rowmax and lambda to the bit as the inference one."""
    q, k, v, mask = solver_inputs(1.0)
    for causal in (False, True):
        kw = dict(order=order, causal=causal, scale=0.125, newton_iter=-1)
        plain = emulated_fwd(emulator, q, k, v, mask.to(torch.uint8), state=False, **kw)
        trained = emulated_fwd(emulator, q, k, v, mask.to(torch.uint8), state=True, **kw)
        for a, b in zip(plain[:3], trained[:3]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("order", [2.0, 4.0])
def test_same_solver_steps_as_the_reference(emulator, order):
    """One solver step from the start: the kernel's start_lambda and step are the reference's (fp32 rounding apart),
    as tests/ops/test_stieltjes_cuda.py checks on the GPU."""
    q, k, v, mask = solver_inputs(2.0)
    for causal in (False, True):
        _, rowmax, lam = emulated_forward(emulator, q, k, v, mask, order=order, causal=causal, newton_iter=1)
        _, rowmax_ref, lam_ref = reference.stieltjes_forward(q, k, v, mask, causal, 0.125, order, 1)
        assert_close_to_oracle(rowmax, rowmax_ref, atol=1e-5, rtol=1e-6, name="rowmax")
        assert_close_to_oracle(lam, lam_ref, atol=0, rtol=2e-5, name="lambda")


@pytest.mark.parametrize("order, scale", [(4.0, 2.0), (2.0, 3.0)])
def test_adaptive_extra_steps_as_the_reference(emulator, order, scale):
    """newton_iter < 0 (the public default's form; here one step, then up to two extra): the rows whose last step
    may have left them short (reference.needs_another_step: a Halley step's error estimate, a Newton step's length)
    take the extra steps and the others keep theirs, as in the reference (fp32 rounding apart); rows of the same
    query block do both. The output too: every lane of a row's quad must take the same steps."""
    q, k, v, mask = solver_inputs(scale)
    _, _, one = reference.stieltjes_forward(q, k, v, mask, False, 0.125, order, 1)
    out_ref, _, want = reference.stieltjes_forward(q, k, v, mask, False, 0.125, order, -1)
    stepped = want != one
    assert 0 < int(stepped.sum()) < stepped.numel()
    out, _, lam = emulated_forward(emulator, q, k, v, mask, order=order, causal=False, newton_iter=-1)
    assert_close_to_oracle(lam, want, atol=0, rtol=2e-5, name="lambda")
    assert_close_to_oracle(out.float(), out_ref.float(), atol=1e-3, rtol=2e-3, name="out")  # ~1 ulp


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
def test_results_do_not_depend_on_the_thread_schedule(emulator, monkeypatch, schedule, causal):
    q, k, v = cpu_inputs(2, 2, 1, 70, 130, 64, dtype=torch.bfloat16)  # GQA, ragged tiles, padding
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype)
    run = functools.partial(emulated(emulator), q, k, v, dout, order=4.0, causal=causal, scale=0.125,
                            mask=make_padding(2, 130, seed=4))
    assert_same_under_schedule(monkeypatch, schedule, run, ("out", "rowmax", "lam", "u", "lsum", "dq", "dk", "dv"))
