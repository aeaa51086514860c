"""Lane-level NumPy models of the mma.sync and ldmatrix fragments of common/mma.cuh (PTX ISA fragment layouts), for
the scripts that check a tensor-core kernel's indexing without a GPU. Registers are (32, 2) arrays of the two
16-bit values of each lane (low half first) or (32,) arrays for tf32; values stay float64."""
import numpy as np

LANES = np.arange(32)
G, TT = LANES // 4, LANES % 4


def mma16816(acc, a, b):
    """acc (32, 4) += A B; a: 4 regs (32, 2) [low, high], b: 2 regs (32, 2)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for j in range(2):
            A[g, 2 * t + j] = a[0][lane, j]
            A[g + 8, 2 * t + j] = a[1][lane, j]
            A[g, 2 * t + 8 + j] = a[2][lane, j]
            A[g + 8, 2 * t + 8 + j] = a[3][lane, j]
            B[2 * t + j, g] = b[0][lane, j]
            B[2 * t + 8 + j, g] = b[1][lane, j]
    Dm = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += [Dm[g, 2 * t], Dm[g, 2 * t + 1], Dm[g + 8, 2 * t], Dm[g + 8, 2 * t + 1]]


def mma1688(acc, a, b):
    """acc (32, 4) += A B, tf32: a 4 regs (32,), b 2 regs (32,)."""
    A = np.zeros((16, 8))
    B = np.zeros((8, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = a[0][lane], a[1][lane], a[2][lane], a[3][lane]
        B[t, g], B[t + 4, g] = b[0][lane], b[1][lane]
    Dm = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += [Dm[g, 2 * t], Dm[g, 2 * t + 1], Dm[g + 8, 2 * t], Dm[g + 8, 2 * t + 1]]


def ld32(tile, idx):
    """(32, 2): the pairs at flat indices idx (32,) of a flat tile."""
    return np.stack([tile[idx], tile[idx + 1]], 1)


def ldsm_x4(tile, addr):
    """ldmatrix.x4 (no transpose) of a flat 16-bit tile: lane l gives the flat index addr[l] of row l % 8 of matrix
    l // 8; returns 4 regs (32, 2), register i = matrix i's (row lane // 4, columns 2 (lane % 4) + {0, 1})."""
    regs = []
    for i in range(4):
        rows = np.stack([tile[addr[8 * i + r]: addr[8 * i + r] + 8] for r in range(8)])  # (8, 8)
        regs.append(np.stack([rows[G, 2 * TT], rows[G, 2 * TT + 1]], 1))
    return regs


def ldsm_x2(tile, addr):
    """ldmatrix.x2: as ldsm_x4 for matrices 0 and 1; lanes 16..31's addresses are ignored."""
    return ldsm_x4(tile, np.concatenate([addr[:16], addr[:16]]))[:2]


def ldsm_x4_trans(tile, addr):
    """ldmatrix.x4.trans: as ldsm_x4 with each 8 x 8 matrix transposed (register i = matrix i's (row 2 (lane % 4) +
    {0, 1}, column lane // 4))."""
    regs = []
    for i in range(4):
        rows = np.stack([tile[addr[8 * i + r]: addr[8 * i + r] + 8] for r in range(8)])
        regs.append(np.stack([rows[2 * TT, G], rows[2 * TT + 1, G]], 1))
    return regs
