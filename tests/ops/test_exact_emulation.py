"""The exact CUDA kernels on the CPU: csrc/exact/exact_kernels.cuh compiled by g++ with
tests/ops/emulation/cuda_on_cpu.h (every CUDA thread a fiber; barriers, warp shuffles and votes emulated) and
checked against the float64 oracle exactly as the GPU tests check the real kernels (tests/ops/test_exact_cuda.py).

So a tile layout, swizzle or reduce-scatter mistake fails on any machine, before GPU time is spent. What the
emulation cannot see (the memory model beyond barriers, timing) stays with the GPU tests. Needs g++ and the CUDA
headers (tests/ops/emulation).
"""
import ctypes
import functools

import pytest
import torch

from tests.inputs import make_padding
from tests.ops.emulation import (SCHEDULES, assert_same_under_schedule, build, check_rc, cpu_inputs, nan_like,
                                  ptr)
from tests.ops.test_exact_cuda import check_against_oracle


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build("exact", tmp_path_factory.mktemp("emulation"))


def test_the_emulator_shuffles_votes_and_reports_deadlocks(emulator):
    assert emulator.emulation_check_warp_ops() == 0
    assert emulator.emulation_check_deadlock() == 0


def test_the_emulator_lands_cp_async_copies_at_their_wait(emulator):
    assert emulator.emulation_check_async_copies() == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_emulator_schedules_expose_an_unordered_read(emulator, monkeypatch, schedule):
    emulator.emulation_schedule_probe.restype = ctypes.c_longlong
    ordered = sum(1000 + t for t in range(64))
    assert emulator.emulation_schedule_probe(1) == ordered
    lockstep = emulator.emulation_schedule_probe(0)
    monkeypatch.setenv("HFAB_EMU_SCHEDULE", schedule)
    assert emulator.emulation_schedule_probe(1) == ordered
    assert emulator.emulation_schedule_probe(0) != lockstep


def test_the_emulator_fails_a_call_with_misaligned_ldmatrix_or_cp_async_addresses(emulator):
    assert emulator.emulation_alignment_probe(0) == 0
    with pytest.raises(AssertionError, match="96 ldmatrix / cp.async operand addresses not 16-byte aligned"):
        emulator.emulation_alignment_probe(8)
    assert emulator.emulation_alignment_probe(16) == 0  # the count was taken: a later aligned call passes


def emulated(lib):
    """run_kernel for check_against_oracle: the forward, then the backward on the forward's out and lse."""
    def run(q, k, v, dout, *, causal, scale, mask):
        b, hq, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        shape = (int(q.dtype == torch.bfloat16), d, b, hq, hkv, nq, nk, int(causal), ctypes.c_float(scale))
        m = mask.to(torch.uint8).contiguous() if mask is not None else None
        out, lse = nan_like(q), nan_like(q, q.shape[:3], torch.float32)
        check_rc(lib.exact_fwd(*shape, ptr(q), ptr(k), ptr(v), ptr(m), ptr(out), ptr(lse)), "exact_fwd")
        dq, dk, dv, delta = nan_like(q), nan_like(k), nan_like(v), nan_like(q, q.shape[:3], torch.float32)
        check_rc(lib.exact_bwd(*shape, ptr(q), ptr(k), ptr(v), ptr(m), ptr(out), ptr(dout.contiguous()), ptr(lse),
                               ptr(delta), ptr(dq), ptr(dk), ptr(dv)), "exact_bwd")
        return out, lse, (dq, dk, dv)
    return run


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_gradients(emulator, d, causal):
    q, k, v = cpu_inputs(1, 2, 1, 65, 65, d)  # two query blocks, a ragged key tile, GQA 2:1
    check_against_oracle(q, k, v, causal=causal, run=emulated(emulator))


@pytest.mark.parametrize("d", [64, 128])
def test_bfloat16(emulator, d):
    q, k, v = cpu_inputs(1, 2, 2, 40, 40, d, dtype=torch.bfloat16, scale=3.0)
    check_against_oracle(q, k, v, causal=True, run=emulated(emulator))


@pytest.mark.parametrize("d", [32, 128])
def test_key_padding(emulator, d):
    q, k, v = cpu_inputs(2, 2, 1, 33, 70, d)
    check_against_oracle(q, k, v, causal=False, mask=make_padding(2, 70, seed=4), run=emulated(emulator))


@pytest.mark.parametrize("nq, nk", [(7, 130), (70, 33)])
def test_bottom_right_causal_and_empty_rows(emulator, nq, nk):
    q, k, v = cpu_inputs(1, 2, 1, nq, nk, 128)  # (70, 33): queries 0..36 see no key
    check_against_oracle(q, k, v, causal=True, run=emulated(emulator))


def test_decode_one_query_against_many_key_tiles(emulator):
    q, k, v = cpu_inputs(2, 4, 1, 1, 130, 64)  # GQA 4:1
    check_against_oracle(q, k, v, causal=True, run=emulated(emulator))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
def test_results_do_not_depend_on_the_thread_schedule(emulator, monkeypatch, schedule, causal):
    q, k, v = cpu_inputs(2, 2, 1, 70, 130, 64, dtype=torch.bfloat16)  # GQA, ragged tiles, padding
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype)
    run = functools.partial(emulated(emulator), q, k, v, dout, causal=causal, scale=0.125,
                            mask=make_padding(2, 130, seed=4))
    assert_same_under_schedule(monkeypatch, schedule, run, ("out", "lse", "dq", "dk", "dv"))
