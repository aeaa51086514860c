"""Checks common/mma.cuh's load_a, load_b and load_b2 (ldmatrix, lane addresses as in the C++) against the 32-bit
loads they replace in the RACE tensor-core kernels, on random 16-bit tiles with the kernels' pitches (kX = D + 8,
kT = 72) and several (r0, k0) / (n0, n1, k0): the same registers, every row address 16-byte aligned, and the mma of
the loaded A and B equal to the dense product of the tiles' blocks. Exits 1 on a mismatch.
Run: python scripts/ldsm_fragments.py (CPU, a few seconds)."""
import sys

import numpy as np

from mma_lanes import G, LANES, TT, ld32, ldsm_x2, ldsm_x4, mma16816

rng = np.random.default_rng(0)
ROWS = 160


def a_ld32(tile, pitch, r0, k0):
    base = (r0 + G) * pitch + k0 + 2 * TT
    return [ld32(tile, base), ld32(tile, base + 8 * pitch), ld32(tile, base + 8), ld32(tile, base + 8 * pitch + 8)]


def b_ld32(tile, pitch, n0, k0):
    row = (n0 + G) * pitch + k0 + 2 * TT
    return [ld32(tile, row), ld32(tile, row + 8)]


def a_addr(pitch, r0, k0):
    return (r0 + (LANES & 7) + ((LANES >> 3) & 1) * 8) * pitch + k0 + (LANES >> 4) * 8


def b_addr(pitch, n0, k0):
    return (n0 + (LANES & 7)) * pitch + k0 + ((LANES >> 3) & 1) * 8


def b2_addr(pitch, n0, n1, k0):
    return (np.where(LANES >> 4, n1, n0) + (LANES & 7)) * pitch + k0 + ((LANES >> 3) & 1) * 8


def same(name, got, want):
    if all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)):
        return True
    print(f"MISMATCH {name}")
    return False


def aligned(name, addr):
    if np.all(addr * 2 % 16 == 0):
        return True
    print(f"UNALIGNED {name}: byte offsets {sorted(set((addr * 2 % 16).tolist()))}")
    return False


def check(pitch):
    ok = True
    tile = rng.permutation(ROWS * pitch).astype(np.float64)  # distinct values: any misplaced element shows
    other = rng.standard_normal(ROWS * pitch)
    dense, dense_b = tile.reshape(ROWS, pitch), other.reshape(ROWS, pitch)
    k0s = sorted({k for k in (0, 16, 48, pitch - 24) if k + 16 <= pitch - 8})
    for r0 in (0, 16, 48, 64, 112):
        for k0 in k0s:
            addr = a_addr(pitch, r0, k0)
            a = ldsm_x4(tile, addr)
            ok &= aligned(f"A pitch {pitch} r0 {r0} k0 {k0}", addr)
            ok &= same(f"A pitch {pitch} r0 {r0} k0 {k0}", a, a_ld32(tile, pitch, r0, k0))
            for n0 in (0, 8, 24, 56):
                addr = b_addr(pitch, n0, k0)
                b = ldsm_x2(other, addr)
                ok &= aligned(f"B pitch {pitch} n0 {n0} k0 {k0}", addr[:16])
                ok &= same(f"B pitch {pitch} n0 {n0} k0 {k0}", b, b_ld32(other, pitch, n0, k0))
                acc = np.zeros((32, 4))
                mma16816(acc, a, b)
                want = dense[r0:r0 + 16, k0:k0 + 16] @ dense_b[n0:n0 + 8, k0:k0 + 16].T
                got = np.zeros((16, 8))
                got[G, 2 * TT], got[G, 2 * TT + 1] = acc[:, 0], acc[:, 1]
                got[G + 8, 2 * TT], got[G + 8, 2 * TT + 1] = acc[:, 2], acc[:, 3]
                if not np.allclose(got, want, rtol=1e-12, atol=1e-9):
                    print(f"MISMATCH mma pitch {pitch} r0 {r0} n0 {n0} k0 {k0}")
                    ok = False
                for n1 in (n0 + 8, n0 + 24, n0 + 64):  # adjacent n-tiles; hi / lo planes; hi / lo halves of a tile
                    if n1 + 8 > ROWS:
                        continue
                    addr = b2_addr(pitch, n0, n1, k0)
                    b2 = ldsm_x4(other, addr)
                    ok &= aligned(f"B2 pitch {pitch} n0 {n0} n1 {n1} k0 {k0}", addr)
                    ok &= same(f"B2 pitch {pitch} n0 {n0} n1 {n1} k0 {k0}", b2,
                               b_ld32(other, pitch, n0, k0) + b_ld32(other, pitch, n1, k0))
    return ok


if __name__ == "__main__":
    pitches = (40, 72, 136)  # kX at D = 32, 64 (and kT), 128
    results = [check(p) for p in pitches]
    print(f"ldmatrix fragments vs 32-bit loads, pitches {pitches}: {'ok' if all(results) else 'MISMATCH'}")
    sys.exit(0 if all(results) else 1)
