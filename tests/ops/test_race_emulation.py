"""The RACE kernels on the CPU: csrc/race's tensor-core kernels (fp16/bf16, S <= 64) and CUDA-core kernels (fp32, or
S > 64) compiled by g++ with tests/ops/emulation, launched in the order of race_fwd.cu / race_bwd.cu, and checked
against the float64 oracle exactly as the GPU tests check the real kernels (tests/ops/test_race_cuda.py). Timing and
the memory model beyond barriers stay with the GPU tests.
"""
import ctypes
import functools

import pytest
import torch

from tests.inputs import make_padding
from tests.ops.emulation import (SCHEDULES, assert_same_under_schedule, build, check_rc, cpu_inputs, nan_like,
                                  ptr)
from tests.ops.test_race_cuda import check_against_oracle, make_planes, per_head_beta

DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build("race", tmp_path_factory.mktemp("emulation"))


def emulated(lib):
    """run_kernel for check_against_oracle: out, then (dq, dk, dv, dbeta) from the emulated kernels."""
    def run(q, k, v, planes, beta, dout, *, causal, mask):
        b, hq, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        tables, planes_per_table = planes.shape[0], planes.shape[1]
        flat_planes = planes.float().contiguous()
        beta_h = beta.float().reshape(-1).expand(hq).contiguous()
        shape = (DTYPES[q.dtype], d, b, hq, hkv, nq, nk, int(causal), planes_per_table, tables)
        m = mask.to(torch.uint8).contiguous() if mask is not None else None
        inputs = (ptr(q), ptr(k), ptr(v), ptr(flat_planes), ptr(beta_h), ptr(m))
        out = nan_like(q)
        check_rc(lib.race_fwd(*shape, *inputs, ptr(out)), "race_fwd")
        dq, dk, dv, dbeta_h = nan_like(q), nan_like(k), nan_like(v), nan_like(beta_h)
        check_rc(lib.race_bwd(*shape, *inputs, ptr(dout.contiguous()), ptr(dq), ptr(dk), ptr(dv), ptr(dbeta_h)),
                 "race_bwd")
        dbeta = dbeta_h.sum() if beta.dim() == 0 else dbeta_h
        return out, (dq, dk, dv, dbeta.to(beta.dtype))
    return run


def check(lib, b, hq, hkv, nq, nk, d, *, causal, dtype=torch.float16, tables=4, planes_per_table=4, mask=None,
          v_scale=None, beta_mult=1.0, dout_scale=1.0):
    """v_scale: a factor per key (Nk,) or per element (Nk, D) that v is multiplied by (in float32, before the cast to
    dtype); dout_scale: check_against_oracle's. Returns out and the gradients."""
    q, k, v = cpu_inputs(b, hq, hkv, nq, nk, d, dtype=dtype)
    if v_scale is not None:
        v = (v.float() * (v_scale if v_scale.dim() == 2 else v_scale[:, None])).to(dtype)
    planes = make_planes(tables, planes_per_table, d, device="cpu")
    return check_against_oracle(q, k, v, planes, per_head_beta(hq, d, mult=beta_mult, device="cpu"), causal=causal,
                                mask=mask, run=emulated(lib), dout_scale=dout_scale)


@pytest.mark.parametrize("causal", [False, True])
def test_tensor_cores_gqa(emulator, causal):
    check(emulator, 1, 2, 1, 130, 130, 64, causal=causal)  # three chunks, a ragged one; GQA 2:1 (dk/dv scratch)


