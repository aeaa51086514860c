"""The one tolerance rule of the test suite.

``assert_close_to_oracle(actual, oracle, baseline=...)``: the error of ``actual`` against a float64
``oracle`` must be at most ``factor`` x the error of ``baseline`` (the reference run in the kernel's
dtype) against the same oracle, plus ``floor`` (absolute, for outputs that are exactly representable).
Without a baseline: ``max|actual - oracle| <= atol + rtol * max|oracle|``.
NaN anywhere fails. On failure the message names the worst index.
"""
from __future__ import annotations

from typing import Optional

import torch


def _worst(actual: torch.Tensor, oracle: torch.Tensor):
    diff = (actual.detach().double() - oracle.detach().double()).abs()
    flat = int(diff.flatten().argmax()) if diff.numel() else 0
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.numel() else ()
    return diff, idx


def assert_close_to_oracle(actual: torch.Tensor, oracle: torch.Tensor, *, baseline: Optional[torch.Tensor] = None,
                           factor: float = 2.0, floor: float = 1e-6, atol: float = 1e-10, rtol: float = 1e-10,
                           name: str = "output") -> None:
    assert actual.shape == oracle.shape, f"{name}: shape {tuple(actual.shape)} != oracle {tuple(oracle.shape)}"
    assert not torch.isnan(actual).any(), f"{name}: NaN at {tuple(torch.nonzero(torch.isnan(actual))[0].tolist())}"
    diff, idx = _worst(actual, oracle)
    err = float(diff.max()) if diff.numel() else 0.0
    if baseline is not None:
        base_err = float((baseline.detach().double() - oracle.detach().double()).abs().max()) if diff.numel() else 0.0
        bound = factor * base_err + floor
        what = f"{factor} x baseline error {base_err:.3e} + {floor:.1e}"
    else:
        scale = float(oracle.detach().double().abs().max()) if diff.numel() else 0.0
        bound = atol + rtol * scale
        what = f"atol {atol:.1e} + rtol {rtol:.1e} x max|oracle| {scale:.3e}"
    assert err <= bound, (f"{name}: max error {err:.3e} > bound {bound:.3e} ({what}); worst at index {idx}: "
                          f"actual {float(actual[idx]):.6e}, oracle {float(oracle[idx]):.6e}")
