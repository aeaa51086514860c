"""Eight Nyström kernels on the CPU (csrc/nystrom/nystrom_kernels.cuh, nystrom_tc_kernels.cuh and
nystrom_tc_bwd_kernels.cuh compiled by g++ with tests/ops/emulation, each launched as csrc/nystrom/nystrom_fwd.cu /
nystrom_bwd.cu launch it) on given inputs, against float64 oracles of what they compute: the landmark means, K3's
forward and backward, the output, and the backward's row statistics, buffer gradients (k1), dq and dk/dv. The output
is softmax(q keysᵀ √scale) vals over the valid buffer slots plus the conv residual of v; the row statistics lse1 (base
2) and Δ1 = dO · that attention. With P[i, c] = 2^(q[i] · keys[c] · √scale · log2(e) - lse1[i]) over the valid buffer
slots c and dS1[i, c] = P[i, c] (dO[i] · vals[c] - Δ1[i]), the buffer gradients of k1 (per query split) are d vals[c]
= Σ_i P[i, c] dO[i] and d keys[c] = √scale Σ_i dS1[i, c] q[i], and dq[i] = √scale (Σ_c dS1[i, c] keys[c] + d Q̃[l(i)]
/ |segment l(i)|) (the landmark term for real tokens of landmark sequences). The dk/dv kernel: for every real key j of
kv head g and each q head h of g's group,

    K3[l, j] = 2^(Q̃[h, l] · k[j] · √scale · log2(e) - lse3[h, l]),   dS3[l, j] = K3[l, j] (dW0[h, l] · v[j] - rowdot[h, l])
    dv[j] = Σ_h Σ_l K3[l, j] dW0[h, l],   dk[j] = √scale (Σ_h Σ_l dS3[l, j] Q̃[h, l] + d K̃[g, l(j)] / |segment l(j)|)

and, for a sequence on the exact path (n <= m real tokens), the gradient rows of its buffer slots; padding rows 0. The
baseline of the tolerance rule is the same oracle in float32, rounded to the kernel's dtype (k1's fp32 partial sums: a
relative bound). The whole backward runs on the GPU tests (tests/ops/test_nystrom_cuda.py); this checks the kernels'
tiling in CI, and the per-row scaling of dS1 before its fp16 halves when dO is tiny."""
import ctypes
import math

import pytest
import torch

from tests.inputs import make_padding
from tests.ops.emulation import (SCHEDULES, assert_same_under_schedule, build, check_rc, cpu_inputs, nan_like,
                                  ptr)
from tests.tolerance import assert_close_to_oracle

FACTOR, FLOOR = 3.0, 1e-6


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build("nystrom", tmp_path_factory.mktemp("emulation"))


@pytest.fixture(scope="module")
def wgmma_emulator(tmp_path_factory):
    """The same kernels built as for sm_90a: the output, row-statistics and dk/dv kernels take their wgmma path."""
    return build("nystrom", tmp_path_factory.mktemp("emulation"), defines=("HFAB_EMULATE_WGMMA",))


@pytest.fixture(params=["mma.sync", "wgmma"])
def paths_emulator(request):
    """The kernels with a wgmma path (attend_tiles, dk/dv) on each of their two paths."""
    return request.getfixturevalue("emulator" if request.param == "mma.sync" else "wgmma_emulator")


def segment_counts(n_real, m):
    """(B, m) rows per landmark segment of n real tokens (the last segment takes the remainder)."""
    counts = torch.zeros(len(n_real), m)
    for b, n in enumerate(n_real.tolist()):
        seg = max(n // m, 1)
        starts = [min(l * seg, n) for l in range(m)]
        ends = [n if l == m - 1 else min(starts[l] + seg, n) for l in range(m)]
        counts[b] = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.float32)
    return counts


