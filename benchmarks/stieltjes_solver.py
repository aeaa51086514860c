"""How many solver steps the Stieltjes pole needs: a CPU study in float64 (no GPU, no kernel).

Every forward sweep of the CUDA kernel after the first evaluates the row sums at one lambda for all N keys (one
MUFU reciprocal per score: at B=4 H=8 N=4096 that is ~0.13 ms per sweep on an H200 before anything else), so the
number of solver steps sets most of the forward's time. For rows of scores s = q.k / sqrt(D) with q, k standard
normal times `scale`, this prints the largest relative error of the output (against the output at the root found by
bisection) after 0..max_steps steps of

- newton: Newton on g = f^(-1/order) - 1 from the Jensen lower bound (the reference's solver below order 4);
- halley: Halley's step on the same g (one more sum per sweep, sum_j y^(-order-2)), kept inside
  [the Newton iterate, n^(1/order)]: the Newton iterate of a concave increasing g never passes the root and
  n^(1/order) is above it, so the step cannot diverge; unlike Newton it can pass the root.

    python -m benchmarks.stieltjes_solver [--n 4096] [--rows 64] [--max-steps 3]
    python -m benchmarks.stieltjes_solver --steps-needed [--tol 3e-4]   # per order: the Newton steps the wider
        grid (scales 0.05..10, N 1..16384, 8 rows each) needs everywhere: the table behind default_newton_iter
    python -m benchmarks.stieltjes_solver --bimodal [--order 4]   # rows of two clusters (bimodal_row): the worst
        output error of the default steps from Jensen's start and from start_lambda, of one step more, and of the
        library's adaptive default
    python -m benchmarks.stieltjes_solver --extra-steps   # Gaussian rows like the benchmarks' (q, k standard normal
        times scale, N 2,048 to 16,384): how many rows, and 64-row query blocks, the adaptive default sends to an
        extra step (each such block is one more sweep of the forward kernel), and its worst output error
"""
from __future__ import annotations

import argparse

import torch

from hf_attention_backends.ops.stieltjes.reference import solve_lambda


