"""Lane-level emulation of the tensor-core Nyström kernels (csrc/nystrom/nystrom_tc_kernels.cuh).

Output kernel: the query fragments by ldmatrix, chunk_scores (keys high part + residual by ldmatrix), chunk_softmax
(online over 32-row chunks, columns >= nvalid masked, P times 2^8), the P values product (p's C registers as the A
fragment in two fp16 halves, the values times the block's power of two 2^e in fp16 halves by ldmatrix.trans: hi hi +
hi lo + lo hi) and store_rows' columns, against the dense softmax(q keysᵀ scale) vals. K3 kernel: landmark_frags,
key tiles by ldmatrix, the bias of padded keys, the online softmax with fully masked tiles, P's C registers as the A
fragment and v by ldmatrix.trans, the partial (max, sum, acc), against the dense partial over the split's real keys.

Two modes: exact (float64 values, splits exact: checks only the indexing, errors ~1e-15 when right) and rounded
(q and the key halves rounded to fp16 / bf16, the P and value halves to fp16 as split_pair<__half>, fp32 accumulation
not modelled): the kernel's operand error against float64, next to the error of rounding the output to the dtype.
Run: python scripts/nystrom_tc_lanes.py (CPU, about a minute)."""
import numpy as np
import torch

from mma_lanes import G, TT, ldsm_x4, ldsm_x4_trans, mma16816

kWarps, kBQ, kChunk, kProbExp = 8, 128, 32, 8


def round_to(x, dtype):
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).to(torch.float32).to(dtype).to(torch.float64).numpy()


def fp16_split(x):
    """split_pair<__half>: hi = fp16(x), lo = fp16(x - hi) in fp32 arithmetic."""
    x32 = np.asarray(x, dtype=np.float32)
    hi = x32.astype(np.float16).astype(np.float32)
    return hi.astype(np.float64), (x32 - hi).astype(np.float16).astype(np.float64)


def value_exponent(vals):
    """fp16_exponent: e with max |vals| 2^e in [2^14, 2^15), at most 100; 0 where the maximum is inf."""
    mx = float(np.abs(vals).max()) if vals.size else 0.0
    if not np.isfinite(mx):
        return 0
    return min(15 - int(np.frexp(np.float32(mx))[1]), 100)


