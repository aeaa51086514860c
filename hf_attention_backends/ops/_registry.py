"""How ops are registered: schema and CPU impl in Python (torch.library), CUDA impls in C++.

Each op.py declares its ops with :func:`cpu_op`. After the compiled extension has had its chance
to register CUDA kernels (``TORCH_LIBRARY_IMPL(hfab, CUDA, m)``), :func:`install_cuda_guards`
gives every op still lacking one a CUDA kernel that raises a clear NotImplementedError, or, with
``HFAB_REFERENCE_ON_CUDA=1``, runs the reference on the GPU (slow; meant for tests and baselines).
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

NAMESPACE = "hfab"
_OPS: dict[str, Callable] = {}
_GUARDED: list[str] = []


def without_autocast(impl: Callable, device_type: str) -> Callable:
    """``impl`` run with ``device_type`` autocast off: a kernel computes in the dtypes it was written for (fp32
    accumulation, Newton–Schulz in fp32), not in the dtype of an autocast region its op was called from."""
    @functools.wraps(impl)
    def run(*args, **kwargs):
        with torch.autocast(device_type, enabled=False):
            return impl(*args, **kwargs)
    return run


def cpu_op(name: str, reference_impl: Callable):
    """Define ``hfab::<name>`` from a type-annotated function; its body, run with CPU autocast off, is the CPU
    kernel."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=(), device_types="cpu")(reference_impl)
    op.register_kernel("cpu", without_autocast(reference_impl, "cpu"))  # schema: from the unwrapped annotations
    _OPS[f"{NAMESPACE}::{name}"] = reference_impl
    return op


def has_cuda_kernel(qualname: str) -> bool:
    """True when ``qualname`` has a compiled CUDA kernel (not one of our Python guards)."""
    return qualname not in _GUARDED and bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"))


def reference_on_cuda_allowed() -> bool:
    return os.environ.get("HFAB_REFERENCE_ON_CUDA", "0").strip().lower() in ("1", "true", "yes", "on")


def _missing_kernel(qualname: str):
    def raise_missing(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} has no CUDA kernel in this build (hf_attention_backends._C is not loaded or does "
            "not implement it). Rebuild with a CUDA torch and CUDA_HOME set (see README), move the "
            "inputs to the CPU, or set HFAB_REFERENCE_ON_CUDA=1 to run the slow PyTorch reference on the GPU.")
    return raise_missing


def install_cuda_guards() -> list[str]:
    """Give each op without a compiled CUDA kernel a Python one; returns the qualnames guarded."""
    guarded = []
    for qualname, reference_impl in _OPS.items():
        if has_cuda_kernel(qualname):
            continue
        impl = without_autocast(reference_impl, "cuda") if reference_on_cuda_allowed() else _missing_kernel(qualname)
        torch.library.register_kernel(qualname, "cuda", impl)
        guarded.append(qualname)
    _GUARDED.extend(guarded)
    return guarded


def guarded_ops() -> list[str]:
    """Ops whose CUDA kernel is a Python guard (or the reference under HFAB_REFERENCE_ON_CUDA=1)."""
    return sorted(_GUARDED)


def registered_ops() -> list[str]:
    return sorted(_OPS)