@pytest.mark.parametrize("d", [32, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_head_dims(emulator, d, causal):
    check(emulator, 1, 2, 2, 70, 70, d, causal=causal, dtype=torch.bfloat16)


def test_float32_cuda_cores(emulator):
    check(emulator, 1, 2, 1, 70, 70, 64, causal=True, dtype=torch.float32)


def test_more_than_64_features_take_the_cuda_core_kernels(emulator):
    check(emulator, 1, 2, 2, 70, 70, 32, causal=False, tables=2, planes_per_table=6)  # S = 128


@pytest.mark.parametrize("nq, nk", [(40, 150), (150, 40)])
def test_bottom_right_causal_with_padding(emulator, nq, nk):
    check(emulator, 2, 2, 1, nq, nk, 64, causal=True, mask=make_padding(2, nk, seed=3))


@pytest.mark.parametrize("causal", [False, True])
def test_more_than_one_group_of_chunks(emulator, causal):
    check(emulator, 1, 1, 1, 1100, 1100, 32, causal=causal, tables=2, planes_per_table=2)  # 18 chunks: two groups


@pytest.mark.parametrize("group_chunks, n", [(3, 1100), (32, 2200)])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_group_sizes(emulator, monkeypatch, group_chunks, n, causal):
    # the forward's group states, scan and causal out kernel with groups of other sizes than 16 (the GPU takes 32 for
    # long inputs, tc::forward_group_chunks): 18 chunks in six groups of 3; 35 chunks in a group of 32 and a ragged one
    monkeypatch.setenv("HFAB_RACE_GROUP_CHUNKS", str(group_chunks))
    check(emulator, 1, 2, 1, n, n, 64, causal=causal, dtype=torch.bfloat16)


@pytest.mark.parametrize("d, tables, planes_per_table, dtype", [(32, 8, 1, torch.bfloat16), (128, 2, 3, torch.bfloat16),
                                                                 (64, 1, 6, torch.float16), (64, 6, 3, torch.bfloat16),
                                                                 (32, 8, 3, torch.float16)])
@pytest.mark.parametrize("causal", [False, True])
def test_feature_shapes_with_padding(emulator, d, tables, planes_per_table, dtype, causal):
    # items of 2, 8 and 16 features per row (the warps' feature stores, the sigma tables of P != 4), Nq != Nk, key
    # padding; L P of 18 and 24 (more planes than one 16-wide step of the dq / dk chain)
    check(emulator, 2, 2, 1, 90, 150, d, causal=causal, dtype=dtype, tables=tables, planes_per_table=planes_per_table,
          mask=make_padding(2, 150, seed=5))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("factors, nk", [((1e-4,), 192), ((3e5,), 192), ((1.0, 7e4), 150), ((7e4, 1e-3, 1.0), 150)],
                         ids=["tiny", "huge", "normal-huge", "huge-small-normal"])
def test_key_state_exponents_of_bfloat16_values(emulator, factors, nk, causal):
    # the forward's group states take bf16 v as fp16 v 2^-e per warp's 16 rows: e < 0 (tiny), e > 0 (beyond fp16;
    # both to the last k-step, so the sums leave the kernel rescaled), and the accumulators rescaled between k-steps
    # whose exponents differ (factors cycled per 16 keys; the zero rows past Nk = 150 have e = 0); causal: the same v
    # in the per-warp out kernel's chunk products and running state (stage_warp_state's exponents per warp)
    per_block = torch.tensor(factors, dtype=torch.float32)[torch.arange(nk) // 16 % len(factors)]
    check(emulator, 1, 2, 1, 90, nk, 64, causal=causal, dtype=torch.bfloat16, v_scale=per_block)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("column", [0, 1])
def test_key_state_exponent_of_a_spike_in_one_column(emulator, column, causal):
    # the largest |v| of each warp's 16 rows in one column (1: the high half of the 32-bit words that the exponent's
    # max reads two at a time), 3e5 among values of 1e-3: an exponent from the other columns would overflow fp16
    nk = 150
    v_scale = torch.full((nk, 64), 1e-3)
    v_scale[::16, column] = 3e5
    check(emulator, 1, 2, 1, 90, nk, 64, causal=causal, dtype=torch.bfloat16, v_scale=v_scale)


@pytest.mark.parametrize("beta_mult", [0.05, 8.0])
def test_causal_out_scores_of_any_size(emulator, beta_mult):
    # beta x 8: sharp corner probabilities, scores between a query and a key in other corners far below fp16's range
    # (the per-warp out kernel rounds each score row times its own power of two to fp16); x 0.05: flat ones
    check(emulator, 1, 2, 1, 200, 200, 64, causal=True, dtype=torch.bfloat16, beta_mult=beta_mult)


@pytest.mark.parametrize("d, dtype", [(64, torch.float16), (128, torch.bfloat16)])
def test_block_wide_causal_out_kernel(emulator, monkeypatch, d, dtype):
    # HFAB_RACE_WARP_CAUSAL=0 selects the block-wide causal out kernel (GPUs with less shared memory per block run
    # it): the same bounds, and other rounding than the per-warp kernel (so the switch did select it)
    mask = make_padding(2, 150, seed=3)
    warp_out, _ = check(emulator, 2, 2, 1, 150, 150, d, causal=True, dtype=dtype, mask=mask)
    monkeypatch.setenv("HFAB_RACE_WARP_CAUSAL", "0")
    block_out, _ = check(emulator, 2, 2, 1, 150, 150, d, causal=True, dtype=dtype, mask=mask)
    assert not torch.equal(warp_out, block_out)


@pytest.mark.parametrize("d, tables, planes_per_table, dtype", [(64, 6, 3, torch.bfloat16), (32, 3, 2, torch.float16),
                                                                 (128, 1, 6, torch.bfloat16)])
@pytest.mark.parametrize("causal", [False, True])
def test_phi_tile_is_bitwise_the_per_use_rebuild(emulator, monkeypatch, d, tables, planes_per_table, dtype, causal):
    # HFAB_RACE_PHI_TILE=0: the backward kernels rebuild phi from the sigma tables at each use instead of reading the
    # fp32 phi tiles; the same values in the same order, so every gradient must match bit for bit (both within bounds)
    args = dict(causal=causal, dtype=dtype, tables=tables, planes_per_table=planes_per_table,
                mask=make_padding(2, 150, seed=4))
    _, tiled = check(emulator, 2, 2, 1, 130, 150, d, **args)
    monkeypatch.setenv("HFAB_RACE_PHI_TILE", "0")
    _, per_use = check(emulator, 2, 2, 1, 130, 150, d, **args)
    for name, a, b in zip(("dq", "dk", "dv", "dbeta"), per_use, tiled):
        assert torch.equal(a, b), f"{name} differs between HFAB_RACE_PHI_TILE=0 and the default"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dout_scale", [2.0 ** -20, 2.0 ** 13], ids=["tiny", "large"])
@pytest.mark.parametrize("causal", [False, True])
def test_upstream_gradients_of_any_size(emulator, dtype, dout_scale, causal):
    # dO x 2^13: ds' = dO . v - c^ past fp16's range unless each row is scaled by its power of two before the T
    # halves (without the scaling the fp16 causal case gives NaN); x 2^-20: subnormal fp16 dO (a mean-reduced loss)
    check(emulator, 1, 2, 1, 150, 150, 64, causal=causal, dtype=dtype, dout_scale=dout_scale)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("d, dtype, causal", [(64, torch.float16, True), (64, torch.bfloat16, False),
                                             (64, torch.bfloat16, True), (32, torch.float16, True),
                                             (128, torch.bfloat16, True)])
def test_results_do_not_depend_on_the_thread_schedule(emulator, monkeypatch, schedule, d, dtype, causal):
    # GQA, padding, a ragged chunk, forward groups of 2 chunks; D 32 and 128 double-buffer the causal out kernel's
    # tiles where D 64 ends each chunk with a second barrier
    monkeypatch.setenv("HFAB_RACE_GROUP_CHUNKS", "2")
    q, k, v = cpu_inputs(2, 2, 1, 300, 300, d, dtype=dtype)
    planes, beta = make_planes(4, 4, d, device="cpu"), per_head_beta(2, d, device="cpu")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    run = functools.partial(emulated(emulator), q, k, v, planes, beta, dout, causal=causal,
                            mask=make_padding(2, 300, seed=4))
    assert_same_under_schedule(monkeypatch, schedule, run, ("out", "dq", "dk", "dv", "dbeta"))
