"""The benchmark runner.

    python -m benchmarks.run --backend race --providers ours,reference,sdpa --modes fwd,fwd+bwd \\
        --quick --out benchmarks/results/nvidia-h200.csv --plot
    python -m benchmarks.run --list
    python -m benchmarks.run --device cpu --quick          # tiny shapes: tests the harness itself

For every case (ascending N), provider and mode it appends one CSV row (see benchmarks/README.md):
status ok | oom | error | skipped, with the message. A provider/mode stops for the larger sizes of a
case after an OOM or once a size exceeds ``--size-budget``; ``--time-budget`` bounds the whole run.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable, Optional

import torch

from . import registry, report
from .registry import Case, Provider
from .timing import OverBudget, is_oom, measure, release_memory

MODES = ("fwd", "fwd+bwd")
MAX_INPUT_SETS = 8
MIN_CUDA_REPS = 20
CPU_CACHE_BYTES = 32 * 2**20


def cache_bytes(device: torch.device) -> int:
    """L2 size of the GPU (the cache rotation must defeat), a nominal 32 MiB on CPU."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * 2**20)
    return CPU_CACHE_BYTES


def input_set_count(case: Case, n: int, device: torch.device) -> int:
    """Enough input sets (q, k, v, dout) to span 4x the cache, at most MAX_INPUT_SETS."""
    elem = torch.empty((), dtype=case.dtype).element_size()
    set_bytes = elem * n * case.batch * case.head_dim * (2 * case.heads + 2 * case.hkv)
    return max(1, min(MAX_INPUT_SETS, math.ceil(4 * cache_bytes(device) / set_bytes)))


def make_inputs(case: Case, n: int, device: torch.device, seed: int, count: int) -> list[dict]:
    """``count`` seeded standard-normal sets {q, k, v, dout}: q/dout (B, H, N, D), k/v (B, Hkv, N, D)."""
    sets = []
    for i in range(count):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + n * MAX_INPUT_SETS + i)
        shapes = {"q": case.heads, "k": case.hkv, "v": case.hkv, "dout": case.heads}
        sets.append({name: torch.randn(case.batch, h, n, case.head_dim, generator=gen, device=device,
                                       dtype=torch.float32).to(case.dtype) for name, h in shapes.items()})
    return sets


def make_call(provider: Provider, case: Case, sets: list[dict], tensors: dict, mode: str) -> Callable[[int], None]:
    """``call(i)``: run ``provider`` on input set ``i % len(sets)``; fwd under no_grad, fwd+bwd by
    autograd.grad w.r.t. q, k, v and the case's trainable tensors. The first call checks the output shape."""
    def check(out, q):
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(q.shape):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"provider {provider.name!r} returned {got}; expected (B, H, N, D)={tuple(q.shape)}")

    if mode == "fwd":
        def call(i: int) -> None:
            s = sets[i % len(sets)]
            with torch.no_grad():
                out = provider.fn(case, s["q"], s["k"], s["v"], tensors)
            if i == 0:
                check(out, s["q"])
        return call

    assert mode == "fwd+bwd", mode
    leaves = [{name: s[name].detach().requires_grad_(True) for name in ("q", "k", "v")} for s in sets]
    extra = {name: (t.detach().requires_grad_(True) if name in case.trainable else t) for name, t in tensors.items()}
    trainable = [extra[name] for name in case.trainable]

    def call(i: int) -> None:
        s, g = leaves[i % len(sets)], sets[i % len(sets)]["dout"]
        out = provider.fn(case, s["q"], s["k"], s["v"], extra)
        if i == 0:
            check(out, s["q"])
        torch.autograd.grad(out, [s["q"], s["k"], s["v"], *trainable], g, allow_unused=True)
    return call


