"""The CSV of a ``scripts/ab_profile.sh`` run: one row per profiled run of ``ab.txt``.

``python -m benchmarks.ab_csv OUT/ab.txt --sha work=eeca75f [--gpu "NVIDIA H200" --torch 2.11.0 --cuda 13.0]``
writes ``OUT/ab.csv`` with the columns gpu, torch, cuda, git_sha, date, case, n, mode, round, gpu_ms_per_call
(the kernels' GPU-time sum), event_ms_per_call (the median between CUDA events, where the profile printed it) and
kernels (``name=ms`` per kernel, ``;``-separated, largest first). A tree is named by its commit; ``--sha NAME=SHA``
names the working tree (``work``), whose commit the GPU machine's ``.git`` copy may not know. GPU, torch and CUDA
default to what the local torch reports (the GPU machine's, when run there).
"""
import argparse
import csv
import datetime
import os
import re
import sys

COLUMNS = ["gpu", "torch", "cuda", "git_sha", "date", "case", "n", "mode", "round", "gpu_ms_per_call",
           "event_ms_per_call", "kernels"]
_RUN = re.compile(r"== round (\d+), tree (\S+): (\S+) (\d+) (\S+)")
_TOTAL = re.compile(r"\S+ N=\d+ \S+ \S+: ([\d.]+) ms of GPU time per call(?:, ([\d.]+) ms between CUDA events)?")
_KERNEL = re.compile(r"\s+([\d.]+) ms\s+[\d.]+%\s+x\d+\s+(.+)")


def short_kernel_name(name: str) -> str:
    """'void hfab::stieltjes::stieltjes_dq_kernel<__nv_bfloat16, 64, 4>(hfab::...)' -> 'stieltjes_dq_kernel<...>'."""
    base, sep, args = name.strip().removeprefix("void ").split("(")[0].partition("<")
    return base.rsplit("::", 1)[-1] + sep + args


def parse(text: str) -> list[dict]:
    """Runs of an ab.txt: [{round, tree, case, n, mode, gpu_ms, event_ms, kernels: [(name, ms)]}]; a run whose
    profile printed no total (it failed) is left out."""
    runs, current, pending = [], None, None
    for line in text.splitlines():
        if m := _RUN.match(line):
            current = None
            r, tree, case, n, mode = m.groups()
            pending = dict(round=int(r), tree=tree, case=case, n=int(n), mode=mode, kernels=[])
            continue
        if (m := _TOTAL.match(line)) and pending is not None:
            current = dict(pending, gpu_ms=float(m.group(1)), event_ms=float(m.group(2)) if m.group(2) else None)
            runs.append(current)
            pending = None
        elif (m := _KERNEL.match(line)) and current is not None:
            current["kernels"].append((short_kernel_name(m.group(2)), float(m.group(1))))
    return runs


def rows(runs: list[dict], *, gpu: str, torch_version: str, cuda: str, shas: dict, date: str) -> list[dict]:
    return [{
        "gpu": gpu, "torch": torch_version, "cuda": cuda, "git_sha": shas.get(r["tree"], r["tree"]), "date": date,
        "case": r["case"], "n": r["n"], "mode": r["mode"], "round": r["round"], "gpu_ms_per_call": r["gpu_ms"],
        "event_ms_per_call": "" if r["event_ms"] is None else r["event_ms"],
        "kernels": ";".join(f"{name}={ms:g}" for name, ms in r["kernels"]),
    } for r in runs]


def versions(gpu, torch_version, cuda) -> tuple[str, str, str]:
    """(GPU name, torch version, CUDA version): the ones given, the missing ones from this machine's torch as the
    benchmark CSVs name them (report.environment)."""
    if gpu and torch_version and cuda:
        return gpu, torch_version, cuda
    import torch

    from .report import device_name
    found = (device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu")), torch.__version__,
             torch.version.cuda or "none")
    return gpu or found[0], torch_version or found[1], cuda or found[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab_csv", description=__doc__.split("\n\n")[0])
    parser.add_argument("ab_txt")
    parser.add_argument("--out", help="default: ab.csv beside ab.txt")
    parser.add_argument("--sha", action="append", default=[], metavar="NAME=SHA",
                        help="the commit of a tree named NAME in ab.txt (e.g. work=eeca75f); repeatable")
    parser.add_argument("--gpu")
    parser.add_argument("--torch")
    parser.add_argument("--cuda")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    args = parser.parse_args(argv)
    shas = {}
    for item in args.sha:
        name, sep, sha = item.partition("=")
        if not sep or not name or not sha:
            parser.error(f"--sha {item!r}: expected NAME=SHA, e.g. work=eeca75f")
        shas[name] = sha
    with open(args.ab_txt) as f:
        runs = parse(f.read())
    if not runs:
        print(f"ab_csv: no profiled run in {args.ab_txt}", file=sys.stderr)
        return 1
    gpu, torch_version, cuda = versions(args.gpu, args.torch, args.cuda)
    out = args.out or os.path.join(os.path.dirname(args.ab_txt), "ab.csv")
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows(runs, gpu=gpu, torch_version=torch_version, cuda=cuda, shas=shas, date=args.date))
    print(f"ab_csv: {len(runs)} runs -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