def score_rows(scale: float, n: int, rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x = s - max_j s (rows, n) and values v (n, dim), float64."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, dim, generator=gen, dtype=torch.float64) * scale
    k = torch.randn(n, dim, generator=gen, dtype=torch.float64) * scale
    s = q @ k.T / dim ** 0.5
    return s - s.max(dim=-1, keepdim=True).values, torch.randn(n, dim, generator=gen, dtype=torch.float64)


def root_by_bisection(x: torch.Tensor, order: float, steps: int = 200) -> torch.Tensor:
    lo = torch.ones(x.shape[0], dtype=x.dtype)
    hi = torch.full_like(lo, x.shape[1] ** (1.0 / order))
    for _ in range(steps):
        mid = (lo + hi) / 2
        above = (mid[:, None] - x).pow(-order).sum(dim=-1) > 1  # f decreasing: the root is right of mid
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return (lo + hi) / 2


def newton(x: torch.Tensor, order: float, steps: int) -> torch.Tensor:
    """Newton on g = f^(-1/order) - 1 from the reference's start (all keys allowed): the reference's solver below
    order 4 (``solve_lambda`` takes Halley steps from order 4 up)."""
    lam = solve_lambda(x, torch.ones_like(x, dtype=torch.bool), order, 0)
    for _ in range(steps):
        y = lam[:, None] - x
        p = y.pow(-order)
        f, s1 = p.sum(dim=-1), (p / y).sum(dim=-1)
        lam = torch.clamp_min(lam + f * (f.pow(1.0 / order) - 1.0) / s1, 1.0)
    return lam


def halley(x: torch.Tensor, order: float, steps: int) -> torch.Tensor:
    """Safeguarded Halley on g = f^(-1/order) - 1 from the reference's start (all keys allowed)."""
    lam = solve_lambda(x, torch.ones_like(x, dtype=torch.bool), order, 0)
    upper = torch.full_like(lam, x.shape[1] ** (1.0 / order))
    a = -1.0 / order
    for _ in range(steps):
        y = lam[:, None] - x
        p = y.pow(-order)
        f, s1, s2 = p.sum(dim=-1), (p / y).sum(dim=-1), (p / y / y).sum(dim=-1)
        df, d2f = -order * s1, order * (order + 1) * s2
        g = f.pow(a) - 1
        dg = a * f.pow(a - 1) * df
        d2g = a * (a - 1) * f.pow(a - 2) * df * df + a * f.pow(a - 1) * d2f
        newton = lam - g / dg
        step = lam - 2 * g * dg / (2 * dg * dg - g * d2g)
        step = torch.where(torch.isfinite(step), step, newton)
        lam = torch.clamp_min(torch.minimum(torch.maximum(step, newton), upper), 1.0)
    return lam


def output_error(x: torch.Tensor, v: torch.Tensor, order: float, lam: torch.Tensor, exact: torch.Tensor) -> float:
    def out(l):
        p = (l[:, None] - x).pow(-order)
        return p @ v / p.sum(dim=-1, keepdim=True)
    o, oe = out(lam), out(exact)
    return ((o - oe).norm(dim=-1) / oe.norm(dim=-1)).max().item()


def newton_steps_needed(order: float, tol: float, scales=(0.05, 0.3, 1, 2, 3, 5, 7, 10),
                        sizes=(1, 2, 7, 64, 333, 2049, 4097, 16384), rows: int = 8, limit: int = 60) -> tuple:
    """(steps, scale, N): the most Newton steps any (scale, N) case needs to bring its output within `tol`."""
    worst = (0, None, None)
    for case, (scale, n) in enumerate((s, n) for s in scales for n in sizes):
        x, v = score_rows(scale, n, rows, 64, seed=case)
        exact = root_by_bisection(x, order)
        steps = next((k for k in range(limit) if output_error(x, v, order, newton(x, order, k), exact) <= tol), limit)
        worst = max(worst, (steps, scale, n), key=lambda w: w[0])
    return worst


def jensen_start(x: torch.Tensor, order: float) -> torch.Tensor:
    """max(1, n^(1/order) + mean x): Jensen on all n keys (``solve_lambda``'s start before ``start_lambda``)."""
    return torch.clamp_min(x.shape[1] ** (1.0 / order) + x.mean(dim=-1), 1.0)


def bimodal_row(n: int, near: int, a: float, b: float, spread: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (1, n) and v (n, 8): the max at 0, `near` keys in [-a - 0.5, -a], the rest in [-b - spread, -b]."""
    gen = torch.Generator().manual_seed(seed)
    x = -(b + spread * torch.rand(1, n, generator=gen, dtype=torch.float64))
    x[0, :near] = -(a + 0.5 * torch.rand(near, generator=gen, dtype=torch.float64))
    x[0, 0] = 0.0
    return x, torch.randn(n, 8, generator=gen, dtype=torch.float64)


def bimodal_study(order: float) -> dict:
    """{scheme: (worst error, its row's parameters)} over bimodal rows, for the default step count (k) from Jensen's
    start ("jensen"), from start_lambda ("fixed"), k + 1 steps from start_lambda ("one more") and the library's
    default, k steps and extra ones where needs_another_step asks ("adaptive"); plus how many rows
    start_lambda left worse off than Jensen's after k steps."""
    from hf_attention_backends.ops.stieltjes.op import default_newton_iter
    from hf_attention_backends.ops.stieltjes.reference import solver_step
    steps = default_newton_iter(order)
    worst = {s: (0.0, None) for s in ("jensen", "fixed", "one more", "adaptive")}
    worse, total = 0, 0
    for n in (1024, 4096, 16384):
        for near in (n // 64, n // 16, n // 8, n // 4):
            for a in (1.0, 2.5, 4.0):
                for b in (6.0, 10.0, 14.0):
                    x, v = bimodal_row(n, near, a, b, 1.0, seed=total)
                    exact = root_by_bisection(x, order)
                    upper = torch.full((1,), n ** (1.0 / order), dtype=torch.float64)
                    lam = jensen_start(x, order)
                    for _ in range(steps):
                        lam = solver_step(x, lam, order, upper)
                    ok = torch.ones_like(x, dtype=torch.bool)
                    errs = {"jensen": output_error(x, v, order, lam, exact),
                            "fixed": output_error(x, v, order, solve_lambda(x, ok, order, steps), exact),
                            "one more": output_error(x, v, order, solve_lambda(x, ok, order, steps + 1), exact),
                            "adaptive": output_error(x, v, order, solve_lambda(x, ok, order, -steps), exact)}
                    for s, e in errs.items():
                        if e > worst[s][0]:
                            worst[s] = (e, f"N {n}, near {near} at {a}, rest at {b}")
                    worse += errs["fixed"] > 1.01 * errs["jensen"] and errs["fixed"] > 1e-6
                    total += 1
    return {**worst, "rows": total, "fixed worse than jensen": worse}


def extra_step_rows(x: torch.Tensor, order: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the adaptive default's lambda, whether each row took an extra step) for x (rows, n), every key allowed: the
    rows whose lambda differs from the default steps' alone."""
    from hf_attention_backends.ops.stieltjes.op import default_newton_iter
    ok = torch.ones_like(x, dtype=torch.bool)
    steps = default_newton_iter(order)
    lam = solve_lambda(x, ok, order, -steps)
    return lam, lam != solve_lambda(x, ok, order, steps)


def extra_steps_study(orders=(4.0, 8.0), scales=(0.5, 1.0, 1.5, 2.0), sizes=(2048, 4096, 16384), rows: int = 512,
                      dim: int = 64, block: int = 64) -> list[tuple]:
    """(order, scale, N, share of rows with an extra step, share of query blocks of ``block`` rows with one, worst
    relative output error of the adaptive default) on score_rows' Gaussian rows."""
    out = []
    for order in orders:
        for scale in scales:
            for n in sizes:
                x, v = score_rows(scale, n, rows, dim, seed=int(10 * scale) + n)
                lam, extra = extra_step_rows(x, order)
                err = output_error(x, v, order, lam, root_by_bisection(x, order, steps=100))
                out.append((order, scale, n, float(extra.double().mean()),
                            float(extra.view(-1, block).any(-1).double().mean()), err))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="keys per row (default 4096)")
    ap.add_argument("--rows", type=int, default=64, help="query rows per case (default 64)")
    ap.add_argument("--dim", type=int, default=64, help="head dim (default 64)")
    ap.add_argument("--max-steps", type=int, default=3, help="solver steps to report (default 3)")
    ap.add_argument("--steps-needed", action="store_true", help="per order, the Newton steps the grid needs")
    ap.add_argument("--tol", type=float, default=3e-4, help="output error for --steps-needed (default 3e-4)")
    ap.add_argument("--bimodal", action="store_true", help="two-cluster rows: the default solve from both starts")
    ap.add_argument("--order", type=float, default=4.0, help="order for --bimodal (default 4)")
    ap.add_argument("--extra-steps", action="store_true",
                    help="Gaussian rows: rows and 64-row blocks the adaptive default steps again")
    args = ap.parse_args(argv)
    if args.extra_steps:
        print("| order | scale | N | rows with an extra step | 64-row blocks with one | worst output error |")
        print("|---|---|---|---|---|---|")
        for order, scale, n, rows, blocks, err in extra_steps_study():
            print(f"| {order:g} | {scale:g} | {n} | {rows:.3f} | {blocks:.2f} | {err:.1e} |")
        return
    if args.bimodal:
        for key, val in bimodal_study(args.order).items():
            print(f"{key}: {val[0]:.1e} ({val[1]})" if isinstance(val, tuple) else f"{key}: {val}")
        return
    if args.steps_needed:
        for order in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 8.0):
            steps, scale, n = newton_steps_needed(order, args.tol)
            print(f"order {order:4.1f}: {steps} Newton steps (worst case: scale {scale}, N {n})")
        return
    steps = range(args.max_steps + 1)
    print(f"max relative output error after k steps (N={args.n}, {args.rows} rows, float64)")
    print(f"{'order':>5s} {'scale':>5s}  " + " ".join(f"newton{k:<3d}" for k in steps) + "  "
          + " ".join(f"halley{k:<3d}" for k in steps))
    for order in (1.0, 2.0, 4.0, 8.0):
        for scale in (0.05, 0.3, 1.0, 2.0, 3.0, 10.0, 30.0):
            x, v = score_rows(scale, args.n, args.rows, args.dim, seed=int(100 * order + 10 * scale))
            exact = root_by_bisection(x, order)
            nw = [output_error(x, v, order, newton(x, order, k), exact) for k in steps]
            hl = [output_error(x, v, order, halley(x, order, k), exact) for k in steps]
            print(f"{order:5.0f} {scale:5.2f}  " + " ".join(f"{e:9.1e}" for e in nw) + "  "
                  + " ".join(f"{e:9.1e}" for e in hl))


if __name__ == "__main__":
    main()
