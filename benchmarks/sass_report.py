"""Static SASS instructions of one kernel by the innermost inlined source function (or line): where a kernel's
instructions come from, read from a cubin on a machine without a GPU.

    nvcc -cubin -lineinfo -O3 --use_fast_math -std=c++20 --expt-relaxed-constexpr -Icsrc \\
         -gencode=arch=compute_90,code=sm_90 one_kernel.cu -o k.cubin
    nvdisasm -gi -c k.cubin > k.sass           # nvdisasm: CUDA toolkit, or triton's backends/nvidia/bin
    python -m benchmarks.sass_report k.sass race_group_dq_bwd_kernel [--lines] [--top 20] [--ncu sass.csv]

`nvdisasm -gi` writes, before each instruction whose source position changed, a block of
``//## File "<path>", line <n>`` comments, innermost first (``... inlined at "<path>", line <m>`` for the
callers). Each instruction counts for the first line of the last block before it; a line belongs to the
function whose definition starts last at or above it in that file. Static counts: a loop body counts once,
unrolled copies count each.

``--copies N``: instead, the runs of N or more consecutive register copies (MOV, IMAD.MOV.U32) with the source line of
their first: in a hot loop, usually values moved into the registers that a branch join expects (the Stieltjes
forward at 5a332f0 spent 6% of its executed instructions that way).

``--ncu``: also what a profile measured, per row: Nsight Compute's SASS source page of the same kernel
(``ncu -i r.ncu-rep --page source --csv --print-source sass > sass.csv``, .csv or .csv.gz; the GPU build must be
the same nvcc and flags, so every instruction sits at the same offset) adds each row's share of the instructions
executed and of the warp stall samples, and the rows are sorted by stall share (then executed share).
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
from pathlib import Path

_FILE = re.compile(r'## File "([^"]+)", line (\d+)')
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SECTION = re.compile(r"^\.text\.(\S+):")
_DEF = re.compile(r"^(?:template\s*<[^>]*>\s*)?(?:static\s+)?(?:__\w+__\s+)+.*?(\w+)(?:<[^()]*>)?\s*\(")


def function_starts(source: str) -> list[tuple[int, str]]:
    """(line, name) of every top-level function definition: a line at column 0 with CUDA qualifiers."""
    starts = []
    for number, line in enumerate(source.splitlines(), 1):
        match = _DEF.match(re.sub(r"__launch_bounds__\([^)]*\)", "", line))
        if match:
            starts.append((number, match.group(1)))
    return starts


def kernel_positions(sass: str, kernel: str, full_opcode: bool = False) -> list[tuple[str, int, str, int]]:
    """(source path, line, opcode, byte offset) of each instruction of the first section whose name contains
    `kernel`; the opcode without its modifiers (IMAD for IMAD.MOV.U32) unless full_opcode."""
    out, inside, current, after_instr = [], False, None, True
    for line in sass.splitlines():
        section = _SECTION.match(line)
        if section:
            if inside:
                break
            inside = kernel in section.group(1)
            continue
        if not inside:
            continue
        position = _FILE.search(line)
        if position:
            if after_instr:  # the first line of a block is the innermost position
                current = (position.group(1), int(position.group(2)))
            after_instr = False
            continue
        instr = _INSTR.match(line)
        if instr:
            after_instr = True
            if current:
                op = instr.group(2) if full_opcode else instr.group(2).split(".")[0]
                out.append((*current, op, int(instr.group(1), 16)))
    if not inside and not out:
        raise ValueError(f"kernel {kernel!r}: no .text section of that name in the SASS")
    return out


def row_keys(positions: list[tuple[str, int, str, int]], by_line: bool = False) -> list[str]:
    """Each instruction's row: `file:function` (or `file:line` with by_line)."""
    starts: dict[str, list[tuple[int, str]]] = {}
    keys = []
    for path, line, *_ in positions:
        name = Path(path).name
        if by_line:
            keys.append(f"{name}:{line}")
            continue
        if path not in starts:
            try:
                starts[path] = function_starts(Path(path).read_text())
            except OSError:
                starts[path] = []
        func = next((f for number, f in reversed(starts[path]) if number <= line), "?")
        keys.append(f"{name}:{func}")
    return keys


def count(positions: list[tuple[str, int, str, int]], by_line: bool = False) -> collections.Counter:
    """Instructions per `file:function` (or `file:line` with by_line)."""
    return collections.Counter(row_keys(positions, by_line))


COPY_OPCODES = ("MOV", "IMAD.MOV.U32", "IMAD.MOV")


