"""Benchmark results: the CSV schema, the run's environment, appending, a text table and a PNG plot.

``python -m benchmarks.report benchmarks/results/nvidia-h200.csv [--all | --run-id ID] [--plot out.png]``
prints the table of the file's last run (every run with ``--all``, one run with ``--run-id``) and
optionally plots it.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import uuid
from collections import OrderedDict
from typing import Optional

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")

COLUMNS = [
    "date", "run_id", "gpu", "torch", "cuda", "git_sha", "extension", "device",
    "backend", "case", "dtype", "B", "H", "Hkv", "N", "D", "causal", "params",
    "provider", "mode", "median_ms", "p20_ms", "p80_ms", "peak_mem_MB", "reps", "input_sets",
    "status", "message",
]
STATUSES = ("ok", "oom", "error", "skipped")


def git_sha() -> str:
    """Short HEAD SHA of the repository, ``+dirty`` when tracked files differ from it; "unknown" without git.

    ``HFAB_GIT_SHA`` overrides it (the GPU machine receives a copy of the tree without .git)."""
    if os.environ.get("HFAB_GIT_SHA"):
        return os.environ["HFAB_GIT_SHA"]
    try:
        sha = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_slug(device: torch.device) -> str:
    """"NVIDIA H200" -> "nvidia-h200": the default results file stem."""
    return "-".join("".join(c if c.isalnum() else " " for c in device_name(device).lower()).split())


KERNEL_SWITCHES = ("HFAB_RACE_TC_BACKWARD", "HFAB_RACE_PHI_TILE", "HFAB_RACE_PREFETCH", "HFAB_RACE_WARP_CAUSAL",
                   "HFAB_RACE_GROUP_CHUNKS", "HFAB_NYSTROM_TC")


def kernel_switches() -> list[str]:
    """``NAME=value`` for each kernel run-time switch set in the environment (csrc/race/race_host.cuh,
    csrc/nystrom/nystrom_host.cuh)."""
    return [f"{name}={os.environ[name]}" for name in KERNEL_SWITCHES if name in os.environ]


def environment(device: torch.device) -> dict:
    """The per-run columns: date (UTC), run_id, GPU, torch, CUDA, git SHA, whether the extension loaded.

    ``extension`` also names the kernels' run-time switches that are set (``loaded HFAB_RACE_PHI_TILE=1``), so
    rows of an A/B run stay apart.
    """
    from hf_attention_backends import _ext
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.isoformat(timespec="seconds"),
        "run_id": f"{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}",
        "gpu": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "git_sha": git_sha(),
        "extension": " ".join(["loaded" if _ext.extension_loaded() else "absent", *kernel_switches()]),
        "device": str(device),
    }


def append_row(path: str, row: dict) -> None:
    """Append one row, writing the header first if the file is new or empty.

    An existing file with other columns raises ValueError (write to a new --out instead).
    """
    missing = [c for c in COLUMNS if c not in row]
    assert not missing and len(row) == len(COLUMNS), f"row columns {sorted(row)} != {COLUMNS}"
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if header != COLUMNS:
            raise ValueError(f"{path} has columns {header}; this harness writes {COLUMNS}. "
                             "Use a new --out file.")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def last_run(rows: list[dict]) -> list[dict]:
    """The rows of the last run in a file (the run_id of its last row)."""
    if not rows:
        return []
    run_id = rows[-1]["run_id"]
    return [r for r in rows if r["run_id"] == run_id]


def _ms(row: dict) -> Optional[float]:
    if row["status"] != "ok" or row["median_ms"] == "":
        return None
    return float(row["median_ms"])


def crossovers(rows: list[dict]) -> list[str]:
    """Per (case, mode) where ours and sdpa both ran at two or more N: the smallest N from which ours is at least as
    fast as SDPA at every larger measured N (the crossover length), or that it is at no measured N / at every one."""
    times: "OrderedDict[tuple, dict]" = OrderedDict()
    for r in rows:
        if r["provider"] in ("ours", "sdpa") and _ms(r) is not None:
            times.setdefault((r["case"], r["mode"]), {}).setdefault(int(r["N"]), {})[r["provider"]] = _ms(r)
    lines = []
    for (case, mode), by_n in times.items():
        both = sorted(n for n, t in by_n.items() if len(t) == 2)
        if len(both) < 2:
            continue
        faster = [by_n[n]["ours"] <= by_n[n]["sdpa"] for n in both]
        span = f"measured N {both[0]}..{both[-1]}"
        if all(faster):
            text = f"ours at least as fast as sdpa at every N ({span})"
        elif not faster[-1]:
            text = f"ours slower than sdpa at N {both[-1]} ({span})"
        else:
            first = next(i for i in range(len(both)) if all(faster[i:]))
            text = f"ours at least as fast as sdpa from N {both[first]} on, slower at N {both[first - 1]} ({span})"
        lines.append(f"  crossover: {case} {mode}: {text}")
    return lines


def format_table(rows: list[dict]) -> str:
    """One line per (case, N, mode): each provider's median ms (or its status), and sdpa/ours
    (> 1: ours is faster than the softmax baseline) when both ran. Then the crossover lengths against SDPA
    (``crossovers``) and the messages of error and oom rows and of the first skipped row of each (case, provider,
    mode)."""
    providers = list(OrderedDict.fromkeys(r["provider"] for r in rows))
    groups: "OrderedDict[tuple, dict]" = OrderedDict()
    for r in rows:
        groups.setdefault((r["case"], r["N"], r["mode"]), {})[r["provider"]] = r
    ratio = "ours" in providers and "sdpa" in providers
    header = ["case", "N", "mode"] + [f"{p} ms" for p in providers] + (["sdpa/ours"] if ratio else [])
    lines = [header]
    for (case, n, mode), by_provider in groups.items():
        cells = [case, n, mode]
        for p in providers:
            r = by_provider.get(p)
            cells.append("-" if r is None else (f"{_ms(r):.3f}" if _ms(r) is not None else r["status"]))
        if ratio:
            ours, sdpa = (_ms(by_provider[p]) if p in by_provider else None for p in ("ours", "sdpa"))
            cells.append(f"{sdpa / ours:.2f}" if ours and sdpa else "")
        lines.append(cells)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    out += crossovers(rows)
    seen = set()
    for r in rows:
        key = (r["case"], r["provider"], r["mode"])
        if r["status"] in ("error", "oom") or (r["status"] == "skipped" and key not in seen):
            out.append(f"  {r['status']}: {r['case']} N={r['N']} {r['provider']} {r['mode']}: {r['message']}")
        if r["status"] == "skipped":
            seen.add(key)
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> str:
    """PNG of median ms vs N (log-log), one panel per (case, mode), one line per provider."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(OrderedDict.fromkeys(r["case"] for r in rows))
    modes = list(OrderedDict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(len(cases), len(modes), figsize=(6 * len(modes), 3.6 * len(cases)), squeeze=False)
    for i, case in enumerate(cases):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            panel = [r for r in rows if r["case"] == case and r["mode"] == mode]
            first = panel[0] if panel else None
            for provider in OrderedDict.fromkeys(r["provider"] for r in panel):
                points = sorted((int(r["N"]), _ms(r)) for r in panel
                                if r["provider"] == provider and _ms(r) is not None)
                if points:
                    ax.plot([n for n, _ in points], [t for _, t in points], marker="o", label=provider)
            if ax.lines:
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, "no successful runs", ha="center", va="center", transform=ax.transAxes)
            if first is not None:
                params = f", {first['params']}" if first["params"] else ""
                ax.set_title(f"{case} {mode}\n{first['dtype']} B={first['B']} H={first['H']} Hkv={first['Hkv']} "
                             f"D={first['D']} causal={first['causal']}{params}", fontsize=8)
            ax.set_xlabel("N")
            ax.set_ylabel("median ms")
            ax.grid(True, which="both", alpha=0.3)
    if rows:
        fig.suptitle(f"{rows[0]['gpu']}  torch {rows[0]['torch']}  CUDA {rows[0]['cuda']}  {rows[0]['git_sha']}  "
                     f"{rows[0]['date']}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="a results CSV written by benchmarks.run")
    parser.add_argument("--all", action="store_true", help="every run in the file, not only the last")
    parser.add_argument("--run-id", help="only the rows of this run_id")
    parser.add_argument("--plot", metavar="PNG", help="also draw the rows into this PNG")
    args = parser.parse_args(argv)
    rows = read_rows(args.csv)
    if args.run_id:
        rows = [r for r in rows if r["run_id"] == args.run_id]
    elif not args.all:
        rows = last_run(rows)
    if not rows:
        print(f"{args.csv}: no rows")
        return 1
    print(f"{rows[0]['gpu']} | torch {rows[0]['torch']} | CUDA {rows[0]['cuda']} | {rows[0]['git_sha']} | "
          f"extension {rows[0]['extension']} | {rows[0]['date']}")
    print(format_table(rows))
    if args.plot:
        print(f"plot: {plot(rows, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
