"""The benchmark registry: cases (what to run) and providers (who runs it).

A :class:`Case` is one backend at one fixed shape and hyper-parameter set, swept over sequence
lengths N (ascending). A :class:`Provider` turns a case and its inputs into an output tensor. The
``bench_<backend>.py`` modules register cases (and any backend-specific provider) on import;
:func:`load` imports them all. A kernel issue adds a case with :func:`register_case` or a provider
with :func:`register_provider` in its ``bench_<backend>.py``, nothing else.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("exact", "nystrom", "stieltjes", "race")

# --device cpu: every case shrinks to these (tests the harness, not the kernels)
TINY_SIZES = (32, 64)
TINY_HEADS = 2
TINY_HEAD_DIM = 16


@dataclass(frozen=True)
class Case:
    """One backend at one shape, swept over N.

    backend: one of BACKENDS. name: unique, ``<backend>_<what>``. dtype: input dtype on CUDA.
    batch, heads, kv_heads (None = heads), head_dim: the fixed (B, Hq, Hkv, D).
    sizes / quick_sizes: ascending sequence lengths (Nq = Nk) for a full / ``--quick`` run.
    options: the public function's static keyword arguments (``causal`` included where the
    backend takes it; it also sets SDPA's ``is_causal``). tiny_options: overrides on ``--device cpu``.
    make_tensors: ``(case, device) -> {kwarg: Tensor}``, tensor keyword arguments built once
    per size (RACE planes and beta); trainable: those of them that get gradients in fwd+bwd.
    tiny_sizes: the sweep on ``--device cpu``.
    """
    backend: str
    name: str
    dtype: torch.dtype
    batch: int
    heads: int
    head_dim: int
    sizes: tuple[int, ...]
    quick_sizes: tuple[int, ...]
    kv_heads: Optional[int] = None
    options: dict = field(default_factory=dict)
    tiny_options: dict = field(default_factory=dict)
    make_tensors: Optional[Callable[["Case", torch.device], dict]] = None
    trainable: tuple[str, ...] = ()
    tiny_sizes: tuple[int, ...] = TINY_SIZES

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"Case {self.name!r}: backend={self.backend!r}; supported: {', '.join(BACKENDS)}")
        for label, ns in (("sizes", self.sizes), ("quick_sizes", self.quick_sizes), ("tiny_sizes", self.tiny_sizes)):
            if not ns or list(ns) != sorted(set(ns)):
                raise ValueError(f"Case {self.name!r}: {label}={ns} must be non-empty, ascending, no repeats")

    @property
    def causal(self) -> bool:
        return bool(self.options.get("causal", False))

    @property
    def hkv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    def tiny(self) -> "Case":
        """The same case shrunk for ``--device cpu``: B=1, 2 heads, D=16, float32, N in tiny_sizes."""
        kv = None if self.kv_heads is None else max(1, TINY_HEADS * self.kv_heads // self.heads)
        return dataclasses.replace(self, dtype=torch.float32, batch=1, heads=TINY_HEADS, kv_heads=kv,
                                   head_dim=TINY_HEAD_DIM, sizes=self.tiny_sizes, quick_sizes=self.tiny_sizes,
                                   options={**self.options, **self.tiny_options})

    def params_label(self) -> str:
        """The options other than ``causal``, as ``k=v;k=v`` (the CSV ``params`` column)."""
        return ";".join(f"{k}={v}" for k, v in sorted(self.options.items()) if k != "causal")


@dataclass(frozen=True)
class Provider:
    """``fn(case, q, k, v, tensors) -> out (B, Hq, N, D)``; backends: None = every backend."""
    name: str
    fn: Callable[[Case, Tensor, Tensor, Tensor, dict], Tensor]
    description: str
    backends: Optional[frozenset] = None

    def applies_to(self, backend: str) -> bool:
        return self.backends is None or backend in self.backends


CASES: dict[str, Case] = {}
PROVIDERS: dict[str, Provider] = {}


def register_case(case: Case) -> Case:
    if case.name in CASES:
        raise ValueError(f"benchmark case {case.name!r} is already registered")
    CASES[case.name] = case
    return case


def register_provider(provider: Provider) -> Provider:
    if provider.name in PROVIDERS:
        raise ValueError(f"benchmark provider {provider.name!r} is already registered")
    PROVIDERS[provider.name] = provider
    return provider


def _ours(case: Case, q: Tensor, k: Tensor, v: Tensor, tensors: dict) -> Tensor:
    import hf_attention_backends as hfab
    return getattr(hfab, f"{case.backend}_attention")(q, k, v, **case.options, **tensors)


def _reference(case: Case, q: Tensor, k: Tensor, v: Tensor, tensors: dict) -> Tensor:
    op = importlib.import_module(f"hf_attention_backends.ops.{case.backend}.op")
    return op.reference_attention(q, k, v, **case.options, **tensors)


def _sdpa(case: Case, q: Tensor, k: Tensor, v: Tensor, tensors: dict) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=q.shape[1] != k.shape[1])


register_provider(Provider("ours", _ours, "the public function hfab.<backend>_attention (the op: CUDA kernel on GPU)"))
register_provider(Provider("reference", _reference,
                           "ops.<backend>.op.reference_attention: pure PyTorch, plain autograd"))
register_provider(Provider("sdpa", _sdpa, "torch scaled_dot_product_attention, same causal flag: the softmax baseline"))


def load() -> None:
    """Import every ``bench_<backend>`` module (each registers its cases once)."""
    for backend in BACKENDS:
        importlib.import_module(f"benchmarks.bench_{backend}")


def select_cases(backends: list[str], names: Optional[list[str]] = None) -> list[Case]:
    """Registered cases of ``backends`` (registry order), restricted to ``names`` when given."""
    load()
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"--backend {b!r} is not supported; supported: {', '.join(BACKENDS)}, all")
    if names:
        unknown = [n for n in names if n not in CASES]
        if unknown:
            raise ValueError(f"--cases {unknown} are not registered; registered: {', '.join(CASES)}")
    return [c for c in CASES.values() if c.backend in backends and (not names or c.name in names)]


def select_providers(names: list[str]) -> list[Provider]:
    load()
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(f"--providers {unknown} are not registered; registered: {', '.join(PROVIDERS)}")
    return [PROVIDERS[n] for n in names]
