"""Per-backend hyper-parameters, validated once at the boundary (enable_backend / convert / nn modules).

Field names are the keyword arguments users pass: ``enable_backend(model, "race", num_planes=4)``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class NystromConfig:
    """num_landmarks m (1..1024), newton_iter (>= 1), kappa_star (>= 0, 0 = plain Newton–Schulz),
    conv_kernel_size (0 = no depthwise-conv residual, else odd)."""
    num_landmarks: int = 64
    newton_iter: int = 6
    kappa_star: float = 0.0
    conv_kernel_size: int = 0

    def __post_init__(self):
        _int_in("num_landmarks", self.num_landmarks, 1, 1024)
        _int_in("newton_iter", self.newton_iter, 1, 100)
        if not float(self.kappa_star) >= 0.0:
            raise ValueError(f"kappa_star={self.kappa_star} must be >= 0 (0 disables the ridge)")
        _int_in("conv_kernel_size", self.conv_kernel_size, 0, 1023)
        if self.conv_kernel_size and self.conv_kernel_size % 2 == 0:
            raise ValueError(f"conv_kernel_size={self.conv_kernel_size} must be odd (or 0 for no conv residual)")


@dataclass(frozen=True)
class StieltjesConfig:
    """order (>= 1; 4 by default), newton_iter (>= 1; None: the order's default, 1 Halley step at order >= 4, else 4
    Newton steps, then extra steps for rows that need them, see ``stieltjes_attention``), per_head_temperature (after
    convert: one learnable score temperature per query head, initialised to 1, multiplying the scores, i.e. the
    effective scale)."""
    order: float = 4.0
    newton_iter: Optional[int] = None
    per_head_temperature: bool = False

    def __post_init__(self):
        if not float(self.order) >= 1.0:
            raise ValueError(f"order={self.order} is not supported; supported: order >= 1")
        if self.newton_iter is not None:
            _int_in("newton_iter", self.newton_iter, 1, 100)
        if not isinstance(self.per_head_temperature, bool):
            raise TypeError(f"per_head_temperature must be a bool, got {self.per_head_temperature!r}")


@dataclass(frozen=True)
class RaceConfig:
    """num_planes P (1..8), num_tables L (1..16), beta (None = D**-0.5), seed of the fixed planes,
    per_head_beta (one learnable beta per query head after convert)."""
    num_planes: int = 4
    num_tables: int = 4
    beta: Optional[float] = None
    seed: int = 0
    per_head_beta: bool = False

    def __post_init__(self):
        _int_in("num_planes", self.num_planes, 1, 8)
        _int_in("num_tables", self.num_tables, 1, 16)
        if self.beta is not None and not float(self.beta) > 0.0:
            raise ValueError(f"beta={self.beta} must be > 0 (or None for D**-0.5)")
        _int_in("seed", self.seed, 0, 2**63 - 1)


@dataclass(frozen=True)
class ExactConfig:
    """No knobs: exact softmax attention."""


CONFIGS = {"nystrom": NystromConfig, "stieltjes": StieltjesConfig, "race": RaceConfig, "exact": ExactConfig}


def make_config(backend: str, **kwargs):
    """Build the backend's config; unknown backend or keyword raises naming what is supported."""
    if backend not in CONFIGS:
        raise ValueError(f"backend={backend!r} is not supported; supported: {', '.join(CONFIGS)}")
    cls = CONFIGS[backend]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for backend {backend!r}; supported: {sorted(known) or 'none'}")
    return cls(**kwargs)


def _int_in(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is not supported; supported: {lo}..{hi}")
