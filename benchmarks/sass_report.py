"""Static SASS instructions of one kernel by the innermost inlined source function (or line): where a kernel's
instructions come from, read from a cubin on a machine without a GPU.

    nvcc -cubin -lineinfo -O3 --use_fast_math -std=c++20 --expt-relaxed-constexpr -Icsrc \\
         -gencode=arch=compute_90,code=sm_90 one_kernel.cu -o k.cubin
    nvdisasm -gi -c k.cubin > k.sass           # nvdisasm: CUDA toolkit, or triton's backends/nvidia/bin
    python -m benchmarks.sass_report k.sass race_group_dq_bwd_kernel [--lines] [--top 20]

`nvdisasm -gi` writes, before each instruction whose source position changed, a block of
``//## File "<path>", line <n>`` comments, innermost first (``... inlined at "<path>", line <m>`` for the
callers). Each instruction counts for the first line of the last block before it; a line belongs to the
function whose definition starts last at or above it in that file. Static counts: a loop body counts once,
unrolled copies count each.
"""
from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_FILE = re.compile(r'## File "([^"]+)", line (\d+)')
_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
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


def kernel_positions(sass: str, kernel: str) -> list[tuple[str, int, str]]:
    """(source path, line, opcode) of each instruction of the first section whose name contains `kernel`."""
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
                out.append((*current, instr.group(1).split(".")[0]))
    if not inside and not out:
        raise ValueError(f"kernel {kernel!r}: no .text section of that name in the SASS")
    return out


def count(positions: list[tuple[str, int, str]], by_line: bool = False) -> collections.Counter:
    """Instructions per `file:function` (or `file:line` with by_line)."""
    starts: dict[str, list[tuple[int, str]]] = {}
    counts: collections.Counter = collections.Counter()
    for path, line, _op in positions:
        name = Path(path).name
        if by_line:
            counts[f"{name}:{line}"] += 1
            continue
        if path not in starts:
            try:
                starts[path] = function_starts(Path(path).read_text())
            except OSError:
                starts[path] = []
        func = next((f for number, f in reversed(starts[path]) if number <= line), "?")
        counts[f"{name}:{func}"] += 1
    return counts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", help="output of nvdisasm -gi -c <cubin>")
    ap.add_argument("kernel", help="a substring of the kernel's mangled name")
    ap.add_argument("--lines", action="store_true", help="count per source line instead of per function")
    ap.add_argument("--top", type=int, default=25, help="rows to print (default 25)")
    args = ap.parse_args(argv)
    positions = kernel_positions(Path(args.sass).read_text(), args.kernel)
    counts = count(positions, by_line=args.lines)
    print(f"{args.kernel}: {len(positions)} instructions with a source position")
    for key, n in counts.most_common(args.top):
        print(f"{n:8d}  {key}")
    ops = collections.Counter(op for *_, op in positions)
    print("opcodes: " + " ".join(f"{op} {n}" for op, n in ops.most_common(12)))


if __name__ == "__main__":
    main()
