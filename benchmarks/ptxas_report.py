"""Registers, spills and serialised wgmma per kernel from a build log made with ``HFAB_PTXAS_VERBOSE=1`` (nvcc -Xptxas=-v).

    python -m benchmarks.ptxas_report build.log            # every kernel x arch
    python -m benchmarks.ptxas_report build.log --spills   # only those that spill (exit 0 either way)
    python -m benchmarks.ptxas_report build.log --strict   # exit 1 if a kernel spills or has its wgmma serialised

ptxas prints, per entry function: ``Compiling entry function '<name>' for 'sm_90'``, then
``<n> bytes stack frame, <s> bytes spill stores, <l> bytes spill loads``, then ``Used <r> registers``; and where it
makes every ``wgmma.mma_async`` of a kernel wait for the one before (a branch or a register copy between them, ...):
``(C75xx) Potential Performance Loss: wgmma.mma_async instructions are serialized due to <why> in the function
'<name>'``.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SERIALISED = re.compile(r"Potential Performance Loss: wgmma\S* instructions are serialized due to (.+?) in the "
                         r"function '([^']+)'")


@dataclass(frozen=True)
class KernelInfo:
    name: str
    arch: str
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse(text: str) -> list[KernelInfo]:
    """One KernelInfo per ``Used N registers`` line that follows an entry function."""
    kernels, entry, spill = [], None, (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            entry, spill = (m.group(1), m.group(2)), (0, 0, 0)
        elif m := _SPILL.search(line):
            spill = tuple(int(x) for x in m.groups())
        elif (m := _REGS.search(line)) and entry is not None:
            kernels.append(KernelInfo(entry[0], entry[1], int(m.group(1)), *spill))
            entry = None
    return kernels


def serialised(text: str) -> dict[str, str]:
    """Kernels whose wgmma ptxas serialised: mangled name -> the reason it gives."""
    return {m.group(2): m.group(1) for m in _SERIALISED.finditer(text)}


def demangle(names: list[str]) -> list[str]:
    """c++filt when available, else the mangled names."""
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def format_kernels(kernels: list[KernelInfo]) -> str:
    names = demangle([k.name for k in kernels])
    return "\n".join(f"{k.arch:<8} {k.registers:>4} regs  stack {k.stack:>5} B  spill st/ld {k.spill_stores}/"
                     f"{k.spill_loads} B  {name}" for k, name in zip(kernels, names))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ptxas_report", description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--spills", action="store_true", help="only kernels that spill")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a kernel spills or has its wgmma serialised")
    args = parser.parse_args(argv)
    with open(args.log, errors="replace") as f:
        text = f.read()
    kernels, slow = parse(text), serialised(text)
    shown = [k for k in kernels if k.spills] if args.spills else kernels
    spilling = sum(k.spills for k in kernels)
    print(f"ptxas: {len(kernels)} kernel x arch entries, {spilling} with spills, {len(slow)} with wgmma serialised")
    if shown:
        print(format_kernels(shown))
    for name, why in zip(demangle(list(slow)), slow.values()):
        print(f"wgmma serialised ({why}): {name}")
    return 1 if args.strict and (spilling or slow) else 0


if __name__ == "__main__":
    raise SystemExit(main())
