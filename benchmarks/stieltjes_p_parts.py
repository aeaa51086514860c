"""Can the Stieltjes forward's P V product take P in one bf16 part? A CPU study in float64 (no GPU, no kernel).

The forward kernels feed P 2^15 to the tensor cores as a 16-bit high part plus a 16-bit residual (two mma per tile).
With bf16 outputs, which round at 2^-9, one part would save a fifth of the forward's products. Per case (Gaussian q,
k, v cast to bf16, scaled q and k, the exact root by bisection) this prints the output error relative to max|out| of
the exact output rounded to bf16 (the floor any kernel has), and of P V / sum P with P in one bf16 part or in two,
before and after the output's bf16 rounding. The GPU tests' bf16 bound is the rounding + 1e-3.

    PYTHONPATH=. .venv/bin/python -m benchmarks.stieltjes_p_parts [--n 1024 4096 16384] [--scales 0.5 1 2 4]
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from benchmarks.stieltjes_solver import root_by_bisection

P_UNIT = 2.0 ** 15  # the kernels' kPUnit


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double()


def errors(n: int, scale: float, *, order: float = 4.0, rows: int = 256, dim: int = 64, seed: int = 0) -> dict:
    """Relative errors (to max|out|) of the exact output rounded to bf16 and of one- and two-part P, unrounded and
    rounded."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (bf16(torch.randn(m, dim, generator=gen, dtype=torch.float64) * scale) for m in (rows, n))
    v = bf16(torch.randn(n, dim, generator=gen, dtype=torch.float64))
    s = q @ k.T / dim ** 0.5
    x = s - s.max(dim=-1, keepdim=True).values
    p = (root_by_bisection(x, order)[:, None] - x).pow(-order) * P_UNIT
    total = p.sum(dim=-1, keepdim=True)  # the kernels sum P in fp32, apart from the product's parts
    exact = p @ v / total
    hi = bf16(p)
    parts = {"one": hi @ v / total, "two": (hi + bf16(p - hi)) @ v / total}
    top = exact.abs().max()
    out = {"rounding": float((bf16(exact) - exact).abs().max() / top)}
    for name, o in parts.items():
        out[name] = float((o - exact).abs().max() / top)
        out[f"{name} rounded"] = float((bf16(o) - exact).abs().max() / top)
    return out


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--order", type=float, default=4.0)
    parser.add_argument("--rows", type=int, default=256)
    args = parser.parse_args(argv)
    for n in args.n:
        for scale in args.scales:
            e = errors(n, scale, order=args.order, rows=args.rows)
            print(f"N {n:6d} scale {scale:4.2f}: bf16 rounding {e['rounding']:.2e}; one part {e['one']:.2e} "
                  f"(rounded {e['one rounded']:.2e}); two parts {e['two']:.2e} (rounded {e['two rounded']:.2e})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
