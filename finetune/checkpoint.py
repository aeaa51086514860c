"""Resumable checkpoints: ``output_dir/checkpoints/<stage>-<step:06d>/``.

Each holds ``accelerator.save_state`` (the prepared model's full state dict, gathered or sharded as the
FSDP config says; the optimizer; every process's RNG states: python, numpy, torch CPU and CUDA; accelerate's
step counter) and ``trainer_state.json``, written last, so a folder without it is incomplete and ignored::

    {"stage": "transfer", "step": 40, "epoch": 1, "batch_in_epoch": 7, "sampler_seed": 0,
     "num_processes": 1, "batch_size": 4, "grad_accum": 1, "scheduler": {...}, "losses": [...],
     "summary": {...}, "elapsed_s": 12.3}

``epoch`` / ``batch_in_epoch`` are the data position: the training rows are visited in the order of
:class:`EpochSampler` (a permutation per epoch from ``sampler_seed + epoch``), and a resumed run skips the
first ``batch_in_epoch`` batches (per process) of epoch ``epoch``. Checkpoints are taken after an optimizer
step only, so no gradient is half accumulated.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from .logs import stage_rank

STATE_FILE = "trainer_state.json"


class EpochSampler(torch.utils.data.Sampler):
    """A permutation of ``range(n)`` drawn from ``torch.Generator().manual_seed(seed + epoch)``.

    Independent of the global RNG, so the data order depends on ``(seed, epoch)`` only; call
    :meth:`set_epoch` before each pass (``run_stage`` does).
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())


def checkpoint_dir(out_dir, stage: str, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"{stage}-{step:06d}"


def list_checkpoints(out_dir) -> list[Path]:
    """Complete checkpoints of ``out_dir``, oldest first (by stage, then step)."""
    root = Path(out_dir) / "checkpoints"
    found = [p for p in root.glob("*-*") if (p / STATE_FILE).is_file()] if root.is_dir() else []
    states = {p: read_state(p) for p in found}
    return sorted(found, key=lambda p: (stage_rank(states[p]["stage"]), states[p]["step"]))


def read_state(path) -> dict:
    with open(Path(path) / STATE_FILE) as f:
        return json.load(f)


def resolve_resume(resume: str, out_dir) -> Path:
    """The checkpoint folder ``--resume`` names: a folder holding trainer_state.json, or ``latest`` (the newest
    complete checkpoint under ``out_dir/checkpoints``). ValueError when there is none."""
    if resume == "latest":
        found = list_checkpoints(out_dir)
        if not found:
            raise ValueError(f"--resume latest: no complete checkpoint under {Path(out_dir) / 'checkpoints'} "
                             f"(a checkpoint folder holds {STATE_FILE}; set train.save_every > 0 to write them)")
        return found[-1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"--resume {resume!r} is not a checkpoint folder (no {STATE_FILE}); pass a folder under "
                         "<output_dir>/checkpoints or 'latest'")
    return path


def check_compatible(state: dict, *, num_processes: int, batch_size: int, grad_accum: int, seed: int) -> None:
    """ValueError unless the run resumes with the data layout and order the checkpoint was written with."""
    now = {"num_processes": num_processes, "batch_size": batch_size, "grad_accum": grad_accum, "sampler_seed": seed}
    diff = {k: (state[k], v) for k, v in now.items() if state[k] != v}
    if diff:
        raise ValueError("cannot resume exactly: " + ", ".join(f"{k} was {a}, now {b}" for k, (a, b) in diff.items())
                         + "; the data position is counted in per-process batches of a seeded order, so these must match")


def save_checkpoint(accelerator, out_dir, state: dict, keep: int,
                    extra: Optional[Callable[[Path], None]] = None) -> Optional[Path]:
    """``accelerator.save_state`` and ``extra(folder)`` (every process) + trainer_state.json (main), then delete all
    but the newest ``keep`` checkpoints (0 = keep all). Returns the folder."""
    path = checkpoint_dir(out_dir, state["stage"], state["step"])
    accelerator.save_state(str(path), safe_serialization=False)  # pickle: tied weights need no special case
    if extra is not None:
        extra(path)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / STATE_FILE).write_text(json.dumps(state, indent=1))
        if keep:
            for old in list_checkpoints(out_dir)[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path
