"""Build and call the CPU emulations of the CUDA kernels (cuda_on_cpu.h, common/ptx.cuh, <backend>_emulation.cpp).

`build(name, tmp_dir)` compiles <name>_emulation.cpp with g++ (this folder first on the include path, so its
common/ptx.cuh replaces csrc's) and returns the ctypes library, each call checked for misaligned ldmatrix / cp.async
addresses (`Checked`); it skips the calling test, with the reason, where g++ or the CUDA headers are missing.
"""
import ctypes
import glob
import hashlib
import os
import shutil
import subprocess

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(HERE))), "csrc")


def cuda_include():
    """A folder with cuda_fp16.h (CUDA_HOME, /usr/local/cuda*, or the nvidia-cuda-runtime wheel), or None."""
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"), "/usr/local/cuda/include"]
    try:
        import nvidia.cuda_runtime as runtime
        candidates += [os.path.join(p, "include") for p in runtime.__path__]
    except ImportError:
        pass
    candidates += sorted(glob.glob("/usr/local/cuda-*/include"))
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "cuda_fp16.h"))), None)


def _sources(name):
    own = [os.path.join(HERE, f"{name}_emulation.cpp")] + sorted(
        glob.glob(os.path.join(HERE, "*.h")) + glob.glob(os.path.join(HERE, "*.cuh")) +
        glob.glob(os.path.join(HERE, "common", "*.cuh")))
    return own + sorted(glob.glob(os.path.join(CSRC, "common", "*.cuh")) +
                        glob.glob(os.path.join(CSRC, name, "*_kernels.cuh")))


def build(name, tmp_dir, defines=()):
    """defines: macros for g++ (e.g. HFAB_EMULATE_WGMMA: the kernels' wgmma paths, as an sm_90a build takes them)."""
    include = cuda_include()
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if include is None or compiler is None:
        pytest.skip(f"the {name} emulation needs g++ (found: {compiler}) and the CUDA headers (found: {include}); "
                    "set CUDA_HOME")
    sources = _sources(name)
    digest = hashlib.sha1(b"".join(open(s, "rb").read() for s in sources)).hexdigest()[:12]
    lib = os.path.join(str(tmp_dir), "_".join([f"{name}_emulation", *defines, digest]) + ".so")
    cmd = [compiler, "-std=c++20", "-O1", "-fno-extern-tls-init", "-shared", "-fPIC", "-w", f"-I{HERE}", f"-I{CSRC}", f"-I{include}",
           *(f"-D{d}" for d in defines), sources[0], "-o", lib]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"g++ failed:\n{' '.join(cmd)}\n{done.stderr[-4000:]}"
    return Checked(ctypes.CDLL(lib))


class Checked:
    """An emulation library whose every call is followed by its emu_faults(): a call in which a kernel gave ldmatrix or
    cp.async an address that is not 16-byte aligned (the GPU would fault or read other bytes) fails. Attributes set on
    a function (argtypes, restype) go to the ctypes function."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        return _CheckedFunction(self._lib, name)


class _CheckedFunction:
    def __init__(self, lib, name):
        object.__setattr__(self, "_lib", lib)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_fn", getattr(lib, name))

    def __setattr__(self, key, value):
        setattr(self._fn, key, value)

    def __call__(self, *args):
        result = self._fn(*args)
        faults = self._lib.emu_faults()
        assert faults == 0, (f"{self._name}: {faults} ldmatrix / cp.async operand addresses not 16-byte aligned (the "
                             "GPU would fault or read other bytes)")
        return result


def ptr(t):
    """A tensor's data pointer for ctypes (None for None)."""
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def nan_like(t, shape=None, dtype=None):
    """NaN-filled output: an element the kernel does not write fails the oracle check."""
    return torch.full(shape if shape is not None else t.shape, float("nan"), dtype=dtype or t.dtype)


def cpu_inputs(b, hq, hkv, nq, nk, d, **kw):
    """tests.ops.cuda_helpers.make_inputs on the CPU."""
    from tests.ops.cuda_helpers import make_inputs
    return make_inputs(b, hq, hkv, nq, nk, d, device="cpu", **kw)


def check_rc(rc, what):
    assert rc == 0, f"{what} emulation returned {rc} (1: unsupported head dim, 2: a block's threads deadlocked)"


SCHEDULES = ("1", "2")  # HFAB_EMU_SCHEDULE (cuda_on_cpu.h): warp by warp; the same with blocks, warps, lanes reversed


def _flat(tensors):
    return [x for t in tensors for x in (_flat(t) if isinstance(t, (tuple, list)) else [t])]


def assert_same_under_schedule(monkeypatch, schedule, run, names):
    """run() -> tensors, nested in tuples or lists (named in order by `names`), once under the default thread schedule
    and once under HFAB_EMU_SCHEDULE = `schedule`: every tensor must be the same bit for bit, else the kernels have a
    shared-memory read that no barrier or cp.async wait orders after its write."""
    first = _flat(run())
    monkeypatch.setenv("HFAB_EMU_SCHEDULE", schedule)
    again = _flat(run())
    for name, a, b in zip(names, first, again, strict=True):
        bits = [x.detach().contiguous().reshape(-1).view(torch.uint8) for x in (a, b)]
        assert torch.equal(*bits), f"{name} differs under HFAB_EMU_SCHEDULE={schedule}"
