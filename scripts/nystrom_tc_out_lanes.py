"""Lane-level emulation of the tensor-core Nyström output kernel (csrc/nystrom/nystrom_tc_kernels.cuh): the query
fragments by ldmatrix, chunk_scores (keys high part + residual by ldmatrix), chunk_softmax (online over 64-row
chunks, columns >= nvalid masked), chunk_values (p's C registers as the tf32 A fragment with the k index permuted,
value B fragments from rows 2t, 2t + 1) and store_rows' columns, against the dense softmax(q keysᵀ scale) vals.

Two modes: exact (float64 values, splits exact: checks only the indexing, errors ~1e-15 when right) and rounded
(q and the key halves rounded to fp16 / bf16, tf32 halves by truncation as mma::tf32_split, fp32 accumulation not
modelled): the kernel's operand error against float64, next to the error of rounding the output to the dtype.
Run: python scripts/nystrom_tc_out_lanes.py (CPU, about a minute)."""
import numpy as np
import torch

from mma_lanes import G, TT, ldsm_x4, mma1688, mma16816

kWarps, kBQ, kChunk = 8, 128, 64


def round_to(x, dtype):
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).to(torch.float32).to(dtype).to(torch.float64).numpy()


def tf32_split(x):
    """mma::tf32_split: hi = x with the low 13 bits cleared, lo likewise of x - hi (fp32 arithmetic)."""
    x32 = np.asarray(x, dtype=np.float32)
    hi = (x32.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    lo = ((x32 - hi).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)
    return hi.astype(np.float64), lo.astype(np.float64)


def emulate(q, keys, vals, nvalid, scale_log2, dtype):
    """q (kBQ, D) one query tile; keys, vals (rows, D) the staged buffer (rows a multiple of 16). dtype None: exact."""
    rows, D = keys.shape
    kKey, kVal = D + 8, D + 4
    if dtype is None:
        qs, khi, klo, split = q, keys, np.zeros_like(keys), (lambda x: (np.asarray(x, np.float64), 0.0 * x))
    else:
        qs = round_to(q, dtype)
        khi = round_to(keys, dtype)
        klo = round_to(keys - khi, dtype)
        split = tf32_split
    pad = lambda a, width: np.concatenate([a, np.zeros((a.shape[0], width - a.shape[1]))], 1).ravel()
    qflat, khf, klf = pad(qs, kKey), pad(khi, kKey), pad(klo, kKey)
    vflat = pad(vals, kVal)
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
                    s[j][:, e] = pe
            for kk in range(kChunk // 8):
                if c0 + 8 * kk >= nvalid:
                    continue
                a = [split(s[kk][:, e]) for e in (0, 2, 1, 3)]
                ahi, alo = [x[0] for x in a], [x[1] for x in a]
                v0 = (c0 + 8 * kk + 2 * TT) * kVal + G
                for dn in range(D // 8):
                    b = [split(vflat[v0 + 8 * dn]), split(vflat[v0 + kVal + 8 * dn])]
                    bhi, blo = [x[0] for x in b], [x[1] for x in b]
                    mma1688(o[dn], ahi, bhi)
                    mma1688(o[dn], ahi, blo)
                    mma1688(o[dn], alo, bhi)
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


if __name__ == "__main__":
    main()
