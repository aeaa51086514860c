"""Run logs, written by the main process only: ``log.jsonl`` (every event), ``log.csv`` (one row per logged
step or evaluation), optional TensorBoard scalars, and ``curves.png`` (loss and perplexity/cosine) at the end.

CSV columns (:data:`CSV_COLUMNS`); a value that does not apply to a row is left empty. ``step`` counts
optimizer steps within ``stage``; the evaluations before training have step 0 and stage ``teacher``,
``converted`` or ``calibrated``. ``tokens_per_s`` counts real (non-padding) tokens of every process since the
previous logged step; ``elapsed_s`` is the wall time since the run started, including time before a resume.
"""
from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Optional

from .config import ConfigError

STAGES = ("teacher", "converted", "calibrated", "transfer", "fine_tune", "final")
METRICS = ("ppl", "top1_agreement", "cosine")
CSV_COLUMNS = ("step", "stage", "loss", "lr", "grad_norm") + METRICS + ("tokens_per_s", "elapsed_s")


def stage_rank(stage: str) -> int:
    """Position of ``stage`` in the run (:data:`STAGES`); ValueError for an unknown stage."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a run stage; supported: {', '.join(STAGES)}")
    return STAGES.index(stage)


def tensorboard_writer_class():
    """``torch.utils.tensorboard.SummaryWriter``; ConfigError naming the fix when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ConfigError("train.tensorboard=true but the tensorboard package is not importable "
                          f"({err}); pip install tensorboard, or set train.tensorboard: false") from err
    return SummaryWriter


class RunLog:
    """The run's logs in ``out_dir``; every method is a no-op unless ``enabled`` (the main process).

    ``resume_at=(stage, step)`` keeps the CSV rows up to that point (a resumed run rewrites what follows)
    and appends to ``log.jsonl``; otherwise both files start empty. ``elapsed_before``: seconds already
    spent by the run being resumed.
    """

    def __init__(self, out_dir: Path, enabled: bool, *, tensorboard: bool = False,
                 resume_at: Optional[tuple[str, int]] = None, elapsed_before: float = 0.0):
        self.out_dir, self.enabled = Path(out_dir), enabled
        self.start = time.time() - elapsed_before
        self.writer = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl, self.csv = self.out_dir / "log.jsonl", self.out_dir / "log.csv"
        rows = []
        if resume_at is not None and self.csv.is_file():
            rank, step = stage_rank(resume_at[0]), resume_at[1]
            with open(self.csv, newline="") as f:
                rows = [r for r in csv.DictReader(f)
                        if stage_rank(r["stage"]) < rank or (r["stage"] == resume_at[0] and int(r["step"]) <= step)]
        else:
            self.jsonl.write_text("")
        with open(self.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        if tensorboard:
            self.writer = tensorboard_writer_class()(log_dir=str(self.out_dir / "tensorboard"))

    def elapsed(self) -> float:
        return time.time() - self.start

    def event(self, **record) -> None:
        """One JSON line (any JSON-able values) with the wall-clock time."""
        if self.enabled:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def metrics(self, stage: str, step: int, **values) -> None:
        """A CSV row (``values`` keys from :data:`CSV_COLUMNS`; ``eval=`` a dict of :data:`METRICS`), the same
        record in log.jsonl, and TensorBoard scalars ``<stage>/<name>`` when enabled."""
        if not self.enabled:
            return
        values = {**(values.pop("eval", None) or {}), **values}
        unknown = sorted(set(values) - set(CSV_COLUMNS))
        assert not unknown, f"no CSV column for {unknown}"
        row = {"step": step, "stage": stage, **values, "elapsed_s": round(self.elapsed(), 3)}
        with open(self.csv, "a", newline="") as f:
            csv.DictWriter(f, CSV_COLUMNS).writerow(row)
        self.event(**row)
        if self.writer is not None:
            for name, value in values.items():
                if value is not None:
                    self.writer.add_scalar(f"{stage}/{name}", value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_csv(path) -> list[dict]:
    """Rows of a ``log.csv`` with numbers parsed (empty cells dropped)."""
    with open(path, newline="") as f:
        return [{k: (v if k == "stage" else float(v)) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def plot_curves(csv_path, png_path) -> bool:
    """Training loss per stage and the evaluation metric (perplexity, log scale, or embedding cosine) against
    the step, one line per stage, the pre-training evaluations as horizontal lines; writes ``png_path``.
    Returns False (with a note on stderr) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("finetune: matplotlib is not installed; no curves.png (pip install matplotlib)", file=sys.stderr)
        return False
    rows = read_csv(csv_path)
    metric = "ppl" if any("ppl" in r for r in rows) else "cosine"
    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    for stage in ("transfer", "fine_tune"):
        pts = [(r["step"], r["loss"]) for r in rows if r["stage"] == stage and "loss" in r]
        if pts:
            ax_loss.plot(*zip(*pts), label=stage)
        pts = [(r["step"], r[metric]) for r in rows if r["stage"] == stage and metric in r]
        if pts:
            ax_eval.plot(*zip(*pts), marker="o", label=stage)
    for stage, style in (("teacher", "k--"), ("converted", "r:"), ("calibrated", "m:"), ("final", "g-.")):
        values = [r[metric] for r in rows if r["stage"] == stage and metric in r]
        if values:
            ax_eval.axhline(values[-1], color=style[0], linestyle=style[1:], label=stage)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", yscale="log", title="loss")
    ax_eval.set(xlabel="optimizer step", ylabel=metric, title=f"held-out {metric}")
    if metric == "ppl":
        ax_eval.set_yscale("log")
    for ax in (ax_loss, ax_eval):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True
