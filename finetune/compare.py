"""Compare two runs' ``log.csv`` step by step: does a multi-GPU run follow the single-GPU curve?

    python -m finetune.compare runs/one_gpu runs/two_gpus [--rtol 0.01] [--keys loss,grad_norm] [--window 10]

Rows are matched by (stage, step); for each key present in both, the relative difference |b - a| / |a|.
``--window K`` first averages each stage's training rows (those with a loss) over consecutive groups of K,
each group logged at its last step: bf16 runs that split a batch differently drift apart step by step
(chaotically) while their curves agree; evaluation rows are compared as they are.
Prints one line per matched row and the largest difference per key; exits 1 when the runs log different
(stage, step) rows or a difference exceeds ``--rtol``, 2 on a missing file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from .logs import read_csv

DEFAULT_KEYS = ("loss", "grad_norm", "ppl", "top1_agreement", "cosine")


def _csv_path(run: str) -> Path:
    path = Path(run)
    return path / "log.csv" if path.is_dir() else path


def _key(row: dict) -> tuple:
    return row["stage"], row.get("step")


def relative_differences(a: list[dict], b: list[dict], keys=DEFAULT_KEYS) -> list[tuple[tuple, dict]]:
    """[((stage, step), {key: relative difference})] for the rows of ``a`` that ``b`` also logs."""
    by_key = {_key(r): r for r in b}
    out = []
    for row in a:
        other = by_key.get(_key(row))
        if other is None:
            continue
        diffs = {k: abs(other[k] - row[k]) / max(abs(row[k]), 1e-12) for k in keys if k in row and k in other}
        if diffs:
            out.append((_key(row), diffs))
    return out


def windowed(rows: list[dict], window: int) -> list[dict]:
    """``rows`` with each stage's training rows (those with a ``loss``) averaged over consecutive groups of
    ``window`` (a last, shorter group too); a group keeps its last row's stage and step. Other rows unchanged."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    out, group = [], []

    def flush():
        if group:
            keys = set.intersection(*(set(k for k, v in r.items() if isinstance(v, float)) for r in group))
            out.append({**group[-1], **{k: sum(r[k] for r in group) / len(group) for k in keys if k != "step"}})
            group.clear()

    for row in rows:
        if "loss" not in row or (group and group[-1]["stage"] != row["stage"]):
            flush()
        if "loss" in row:
            group.append(row)
            if len(group) == window:
                flush()
        else:
            out.append(row)
    flush()
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", help="output_dir (or log.csv) of the reference run")
    parser.add_argument("run_b", help="output_dir (or log.csv) of the run to check")
    parser.add_argument("--rtol", type=float, default=1e-2, help="largest relative difference allowed (1e-2)")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma list of log.csv columns")
    parser.add_argument("--window", type=int, default=1,
                        help="average training rows over groups of this many logged rows first (1: row by row)")
    args = parser.parse_args(argv)
    paths = [_csv_path(r) for r in (args.run_a, args.run_b)]
    for path in paths:
        if not path.is_file():
            print(f"finetune.compare: error: {path} does not exist", file=sys.stderr)
            return 2
    if args.window < 1:
        parser.error(f"--window={args.window} must be >= 1")
    a, b = (windowed(read_csv(p), args.window) for p in paths)
    keys = tuple(k for k in args.keys.split(",") if k)
    rows_a, rows_b = [_key(r) for r in a], [_key(r) for r in b]
    diffs = relative_differences(a, b, keys)
    worst: dict = {}
    for (stage, step), d in diffs:
        print(f"{stage:<10} {step if step is not None else '-':>6}  " +
              "  ".join(f"{k} {v:.2e}" for k, v in d.items()))
        for k, v in d.items():
            worst[k] = max(worst.get(k, 0.0), v)
    print("largest relative difference: " + (", ".join(f"{k} {v:.3e}" for k, v in worst.items()) or "none"))
    failed = False
    if rows_a != rows_b:
        print(f"finetune.compare: the runs log different rows ({len(rows_a)} vs {len(rows_b)}; first differing: "
              f"{next((x, y) for x, y in zip(rows_a + [None], rows_b + [None]) if x != y)})", file=sys.stderr)
        failed = True
    if not diffs:
        print("finetune.compare: no row with a common value to compare", file=sys.stderr)
        failed = True
    over = {k: v for k, v in worst.items() if v > args.rtol}
    if over:
        print(f"finetune.compare: relative differences above --rtol {args.rtol}: {over}", file=sys.stderr)
        failed = True
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