def emulate(q, keys, vals, nvalid, scale_log2, dtype):
    """q (kBQ, D) one query tile; keys, vals (rows, D) the staged buffer (rows a multiple of 16). dtype None: exact."""
    rows, D = keys.shape
    kKey = D + 8
    if dtype is None:
        qs, khi, klo, split = q, keys, np.zeros_like(keys), (lambda x: (np.asarray(x, np.float64), 0.0 * x))
    else:
        qs = round_to(q, dtype)
        khi = round_to(keys, dtype)
        klo = round_to(keys - khi, dtype)
        split = fp16_split
    e_val = value_exponent(vals[:nvalid])
    vhi, vlo = split(vals * 2.0 ** e_val)
    pad = lambda a, width: np.concatenate([a, np.zeros((a.shape[0], width - a.shape[1]))], 1).ravel()
    qflat, khf, klf, vhf, vlf = (pad(a, kKey) for a in (qs, khi, klo, vhi, vlo))
    out = np.zeros((kBQ, D))
    lane = np.arange(32)
    for warp in range(kWarps):
        arow = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8
        acol = (lane >> 4) * 8
        qa = [ldsm_x4(qflat, arow * kKey + 16 * kc + acol) for kc in range(D // 16)]
        m = np.full((32, 2), -np.inf)
        l = np.zeros((32, 2))
        o = [np.zeros((32, 4)) for _ in range(D // 8)]
        for c0 in range(0, nvalid, kChunk):
            s = [np.zeros((32, 4)) for _ in range(kChunk // 8)]
            brow = (lane & 7) + (lane >> 4) * 8
            bcol = ((lane >> 3) & 1) * 8
            for jj in range(kChunk // 16):
                if c0 + 16 * jj >= nvalid:
                    continue
                off = (c0 + 16 * jj + brow) * kKey + bcol
                for kc in range(D // 16):
                    for half in (khf, klf):
                        b = ldsm_x4(half, off + 16 * kc)
                        mma16816(s[2 * jj], qa[kc], [b[0], b[1]])
                        mma16816(s[2 * jj + 1], qa[kc], [b[2], b[3]])
            cmax = np.full((32, 2), -np.inf)
            for j in range(kChunk // 8):
                for e in range(4):
                    col = c0 + 8 * j + 2 * TT + (e & 1)
                    x = np.where(col < nvalid, s[j][:, e] * scale_log2, -np.inf)
                    s[j][:, e] = x
                    cmax[:, e >> 1] = np.maximum(cmax[:, e >> 1], x)
            for r in range(2):
                quad = np.repeat(cmax[:, r].reshape(8, 4).max(1), 4)
                m_new = np.maximum(m[:, r], quad)
                alpha = np.exp2(m[:, r] - m_new)
                m[:, r] = m_new
                l[:, r] *= alpha
                for dn in range(D // 8):
                    o[dn][:, 2 * r] *= alpha
                    o[dn][:, 2 * r + 1] *= alpha
            for j in range(kChunk // 8):
                for e in range(4):
                    pe = np.exp2(s[j][:, e] - m[:, e >> 1])
                    l[:, e >> 1] += pe
                    s[j][:, e] = pe * 2.0 ** kProbExp
            for kc in range(kChunk // 16):
                if c0 + 16 * kc >= nvalid:
                    continue
                # A fragment registers: (row g, k 0-7), (g + 8, 0-7), (g, 8-15), (g + 8, 8-15) of p's C registers
                a = [split(s[2 * kc + e // 2][:, 2 * (e % 2):2 * (e % 2) + 2]) for e in range(4)]
                ahi, alo = [x[0] for x in a], [x[1] for x in a]
                for dn in range(D // 16):
                    off = (c0 + 16 * kc + TROW) * kKey + 16 * dn + TCOL
                    bh, bl = ldsm_x4_trans(vhf, off), ldsm_x4_trans(vlf, off)
                    for x, b in ((ahi, bh), (ahi, bl), (alo, bh)):
                        mma16816(o[2 * dn], x, [b[0], b[1]])
                        mma16816(o[2 * dn + 1], x, [b[2], b[3]])
        for dn in range(D // 8):
            o[dn] *= 2.0 ** (-e_val - kProbExp)
        for r in range(2):
            total = np.repeat(l[:, r].reshape(8, 4).sum(1), 4)
            inv = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0)
            row = 16 * warp + G + 8 * r
            for dn in range(D // 8):
                out[row, 8 * dn + 2 * TT] = o[dn][:, 2 * r] * inv
                out[row, 8 * dn + 2 * TT + 1] = o[dn][:, 2 * r + 1] * inv
    return out


def dense(q, keys, vals, nvalid, scale_log2):
    if nvalid == 0:
        return np.zeros((q.shape[0], keys.shape[1]))
    s = q @ keys[:nvalid].T * scale_log2
    p = np.exp2(s - s.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True) @ vals[:nvalid]


def case(D, slots, nvalid, dtype, amplify, seed):
    rng = np.random.default_rng(seed)
    rows = (slots + 15) // 16 * 16
    q = rng.standard_normal((kBQ, D))
    if dtype is not None:
        q = round_to(q, dtype)  # the kernel's input is already in the dtype
    keys = np.zeros((rows, D))
    vals = np.zeros((rows, D))
    keys[:nvalid] = rng.standard_normal((nvalid, D)) * D ** -0.25
    # values like W = Z (K3 v) of an ill-conditioned K2: large entries that cancel
    base = rng.standard_normal((nvalid, D))
    vals[:nvalid] = base + amplify * rng.standard_normal((nvalid, 1)) * rng.standard_normal((1, D))
    scale_log2 = D ** -0.25 * 1.4426950408889634
    want = dense(q, keys, vals, nvalid, scale_log2)
    got = emulate(q, keys, vals, nvalid, scale_log2, dtype)
    norm = np.abs(want).max() if nvalid else 1.0
    err = np.abs(got - want).max() / norm
    out_rounding = np.abs(round_to(want, dtype) - want).max() / norm if dtype is not None else 0.0
    return err, out_rounding


def emulate_k3(land, k, v, real, scale_log2, dtype):
    """land (64, D) one block's landmarks; k, v (n, D) the split's keys; real (n,) bool. dtype None: exact.
    Returns the partial (max (64,), sum (64,), acc (64, D)) as the kernel writes it."""
    n, D = k.shape
    kRow, keys_per_tile = D + 8, 64
    if dtype is None:
        lhi, llo = land, np.zeros_like(land)
        ksr, vsr = k, v
        psplit = lambda x: (x, 0.0 * x)
    else:
        lhi = round_to(land, dtype)
        llo = round_to(land - lhi, dtype)
        ksr, vsr = round_to(k, dtype), round_to(v, dtype)
        psplit = lambda x: (round_to(x, dtype), round_to(x - round_to(x, dtype), dtype))
    pmax, psum, pacc = np.zeros(64), np.zeros(64), np.zeros((64, D))
    lane = np.arange(32)
    for warp in range(4):
        ahi, alo = [], []
        for kc in range(D // 16):
            regs_hi, regs_lo = [], []
            for e in range(4):
                row = 16 * warp + G + 8 * (e & 1)
                col = 16 * kc + 2 * TT + 8 * (e >> 1)
                regs_hi.append(np.stack([lhi[row, col], lhi[row, col + 1]], 1))
                regs_lo.append(np.stack([llo[row, col], llo[row, col + 1]], 1))
            ahi.append(regs_hi)
            alo.append(regs_lo)
        m = np.full((32, 2), -np.inf)
        l = np.zeros((32, 2))
        o = [np.zeros((32, 4)) for _ in range(D // 8)]
        brow, bcol = (lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8
        vrow, vcol = (lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8
        for k0 in range(0, n, keys_per_tile):
            kt = np.zeros((keys_per_tile, kRow))
            vt = np.zeros((keys_per_tile, kRow))
            count = min(keys_per_tile, n - k0)
            kt[:count, :D], vt[:count, :D] = ksr[k0:k0 + count], vsr[k0:k0 + count]
            kt, vt = kt.ravel(), vt.ravel()
            bias = np.full(keys_per_tile, -np.inf)
            bias[:count] = np.where(real[k0:k0 + count], 0.0, -np.inf)
            s = [np.zeros((32, 4)) for _ in range(keys_per_tile // 8)]
            for jj in range(keys_per_tile // 16):
                for kc in range(D // 16):
                    bf = ldsm_x4(kt, (16 * jj + brow) * kRow + 16 * kc + bcol)
                    for a in (ahi[kc], alo[kc]):
                        mma16816(s[2 * jj], a, [bf[0], bf[1]])
                        mma16816(s[2 * jj + 1], a, [bf[2], bf[3]])
            cmax = np.full((32, 2), -np.inf)
            for j in range(keys_per_tile // 8):
                for e in range(4):
                    x = s[j][:, e] * scale_log2 + bias[8 * j + 2 * TT + (e & 1)]
                    s[j][:, e] = x
                    cmax[:, e >> 1] = np.maximum(cmax[:, e >> 1], x)
            m_use = np.zeros((32, 2))
            for r in range(2):
                m_new = np.maximum(m[:, r], np.repeat(cmax[:, r].reshape(8, 4).max(1), 4))
                m_use[:, r] = np.where(m_new == -np.inf, 0.0, m_new)
                alpha = np.exp2(m[:, r] - m_use[:, r])
                m[:, r] = m_new
                l[:, r] *= alpha
                for dn in range(D // 8):
                    o[dn][:, 2 * r] *= alpha
                    o[dn][:, 2 * r + 1] *= alpha
            for kc in range(keys_per_tile // 16):
                phi, plo = [], []
                for e in range(4):
                    x = s[2 * kc + e // 2]
                    r = e % 2
                    p0, p1 = np.exp2(x[:, 2 * r] - m_use[:, r]), np.exp2(x[:, 2 * r + 1] - m_use[:, r])
                    l[:, r] += p0 + p1
                    (h0, l0), (h1, l1) = psplit(p0), psplit(p1)
                    phi.append(np.stack([h0, h1], 1))
                    plo.append(np.stack([l0, l1], 1))
                for dn in range(D // 16):
                    bv = ldsm_x4_trans(vt, (16 * kc + vrow) * kRow + 16 * dn + vcol)
                    for a in (phi, plo):
                        mma16816(o[2 * dn], a, [bv[0], bv[1]])
                        mma16816(o[2 * dn + 1], a, [bv[2], bv[3]])
        for r in range(2):
            row = 16 * warp + G + 8 * r
            pmax[row] = m[:, r]
            psum[row] = np.repeat(l[:, r].reshape(8, 4).sum(1), 4)
            for dn in range(D // 8):
                pacc[row, 8 * dn + 2 * TT] = o[dn][:, 2 * r]
                pacc[row, 8 * dn + 2 * TT + 1] = o[dn][:, 2 * r + 1]
    return pmax, psum, pacc


def k3_case(D, n, real_fraction, dtype, seed):
    rng = np.random.default_rng(seed)
    land = rng.standard_normal((64, D)) * D ** -0.25
    k = rng.standard_normal((n, D))
    v = rng.standard_normal((n, D))
    if dtype is not None:
        k, v = round_to(k, dtype), round_to(v, dtype)
    real = rng.random(n) < real_fraction
    real[:64] = False  # the first tile fully masked: the kernel's m_use guard
    scale_log2 = D ** -0.25 * 1.4426950408889634
    pmax, psum, pacc = emulate_k3(land, k, v, real, scale_log2, dtype)
    s = land @ k[real].T * scale_log2
    want_max = s.max(1)
    p = np.exp2(s - want_max[:, None])
    want = p @ v[real] / p.sum(1, keepdims=True)
    assert np.allclose(pmax, want_max, rtol=1e-5 if dtype else 1e-12, atol=1e-5 if dtype else 1e-12)
    got = pacc / psum[:, None]
    return np.abs(got - want).max() / np.abs(want).max()


LANE = np.arange(32)
AROW, ACOL = (LANE & 7) + ((LANE >> 3) & 1) * 8, (LANE >> 4) * 8  # A fragments by ldmatrix
BROW, BCOL = (LANE & 7) + (LANE >> 4) * 8, ((LANE >> 3) & 1) * 8  # B: tile rows as n
TROW, TCOL = (LANE & 7) + ((LANE >> 3) & 1) * 8, (LANE >> 4) * 8  # B by ldmatrix.trans: tile rows as k


def flat(a, D):
    """(rows, D) -> a flat 16-bit tile with rows D + 8 apart."""
    return np.concatenate([a, np.zeros((a.shape[0], 8))], 1).ravel()


def halves(a, D):
    """The two 16-bit halves of fp32 rows as staged tiles (exact mode: the values and zeros)."""
    return flat(a, D), np.zeros(a.shape[0] * (D + 8))


def halves_scores(a, y, z, warp, NT, D):
    """tc::halves_scores: s = (a0 + a1) yᵀ, dp = (a2 + a3) zᵀ for the warp's rows; returns (s, dp) as C registers."""
    kRow = D + 8
    s = [np.zeros((32, 4)) for _ in range(NT)]
    dp = [np.zeros((32, 4)) for _ in range(NT)]
    for kc in range(D // 16):
        af = [ldsm_x4(t, (16 * warp + AROW) * kRow + 16 * kc + ACOL) for t in a]
        for jj in range(NT // 2):
            by = ldsm_x4(y, (16 * jj + BROW) * kRow + 16 * kc + BCOL)
            bz = ldsm_x4(z, (16 * jj + BROW) * kRow + 16 * kc + BCOL)
            for part in range(2):
                mma16816(s[2 * jj], af[part], [by[0], by[1]])
                mma16816(s[2 * jj + 1], af[part], [by[2], by[3]])
                mma16816(dp[2 * jj], af[2 + part], [bz[0], bz[1]])
                mma16816(dp[2 * jj + 1], af[2 + part], [bz[2], bz[3]])
    return s, dp


def scores_against_halves(x, w, b, valid, warp, NT, D):
    """tc::scores_against_halves: s = x (b0 + b1)ᵀ, dp = w (b2 + b3)ᵀ, n-tile pairs at or past `valid` skipped."""
    kRow = D + 8
    s = [np.zeros((32, 4)) for _ in range(NT)]
    dp = [np.zeros((32, 4)) for _ in range(NT)]
    for kc in range(D // 16):
        ax = ldsm_x4(x, (16 * warp + AROW) * kRow + 16 * kc + ACOL)
        aw = ldsm_x4(w, (16 * warp + AROW) * kRow + 16 * kc + ACOL)
        for jj in range(NT // 2):
            if 16 * jj >= valid:
                continue
            off = (16 * jj + BROW) * kRow + 16 * kc + BCOL
            for part in range(2):
                bs, bd = ldsm_x4(b[part], off), ldsm_x4(b[2 + part], off)
                mma16816(s[2 * jj], ax, [bs[0], bs[1]])
                mma16816(s[2 * jj + 1], ax, [bs[2], bs[3]])
                mma16816(dp[2 * jj], aw, [bd[0], bd[1]])
                mma16816(dp[2 * jj + 1], aw, [bd[2], bd[3]])
    return s, dp


def halves_product(acc, x, b, b_lo, valid, NT, D):
    """tc::halves_product: acc += x (b + b_lo) with x's C registers as the A fragments and b by ldmatrix.trans (x exact
    here: its low half is 0); k-steps at or past `valid` skipped."""
    kRow = D + 8
    for kc in range(NT // 2):
        if 16 * kc >= valid:
            continue
        xa = [np.stack([x[2 * kc + e // 2][:, 2 * (e % 2)], x[2 * kc + e // 2][:, 2 * (e % 2) + 1]], 1) for e in range(4)]
        for dn in range(D // 16):
            off = (16 * kc + TROW) * kRow + 16 * dn + TCOL
            for tile in (b,) if b_lo is None else (b, b_lo):
                bf = ldsm_x4_trans(tile, off)
                mma16816(acc[2 * dn], xa, [bf[0], bf[1]])
                mma16816(acc[2 * dn + 1], xa, [bf[2], bf[3]])


def c_rows(out, acc, warp, D):
    """The warp's C-layout accumulators acc[dn] into rows 16 warp + g (+ 8) of out."""
    for r in range(2):
        row = 16 * warp + G + 8 * r
        for dn in range(D // 8):
            out[row, 8 * dn + 2 * TT], out[row, 8 * dn + 2 * TT + 1] = acc[dn][:, 2 * r], acc[dn][:, 2 * r + 1]


def emulate_k1(keys, vals, q, dout, lse, delta, nvalid, scale_log2, kQueries):
    """keys, vals (64, D) one block's slots (rows >= nvalid zero); q, dout (nq, D) the split's queries; lse, delta (nq,).
    Exact arithmetic. Returns the partial (d vals, d keys before the √scale factor), (64, D) each."""
    D, nq = keys.shape[1], q.shape[0]
    a = [*halves(keys, D), *halves(vals, D)]
    dvals, dkeys = np.zeros((64, D)), np.zeros((64, D))
    for warp in range(4):
        dv = [np.zeros((32, 4)) for _ in range(D // 8)]
        dk = [np.zeros((32, 4)) for _ in range(D // 8)]
        slot_ok = [16 * warp + G + 8 * r < nvalid for r in range(2)]
        for q0 in range(0, nq, kQueries):
            count = min(kQueries, nq - q0)
            qt, dt = np.zeros((kQueries, D)), np.zeros((kQueries, D))
            qt[:count], dt[:count] = q[q0:q0 + count], dout[q0:q0 + count]
            qt, dt = flat(qt, D), flat(dt, D)
            s, dp = halves_scores(a, qt, dt, warp, kQueries // 8, D)
            for j in range(kQueries // 8):
                for e in range(4):
                    c = 8 * j + 2 * TT + (e & 1)
                    ok = slot_ok[e >> 1] & (c < count)
                    cc = np.minimum(q0 + c, nq - 1)
                    pr = np.where(ok, np.exp2(s[j][:, e] * scale_log2 - lse[cc]), 0.0)
                    s[j][:, e] = pr
                    dp[j][:, e] = pr * (dp[j][:, e] - delta[cc])
            halves_product(dv, s, dt, None, kQueries, kQueries // 8, D)
            halves_product(dk, dp, qt, None, kQueries, kQueries // 8, D)
        c_rows(dvals, dv, warp, D)
        c_rows(dkeys, dk, warp, D)
    return dvals, dkeys


def k1_case(D, nq, nvalid, seed):
    rng = np.random.default_rng(seed)
    keys, vals = np.zeros((64, D)), np.zeros((64, D))
    keys[:nvalid] = rng.standard_normal((nvalid, D)) * D ** -0.25
    vals[:nvalid] = rng.standard_normal((nvalid, D))
    q, dout = rng.standard_normal((nq, D)), rng.standard_normal((nq, D))
    scale_log2 = D ** -0.25 * 1.4426950408889634
    s = q @ keys[:nvalid].T * scale_log2
    lse = np.log2(np.exp2(s).sum(1)) + rng.standard_normal(nq) * 0.1  # any row statistics: the kernel takes them
    delta = rng.standard_normal(nq)
    p = np.exp2(s - lse[:, None])
    ds = p * (dout @ vals[:nvalid].T - delta[:, None])
    want_v, want_k = np.zeros((64, D)), np.zeros((64, D))
    want_v[:nvalid], want_k[:nvalid] = p.T @ dout, ds.T @ q
    got_v, got_k = emulate_k1(keys, vals, q, dout, lse, delta, nvalid, scale_log2, 32 if D == 128 else 64)
    return max(np.abs(got_v - want_v).max() / np.abs(want_v).max(), np.abs(got_k - want_k).max() / np.abs(want_k).max())


def emulate_dq(q, dout, keys, vals, lse, delta, nvalid, scale_log2):
    """q, dout (128, D) one query tile; keys, vals (rows, D) the buffer; exact. Returns dS1 keys (128, D)."""
    D = keys.shape[1]
    kRow = D + 8
    b = [*halves(keys, D), *halves(vals, D)]
    qs, dos = flat(q, D), flat(dout, D)
    out = np.zeros((128, D))
    for warp in range(kWarps):
        ls = [lse[16 * warp + G + 8 * r] for r in range(2)]
        ds = [delta[16 * warp + G + 8 * r] for r in range(2)]
        acc = [np.zeros((32, 4)) for _ in range(D // 8)]
        for c0 in range(0, nvalid, kChunk):
            bc = [t[c0 * kRow:] for t in b]
            s, dp = scores_against_halves(qs, dos, bc, nvalid - c0, warp, kChunk // 8, D)
            for j in range(kChunk // 8):
                for e in range(4):
                    ok = c0 + 8 * j + 2 * TT + (e & 1) < nvalid
                    pr = np.where(ok, np.exp2(s[j][:, e] * scale_log2 - ls[e >> 1]), 0.0)
                    dp[j][:, e] = pr * (dp[j][:, e] - ds[e >> 1])
            halves_product(acc, dp, bc[0], bc[1], nvalid - c0, kChunk // 8, D)
        c_rows(out, acc, warp, D)
    return out


def dq_case(D, slots, nvalid, seed):
    rng = np.random.default_rng(seed)
    rows = (slots + 15) // 16 * 16
    keys, vals = np.zeros((rows, D)), np.zeros((rows, D))
    keys[:nvalid] = rng.standard_normal((nvalid, D)) * D ** -0.25
    vals[:nvalid] = rng.standard_normal((nvalid, D))
    q, dout = rng.standard_normal((128, D)), rng.standard_normal((128, D))
    scale_log2 = D ** -0.25 * 1.4426950408889634
    s = q @ keys[:nvalid].T * scale_log2
    lse = np.log2(np.exp2(s).sum(1))
    delta = rng.standard_normal(128)
    want = (np.exp2(s - lse[:, None]) * (dout @ vals[:nvalid].T - delta[:, None])) @ keys[:nvalid]
    got = emulate_dq(q, dout, keys, vals, lse, delta, nvalid, scale_log2)
    return np.abs(got - want).max() / np.abs(want).max()


def emulate_k3_bwd(land, dw0, k, v, real, lse, rowdot, scale_log2):
    """land, dw0 (64, D) one block's landmarks; k, v (n, D) the split's keys; real (n,) bool; exact.
    Returns dS3 k (64, D) before the √scale factor."""
    n, D = k.shape
    a = [*halves(land, D), *halves(dw0, D)]
    out = np.zeros((64, D))
    for warp in range(4):
        ls = [lse[16 * warp + G + 8 * r] for r in range(2)]
        rd = [rowdot[16 * warp + G + 8 * r] for r in range(2)]
        acc = [np.zeros((32, 4)) for _ in range(D // 8)]
        for k0 in range(0, n, 64):
            count = min(64, n - k0)
            kt, vt = np.zeros((64, D)), np.zeros((64, D))
            kt[:count], vt[:count] = k[k0:k0 + count], v[k0:k0 + count]
            kt, vt = flat(kt, D), flat(vt, D)
            bias = np.full(64, -np.inf)
            bias[:count] = np.where(real[k0:k0 + count], 0.0, -np.inf)
            s, dp = halves_scores(a, kt, vt, warp, 8, D)
            for j in range(8):
                for e in range(4):
                    pr = np.exp2(s[j][:, e] * scale_log2 + bias[8 * j + 2 * TT + (e & 1)] - ls[e >> 1])
                    dp[j][:, e] = pr * (dp[j][:, e] - rd[e >> 1])
            halves_product(acc, dp, kt, None, 64, 8, D)
        c_rows(out, acc, warp, D)
    return out


def k3_bwd_case(D, n, seed):
    rng = np.random.default_rng(seed)
    land = rng.standard_normal((64, D)) * D ** -0.25
    dw0 = rng.standard_normal((64, D))
    k, v = rng.standard_normal((n, D)), rng.standard_normal((n, D))
    real = rng.random(n) < 0.7
    scale_log2 = D ** -0.25 * 1.4426950408889634
    s = land @ k[real].T * scale_log2
    lse = np.log2(np.exp2(s).sum(1))
    rowdot = rng.standard_normal(64)
    want = (np.exp2(s - lse[:, None]) * (dw0 @ v[real].T - rowdot[:, None])) @ k[real]
    got = emulate_k3_bwd(land, dw0, k, v, real, lse, rowdot, scale_log2)
    return np.abs(got - want).max() / np.abs(want).max()


def emulate_kv(k, v, real, land, dw0, lse, rowdot, scale_log2, kLand):
    """k, v (64, D) one block's keys (exact); real (64,) bool; land, dw0 (m, D), lse, rowdot (m,) one q head.
    Returns (K3ᵀ dW0, dS3ᵀ Q̃) (64, D) each, as the kernel accumulates them before the epilogue."""
    D, m = k.shape[1], land.shape[0]
    kt, vt = flat(k, D), flat(v, D)
    out_v, out_k = np.zeros((64, D)), np.zeros((64, D))
    for warp in range(4):
        bias = [np.where(real[16 * warp + G + 8 * r], 0.0, -np.inf) for r in range(2)]
        dv = [np.zeros((32, 4)) for _ in range(D // 8)]
        dk = [np.zeros((32, 4)) for _ in range(D // 8)]
        for l0 in range(0, m, kLand):
            count = min(m - l0, kLand)
            lt, wt = np.zeros((kLand, D)), np.zeros((kLand, D))
            lt[:count], wt[:count] = land[l0:l0 + count], dw0[l0:l0 + count]
            b = [*halves(lt, D), *halves(wt, D)]
            ls, rd = np.zeros(kLand), np.zeros(kLand)
            ls[:count], rd[:count] = lse[l0:l0 + count], rowdot[l0:l0 + count]
            s, dp = scores_against_halves(kt, vt, b, count, warp, kLand // 8, D)
            for c in range(kLand // 8):
                for e in range(4):
                    col = 8 * c + 2 * TT + (e & 1)
                    pr = np.where(col < count, np.exp2(s[c][:, e] * scale_log2 + bias[e >> 1] - ls[col]), 0.0)
                    s[c][:, e] = pr
                    dp[c][:, e] = pr * (dp[c][:, e] - rd[col])
            halves_product(dv, s, b[2], b[3], count, kLand // 8, D)
            halves_product(dk, dp, b[0], b[1], count, kLand // 8, D)
        c_rows(out_v, dv, warp, D)
        c_rows(out_k, dk, warp, D)
    return out_v, out_k


def kv_case(D, m, seed):
    rng = np.random.default_rng(seed)
    k, v = rng.standard_normal((64, D)), rng.standard_normal((64, D))
    real = rng.random(64) < 0.8
    land, dw0 = rng.standard_normal((m, D)) * D ** -0.25, rng.standard_normal((m, D))
    scale_log2 = D ** -0.25 * 1.4426950408889634
    lse, rowdot = rng.standard_normal(m) + 3.0, rng.standard_normal(m)
    p = np.where(real[:, None], np.exp2(k @ land.T * scale_log2 - lse[None, :]), 0.0)  # K3ᵀ (keys x landmarks)
    want_v = p @ dw0
    want_k = (p * (v @ dw0.T - rowdot[None, :])) @ land
    got_v, got_k = emulate_kv(k, v, real, land, dw0, lse, rowdot, scale_log2, 32 if D == 128 else 64)
    return max(np.abs(got_v - want_v).max() / np.abs(want_v).max(), np.abs(got_k - want_k).max() / np.abs(want_k).max())


def main():
    for D, slots, nvalid in [(32, 7, 7), (64, 32, 32), (64, 128, 100), (128, 64, 64), (64, 128, 65), (32, 16, 0),
                             (128, 128, 128)]:
        err, _ = case(D, slots, nvalid, None, 0.0, D + slots)
        print(f"exact   D={D:3d} slots={slots:3d} nvalid={nvalid:3d}: max relative error {err:.1e}")
        assert err < 1e-12, "indexing"
    for dtype in (torch.float16, torch.bfloat16):
        for amplify in (0.0, 50.0):
            err, rounding = case(64, 64, 64, dtype, amplify, 7)
            print(f"rounded {str(dtype):14s} values x{amplify:4.0f}: kernel operands {err:.1e}, "
                  f"output rounding to the dtype {rounding:.1e}")
    for D, n, frac in [(32, 200, 0.7), (64, 130, 1.0), (128, 100, 0.5)]:
        err = k3_case(D, n, frac, None, D + n)
        print(f"K3 exact   D={D:3d} keys={n:3d}: max relative error of acc / sum {err:.1e}")
        assert err < 1e-12, "indexing"
    for dtype in (torch.float16, torch.bfloat16):
        print(f"K3 rounded {str(dtype):14s}: acc / sum relative error {k3_case(64, 200, 0.8, dtype, 3):.1e}")
    for D, nq, nvalid in [(32, 150, 64), (64, 70, 33), (128, 45, 64), (128, 100, 7)]:
        err = k1_case(D, nq, nvalid, D + nq)
        print(f"K1 exact   D={D:3d} queries={nq:3d} nvalid={nvalid:2d}: max relative error of d vals, d keys {err:.1e}")
        assert err < 1e-12, "indexing"
    for D, slots, nvalid in [(32, 7, 7), (64, 128, 100), (128, 64, 50), (64, 32, 32)]:
        err = dq_case(D, slots, nvalid, D + slots)
        print(f"dq exact   D={D:3d} slots={slots:3d} nvalid={nvalid:3d}: max relative error {err:.1e}")
        assert err < 1e-12, "indexing"
    for D, n in [(32, 150), (64, 64), (128, 100)]:
        err = k3_bwd_case(D, n, D + n)
        print(f"K3 bwd exact D={D:3d} keys={n:3d}: max relative error {err:.1e}")
        assert err < 1e-12, "indexing"
    for D, m in [(32, 40), (64, 128), (128, 100), (128, 16)]:
        err = kv_case(D, m, D + m)
        print(f"kv exact   D={D:3d} landmarks={m:3d}: max relative error of dv, dk {err:.1e}")
        assert err < 1e-12, "indexing"


if __name__ == "__main__":
    main()
