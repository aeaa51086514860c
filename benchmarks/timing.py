"""Timing one benchmark call: warm-up, CUDA events (perf_counter on CPU), median / p20 / p80, peak memory."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class Measurement:
    """Times in milliseconds over ``reps`` calls; peak_mem_mb is None off CUDA."""
    median_ms: float
    p20_ms: float
    p80_ms: float
    peak_mem_mb: Optional[float]
    reps: int


class OverBudget(Exception):
    """The measurement would take longer than its budget (estimated from a warm-up call)."""

    def __init__(self, seconds_per_call: float, calls: int, budget_s: float):
        self.estimate_s = seconds_per_call * calls
        super().__init__(f"estimated {calls} calls x {seconds_per_call:.3g} s = {self.estimate_s:.3g} s "
                         f"> budget {budget_s:.3g} s")


def summarize(times_ms: list[float]) -> tuple[float, float, float]:
    """(median, 20th percentile, 80th percentile), linear interpolation between order statistics."""
    p20, p50, p80 = np.percentile(np.asarray(times_ms, dtype=np.float64), [20, 50, 80])
    return float(p50), float(p20), float(p80)


def is_oom(err: BaseException) -> bool:
    """torch's CUDA OOM, or an allocator failure on the CPU."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory(device: torch.device) -> None:
    """On CUDA: collect garbage (tensors in reference cycles) and return cached blocks, so the next
    size or case starts from a clean allocator and peak memory is not hidden by the cache."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _peak_memory_mb(call: Callable[[int], None], index: int, device: torch.device) -> float:
    """Peak MiB allocated during one call beyond what was allocated before it (inputs excluded)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call(index)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def times_ms(call: Callable[[int], None], first: int, reps: int, device: torch.device) -> list[float]:
    """Milliseconds of call(first) .. call(first + reps - 1), each between its own CUDA events (CPU: perf_counter)."""
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for r in range(reps):
            starts[r].record()
            call(first + r)
            ends[r].record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        call(first + r)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure(call: Callable[[int], None], device: torch.device, *, warmup: int, reps: int,
            budget_s: float) -> Measurement:
    """Time ``call(i)`` (i counts up; the caller rotates its input sets with ``i % n_sets``).

    ``warmup`` (>= 1) untimed calls first (the first may compile or autotune); the last one, timed
    by wall clock after a synchronize, estimates the cost: if ``reps + 1`` more calls would exceed
    ``budget_s`` it raises :class:`OverBudget` before running them. Then one call for peak memory
    (CUDA only) and ``reps`` timed calls, each between its own pair of CUDA events.
    """
    if warmup < 1 or reps < 1:
        raise ValueError(f"warmup={warmup} and reps={reps} must both be >= 1")
    index = 0
    for _ in range(warmup):
        synchronize(device)
        t0 = time.perf_counter()
        call(index)
        synchronize(device)
        per_call = time.perf_counter() - t0
        index += 1
    if per_call * (reps + 1) > budget_s:
        raise OverBudget(per_call, reps + 1, budget_s)
    peak = None
    if device.type == "cuda":
        peak = _peak_memory_mb(call, index, device)
        index += 1
    median, p20, p80 = summarize(times_ms(call, index, reps, device))
    return Measurement(median, p20, p80, peak, reps)