def stage_inputs(b, hq, hkv, n, m, d, dtype, mask, seed, land_scale=0.5, rank_one=0.0):
    """k, v and the landmark stage's arrays: Q̃ (times land_scale) and dW0 (plus a rank-one part rank_one times larger),
    both (B, Hq, m, D), lse3 and rowdot (B, Hq, m) consistent with k and v (lse3 the base-2 log-sum-exp of each
    landmark's scores over the real keys), d K̃ (B, Hkv, m, D), the buffer's gradient rows (B, Hkv, slots, D)."""
    _, k, v = cpu_inputs(b, hkv, hkv, n, n, d, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    root = d ** -0.25
    q_land = torch.randn(b, hq, m, d, generator=g) * land_scale
    dw0 = torch.randn(b, hq, m, d, generator=g)
    dw0 += rank_one * torch.randn(b, hq, m, 1, generator=g) * torch.randn(b, hq, 1, d, generator=g)
    real = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    kg = k.double().repeat_interleave(hq // hkv, 1)
    vg = v.double().repeat_interleave(hq // hkv, 1)
    logits = (q_land.double() @ kg.transpose(-1, -2)) * root * math.log2(math.e)
    logits = logits.masked_fill(~real[:, None, None, :], -math.inf)
    lse3 = torch.logsumexp(logits * math.log(2), -1) / math.log(2)
    k3 = torch.exp2(logits - lse3[..., None]).nan_to_num(0.0)
    rowdot = (dw0.double() * (k3 @ vg)).sum(-1)
    slots = min(m, n)
    tensors = dict(q_land=q_land, dw0=dw0, lse3=lse3.float(), rowdot=rowdot.float(),
                   dkl=torch.randn(b, hkv, m, d, generator=g) * 0.1,
                   dkeys=torch.randn(b, hkv, slots, d, generator=g), dvals=torch.randn(b, hkv, slots, d, generator=g))
    return k, v, root, tensors


def oracle(k, v, root, t, mask, m, precision):
    """dk, dv in `precision` (float64: the oracle; float32: the baseline before rounding)."""
    b, hkv, n, d = k.shape
    hq = t["q_land"].shape[1]
    groups = hq // hkv
    f = lambda x: x.to(precision)
    real = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    n_real = real.sum(1)
    kg, vg = f(k).repeat_interleave(groups, 1), f(v).repeat_interleave(groups, 1)
    logits = (f(t["q_land"]) @ kg.transpose(-1, -2)) * root * math.log2(math.e)
    k3 = torch.exp2(logits - f(t["lse3"])[..., None]) * real[:, None, None, :]
    ds3 = k3 * (f(t["dw0"]) @ vg.transpose(-1, -2) - f(t["rowdot"])[..., None])
    group_sum = lambda x: x.unflatten(1, (hkv, groups)).sum(2)
    dv = group_sum(k3.transpose(-1, -2) @ f(t["dw0"]))
    dk = group_sum(ds3.transpose(-1, -2) @ f(t["q_land"]))
    counts = f(segment_counts(n_real, m))
    for bi in range(b):
        ranks = torch.cumsum(real[bi].long(), 0) - 1
        nr = int(n_real[bi])
        for j in range(n):
            if not real[bi, j]:
                continue
            r = int(ranks[j])
            if nr > m:  # landmark path: d K̃ of the token's segment, shared over its rows
                lt = min(r // max(nr // m, 1), m - 1)
                dk[bi, :, j] += f(t["dkl"][bi, :, lt]) / counts[bi, lt].clamp_min(1)
            else:  # exact path: no landmark term, the token's buffer slot
                dk[bi, :, j] = f(t["dkeys"][bi, :, r])
                dv[bi, :, j] = f(t["dvals"][bi, :, r])
    keep = real[:, None, :, None]
    return dk * root * keep, dv * keep


def emulate(lib, k, v, root, t, mask, m, kv_chunk):
    b, hkv, n, d = k.shape
    hq = t["q_land"].shape[1]
    real = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    n_real = real.sum(1).int()
    exact = (n_real <= m).to(torch.uint8)
    counts = segment_counts(n_real, m)
    if mask is not None:
        mask_u8, cumsum = mask.to(torch.uint8).contiguous(), torch.cumsum(mask.int(), 1).int().contiguous()
        n_real_arg = n_real.contiguous()
    else:
        mask_u8 = cumsum = n_real_arg = None
    dk, dv = nan_like(k), nan_like(v)
    rc = lib.nystrom_kv_bwd(int(k.dtype == torch.bfloat16), d, b, hq, hkv, n, m, min(m, n), ctypes.c_float(root),
                            kv_chunk, ptr(k), ptr(v), ptr(mask_u8), ptr(cumsum), ptr(n_real_arg), ptr(exact),
                            *(ptr(t[name].contiguous()) for name in ("q_land", "dw0", "lse3", "rowdot", "dkl")),
                            ptr(counts), ptr(t["dkeys"].contiguous()), ptr(t["dvals"].contiguous()), ptr(dk), ptr(dv))
    check_rc(rc, "nystrom_kv_bwd")
    return dk, dv


def check_key_gradients(lib, k, v, root, t, mask, m, kv_chunk):
    """The dk/dv kernel's dk and dv against the float64 oracle (the float32 one rounded to k's dtype as baseline)."""
    dk, dv = emulate(lib, k, v, root, t, mask, m, kv_chunk)
    want = oracle(k, v, root, t, mask, m, torch.float64)
    base = [x.to(k.dtype) for x in oracle(k, v, root, t, mask, m, torch.float32)]
    for name, got, w, bl in zip(("dk", "dv"), (dk, dv), want, base):
        assert_close_to_oracle(got, w, baseline=bl, factor=FACTOR, floor=FLOOR, name=name)


@pytest.mark.parametrize("d, m, hq, hkv, dtype, kv_chunk, padded", [
    (64, 16, 1, 1, torch.float16, 128, False),    # resident landmarks in 32-landmark passes, two k/v stages, splits
    (64, 32, 2, 1, torch.bfloat16, 128, True),    # the same for two q heads (64 rows), padding
    (64, 48, 1, 1, torch.float16, 128, False),    # resident, one pass of 64 landmarks (48 of them real)
    (128, 32, 2, 1, torch.bfloat16, 128, True),   # two q heads resident (64 rows), one stage (D 128), padding
    (128, 64, 1, 1, torch.float16, 128, False),   # resident, two passes of 32 landmarks (D 128)
    (64, 80, 1, 1, torch.float16, 192, False),    # restaged: passes of 64 and 16 landmarks, a split of three tiles
    (32, 20, 3, 1, torch.float16, 64, True),      # restaged (3 x 32 rows), one tile per block, an exact sequence
    (128, 40, 2, 1, torch.float16, 256, False),   # restaged at D 128: passes of 32 and 8, one split
    (128, 12, 2, 1, torch.bfloat16, 128, True),   # two q heads of 12 landmarks resident (2 x 32 rows), padding
    (64, 16, 4, 1, torch.float16, 128, False),    # four q heads of 16: restaged (4 x 32 rows exceed the stage)
])
def test_dk_dv_kernel_against_the_oracle(paths_emulator, d, m, hq, hkv, dtype, kv_chunk, padded):
    b, n = 2, 200  # four key tiles, the last one of 8 keys
    mask = None
    if padded:
        mask = make_padding(b, n, min_real=n // 2, seed=d)
        mask[1] = torch.arange(n) < min(m, 20)  # few real tokens: the exact path where m allows it
    k, v, root, t = stage_inputs(b, hq, hkv, n, m, d, dtype, mask, seed=d + m)
    check_key_gradients(paths_emulator, k, v, root, t, mask, m, kv_chunk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dk_dv_kernel_needs_every_halves_product(paths_emulator, dtype):
    """Near-uniform K3 (tiny Q̃) and dW0 with a rank-one part 50x larger, where dv = K3ᵀ dW0 cancels: dropping either
    residual product of dv fails this case (scripts/nystrom_tc_precision.py: 17-25x the bound)."""
    b, hq, hkv, n, m, d = 1, 1, 1, 333, 16, 64
    k, v, root, t = stage_inputs(b, hq, hkv, n, m, d, dtype, None, seed=7, land_scale=1e-3, rank_one=50.0)
    check_key_gradients(paths_emulator, k, v, root, t, None, m, 128)


def buffer_inputs(b, hq, n, slots, nvalid, d, dtype, dout_scale, seed):
    """q, dO (dO x dout_scale), the key/value buffers (B, Hq, slots, D) fp32 with nvalid (B,) valid rows, and K1's row
    statistics lse1, Δ1 (B Hq, N) consistent with them."""
    q, _, _ = cpu_inputs(b, hq, hq, n, n, d, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)  # not q's stream: dO equal to q would hide a swap of the two tiles
    dout = (torch.randn(b, hq, n, d, generator=g) * dout_scale).to(dtype)
    keys = torch.randn(b, hq, slots, d, generator=g) * d ** -0.25
    vals = torch.randn(b, hq, slots, d, generator=g)
    nvalid = torch.tensor(nvalid, dtype=torch.int32)
    lse1, delta1 = stats_oracle(q, dout, keys, vals, nvalid, torch.float64)
    return q, dout, keys, vals, nvalid, lse1.float(), delta1.float()


def stats_oracle(q, dout, keys, vals, nvalid, precision):
    """K1's row statistics (B Hq, N): lse1 = log2 Σ_c 2^(base-2 logit) (+inf for a row with no valid slot, as the
    row-statistics kernel writes) and Δ1 = dO · (P vals)."""
    root = q.shape[-1] ** -0.25
    p = buffer_probabilities(q, keys, nvalid, root, precision)
    delta1 = (p * (dout.to(precision) @ vals.to(precision).transpose(-1, -2))).sum(-1)
    lse1 = buffer_logits(q, keys, nvalid, root, precision).logsumexp(-1) / math.log(2)
    lse1 = lse1.masked_fill(lse1 == -math.inf, math.inf)
    return lse1.flatten(0, 1), delta1.flatten(0, 1)


def buffer_logits(q, keys, nvalid, root, precision):
    """Base-2 logits of q against the valid buffer rows (B, Hq, N, slots), -inf past nvalid."""
    logits = (q.to(precision) @ keys.to(precision).transpose(-1, -2)) * root * math.log2(math.e)
    valid = torch.arange(keys.shape[2])[None, :] < nvalid[:, None]
    return logits.masked_fill(~valid[:, None, None, :], -math.inf) * math.log(2)


def buffer_probabilities(q, keys, nvalid, root, precision):
    return torch.softmax(buffer_logits(q, keys, nvalid, root, precision), -1).nan_to_num(0.0)


def dS1(q, dout, keys, vals, nvalid, lse1, delta1, root, precision):
    """P and dS1 (B, Hq, N, slots) from the given row statistics."""
    logits = buffer_logits(q, keys, nvalid, root, precision) / math.log(2)
    p = torch.exp2(logits - lse1.to(precision).view(logits.shape[:3])[..., None])
    dp = dout.to(precision) @ vals.to(precision).transpose(-1, -2)
    return p, p * (dp - delta1.to(precision).view(logits.shape[:3])[..., None])


def k1_oracle(q, dout, keys, vals, nvalid, lse1, delta1, a_chunk, precision):
    """(splits, B Hq, slots, D) partial d keys and d vals."""
    b, hq, n, d = q.shape
    root = d ** -0.25
    p, ds = dS1(q, dout, keys, vals, nvalid, lse1, delta1, root, precision)
    dkeys, dvals = [], []
    for q0 in range(0, n, a_chunk):
        rows = slice(q0, min(q0 + a_chunk, n))
        dvals.append((p[:, :, rows].transpose(-1, -2) @ dout[:, :, rows].to(precision)).flatten(0, 1))
        dkeys.append((ds[:, :, rows].transpose(-1, -2) @ q[:, :, rows].to(precision)).flatten(0, 1) * root)
    return torch.stack(dkeys), torch.stack(dvals)


@pytest.mark.parametrize("d, dtype, slots, nvalid, a_chunk, dout_scale, delta", [
    (64, torch.float16, 32, [32, 32], 128, 1.0, False),     # two-warp blocks; two query splits, the second partial
    (128, torch.bfloat16, 70, [70, 41], 64, 1.0, False),    # four warps: two slot tiles (64 + 6), fewer valid rows
    (32, torch.float16, 16, [9, 0], 256, 1.0, False),       # one split; a batch without valid rows; an idle warp
    (64, torch.float16, 32, [32, 20], 128, 1e-4, False),    # tiny dO: dS1 among fp16's subnormals unless rows scaled
    (64, torch.float16, 32, [32, 20], 128, 1.0, True),      # Δ1 summed over the two warps' slots
    (32, torch.float16, 16, [9, 0], 256, 1.0, True),        # the same with an idle warp; a batch without valid rows
    (128, torch.bfloat16, 48, [48, 30], 64, 1.0, True),     # four warps, the last idle in batch 1; four splits
    (64, torch.float16, 64, [64, 40], 128, 1.0, True),      # four warps, one slot tile, fused; two splits
    (32, torch.bfloat16, 40, [40, 0], 128, 1.0, False),     # four warps at D 32; a batch without valid rows
])
def test_buffer_gradient_kernel_against_the_oracle(emulator, d, dtype, slots, nvalid, a_chunk, dout_scale, delta):
    """With `delta` (the fused instance) the kernel sums Δ1 itself (one slot tile) and writes it for every query row
    of a sequence with valid slots, and writes dq's buffer part √scale dS1 keys for every query row (zeros without
    valid slots); else it reads the given Δ1 and leaves dq alone."""
    b, hq, n = 2, 2, 200
    q, dout, keys, vals, nv, lse1, delta1 = buffer_inputs(b, hq, n, slots, nvalid, d, dtype, dout_scale, seed=d)
    given = nan_like(delta1) if delta else delta1
    splits = -(-n // a_chunk)
    part_dkeys = nan_like(keys, (splits, b * hq, slots, d), torch.float32)
    part_dvals = nan_like(keys, (splits, b * hq, slots, d), torch.float32)
    dq = nan_like(q)
    rc = emulator.nystrom_k1_bwd(int(dtype == torch.bfloat16), d, b, hq, n, slots, ctypes.c_float(d ** -0.25), a_chunk,
                                 int(delta), ptr(q), ptr(dout), ptr(keys), ptr(vals), ptr(nv), ptr(lse1), ptr(given),
                                 ptr(part_dkeys), ptr(part_dvals), ptr(dq))
    check_rc(rc, "nystrom_k1_bwd")
    if not delta:
        assert torch.isnan(dq).all()
    else:
        args = (q, dout, keys, vals, nv, lse1, delta1)
        root = d ** -0.25
        assert_close_to_oracle(dq, dq_buffer_part(*args, torch.float64) * root,
                               baseline=(dq_buffer_part(*args, torch.float32) * root).to(dtype), factor=FACTOR,
                               floor=FLOOR * dout_scale, name="dq")
    if delta:
        rows = (nv > 0).repeat_interleave(hq)  # (B Hq,): sequences with valid slots; the others' rows stay unwritten
        want_delta = stats_oracle(q, dout, keys, vals, nv, torch.float64)[1]
        assert torch.isnan(given[~rows]).all()
        assert_close_to_oracle(given[rows], want_delta[rows], rtol=SPLIT_RTOL[dtype], name="delta1")
    want = k1_oracle(q, dout, keys, vals, nv, lse1, delta1, a_chunk, torch.float64)
    for name, got, w in zip(("d keys", "d vals"), (part_dkeys, part_dvals), want):
        assert_close_to_oracle(got, w, rtol=SPLIT_RTOL[dtype], name=name)


# of max|oracle|: fp32 sums of products whose fp32 factor is split into two 16-bit halves, which keep ~22 bits in fp16
# and ~16 in bf16 (2^-16 = 1.5e-5 per product; measured 4e-6 of the maximum at D 128 in k1)
SPLIT_RTOL = {torch.float16: 2e-6, torch.bfloat16: 2e-5}


def dq_buffer_part(q, dout, keys, vals, nvalid, lse1, delta1, precision):
    """dS1 keys (B, Hq, N, D), without √scale."""
    _, ds = dS1(q, dout, keys, vals, nvalid, lse1, delta1, q.shape[-1] ** -0.25, precision)
    return ds @ keys.to(precision)


def dq_oracle(q, dout, keys, vals, nvalid, lse1, delta1, mask, m, dql, precision):
    b, hq, n, d = q.shape
    root = d ** -0.25
    dq = dq_buffer_part(q, dout, keys, vals, nvalid, lse1, delta1, precision)
    real = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    n_real = real.sum(1)
    counts = segment_counts(n_real, m).to(precision)
    for bi in range(b):
        nr = int(n_real[bi])
        if nr <= m:
            continue
        ranks = torch.cumsum(real[bi].long(), 0) - 1
        for i in range(n):
            if real[bi, i]:
                lt = min(int(ranks[i]) // max(nr // m, 1), m - 1)
                dq[bi, :, i] += dql[bi, :, lt].to(precision) / counts[bi, lt].clamp_min(1)
    return dq * root


@pytest.mark.parametrize("d, dtype, m, padded, blocks_per_head, stages, dout_scale", [
    (64, torch.float16, 32, False, 1, 2, 1.0),   # one block walks both query tiles (128 + 72), the second copied early
    (64, torch.float16, 32, False, 1, 1, 1.0),   # the same, each tile copied after the last
    (128, torch.bfloat16, 40, True, 2, 1, 1.0),  # slots in two chunks of 32 (+ 8); padding and an exact sequence
    (64, torch.float16, 32, False, 2, 2, 1e-4),  # tiny dO: dS1's fp16 halves lose less than dq's own rounding
])
def test_query_gradient_kernel_against_the_oracle(emulator, d, dtype, m, padded, blocks_per_head, stages, dout_scale):
    b, hq, n = 2, 2, 200
    mask = None
    if padded:
        mask = make_padding(b, n, min_real=n // 2, seed=d)
        mask[1] = torch.arange(n) < m - 5  # an exact sequence: its buffer holds its m - 5 real tokens
    real = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    n_real = real.sum(1).int()
    nvalid = torch.minimum(n_real, torch.tensor(m)).tolist()
    q, dout, keys, vals, nv, lse1, delta1 = buffer_inputs(b, hq, n, m, nvalid, d, dtype, dout_scale, seed=d + 1)
    dql = torch.randn(b, hq, m, d, generator=torch.Generator().manual_seed(d)) * dout_scale
    exact = (n_real <= m).to(torch.uint8)
    counts = segment_counts(n_real, m)
    if mask is not None:
        mask_u8, cumsum, n_real_arg = mask.to(torch.uint8), torch.cumsum(mask.int(), 1).int(), n_real
    else:
        mask_u8 = cumsum = n_real_arg = None
    dq = nan_like(q)
    rc = emulator.nystrom_dq_bwd(int(dtype == torch.bfloat16), d, b, hq, n, m, m, ctypes.c_float(d ** -0.25),
                                 blocks_per_head, stages, ptr(q), ptr(dout), ptr(keys), ptr(vals), ptr(nv), ptr(lse1),
                                 ptr(delta1), ptr(mask_u8), ptr(cumsum), ptr(n_real_arg), ptr(exact), ptr(dql),
                                 ptr(counts), ptr(dq))
    check_rc(rc, "nystrom_dq_bwd")
    args = (q, dout, keys, vals, nv, lse1, delta1, mask, m, dql)
    assert_close_to_oracle(dq, dq_oracle(*args, torch.float64), baseline=dq_oracle(*args, torch.float32).to(dtype),
                           factor=FACTOR, floor=FLOOR * dout_scale, name="dq")


def k3_logits(q_land, k, mask, root):
    """Base-2 scores of the scaled landmarks against the keys (B, Hq, m, N), -inf at padded keys."""
    groups = q_land.shape[1] // k.shape[1]
    logits = (q_land.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2)) * root * math.log2(math.e)
    return logits if mask is None else logits.masked_fill(~mask[:, None, None, :], -math.inf)


def splits_of(n, chunk):
    return [slice(k0, min(k0 + chunk, n)) for k0 in range(0, n, chunk)]


@pytest.mark.parametrize("d, dtype, m, hq, hkv, chunk, padded", [
    (64, torch.float16, 32, 1, 1, 128, True),    # two-warp blocks; a split of padding only
    (128, torch.bfloat16, 80, 2, 2, 64, False),  # four warps: two landmark tiles (64 + 16), four key splits
    (32, torch.float16, 16, 2, 1, 256, False),   # GQA 2:1, one split; the second warp holds no landmark
])
def test_k3_forward_kernel_against_the_oracle(emulator, d, dtype, m, hq, hkv, chunk, padded):
    """Per key split and landmark row: the running maximum M, the sum Σ 2^(s - M) and Σ 2^(s - M) v, compared as
    sum 2^(M - M_oracle) and acc 2^(M - M_oracle) (the kernel may settle on a maximum one rounding away)."""
    b, n = 2, 200
    mask = None
    if padded:
        mask = make_padding(b, n, min_real=n // 2, seed=d)
        mask[1] = torch.arange(n) < 60  # the second split of batch 1 holds padding only
    k, v, root, t = stage_inputs(b, hq, hkv, n, m, d, dtype, mask, seed=d + m)
    splits = splits_of(n, chunk)
    part_max = nan_like(k, (len(splits), b * hq, m), torch.float32)
    part_sum = nan_like(k, (len(splits), b * hq, m), torch.float32)
    part_acc = nan_like(k, (len(splits), b * hq, m, d), torch.float32)
    mask_u8 = None if mask is None else mask.to(torch.uint8).contiguous()
    rc = emulator.nystrom_k3_fwd(int(dtype == torch.bfloat16), d, b, hq, hkv, n, m, ctypes.c_float(root), chunk,
                                 ptr(k), ptr(v), ptr(mask_u8), ptr(t["q_land"].contiguous()), ptr(part_max),
                                 ptr(part_sum), ptr(part_acc))
    check_rc(rc, "nystrom_k3_fwd")
    logits = k3_logits(t["q_land"], k, mask, root)
    vg = v.double().repeat_interleave(hq // hkv, 1)
    for s, keys in enumerate(splits):
        x = logits[..., keys]
        top = x.amax(-1)  # (B, Hq, m)
        empty = top == -math.inf
        w = torch.exp2(x - top.masked_fill(empty, 0.0)[..., None])
        want_sum, want_acc = w.sum(-1).flatten(0, 1), (w @ vg[:, :, keys]).flatten(0, 1)
        got_max = part_max[s].double()
        assert torch.equal(got_max == -math.inf, empty.flatten(0, 1)), "splits without a real key"
        shift = torch.exp2(got_max - top.flatten(0, 1)).masked_fill(empty.flatten(0, 1), 0.0)
        assert_close_to_oracle(part_sum[s].double() * shift, want_sum, rtol=K3_RTOL[dtype], name=f"sum, split {s}")
        assert_close_to_oracle(part_acc[s].double() * shift[..., None], want_acc, rtol=K3_RTOL[dtype],
                               name=f"acc, split {s}")


# of max|oracle|: the landmarks and the probabilities split into two 16-bit halves (fp16 ~22 bits, bf16 ~16)
K3_RTOL = {torch.float16: 1e-5, torch.bfloat16: 1e-4}


@pytest.mark.parametrize("d, dtype, m, hq, hkv, chunk, padded", [
    (64, torch.float16, 32, 1, 1, 128, True),    # two-warp blocks; an exact sequence writes zeros
    (128, torch.bfloat16, 70, 2, 2, 64, False),  # four warps: two landmark tiles (64 + 6), four key splits
    (128, torch.float16, 64, 1, 1, 192, True),   # four warps at D 128 (one k/v buffer): a split of three key tiles
    (32, torch.float16, 20, 2, 1, 256, True),    # GQA 2:1, one split, padding; the second warp holds 4 landmarks
])
def test_k3_backward_kernel_against_the_oracle(emulator, d, dtype, m, hq, hkv, chunk, padded):
    """Per key split: dQ̃[l] = √scale Σ_j dS3[l, j] k[j] over its real keys, dS3 = K3 ∘ (dW0 vᵀ - rowdot)."""
    b, n = 2, 200
    mask = None
    if padded:
        mask = make_padding(b, n, min_real=n // 2, seed=d)
        mask[1] = torch.arange(n) < m - 3  # n <= m real tokens: the exact path, no landmark gradient
    k, v, root, t = stage_inputs(b, hq, hkv, n, m, d, dtype, mask, seed=d + m)
    real = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    exact = (real.sum(1) <= m).to(torch.uint8)
    splits = splits_of(n, chunk)
    part_dql = nan_like(k, (len(splits), b * hq, m, d), torch.float32)
    mask_u8 = None if mask is None else mask.to(torch.uint8).contiguous()
    rc = emulator.nystrom_k3_bwd(int(dtype == torch.bfloat16), d, b, hq, hkv, n, m, ctypes.c_float(root), chunk,
                                 ptr(k), ptr(v), ptr(mask_u8), ptr(t["q_land"].contiguous()), ptr(exact),
                                 ptr(t["dw0"].contiguous()), ptr(t["lse3"].contiguous()),
                                 ptr(t["rowdot"].contiguous()), ptr(part_dql))
    check_rc(rc, "nystrom_k3_bwd")
    groups = hq // hkv
    kg, vg = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    k3 = torch.exp2(k3_logits(t["q_land"], k, mask, root) - t["lse3"].double()[..., None])
    ds3 = k3 * (t["dw0"].double() @ vg.transpose(-1, -2) - t["rowdot"].double()[..., None])
    ds3 = ds3 * (1 - exact.double())[:, None, None, None]
    for s, keys in enumerate(splits):
        want = (ds3[..., keys] @ kg[:, :, keys]).flatten(0, 1) * root
        assert_close_to_oracle(part_dql[s], want, rtol=SPLIT_RTOL[dtype], name=f"dQ̃, split {s}")


def out_oracle(q, v, keys, vals, nvalid, conv, mask, precision):
    """softmax(q keysᵀ √scale) vals over the valid buffer rows (0 where none), plus the conv residual
    Σ_tap conv[h, tap] v[i + tap - ks // 2] over the real tokens inside the sequence."""
    b, hq, n, d = q.shape
    out = buffer_probabilities(q, keys, nvalid, d ** -0.25, precision) @ vals.to(precision)
    if conv is None:
        return out
    vg = v.to(precision).repeat_interleave(hq // v.shape[1], 1)
    if mask is not None:
        vg = vg * mask[:, None, :, None]
    for tap in range(conv.shape[1]):
        shift = tap - conv.shape[1] // 2  # out[i] takes v[i + shift]
        shifted = torch.zeros_like(vg)
        if shift >= 0:
            shifted[:, :, :n - shift] = vg[:, :, shift:]
        else:
            shifted[:, :, -shift:] = vg[:, :, :n + shift]
        out = out + conv[:, tap].to(precision)[None, :, None, None] * shifted
    return out


# (d, dtype, slots, nvalid, blocks_per_head, stages, conv_ks, padded); N = 200: two query tiles of 128 and 72
QUERY_TILE_CASES = [
    (64, torch.float16, 32, [32, 32], 1, 2, None, False),   # one block walks both tiles, the second copied early
    (64, torch.float16, 32, [32, 20], 1, 1, 3, True),       # the same, each tile copied after the last; conv, padding
    (128, torch.bfloat16, 70, [70, 41], 2, 2, None, False),  # slots in chunks of 32 (+ 6); a tile per block
    (32, torch.float16, 16, [9, 0], 1, 2, 5, True),         # a batch without valid slots: its rows are the conv only
]


@pytest.mark.parametrize("d, dtype, slots, nvalid, blocks_per_head, stages, conv_ks, padded", QUERY_TILE_CASES)
def test_output_kernel_against_the_oracle(paths_emulator, d, dtype, slots, nvalid, blocks_per_head, stages, conv_ks,
                                          padded):
    """The output and, as the forward saves them for the backward, the rows' base-2 log-sum-exp (lse1)."""
    b, hq, hkv, n = 2, 2, 1, 200
    q, _, keys, vals, nv, _, _ = buffer_inputs(b, hq, n, slots, nvalid, d, dtype, 1.0, seed=d + slots)
    _, _, v = cpu_inputs(b, hkv, hkv, n, n, d, dtype=dtype, seed=d)
    conv = None if conv_ks is None else torch.randn(hq, conv_ks, generator=torch.Generator().manual_seed(d)) * 0.3
    mask = make_padding(b, n, min_real=n // 2, seed=d) if padded else None
    mask_u8 = None if mask is None else mask.to(torch.uint8)
    out, lse = nan_like(q), nan_like(q, (b * hq, n), torch.float32)
    rc = paths_emulator.nystrom_out_fwd(int(dtype == torch.bfloat16), d, b, hq, hkv, n, slots, ctypes.c_float(d ** -0.25),
                                  blocks_per_head, stages, ptr(q), ptr(v), ptr(keys), ptr(vals), ptr(nv), ptr(conv),
                                  0 if conv is None else conv_ks, ptr(mask_u8), ptr(out), ptr(lse))
    check_rc(rc, "nystrom_out_fwd")
    args = (q, v, keys, vals, nv, conv, mask)
    assert_close_to_oracle(out, out_oracle(*args, torch.float64), baseline=out_oracle(*args, torch.float32).to(dtype),
                           factor=FACTOR, floor=FLOOR, name="out")
    want_lse = stats_oracle(q, q, keys, vals, nv, torch.float64)[0]  # the backward's lse1 (dO unused)
    none = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), none) and (lse[none] > 0).all()
    assert_close_to_oracle(lse[~none], want_lse[~none], rtol=SPLIT_RTOL[dtype], name="lse")


@pytest.mark.parametrize("vals_scale", [3e5, 1e-7])
def test_output_kernel_values_beyond_fp16_range(paths_emulator, vals_scale):
    """The values enter the P values product in fp16 halves times the block's power of two (whatever the input
    dtype): values far above fp16's largest (3e5 > 65,504) or among its subnormals (1e-7, their residuals far below)
    keep the output's precision, per block (batch 0 scaled, batch 1 not). bf16 inputs, so the output can hold them."""
    b, hq, hkv, n, d, slots, dtype = 2, 2, 1, 200, 64, 40, torch.bfloat16
    q, _, keys, vals, nv, _, _ = buffer_inputs(b, hq, n, slots, [40, 33], d, dtype, 1.0, seed=5)
    vals[0] *= vals_scale
    _, _, v = cpu_inputs(b, hkv, hkv, n, n, d, dtype=dtype, seed=5)
    out, lse = nan_like(q), nan_like(q, (b * hq, n), torch.float32)
    rc = paths_emulator.nystrom_out_fwd(1, d, b, hq, hkv, n, slots, ctypes.c_float(d ** -0.25), 1, 2, ptr(q), ptr(v),
                                  ptr(keys), ptr(vals), ptr(nv), None, 0, None, ptr(out), ptr(lse))
    check_rc(rc, "nystrom_out_fwd")
    args = (q, v, keys, vals, nv, None, None)
    want, base = out_oracle(*args, torch.float64), out_oracle(*args, torch.float32).to(dtype)
    for bi in range(b):
        assert_close_to_oracle(out[bi], want[bi], baseline=base[bi], factor=FACTOR,
                               floor=FLOOR * float(want[bi].abs().max()), name=f"out, batch {bi}")


@pytest.mark.parametrize("d, dtype, slots, nvalid, blocks_per_head, stages", [c[:6] for c in QUERY_TILE_CASES])
def test_row_statistics_kernel_against_the_oracle(paths_emulator, d, dtype, slots, nvalid, blocks_per_head, stages):
    b, hq, n = 2, 2, 200
    q, dout, keys, vals, nv, _, _ = buffer_inputs(b, hq, n, slots, nvalid, d, dtype, 1.0, seed=d + slots)
    lse1 = nan_like(q, (b * hq, n), torch.float32)
    delta1 = nan_like(q, (b * hq, n), torch.float32)
    rc = paths_emulator.nystrom_stats_bwd(int(dtype == torch.bfloat16), d, b, hq, n, slots, ctypes.c_float(d ** -0.25),
                                    blocks_per_head, stages, ptr(q), ptr(dout), ptr(keys), ptr(vals), ptr(nv),
                                    ptr(lse1), ptr(delta1))
    check_rc(rc, "nystrom_stats_bwd")
    want_lse, want_delta = stats_oracle(q, dout, keys, vals, nv, torch.float64)
    none = torch.isinf(want_lse)  # rows with no valid slot: +inf and Δ1 = 0 exactly
    assert torch.equal(torch.isinf(lse1), none) and (lse1[none] > 0).all() and (delta1[none] == 0).all()
    assert_close_to_oracle(lse1[~none], want_lse[~none], rtol=SPLIT_RTOL[dtype], name="lse1")
    assert_close_to_oracle(delta1, want_delta, rtol=SPLIT_RTOL[dtype], name="delta1")



def landmark_oracle(x, real, m, root):
    """(B, H, m, D) float64: the means of each sequence's real rows in m segments (the last takes the remainder) times
    √scale, and the rows per segment (B, m)."""
    b, h, _, d = x.shape
    counts = segment_counts(real.sum(1), m)
    means = torch.zeros(b, h, m, d, dtype=torch.float64)
    for bi in range(b):
        rows = x[bi][:, real[bi]].double()
        start = 0
        for l in range(m):
            c = int(counts[bi, l])
            if c:
                means[bi, :, l] = rows[:, start:start + c].mean(1) * root
            start += c
    return means, counts


@pytest.mark.parametrize("d, dtype, n, m, threads, padded", [
    (64, torch.float16, 300, 3, 1024, False),    # blocks of 1,024 threads: 128 row slots, the last segment longer
    (128, torch.bfloat16, 333, 2, 1024, True),   # the same at D 128 (64 row slots) over the real rows only
    (32, torch.float16, 200, 1, 256, True),      # blocks of 256 threads, 64 row slots: one segment of ~150 rows
])
def test_landmark_kernel_against_the_oracle(emulator, d, dtype, n, m, threads, padded):
    b, hq, hkv = 2, 2, 1
    q, k, _ = cpu_inputs(b, hq, hkv, n, n, d, dtype=dtype, seed=d + m)
    mask = make_padding(b, n, min_real=n // 2, seed=d) if padded else None
    real = mask if mask is not None else torch.ones(b, n, dtype=torch.bool)
    if mask is not None:
        n_real = real.sum(1).int()
        pos = torch.zeros(b, n, dtype=torch.int32)
        for bi in range(b):
            idx = real[bi].nonzero().flatten().int()
            pos[bi, :len(idx)] = idx
    else:
        n_real = pos = None
    root = d ** -0.25
    q_land, k_land = nan_like(q, (b, hq, m, d), torch.float32), nan_like(q, (b, hkv, m, d), torch.float32)
    counts = nan_like(q, (b, m), torch.float32)
    rc = emulator.nystrom_landmark_fwd(int(dtype == torch.bfloat16), d, b, hq, hkv, n, m, ctypes.c_float(root), threads,
                                       ptr(q), ptr(k), ptr(n_real), ptr(pos), ptr(q_land), ptr(k_land), ptr(counts))
    check_rc(rc, "nystrom_landmark_fwd")
    for name, got, x in (("q landmarks", q_land, q), ("k landmarks", k_land, k)):
        want, want_counts = landmark_oracle(x, real, m, root)
        assert_close_to_oracle(got, want, rtol=LANDMARK_RTOL, name=name)
    assert torch.equal(counts, want_counts)


# of max|oracle|: fp32 sums of up to a few hundred 16-bit rows in a fixed order (~1e-7 relative each)
LANDMARK_RTOL = 1e-6


@pytest.mark.parametrize("splits, arrays", [(1, 1), (3, 2), (7, 1)])
def test_split_sum_kernel_against_the_oracle(emulator, splits, arrays):
    """Each array's splits summed in order into its first split; the other splits untouched."""
    gen = torch.Generator().manual_seed(splits)
    parts = [torch.randn(splits, 3, 40, 32, generator=gen) for _ in range(arrays)]
    before = [part.clone() for part in parts]
    rc = emulator.nystrom_split_sum(ptr(parts[0]), ptr(parts[1]) if arrays == 2 else None,
                                    ctypes.c_longlong(parts[0][0].numel()), splits)
    check_rc(rc, "nystrom_split_sum")
    for i, (part, old) in enumerate(zip(parts, before)):
        assert_close_to_oracle(part[0], old.double().sum(0), rtol=1e-6, name=f"array {i}: the sum")
        assert torch.equal(part[1:], old[1:]), f"array {i}: a later split changed"


@pytest.mark.parametrize("d, m, hq, hkv, add_vjp_to_dkl", [
    (32, 16, 4, 2, False),   # GQA 2:1; the second sequence exact (no landmark path)
    (64, 37, 2, 2, True),    # m not a multiple of 16 (a partial row block); d K̃'s VJP part added to dkl
    (128, 128, 2, 1, False),  # the largest m and D: 128 KB of shared memory per block; MQA 2:1
])
def test_landmark_stage_kernels_against_the_oracle(emulator, d, m, hq, hkv, add_vjp_to_dkl):
    """Before the Newton–Schulz VJP: d keys, d vals summed over each kv head's q heads (where Hq > Hkv), dZ = dW W0ᵀ,
    dW0 = Zᵀ dW, rowdot = rowsum(dW0 ∘ W0), d K̃'s buffer part (dW and it zero for exact sequences). After it: dS2 =
    K2 ∘ (dK2ᵢ - rowsum(K2 ∘ dK2ᵢ)), dQ̃ = K3's part + dS2 K̃, d K̃'s VJP part Σ_group dS2ᵀ Q̃."""
    b, groups = 2, hq // hkv
    gen = torch.Generator().manual_seed(d + m)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float32)  # noqa: E731
    exact = torch.tensor([0, int(not add_vjp_to_dkl)], dtype=torch.uint8)
    dkeys, dvals, w0, z = rand(b * hq, m, d), rand(b * hq, m, d), rand(b * hq, m, d), rand(b * hq, m, m) / m
    dkeys_kv, dvals_kv, dkl = (nan_like(w0, (b, hkv, m, d), torch.float32) for _ in range(3))
    dz, dw0, rowdot = (nan_like(w0, shape, torch.float32) for shape in ((b * hq, m, m), (b * hq, m, d), (b * hq, m)))
    rc = emulator.nystrom_landmark_vjp(d, b, hq, hkv, m, ptr(exact), ptr(dkeys), ptr(dvals), ptr(w0), ptr(z),
                                       ptr(dkeys_kv), ptr(dvals_kv), ptr(dz), ptr(dw0), ptr(rowdot), ptr(dkl))
    check_rc(rc, "nystrom_landmark_vjp")
    landmark = (1 - exact.double()).repeat_interleave(hq)[:, None, None]
    per_kv = lambda x: x.view(b, hkv, groups, m, -1).sum(2)  # noqa: E731
    dw = dvals.double() * landmark
    want_dw0 = z.double().transpose(-1, -2) @ dw
    rtol = 1e-5
    if groups > 1:
        assert_close_to_oracle(dkeys_kv, per_kv(dkeys.double()), rtol=rtol, name="d keys per kv head")
        assert_close_to_oracle(dvals_kv, per_kv(dvals.double()), rtol=rtol, name="d vals per kv head")
    assert_close_to_oracle(dkl, per_kv(dkeys.double() * landmark), rtol=rtol, name="d K̃, buffer part")
    assert_close_to_oracle(dz, dw @ w0.double().transpose(-1, -2), rtol=rtol, name="dZ")
    assert_close_to_oracle(dw0, want_dw0, rtol=rtol, name="dW0")
    assert_close_to_oracle(rowdot, (want_dw0 * w0.double()).sum(-1), rtol=rtol, name="rowdot")

    k2 = torch.softmax(rand(b * hq, m, m), -1)
    dk2, q_land, k_land, dql = rand(b * hq, m, m), rand(b * hq, m, d), rand(b, hkv, m, d), rand(b * hq, m, d)
    dql_before, dkl_before = dql.clone(), dkl.clone()
    dkl_vjp = nan_like(w0, (b, hkv, m, d), torch.float32)
    rc = emulator.nystrom_landmark_grads(d, b, hq, hkv, m, int(add_vjp_to_dkl), ptr(k2), ptr(dk2), ptr(q_land),
                                         ptr(k_land), ptr(dql), ptr(dkl), ptr(dkl_vjp))
    check_rc(rc, "nystrom_landmark_grads")
    k2d, dk2d = k2.double(), dk2.double()
    ds2 = k2d * (dk2d - (k2d * dk2d).sum(-1, keepdim=True))
    k_land_g = k_land.double().repeat_interleave(groups, 1).flatten(0, 1)
    assert_close_to_oracle(dql, dql_before.double() + ds2 @ k_land_g, rtol=rtol, name="dQ̃")
    vjp_part = per_kv(ds2.transpose(-1, -2) @ q_land.double())
    if add_vjp_to_dkl:
        assert_close_to_oracle(dkl, dkl_before.double() + vjp_part, rtol=rtol, name="d K̃ with its VJP part")
    else:
        assert_close_to_oracle(dkl_vjp, vjp_part, rtol=rtol, name="d K̃'s VJP part")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("m, kv_chunk", [(32, 128), (80, 192)])
def test_dk_dv_kernel_does_not_depend_on_the_thread_schedule(paths_emulator, monkeypatch, schedule, m, kv_chunk):
    # resident and restaged landmarks, two q heads, padding
    b, n, d = 2, 200, 64
    mask = make_padding(b, n, min_real=n // 2, seed=d)
    k, v, root, t = stage_inputs(b, 2, 1, n, m, d, torch.bfloat16, mask, seed=m)
    assert_same_under_schedule(monkeypatch, schedule, lambda: emulate(paths_emulator, k, v, root, t, mask, m, kv_chunk),
                               ("dk", "dv"))
