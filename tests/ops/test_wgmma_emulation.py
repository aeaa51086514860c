"""The emulator's wgmma model (tests/ops/emulation/common/wgmma.cuh) against what the H200 did with the same kernel
(tests/ops/emulation/wgmma_product.cuh, run there by scripts/wgmma_check.cu on 2026-12-04, csrc/nystrom/NOTES.md):
of the four assignments of the two core-matrix distances to the A and B descriptors' fields, only k -> leading and
m/n -> stride gives the product, for fp16 and bf16 and B K-major or MN-major, with the accumulators where
csrc/common/wgmma.cuh says. A kernel checked in the emulator then reads its tiles as the GPU will."""
import ctypes

import numpy as np
import pytest

from tests.ops.emulation import build, check_rc

K_CORES, ROW_CORES = 128, 256  # the tiles' byte distances between core matrices adjacent in k and in m / n
ASSIGNMENTS = [(K_CORES, ROW_CORES), (ROW_CORES, K_CORES)]  # (leading field, stride field)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    lib = build("wgmma", tmp_path_factory.mktemp("emulation"))
    lib.wgmma_product.argtypes = [ctypes.c_int] * 2 + [ctypes.c_uint] * 4 + [ctypes.c_void_p] * 3
    return lib


def accumulators_as_matrix(out: np.ndarray) -> np.ndarray:
    """D (64 x 64) from the 128 threads' 32 accumulators: warp w rows 16w.., the m16n8 C layout per 8 columns."""
    d = np.full((64, 64), np.nan)
    for tid in range(128):
        w, g, t = tid // 32, (tid % 32) // 4, tid % 4
        for i in range(32):
            d[16 * w + g + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * t + i % 2] = out[tid, i]
    return d


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
def test_only_the_hardware_reading_of_the_descriptors_gives_the_product(emulator, bf16, trans_b):
    rng = np.random.default_rng(int(bf16) * 2 + int(trans_b))
    a = rng.integers(-8, 9, (64, 16)).astype(np.float32)
    b = rng.integers(-8, 9, (16, 64) if trans_b else (64, 16)).astype(np.float32)
    expected = a.astype(np.float64) @ (b if trans_b else b.T)
    exact = []
    for fa in ASSIGNMENTS:
        for fb in ASSIGNMENTS:
            out = np.full((128, 32), np.nan, dtype=np.float32)
            rc = emulator.wgmma_product(int(bf16), int(trans_b), *fa, *fb, a.ctypes.data, b.ctypes.data,
                                        out.ctypes.data)
            check_rc(rc, "wgmma_product")
            if np.array_equal(accumulators_as_matrix(out), expected):
                exact.append((fa, fb))
    assert exact == [((K_CORES, ROW_CORES), (K_CORES, ROW_CORES))]
