"""How close RACE gets to softmax before any training, per feature-map shape: convert every layer with each
(P planes, L tables), run the calibration's beta grid, and print the summed per-layer relative error
(``calibrate``'s ``before`` / ``after``: squared error over squared softmax output, teacher-forced).

    python -m benchmarks.race_calibration_sweep --model smollm2 --shapes 4x4 4x8 6x2 [--rows 4] [--device cpu]

One JSON line per shape: P, L, S = L·2^P, the summed error before and after the grid, the chosen beta of
the first layers, seconds. ``--betas`` replaces the grid (absolute values); default: the calibration's.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import hf_attention_backends as hfab
from hf_attention_backends.calibrate import calibrate
from finetune.data import load_documents, tokenize_rows
from finetune.models import load_model


def parse_shape(text: str) -> tuple[int, int]:
    """``"PxL"`` -> (P, L); argparse error otherwise."""
    try:
        planes, tables = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected PxL, e.g. 4x4 (planes x tables)") from None
    return planes, tables


def calibration_batch(tokenizer, rows: int, seq_len: int, device) -> dict:
    """The first ``rows`` rows of ``seq_len`` tokens of the offline news corpus."""
    docs = load_documents("news", 4 * rows)
    data = tokenize_rows(docs, tokenizer, seq_len)
    if len(data["input_ids"]) < rows:
        raise ValueError(f"rows={rows}: the first {4 * rows} articles give only {len(data['input_ids'])} rows")
    return {k: data[k][:rows].to(device) for k in ("input_ids", "attention_mask")}


def sweep_one(base, batch: dict, planes: int, tables: int, betas) -> dict:
    """Convert ``base`` (``convert`` copies it) on every layer with P = ``planes``, L = ``tables``; calibrate."""
    start = time.time()
    model = hfab.convert(base, "race", None, num_planes=planes, num_tables=tables, per_head_beta=True, seed=0)
    report = calibrate(model, [batch], race_betas=betas)
    chosen = [float(torch.as_tensor(b).flatten()[0]) for b in report["choices"]["beta"].values()]
    return {"P": planes, "L": tables, "S": tables * 2 ** planes, "sum_before": sum(report["before"].values()),
            "sum_after": sum(report["after"].values()), "layers": len(report["after"]),
            "beta_first_layers": [round(b, 4) for b in chosen[:5]], "seconds": round(time.time() - start, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a finetune model name (smollm2, minilm, tiny_llama, ...)")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(4, 4)], metavar="PxL")
    parser.add_argument("--rows", type=int, default=4, help="calibration rows (default 4)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--betas", type=float, nargs="+", help="beta grid (absolute); default: the calibration's")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    base, tokenizer, _ = load_model(args.model)
    base.to(args.device)
    batch = calibration_batch(tokenizer, args.rows, args.seq_len, args.device)
    with torch.no_grad():
        for planes, tables in args.shapes:
            print(json.dumps(sweep_one(base, batch, planes, tables, args.betas)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