def copy_runs(positions: list[tuple[str, int, str, int]], min_length: int) -> list[tuple[int, int, str]]:
    """(length, byte offset of the first, its `file:line`) of every run of at least min_length consecutive register
    copies (MOV, IMAD.MOV.U32; positions with full opcodes), longest first: in a hot loop such runs are usually
    values moved into the registers a branch join expects."""
    runs, start = [], None
    for i, (_, _, op, _) in enumerate([*positions, ("", 0, "", -1)]):
        if op in COPY_OPCODES:
            start = i if start is None else start
            continue
        if start is not None and i - start >= min_length:
            path, line, _, offset = positions[start]
            runs.append((i - start, offset, f"{Path(path).name}:{line}"))
        start = None
    return sorted(runs, key=lambda r: (-r[0], r[1]))


def read_source_page(path: str, kernel: str) -> dict[int, tuple[int, int]]:
    """{byte offset: (instructions executed, warp stall samples)} of the first kernel whose name contains `kernel`
    in an ``ncu --page source --csv --print-source sass`` export (offsets from the kernel's first instruction)."""
    opener = gzip.open if path.endswith(".gz") else open
    rows, header, inside = [], None, False
    with opener(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                if inside:
                    break
                inside = kernel in row[1]
            elif row and row[0] == "Address":
                header = row
            elif inside and header and len(row) >= len(header) - 1:
                rows.append(dict(zip(header, row)))
    if not rows:
        raise ValueError(f"kernel {kernel!r}: not in the profile {path}")
    base = int(rows[0]["Address"], 16)
    return {int(r["Address"], 16) - base: (int(r["Instructions Executed"] or 0),
                                          int(r["Warp Stall Sampling (All Samples)"] or 0)) for r in rows}


def measured(positions: list[tuple[str, int, str, int]], keys: list[str], profile: dict[int, tuple[int, int]]):
    """{row: (share of instructions executed, share of stall samples)}; instructions the profile lacks count 0."""
    executed: collections.Counter = collections.Counter()
    stalls: collections.Counter = collections.Counter()
    for (*_, offset), key in zip(positions, keys):
        e, s = profile.get(offset, (0, 0))
        executed[key] += e
        stalls[key] += s
    total_e, total_s = max(1, sum(executed.values())), max(1, sum(stalls.values()))
    return {key: (executed[key] / total_e, stalls[key] / total_s) for key in set(keys)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", help="output of nvdisasm -gi -c <cubin>")
    ap.add_argument("kernel", help="a substring of the kernel's mangled name")
    ap.add_argument("--lines", action="store_true", help="count per source line instead of per function")
    ap.add_argument("--top", type=int, default=25, help="rows to print (default 25)")
    ap.add_argument("--ncu", help="Nsight Compute SASS source page of the same kernel (.csv or .csv.gz)")
    ap.add_argument("--ncu-kernel", help="a substring of the kernel's demangled name in the --ncu page, where the "
                                         "mangled substring does not match it (default: the kernel argument)")
    ap.add_argument("--copies", type=int, metavar="N", help="instead: the runs of N or more consecutive register "
                                                          "copies (MOV, IMAD.MOV.U32) and where they come from")
    args = ap.parse_args(argv)
    if args.copies is not None:
        runs = copy_runs(kernel_positions(Path(args.sass).read_text(), args.kernel, full_opcode=True), args.copies)
        print(f"{args.kernel}: {len(runs)} runs of {args.copies} or more register copies, "
              f"{sum(r[0] for r in runs)} instructions")
        for length, offset, row in runs[:args.top]:
            print(f"{length:8d}  at {offset:#06x}  {row}")
        return
    positions = kernel_positions(Path(args.sass).read_text(), args.kernel)
    keys = row_keys(positions, by_line=args.lines)
    counts = collections.Counter(keys)
    print(f"{args.kernel}: {len(positions)} instructions with a source position")
    if args.ncu:
        shares = measured(positions, keys, read_source_page(args.ncu, args.ncu_kernel or args.kernel))
        print(f"{'static':>8s}  {'exec %':>6s}  {'stall %':>7s}  row")
        for key in sorted(shares, key=lambda k: (-shares[k][1], -shares[k][0], k))[:args.top]:
            print(f"{counts[key]:8d}  {shares[key][0] * 100:6.1f}  {shares[key][1] * 100:7.1f}  {key}")
    else:
        for key, n in counts.most_common(args.top):
            print(f"{n:8d}  {key}")
    ops = collections.Counter(op for _, _, op, _ in positions)
    print("opcodes: " + " ".join(f"{op} {n}" for op, n in ops.most_common(12)))


if __name__ == "__main__":
    main()
