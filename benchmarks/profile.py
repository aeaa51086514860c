"""Where the time of one benchmark call goes, kernel by kernel (torch.profiler, CUDA activity).

``python -m benchmarks.profile CASE N [--mode fwd|fwd+bwd] [--provider ours] [--calls 3]`` builds the
case's inputs as the runner does, warms up, profiles ``--calls`` calls and prints the kernels sorted by
total GPU time (per-call milliseconds and share), so a NOTES.md can say which kernel bounds a shape. The first line
also gives the median time between CUDA events around a call: below the GPU time's sum where kernels overlap
(dependent launches, side streams), above it by the gaps between kernels.

``--host``: instead, where the host's time goes: the wall time to enqueue ``--calls`` calls without waiting for
the GPU (a call whose enqueue time exceeds its GPU time is host-bound) and the CPU operators sorted by self time.

``--ncu``: instead, one call between cudaProfilerStart and cudaProfilerStop after the warm-up, for Nsight
Compute's hardware counters on exactly that call's kernels (``scripts/ncu_profile.sh`` runs it)::

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... \
        python -m benchmarks.profile race_causal 262144 --mode fwd+bwd --ncu
"""
import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from . import registry
from .run import make_call, make_inputs
from .timing import summarize, times_ms


def warm_call(case_name: str, n: int, mode: str, provider: str):
    """The benchmark runner's call of one case, size and mode, already run twice (compiled, allocated)."""
    registry.load()
    if case_name not in registry.CASES:
        raise ValueError(f"case {case_name!r} is not registered; registered: {', '.join(registry.CASES)}")
    case, device = registry.CASES[case_name], torch.device("cuda")
    tensors = case.make_tensors(case, device) if case.make_tensors else {}
    call = make_call(registry.select_providers([provider])[0], case, make_inputs(case, n, device, 0, 1), tensors,
                     mode)
    for i in range(2):
        call(i)
    torch.cuda.synchronize()
    return call


def profiled(call, calls: int, activity, time_of) -> list[tuple[str, float, int]]:
    """[(event name, ms per call, occurrences per call)] of ``calls`` calls under torch.profiler recording
    ``activity``, timed by ``time_of(event)`` (µs), largest first."""
    with profile(activities=[activity]) as prof:
        for i in range(calls):
            call(i)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rows = [(e.key, time_of(e) / 1e3 / calls, e.count // calls) for e in prof.key_averages() if time_of(e) > 0]
    return sorted(rows, key=lambda r: -r[1])


def kernel_rows(call, calls: int) -> list[tuple[str, float, int]]:
    """[(kernel name, GPU ms per call, launches per call)] sorted by time, for ``calls`` profiled calls."""
    return profiled(call, calls, ProfilerActivity.CUDA, lambda e: e.device_time_total)


def kernel_table(case_name: str, n: int, mode: str, provider: str, calls: int) -> list[tuple[str, float, int]]:
    """kernel_rows of a case's warm call."""
    return kernel_rows(warm_call(case_name, n, mode, provider), calls)


def host_table(case_name: str, n: int, mode: str, provider: str, calls: int):
    """(host ms per call to enqueue, wall ms per call, [(CPU operator, self ms per call, calls per call)])."""
    call = warm_call(case_name, n, mode, provider)
    start = time.perf_counter()
    for i in range(calls):
        call(i)
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    rows = profiled(call, calls, ProfilerActivity.CPU, lambda e: e.self_cpu_time_total)
    return 1e3 * (enqueued - start) / calls, 1e3 * (done - start) / calls, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("case")
    parser.add_argument("n", type=int)
    parser.add_argument("--mode", default="fwd", choices=["fwd", "fwd+bwd"])
    parser.add_argument("--provider", default="ours")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--ncu", action="store_true", help="one call inside cudaProfilerStart/Stop, no table")
    parser.add_argument("--host", action="store_true", help="host enqueue time and CPU operators, no kernel table")
    args = parser.parse_args(argv)
    if args.host:
        enqueue_ms, wall_ms, rows = host_table(args.case, args.n, args.mode, args.provider, args.calls)
        print(f"{args.case} N={args.n} {args.mode} {args.provider}: host enqueues a call in {enqueue_ms:.3f} ms, "
              f"{wall_ms:.3f} ms per call with the GPU; CPU self time (under the profiler):")
        for name, ms, count in rows[:args.top]:
            print(f"  {ms:9.3f} ms  x{count:<4d} {name[:110]}")
        return 0
    if args.ncu:
        call = warm_call(args.case, args.n, args.mode, args.provider)
        torch.cuda.profiler.start()
        call(0)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return 0
    call = warm_call(args.case, args.n, args.mode, args.provider)
    wall = summarize(times_ms(call, 0, max(args.calls, 5), torch.device("cuda")))[0]
    rows = kernel_rows(call, args.calls)
    total = sum(r[1] for r in rows)
    print(f"{args.case} N={args.n} {args.mode} {args.provider}: {total:.3f} ms of GPU time per call, "
          f"{wall:.3f} ms between CUDA events (median; kernels that overlap count once)")
    for name, ms, count in rows[:args.top]:
        print(f"  {ms:9.3f} ms {100 * ms / total:5.1f}%  x{count:<4d} {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
