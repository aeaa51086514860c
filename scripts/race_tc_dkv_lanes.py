"""Lane-level emulation of the fragment addressing of the tensor-core RACE key side (csrc/race/race_tc_bwd_kernels.cuh:
scores with phi(k) as A, split_product's C-to-A registers and row scaling, rows_dot with a transposed B (dO^T),
phi_frag both ways, state_frag, rows_times_state, query_state_delta with c^ in B columns 0/1) against the dense
per-tile math of chunk_dkv and the state advance. mma.sync semantics from the PTX fragment layouts (common/mma.cuh).
float64 values, T / tf32 halves replaced by exact splits: only indexing is checked (errors ~1e-16 when right).
Run: python scripts/race_tc_dkv_lanes.py (CPU, a few seconds)."""
import numpy as np

from mma_lanes import G, LANES, TT, ld32, mma1688, mma16816  # noqa: F401

rng = np.random.default_rng(0)
kC = kS = 64
kT = kC + 8


def c_to_dense(accs, ncols):
    """accs[warp][n] (32, 4) in the C layout -> dense (64, 8 * len)."""
    out = np.zeros((64, ncols))
    for w in range(4):
        for n, acc in enumerate(accs[w]):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for e in range(4):
                    r, c = 16 * w + g + 8 * (e // 2), n * 8 + 2 * t + (e & 1)
                    if c < ncols:
                        out[r, c] = acc[lane, e]
    return out


def scores(a, b):
    """a, b flat [64][kT] tiles; returns per warp sc[n] (32, 4)."""
    res = []
    for w in range(4):
        r0 = 16 * w
        sc = [np.zeros((32, 4)) for _ in range(kC // 8)]
        for kk in range(kS // 16):
            base = (r0 + G) * kT + kk * 16 + 2 * TT
            ar = [ld32(a, base), ld32(a, base + 8 * kT), ld32(a, base + 8), ld32(a, base + 8 * kT + 8)]
            for n in range(kC // 8):
                brow = (n * 8 + G) * kT + kk * 16 + 2 * TT
                mma16816(sc[n], ar, [ld32(b, brow), ld32(b, brow + 8)])
        res.append(sc)
    return res


def split_product(xs, b, b_lo, ncount, NN, split=0.5):
    """xs[w][n] (32, 4); b, b_lo flat [.][kT]; returns acc[w][n]."""
    res = []
    for w in range(4):
        x = xs[w]
        mx = np.zeros((32, 2))
        for n in range(kC // 8):
            for e in range(4):
                mx[:, e // 2] = np.maximum(mx[:, e // 2], np.abs(x[n][:, e]))
        for half in range(2):  # quad max
            q = mx[:, half].reshape(8, 4).max(1)
            mx[:, half] = np.repeat(q, 4)
        ex = np.floor(np.log2(np.where(mx > 0, mx, 1.0)))
        scale, unscale = 2.0 ** -ex, 2.0 ** ex
        acc = [np.zeros((32, 4)) for _ in range(NN)]
        for kk in range(kC // 16):
            hi, lo = [], []
            for r in range(4):
                x0 = x[2 * kk + r // 2][:, 2 * (r % 2)] * scale[:, r % 2]
                x1 = x[2 * kk + r // 2][:, 2 * (r % 2) + 1] * scale[:, r % 2]
                hi.append(np.stack([x0 * split, x1 * split], 1))
                lo.append(np.stack([x0 * (1 - split), x1 * (1 - split)], 1))
            for n in range(NN):
                if n >= ncount:
                    continue
                brow = (n * 8 + G) * kT + kk * 16 + 2 * TT
                bhi = [ld32(b, brow), ld32(b, brow + 8)]
                mma16816(acc[n], hi, bhi)
                if b_lo is not None:
                    blo = [ld32(b_lo, brow), ld32(b_lo, brow + 8)]
                    mma16816(acc[n], hi, blo)
                mma16816(acc[n], lo, bhi)  # the kernel drops lo * b_lo (callers here pass lo = 0 then)
        for n in range(NN):
            for e in range(4):
                acc[n][:, e] *= unscale[:, e // 2]
        res.append(acc)
    return res


def rows_dot_bt(a, bt, D):
    """a flat [64][D+8]; bt flat [D(+8)][kT] (transposed B); acc[w][n] over kC/8."""
    kX = D + 8
    res = []
    for w in range(4):
        r0 = 16 * w
        acc = [np.zeros((32, 4)) for _ in range(kC // 8)]
        for k0 in range(0, D, 16):
            base = (r0 + G) * kX + k0 + 2 * TT
            ar = [ld32(a, base), ld32(a, base + 8 * kX), ld32(a, base + 8), ld32(a, base + 8 * kX + 8)]
            for n in range(kC // 8):
                col = (k0 + 2 * TT) * kT + n * 8 + G
                br = [np.stack([bt[col], bt[col + kT]], 1), np.stack([bt[col + 8 * kT], bt[col + 9 * kT]], 1)]
                mma16816(acc[n], ar, br)
        res.append(acc)
    return res


def phi_frag(phi, ok, scale, m0, kk, rows_m, features):
    """phi (64 rows, kS) dense; returns 4 regs (32,)."""
    regs = []
    for r in range(4):
        mi = m0 + G + 8 * (r % 2)
        ki = kk * 8 + TT + 4 * (r // 2)
        row, f = (mi, ki) if rows_m else (ki, mi)
        val = phi[row, f] * (scale[row] if scale is not None else 1.0)
        val = np.where((f < features) & (ok[row] if ok is not None else True), val, 0.0)
        regs.append(val)
    return regs


def state_frag(st, kX, kk, n):
    col = (kk * 8 + TT) * kX + n * 8 + G
    return [st[col], st[col + 4 * kX]]


def rows_times_state(rows, st, nf, D):
    kX = D + 8
    res = []
    for w in range(4):
        r0 = 16 * w
        acc = [np.zeros((32, 4)) for _ in range(kS // 8)]
        for kk in range(D // 8):
            base = (r0 + G) * kX + kk * 8 + TT
            a = [rows[base], rows[base + 8 * kX], rows[base + 4], rows[base + 8 * kX + 4]]
            for n in range(kS // 8):
                if n >= nf:
                    continue
                row = (n * 8 + G) * kX + kk * 8 + TT
                mma1688(acc[n], a, [st[row], st[row + 4]])
        res.append(acc)
    return res


def query_state_delta(phi, inv, vt, chat, D, features):
    res = []
    for w in range(4):
        f0 = 16 * w
        acc = [np.zeros((32, 4)) for _ in range(D // 8 + 1)]
        if f0 >= features:
            res.append(acc)
            continue
        for kk in range(kC // 8):
            a = phi_frag(phi, None, inv, f0, kk, False, features)
            for n in range(D // 8):
                row = (n * 8 + G) * kT + kk * 8 + TT
                mma1688(acc[n], a, [vt[row], vt[row + 4]])
            c0, c1 = chat[kk * 8 + TT], chat[kk * 8 + TT + 4]
            chi0, clo0, chi1, clo1 = c0 * 0.75, c0 * 0.25, c1 * 0.75, c1 * 0.25
            b = [np.where(G == 0, chi0, np.where(G == 1, clo0, 0.0)), np.where(G == 0, chi1, np.where(G == 1, clo1, 0.0))]
            mma1688(acc[D // 8], a, b)
        res.append(acc)
    return res


def check(D, features):
    kX = D + 8
    nf = (features + 7) // 8
    phk = rng.random((64, kS)); phk[:, features:] = 0
    phq = rng.random((64, kS)); phq[:, features:] = 0
    okk = rng.random(64) > 0.2
    phk_ok = phk * okk[:, None]
    v = rng.standard_normal((64, D)) * okk[:, None]
    dO = rng.standard_normal((64, D))
    inv = rng.random(64) * 10.0 ** rng.integers(-6, 0, 64); inv[rng.random(64) < 0.1] = 0
    chat = rng.standard_normal(64)
    st = np.zeros((kS, kX)); st[:features, :D + 1] = rng.standard_normal((features, D + 1))
    # tiles as the kernel lays them out
    phk_t = np.zeros((64, kT)); phk_t[:, :kS] = phk_ok; phk_t = phk_t.ravel()
    phq_t = np.zeros((64, kT)); phq_t[:, :kS] = phq; phq_t = phq_t.ravel()
    pkt = np.zeros((2 * kS, kT)); pkt[:kS, :64] = 0.6 * phq.T; pkt[kS:, :64] = 0.4 * phq.T; pkt = pkt.ravel()
    vt = np.zeros((kX, kT)); vt[:D, :64] = dO.T; vt = vt.ravel()
    x = np.zeros((64, kX)); x[:, :D] = v; x = x.ravel()
    stf = st.ravel()
    tri = np.arange(64)[:, None] <= np.arange(64)[None, :]
    # dv
    sc = scores(phk_t, phq_t)
    for w in range(4):
        for n in range(8):
            for e in range(4):
                j = 16 * w + G + 8 * (e // 2)
                i = n * 8 + 2 * TT + (e & 1)
                sc[w][n][:, e] = np.where(j <= i, sc[w][n][:, e] * inv[i], 0.0)
    dv = split_product(sc, vt, None, D // 8, D // 8, split=0.7)
    for w in range(4):
        for kk in range(kS // 8):
            if kk >= nf:
                continue
            khi = phi_frag(phk, okk, None, 16 * w, kk, True, features)
            for n in range(D // 8):
                mma1688(dv[w][n], khi, state_frag(stf, kX, kk, n))
    dv_dense = c_to_dense(dv, D)
    a = (phk_ok @ phq.T) * tri
    want_dv = (a * inv[None, :]) @ dO + phk_ok @ st[:, :D]
    e_dv = np.abs(dv_dense - want_dv).max() / np.abs(want_dv).max()
    # dphi
    ds = rows_dot_bt(x, vt, D)
    for w in range(4):
        for n in range(8):
            for e in range(4):
                j = 16 * w + G + 8 * (e // 2)
                i = n * 8 + 2 * TT + (e & 1)
                ds[w][n][:, e] = np.where(j <= i, (ds[w][n][:, e] - chat[i]) * inv[i], 0.0)
    dphi = split_product(ds, pkt, pkt[kS * kT:], nf, kS // 8, split=1.0)  # lo = 0: hi b + hi b_lo = x (bhi + blo)
    rts = rows_times_state(x, stf, nf, D)
    for w in range(4):
        for n in range(8):
            dphi[w][n] += rts[w][n]
    dphi_dense = c_to_dense(dphi, kS)
    dsd = np.where(tri, (v @ dO.T - chat[None, :]) * inv[None, :], 0.0)
    want_dphi = dsd @ phq + v @ st[:, :D].T
    want_dphi[:, features:] = 0
    e_dphi = np.abs(dphi_dense - want_dphi).max() / np.abs(want_dphi).max()
    # state delta
    qs = query_state_delta(phq, inv, vt, chat, D, features)
    qd = c_to_dense(qs, D + 8)
    got_B, got_y = qd[:, :D], qd[:, D] + qd[:, D + 1]
    pt = phq * inv[:, None]
    want_B, want_y = pt.T @ dO, pt.T @ chat
    e_state = max(np.abs(got_B[:features] - want_B[:features]).max() / np.abs(want_B).max(),
                  np.abs(got_y[:features] - want_y[:features]).max() / np.abs(want_y).max(),
                  np.abs(qd[features:]).max() if features < 64 else 0.0)
    return e_dv, e_dphi, e_state


if __name__ == "__main__":
    for D, S in [(32, 2), (64, 64), (128, 12), (64, 40), (32, 24)]:
        errs = check(D, S)
        print(f"D={D} S={S}: relative max error dv {errs[0]:.1e}, dphi(k) {errs[1]:.1e}, state delta {errs[2]:.1e}")
        assert max(errs) < 1e-12