class Runner:
    """Sweeps cases x sizes x providers x modes, appending each row to ``out`` as soon as it exists
    (a killed run keeps what it measured)."""

    def __init__(self, *, device: torch.device, out: str, quick: bool, reps: int, warmup: int,
                 size_budget_s: float, time_budget_s: Optional[float], seed: int, run_id: Optional[str] = None,
                 log=print):
        self.device, self.out, self.quick = device, out, quick
        self.reps, self.warmup, self.seed = reps, warmup, seed
        self.size_budget_s, self.log = size_budget_s, log
        self.deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        self.time_budget_s = time_budget_s
        self.env = report.environment(device)
        if run_id:
            self.env["run_id"] = run_id
        self.rows: list[dict] = []

    def time_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def run(self, cases: list[Case], providers: list[Provider], modes: list[str]) -> list[dict]:
        for case in cases:
            case = case.tiny() if self.device.type == "cpu" else case
            stopped: dict[tuple, str] = {}
            for n in (case.quick_sizes if self.quick else case.sizes):
                jobs = [(p, m) for p in providers if p.applies_to(case.backend) for m in modes]
                self._run_size(case, n, jobs, stopped)
                release_memory(self.device)
        return self.rows

    def _run_size(self, case: Case, n: int, jobs: list[tuple[Provider, str]], stopped: dict) -> None:
        count = input_set_count(case, n, self.device)
        live = [(p, m) for p, m in jobs if (p.name, m) not in stopped and self.time_left() > 0]
        sets, tensors, setup_error = [], {}, None
        if live:
            try:
                sets = make_inputs(case, n, self.device, self.seed, count)
                tensors = case.make_tensors(case, self.device) if case.make_tensors else {}
            except Exception as err:  # noqa: BLE001 - recorded in every row of this size
                setup_error = ("oom" if is_oom(err) else "error", f"creating inputs: {type(err).__name__}: {err}")
        for provider, mode in jobs:
            measured = None
            if (provider.name, mode) in stopped:
                status, message = "skipped", stopped[(provider.name, mode)]
            elif self.time_left() <= 0:
                status, message = "skipped", f"--time-budget {self.time_budget_s:g} s exhausted"
            elif setup_error is not None:
                status, message = setup_error
            else:
                status, message, measured = self._measure(case, n, provider, mode, sets, tensors, stopped)
            self._emit(case, n, provider, mode, count, status, message, measured)

    def _measure(self, case, n, provider, mode, sets, tensors, stopped):
        key = (provider.name, mode)
        budget = min(self.size_budget_s, self.time_left())
        started = time.monotonic()
        try:
            measured = measure(make_call(provider, case, sets, tensors, mode), self.device,
                               warmup=self.warmup, reps=self.reps, budget_s=budget)
        except OverBudget as err:
            which = "--size-budget" if budget == self.size_budget_s else "time left of --time-budget"
            stopped[key] = f"N={n} was over budget ({err}); larger sizes skipped"
            return "skipped", f"{err} ({which})", None
        except NotImplementedError as err:
            return "skipped", f"NotImplementedError: {err}", None
        except Exception as err:  # noqa: BLE001 - the row records it; the sweep goes on
            status, message = ("oom" if is_oom(err) else "error"), f"{type(err).__name__}: {err}"
        else:
            status, message = "ok", ""
        if status == "oom":
            stopped[key] = f"after OOM at N={n}"
            release_memory(self.device)  # outside the except block: the traceback's tensors are gone
        if status != "ok":
            return status, message, None
        elapsed = time.monotonic() - started
        if elapsed > self.size_budget_s:
            stopped[key] = f"N={n} took {elapsed:.1f} s > --size-budget {self.size_budget_s:g} s; larger sizes skipped"
        return "ok", "", measured

    def _emit(self, case, n, provider, mode, count, status, message, measured) -> None:
        row = dict(self.env)
        row.update({
            "backend": case.backend, "case": case.name, "dtype": str(case.dtype).replace("torch.", ""),
            "B": case.batch, "H": case.heads, "Hkv": case.hkv, "N": n, "D": case.head_dim,
            "causal": case.causal, "params": case.params_label(), "provider": provider.name, "mode": mode,
            "median_ms": "", "p20_ms": "", "p80_ms": "", "peak_mem_MB": "", "reps": "", "input_sets": count,
            "status": status, "message": " ".join(str(message).split())[:500],
        })
        if measured is not None:
            row.update({"median_ms": f"{measured.median_ms:.4f}", "p20_ms": f"{measured.p20_ms:.4f}",
                        "p80_ms": f"{measured.p80_ms:.4f}", "reps": measured.reps,
                        "peak_mem_MB": "" if measured.peak_mem_mb is None else f"{measured.peak_mem_mb:.1f}"})
        report.append_row(self.out, row)
        self.rows.append(row)
        timing = (f"{row['median_ms']} ms [{row['p20_ms']}, {row['p80_ms']}] peak {row['peak_mem_MB'] or '-'} MB"
                  if status == "ok" else f"{status}: {row['message']}")
        self.log(f"{case.name} N={n} {provider.name} {mode}: {timing}", flush=True)


