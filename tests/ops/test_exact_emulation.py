"""The exact CUDA kernels on the CPU: csrc/exact/exact_kernels.cuh compiled by g++ with
tests/ops/emulation/cuda_on_cpu.h (every CUDA thread a fiber; barriers, warp shuffles and votes emulated) and
checked against the float64 oracle exactly as the GPU tests check the real kernels (tests/ops/test_exact_cuda.py).

So a tile layout, swizzle or reduce-scatter mistake fails on any machine, before GPU time is spent. What the
emulation cannot see (the memory model beyond barriers, timing) stays with the GPU tests. Needs g++ and the CUDA
headers (cuda_fp16.h): CUDA_HOME, /usr/local/cuda, or the nvidia-cuda-runtime wheel.
"""
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess

import pytest
import torch

from tests.inputs import make_padding
from tests.ops.cuda_helpers import make_inputs
from tests.ops.test_exact_cuda import check_against_oracle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "ops", "emulation")
SOURCES = [os.path.join(HERE, "exact_emulation.cpp"), os.path.join(HERE, "cuda_on_cpu.h"),
           os.path.join(ROOT, "csrc", "exact", "exact_kernels.cuh"), os.path.join(ROOT, "csrc", "common", "tile.cuh"),
           os.path.join(ROOT, "csrc", "common", "strides.cuh")]


def cuda_include():
    """A folder with cuda_fp16.h, or None."""
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"), "/usr/local/cuda/include"]
    try:
        import nvidia.cuda_runtime as runtime
        candidates += [os.path.join(p, "include") for p in runtime.__path__]
    except ImportError:
        pass
    candidates += glob.glob("/usr/local/cuda-*/include")
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "cuda_fp16.h"))), None)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    include = cuda_include()
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if include is None or compiler is None:
        pytest.skip(f"needs g++ ({compiler}) and the CUDA headers ({include}): set CUDA_HOME")
    digest = hashlib.sha1(b"".join(open(s, "rb").read() for s in SOURCES)).hexdigest()[:12]
    lib = str(tmp_path_factory.mktemp("emulation") / f"exact_emulation_{digest}.so")
    cmd = [compiler, "-std=c++20", "-O2", "-shared", "-fPIC", "-w", f"-I{ROOT}/csrc", f"-I{HERE}", f"-I{include}",
           SOURCES[0], "-o", lib]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, f"g++ failed:\n{' '.join(cmd)}\n{build.stderr[-4000:]}"
    return ctypes.CDLL(lib)


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def _nan_like(t, shape=None, dtype=None):
    return torch.full(shape if shape is not None else t.shape, float("nan"), dtype=dtype or t.dtype)


def emulated(lib):
    """run_kernel for check_against_oracle: the forward, then the backward on the forward's out and lse."""
    def run(q, k, v, dout, *, causal, scale, mask):
        b, hq, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        shape = (int(q.dtype == torch.bfloat16), d, b, hq, hkv, nq, nk, int(causal), ctypes.c_float(scale))
        m = mask.to(torch.uint8).contiguous() if mask is not None else None
        out, lse = _nan_like(q), _nan_like(q, q.shape[:3], torch.float32)
        rc = lib.exact_fwd(*shape, _ptr(q), _ptr(k), _ptr(v), _ptr(m), _ptr(out), _ptr(lse))
        assert rc == 0, f"exact_fwd emulation returned {rc} (1: head dim, 2: a block's threads deadlocked)"
        dq, dk, dv, delta = _nan_like(q), _nan_like(k), _nan_like(v), _nan_like(q, q.shape[:3], torch.float32)
        rc = lib.exact_bwd(*shape, _ptr(q), _ptr(k), _ptr(v), _ptr(m), _ptr(out), _ptr(dout.contiguous()), _ptr(lse),
                           _ptr(delta), _ptr(dq), _ptr(dk), _ptr(dv))
        assert rc == 0, f"exact_bwd emulation returned {rc} (1: head dim, 2: a block's threads deadlocked)"
        return out, lse, (dq, dk, dv)
    return run


def cpu_inputs(b, hq, hkv, nq, nk, d, **kw):
    return make_inputs(b, hq, hkv, nq, nk, d, device="cpu", **kw)


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
