"""Compile the exact attention kernels for Pascal and Volta with CUDA 12's NVRTC and ptxas.

CUDA 13 (the toolkit that builds the extension) targets nothing below sm_75, so this proves that
csrc/exact/exact_kernels.cuh still builds for sm_60 and sm_70: every kernel instantiation the
extension launches (fp16 and bf16, head dims 32, 64, 128) is compiled to PTX by libnvrtc
(PyPI ``nvidia-cuda-nvrtc-cu12``; cuda_fp16.h / cuda_bf16.h from ``nvidia-cuda-runtime-cu12``) and
assembled by ptxas (PyPI ``nvidia-cuda-nvcc-cu12``) with -v.

Fails (exit 1) on a compile error, any register spill, or static shared memory above 48 KB.
Prints one line per (arch, kernel): registers, shared memory, spills. Needs no GPU.

Usage: python scripts/nvrtc_check.py [--archs 60,70] [--keep DIR]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
SMEM_LIMIT = 48 * 1024

# Mirrors csrc/exact/exact_kernels.cuh: FwdTiles, DqTiles, DkvTiles.
TILES = {32: dict(fwd=(64, 64), dq=(64, 32), dkv=(64, 32)),
         64: dict(fwd=(64, 32), dq=(64, 16), dkv=(64, 16)),
         128: dict(fwd=(64, 16), dq=(64, 16), dkv=(64, 16))}
DTYPES = ("__half", "__nv_bfloat16")


def kernel_names():
    names = []
    for dtype in DTYPES:
        for d, t in TILES.items():
            names += [f"hfab::exact::exact_attn_fwd_kernel<{dtype}, {d}, {t['fwd'][0]}, {t['fwd'][1]}>",
                      f"hfab::exact::exact_delta_bwd_kernel<{dtype}, {d}>",
                      f"hfab::exact::exact_dq_bwd_kernel<{dtype}, {d}, {t['dq'][0]}, {t['dq'][1]}>",
                      f"hfab::exact::exact_dkv_bwd_kernel<{dtype}, {d}, {t['dkv'][0]}, {t['dkv'][1]}>"]
    return names


def _package_dir(module):
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{module} not found: pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 "
                         "nvidia-cuda-runtime-cu12")
    return list(spec.submodule_search_locations)[0]


def find_tools():
    """(libnvrtc.so.12, ptxas, the CUDA 12 include folder with cuda_fp16.h) from the cu12 wheels."""
    nvrtc = sorted(glob.glob(os.path.join(_package_dir("nvidia.cuda_nvrtc"), "lib", "libnvrtc.so.12*")))
    ptxas = os.path.join(_package_dir("nvidia.cuda_nvcc"), "bin", "ptxas")
    include = os.path.join(_package_dir("nvidia.cuda_runtime"), "include")
    if not nvrtc or not os.path.exists(ptxas) or not os.path.exists(os.path.join(include, "cuda_fp16.h")):
        raise SystemExit(f"libnvrtc.so.12 ({nvrtc}), ptxas ({ptxas}) or cuda_fp16.h ({include}) missing: "
                         "pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12")
    return nvrtc[0], ptxas, include


class Nvrtc:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        self.version = f"{major.value}.{minor.value}"

    def _check(self, status, log=""):
        if status != 0:
            raise RuntimeError(f"NVRTC: {self.lib.nvrtcGetErrorString(status).decode()}\n{log}")

    def compile_ptx(self, source, name_expressions, options):
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"exact_check.cu", 0, None, None))
        try:
            for expr in name_expressions:
                self._check(self.lib.nvrtcAddNameExpression(prog, expr.encode()))
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, log)
            self._check(status, log.value.decode(errors="replace"))
            lowered = {}
            for expr in name_expressions:
                mangled = ctypes.c_char_p()
                self._check(self.lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(mangled)))
                lowered[mangled.value.decode()] = expr
            self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetPTX(prog, ptx))
            return ptx.value.decode(), lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(report):
    """{mangled name: dict(registers, smem, stack, spill_stores, spill_loads)} from ptxas -v output."""
    result, current = {}, None
    for line in report.splitlines():
        if m := _FUNC.search(line):
            current = result.setdefault(m.group(1), dict(registers=None, smem=0, stack=0, spill_stores=0,
                                                          spill_loads=0))
        elif current is not None and (m := _SPILL.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m.group(1))
            smem = _SMEM.search(line)
            current["smem"] = int(smem.group(1)) if smem else 0
    return result


def check_arch(nvrtc, ptxas, include, arch, workdir):
    names = kernel_names()
    source = '#include "exact/exact_kernels.cuh"\n'
    options = [f"--gpu-architecture=compute_{arch}", f"-I{CSRC}", f"-I{include}", "-std=c++17", "--use_fast_math",
               "-default-device"]
    ptx, lowered = nvrtc.compile_ptx(source, names, options)
    ptx_path = os.path.join(workdir, f"exact_sm{arch}.ptx")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    run = subprocess.run([ptxas, f"-arch=sm_{arch}", "-O3", "-v", ptx_path, "-o", ptx_path[:-4] + ".cubin"],
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas sm_{arch} failed:\n{run.stderr}")
    report = parse_ptxas(run.stderr)
    failures = []
    for mangled, expr in lowered.items():
        info = report.get(mangled)
        if info is None or info["registers"] is None:
            failures.append(f"sm_{arch} {expr}: no ptxas report")
            continue
        print(f"sm_{arch}  {info['registers']:3d} regs  {info['smem']:6d} B smem  "
              f"{info['spill_stores']} B spill st  {info['spill_loads']} B spill ld  {info['stack']} B stack  {expr}")
        if info["spill_stores"] or info["spill_loads"]:
            failures.append(f"sm_{arch} {expr}: spills ({info['spill_stores']} B stores, {info['spill_loads']} B loads)")
        if info["smem"] > SMEM_LIMIT:
            failures.append(f"sm_{arch} {expr}: {info['smem']} B static shared memory > {SMEM_LIMIT}")
    return failures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="60,70", help="comma-separated SM versions (default 60,70)")
    parser.add_argument("--keep", default=None, help="directory to keep the PTX and cubins in")
    args = parser.parse_args(argv)
    nvrtc_path, ptxas, include = find_tools()
    nvrtc = Nvrtc(nvrtc_path)
    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    print(f"NVRTC {nvrtc.version} ({nvrtc_path}); ptxas: {ptxas_version}")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or tmp
        os.makedirs(workdir, exist_ok=True)
        for arch in filter(None, (a.strip() for a in args.archs.split(","))):
            try:
                failures += check_arch(nvrtc, ptxas, include, arch, workdir)
            except RuntimeError as err:
                failures.append(f"sm_{arch}: {err}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    print(f"OK: {len(kernel_names())} kernels x {args.archs}: no errors, no spills, static smem <= {SMEM_LIMIT} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