def list_registry() -> str:
    registry.load()
    lines = ["cases (B, H, Hkv, D; N: full | --quick):"]
    for c in registry.CASES.values():
        opts = ", ".join(f"{k}={v}" for k, v in c.options.items())
        lines.append(f"  {c.backend:<9} {c.name:<24} {str(c.dtype).replace('torch.', ''):<8} "
                     f"B={c.batch} H={c.heads} Hkv={c.hkv} D={c.head_dim}  N={list(c.sizes)} | "
                     f"{list(c.quick_sizes)}  {opts}")
    lines.append("providers:")
    for p in registry.PROVIDERS.values():
        scope = "all backends" if p.backends is None else ", ".join(sorted(p.backends))
        lines.append(f"  {p.name:<10} {p.description} ({scope})")
    return "\n".join(lines)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                     description="Benchmark the attention backends; append rows to a CSV.")
    parser.add_argument("--list", action="store_true", help="print the registered cases and providers, then exit")
    parser.add_argument("--backend", default="all", help="comma list of backends, or 'all' (default)")
    parser.add_argument("--cases", default="", help="comma list of case names (default: every case of --backend)")
    parser.add_argument("--providers", default="ours,reference,sdpa", help="comma list (default ours,reference,sdpa)")
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="comma list of fwd, fwd+bwd (default both)")
    parser.add_argument("--quick", action="store_true", help="each case's quick_sizes instead of its full sweep")
    parser.add_argument("--device", default=None,
                        help="cuda[:i] (default when available) or cpu (tiny shapes, float32: tests the harness)")
    parser.add_argument("--out", default=None,
                        help="CSV to append to (default benchmarks/results/<device>.csv, e.g. nvidia-h200.csv)")
    parser.add_argument("--plot", nargs="?", const="", default=None, metavar="PNG",
                        help="draw this run's rows into PNG (default: the CSV path with .png)")
    parser.add_argument("--reps", type=int, default=25, help=f"timed calls per row (default 25; >= {MIN_CUDA_REPS} "
                        "on CUDA)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3, >= 1)")
    parser.add_argument("--size-budget", type=float, default=30.0,
                        help="seconds one (case, N, provider, mode) may take; over it, larger N are skipped (30)")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (default none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads on --device cpu (default 1: stable timings on a shared machine)")
    parser.add_argument("--run-id", default=None, help="the run_id column (default <UTC time>-<random hex>)")
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device!r} is not supported; supported: cuda, cuda:<i>, cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and args.reps < MIN_CUDA_REPS:
        parser.error(f"--reps {args.reps}: at least {MIN_CUDA_REPS} on CUDA (DESIGN.md: median of >= 20)")
    if args.reps < 1 or args.warmup < 1 or args.cpu_threads < 1:
        parser.error(f"--reps {args.reps}, --warmup {args.warmup}, --cpu-threads {args.cpu_threads} must be >= 1")
    if args.size_budget <= 0 or (args.time_budget is not None and args.time_budget < 0):
        parser.error(f"--size-budget {args.size_budget} must be > 0 and --time-budget {args.time_budget} >= 0")
    for mode in _split(args.modes):
        if mode not in MODES:
            parser.error(f"--modes {mode!r} is not supported; supported: {', '.join(MODES)}")
    args.device = device
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Returns 0, or 1 when some row has status error (oom and skipped are results, not failures)."""
    args = parse_args(argv)
    if args.list:
        print(list_registry())
        return 0
    backends = list(registry.BACKENDS) if args.backend == "all" else _split(args.backend)
    cases = registry.select_cases(backends, _split(args.cases))
    providers = registry.select_providers(_split(args.providers))
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device)
        from hf_attention_backends.ops._registry import reference_on_cuda_allowed
        if "ours" in [p.name for p in providers] and reference_on_cuda_allowed():
            print("HFAB_REFERENCE_ON_CUDA is set: provider 'ours' would time the PyTorch reference, not a kernel. "
                  "Unset it (the 'reference' provider times the reference).", file=sys.stderr)
            return 2
    out = args.out or os.path.join(report.RESULTS_DIR, f"{report.device_slug(args.device)}.csv")
    runner = Runner(device=args.device, out=out, quick=args.quick, reps=args.reps, warmup=args.warmup,
                    size_budget_s=args.size_budget, time_budget_s=args.time_budget, seed=args.seed,
                    run_id=args.run_id)
    env = runner.env
    print(f"{env['gpu']} | torch {env['torch']} | CUDA {env['cuda']} | {env['git_sha']} | extension "
          f"{env['extension']} | {len(cases)} cases x {len(providers)} providers -> {out}", flush=True)
    threads = torch.get_num_threads()
    if args.device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    try:
        rows = runner.run(cases, providers, _split(args.modes))
    finally:
        torch.set_num_threads(threads)
    print(report.format_table(rows))
    if args.plot is not None and rows:
        print(f"plot: {report.plot(rows, args.plot or os.path.splitext(out)[0] + '.png')}")
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
