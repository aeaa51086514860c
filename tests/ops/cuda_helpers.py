"""Helpers shared by the GPU tests of the kernels (tests/ops/test_*_cuda.py)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

DEV = "cuda"


def make_inputs(b, hq, hkv, nq, nk, d, *, dtype=torch.float16, scale=1.0, seed=0, device=DEV):
    """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) on `device` (the GPU), N(0, 1) x scale for q and k, N(0, 1) v."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, nq, d, device=device, generator=g) * scale
    k = torch.randn(b, hkv, nk, d, device=device, generator=g) * scale
    v = torch.randn(b, hkv, nk, d, device=device, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def assert_not_drawn_like(dout, q):
    """The upstream gradient must not be q itself (the same seed's stream, e.g. make_inputs(seed=s) beside a dO drawn
    with seed s): a kernel that swapped the two tiles would then pass."""
    assert not torch.equal(dout, q.to(dout.dtype)), "dO equals q: draw dO from another seed"


def poison(*likes):
    """Leave NaN-filled blocks of these sizes in the CUDA caching allocator for the next outputs to reuse."""
    blocks = [torch.full_like(t, float("nan")) for t in likes]
    del blocks


def strided_views(*tensors):
    """Same values, other layouts: (B, N, H, D) transposed, inside a wider last dim, misaligned offset.

    Returns one tuple of views per layout."""
    def transposed(t):
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    def strided(t):
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]

    def offset(t):
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype, device=t.device)
        wide[..., 1:] = t
        return wide[..., 1:]

    return [tuple(f(t) for t in tensors) for f in (transposed, strided, offset)]


def strided_mask(mask):
    """The same (B, N) bool mask read with stride 2 along N."""
    return torch.stack([mask, ~mask], dim=-1)[..., 0]


def replay_in_cuda_graph(fn):
    """fn() warmed up on a side stream, captured in a CUDA graph, output NaN-filled, replayed: returns it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return captured


SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"


def assert_sanitizer_clean(tool: str, script: str) -> None:
    """Run ``script`` (Python source) under compute-sanitizer's ``tool``; fail on any report it makes."""
    if not os.path.exists(SANITIZER):
        pytest.skip(f"compute-sanitizer not found (PATH, {SANITIZER})")
    res = subprocess.run([SANITIZER, "--tool", tool, "--error-exitcode", "1", sys.executable, "-c", script],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]


def cases_in_subprocess(module: str, function: str, env: dict, tmp_path):
    """``tests.ops.<module>.<function>()`` run in a fresh Python process with ``env`` added to the environment (the
    kernels read their A/B switches once per process), its result passed back through ``torch.save``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = tmp_path / f"{function}.pt"
    script = f"import torch; from tests.ops.{module} import {function}; torch.save({function}(), {str(path)!r})"
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)


def assert_compiled_matches_eager(fn, *leaves, backend: str) -> None:
    """fn(*leaves) under torch.compile(fullgraph=True, backend=backend): output and the gradients of
    out.sum() w.r.t. every leaf bitwise equal to eager (the op must not break the graph)."""
    out = torch.compile(fn, fullgraph=True, backend=backend)(*leaves)
    out.sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    eager = fn(*leaves)
    eager.sum().backward()
    assert torch.equal(out, eager)
    for got, t in zip(grads, leaves):
        assert torch.equal(got, t.grad)


def assert_kernels_registered(backend: str) -> None:
    """The compiled extension loaded, hfab::<backend>_fwd / _bwd dispatch to its CUDA kernels (registered from
    csrc/<backend>/<backend>_{fwd,bwd}.cu, not the guard) and the forward's CUDA autograd is the C++ one
    (csrc/<backend>/<backend>_autograd.cpp, registered for AutogradCUDA)."""
    from hf_attention_backends import _ext

    assert _ext.extension_loaded(), f"hf_attention_backends._C failed to load: {_ext.extension_error()}"
    for op in (f"{backend}_fwd", f"{backend}_bwd"):
        table = torch._C._dispatch_dump(f"hfab::{op}")
        assert f"{op}.cu" in table, f"hfab::{op} CUDA kernel is not the compiled one:\n{table}"
    table = torch._C._dispatch_dump(f"hfab::{backend}_fwd")
    autograd = [line for line in table.splitlines() if line.startswith("AutogradCUDA")]
    assert autograd and f"{backend}_autograd.cpp" in autograd[0], f"hfab::{backend}_fwd's CUDA autograd:\n{table}"


def flat_tensors(x):
    """The tensors of a nested tuple/list, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in flat_tensors(item)]


def assert_unchanged_by_autocast(run):
    """run() -> (nested tuples of) tensors: the same bits inside a bf16 autocast region as outside it. The CUDA impls
    do part of their math with ATen calls (fp32 landmark algebra, reductions) that autocast must not recast."""
    plain = flat_tensors(run())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cast = flat_tensors(run())
    assert len(cast) == len(plain)
    for got, want in zip(cast, plain):
        assert got.dtype == want.dtype and torch.equal(got, want)
