"""Exact softmax attention (FlashAttention-2 on CUDA cores): B=1, H=16, causal, fp16, D=64 and 128.

``python -m benchmarks.bench_exact [CSV ...]`` measures the GPU's packed-half and fp32 FMA rates (the
CUDA-core limits of issue 7) and prints each exact-case row of the last run with exact rows in each CSV as useful TFLOP/s and % of it.
"""
import ctypes
import importlib
import sys

import torch

from .registry import Case, register_case

for _d in (64, 128):
    register_case(Case(backend="exact", name=f"exact_d{_d}_causal", dtype=torch.float16, batch=1, heads=16,
                       head_dim=_d, sizes=(2048, 4096), quick_sizes=(2048, 4096), options={"causal": True}))

PROBE_FMAS_PER_TRIP = 64  # kProbeChains x kProbeUnroll in csrc/exact/exact_fma_probe.cu
BWD_OVER_FWD = 2.5  # backward: 5 N x N x D products against the forward's 2


def useful_tflop(n: int, d: int, batch: int, heads: int, causal: bool, mode: str) -> float:
    """Useful TFLOP of one call: forward 4 N^2 D B H (half of it causal); fwd+bwd 3.5 x that."""
    fwd = 4.0 * n * n * d * batch * heads * (0.5 if causal else 1.0) / 1e12
    return fwd * (1.0 + BWD_OVER_FWD) if mode == "fwd+bwd" else fwd


def _probe_tflops(entry: str, flops_per_fma: int, blocks_per_sm: int, iters: int) -> float:
    module = importlib.import_module("hf_attention_backends._C")
    torch.cuda.init()
    blocks = blocks_per_sm * torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    ms = ctypes.c_float(0.0)
    err = getattr(ctypes.CDLL(module.__file__), entry)(ctypes.c_int(blocks), ctypes.c_int(iters), ctypes.byref(ms))
    if err != 0 or ms.value <= 0.0:
        raise RuntimeError(f"{entry}(blocks={blocks}, iters={iters}): CUDA error {err}, {ms.value} ms")
    return blocks * 256 * iters * PROBE_FMAS_PER_TRIP * flops_per_fma / (ms.value * 1e-3) / 1e12


def packed_half_fma_tflops(blocks_per_sm: int = 8, iters: int = 2048) -> float:
    """TFLOP/s of ``__hfma2`` (2 fp16 FMAs, 4 FLOPs) on the current CUDA device, timed by the compiled
    extension's ``hfab_hfma2_probe`` (csrc/exact/exact_fma_probe.cu). Raises ImportError without the
    extension, RuntimeError on a CUDA error."""
    return _probe_tflops("hfab_hfma2_probe", 4, blocks_per_sm, iters)


def fp32_fma_tflops(blocks_per_sm: int = 8, iters: int = 2048) -> float:
    """TFLOP/s of fp32 ``fmaf`` (2 FLOPs) on the current CUDA device (``hfab_ffma_probe``): the limit of
    kernels that accumulate in fp32 on CUDA cores."""
    return _probe_tflops("hfab_ffma_probe", 2, blocks_per_sm, iters)


def main(argv: list[str]) -> int:
    from .report import last_run, read_rows
    peak, fp32 = packed_half_fma_tflops(), fp32_fma_tflops()
    print(f"{torch.cuda.get_device_name()}: packed-half FMA {peak:.1f} TFLOP/s, fp32 FMA {fp32:.1f} TFLOP/s")
    for path in argv:
        for row in last_run([r for r in read_rows(path) if r["backend"] == "exact"]):
            if row["status"] != "ok":
                continue
            tflop = useful_tflop(int(row["N"]), int(row["D"]), int(row["B"]), int(row["H"]),
                                 row["causal"].lower() in ("true", "1"), row["mode"])
            rate = tflop / (float(row["median_ms"]) * 1e-3)
            print(f"{row['case']:>18} N={row['N']:>5} {row['provider']:>9} {row['mode']:>7} "
                  f"{float(row['median_ms']):8.3f} ms {rate:6.1f} TFLOP/s {100 * rate / peak:5.1f}% of packed-half "
                  f"{100 * rate / fp32:5.1f}% of fp32")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
