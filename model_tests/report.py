"""The verification report: every model_tests check for the chosen backends, written as report.md,
report.json and PNG plots (matplotlib, Agg) in one folder.

    python -m model_tests.report --model minilm --out out/      # or: hfab verify --model minilm --report out/

Contents per backend: per-layer teacher-forced parity (layers_<backend>.png), output parity on news
articles, behaviour checks, quality against its knobs (knobs_<backend>.png) and against sequence length
(length.png); the exact backend's envelope gates. Defaults take a few minutes on CPU for MiniLM.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from hf_attention_backends.cli import MODELS, _versions

from . import behaviour, common, layers, outputs, sweeps

DEFAULT_LENGTHS = {"minilm": [32, 64, 128, 256, 512], "smollm2": [64, 256, 1024]}


def build(model_name: str, model, tokenizer, backends: list, configs: Optional[dict] = None, *, num_texts: int = 4,
          seq_len: int = 128, lengths: Optional[list] = None, knobs: bool = True, checks: bool = True) -> dict:
    """Run every check of ``backends`` on ``model`` (its current attention is the softmax reference).

    configs: {backend: options} (default: the backends' defaults); the knob sweeps vary one option at a
    time on top of them. lengths: sequence lengths of the length sweep (default per model, [] for none).
    knobs / checks: include the knob sweeps / behaviour checks. Returns the JSON-serialisable report.
    """
    configs = configs or {}
    lengths = DEFAULT_LENGTHS.get(model_name, [seq_len]) if lengths is None else lengths
    device = model.device
    inputs = dict(common.text_batch(tokenizer, num_texts, seq_len, device=device))
    sequences = behaviour.text_sequences(tokenizer, 3, 48, device=device) if checks else []
    ref = common.output_of(model, inputs)
    report = {"model": model_name, "baseline": model.config._attn_implementation,
              "compared": "logits" if MODELS[model_name].causal else "last_hidden_state",
              "device": str(device), "dtype": str(model.dtype).replace("torch.", ""),
              "texts": {"count": num_texts, "seq_len": seq_len, "tokens": int(inputs["attention_mask"].sum())},
              "versions": _versions(), "backends": {}}
    if checks:
        report["softmax_behaviour"] = behaviour.run_behaviour(model, sequences, tokenizer.pad_token_id)
    for name in backends:
        start = time.perf_counter()
        config = configs.get(name, {})
        entry = {"config": config,
                 "layers": layers.layer_parity(model, inputs, name, config),
                 "output": outputs.output_parity(model, inputs, name, config, ref=ref)}
        if checks:
            entry["behaviour"] = behaviour.run_behaviour(model, sequences, tokenizer.pad_token_id, name, config)
        if knobs:
            entry["knobs"] = sweeps.sweep_knobs(model, inputs, name, base=config)
        entry["length"] = sweeps.sweep_length(model, tokenizer, name, lengths, min(num_texts, 2), config)
        if name == "exact":
            entry["gates"] = outputs.exact_gates(model, inputs)
        entry["seconds"] = time.perf_counter() - start
        report["backends"][name] = entry
    return report


def _plot_layers(name: str, rows: list, path: Path) -> None:
    import matplotlib.pyplot as plt

    index = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.3 * len(rows) + 3), 3.5))
    width = 0.4
    ax.bar([i - width / 2 for i in index], [r["attention"]["rel_error"] for r in rows], width, label="attention")
    ax.bar([i + width / 2 for i in index], [r["residual"]["rel_error"] for r in rows], width, label="residual")
    ax.set(yscale="log", xlabel="layer", ylabel="relative error (teacher-forced)", title=f"{name}: per-layer error")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_knobs(name: str, knobs: dict, causal: bool, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(knobs), figsize=(4 * len(knobs), 3.5), squeeze=False)
    for ax, (knob, points) in zip(axes[0], knobs.items()):
        values = [p["value"] for p in points]
        ax.plot(values, [p["rel_error"] for p in points], "o-", label="relative error")
        if causal:
            ax.plot(values, [p["kl"] for p in points], "s--", label="KL (nats)")
        ax.set(yscale="log", xlabel=knob, title=f"{name}: {knob}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_length(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    lengths = set()
    for name, entry in report["backends"].items():
        points = entry["length"]
        lengths.update(p["seq_len"] for p in points)
        ax.plot([p["seq_len"] for p in points], [max(p["rel_error"], 1e-12) for p in points], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(lengths), [str(n) for n in sorted(lengths)])
    ax.set(yscale="log", xlabel="sequence length (tokens)",
           ylabel=f"relative error of {report['compared']}", title=f"{report['model']}: quality vs length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "pass" if value else "FAIL"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(headers: list, rows: list) -> list:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + [
        "| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def markdown(report: dict, images: dict) -> str:
    """The Markdown summary of :func:`build`'s report; ``images``: {key: file name} of the plots."""
    causal = report["compared"] == "logits"
    texts = report["texts"]
    lines = [f"# hfab verify: {report['model']}", "",
             f"Reference: the model's own `{report['baseline']}` attention; compared: {report['compared']} "
             f"({report['dtype']}, {report['device']}) on {texts['count']} news articles cut to {texts['seq_len']} "
             f"tokens ({texts['tokens']} real tokens). Metrics over real tokens; per-layer numbers are "
             "teacher-forced (each layer gets the softmax model's input).", "", "## Output parity", ""]
    keys = (["kl", "top1", "top5", "ppl_softmax", "ppl_backend", "rel_error"] if causal
            else ["embedding_cosine_mean", "embedding_cosine_min", "rel_error", "cosine_mean", "max_dev"])
    lines += _table(["backend", "config"] + keys,
                    [[n, json.dumps(e["config"])] + [e["output"][k] for k in keys]
                     for n, e in report["backends"].items()])
    checks = {**({"softmax": report["softmax_behaviour"]} if "softmax_behaviour" in report else {}),
              **{n: e["behaviour"] for n, e in report["backends"].items() if "behaviour" in e}}
    if checks:
        names = list(next(iter(checks.values())))
        lines += ["", "## Behaviour checks (value / limit)", ""]
        lines += _table(["attention"] + names, [[who] + [f"{_fmt(r[c]['passed'])} ({_fmt(r[c]['value'])} / "
                                                         f"{_fmt(r[c]['limit'])})" for c in names]
                                                for who, r in checks.items()])
    for name, entry in report["backends"].items():
        lines += ["", f"## {name}", ""]
        if "gates" in entry:
            gates = entry["gates"]
            lines += [f"Exact-backend envelope gates: **{'pass' if gates['passed'] else 'FAIL'}** "
                      f"(envelope = eager vs sdpa: mean {gates['envelope']['mean_abs']:.3g}, "
                      f"p99.99 {gates['envelope']['p9999_abs']:.3g})", ""]
            lines += _table(["gate", "value", "limit", "result"],
                            [[g, v["value"], v["limit"], v["passed"]] for g, v in gates.items()
                             if isinstance(v, dict) and "passed" in v]) + [""]
        lines += _table(["layer", "attn rel err", "attn cos", "attn max dev", "resid rel err", "resid cos",
                         "resid max dev"],
                        [[r["layer"], r["attention"]["rel_error"], r["attention"]["cosine_mean"],
                          r["attention"]["max_dev"], r["residual"]["rel_error"], r["residual"]["cosine_mean"],
                          r["residual"]["max_dev"]] for r in entry["layers"]])
        for key in (f"layers_{name}", f"knobs_{name}"):
            if key in images:
                lines += ["", f"![{key}]({images[key]})"]
    if "length" in images:
        lines += ["", "## Quality against sequence length", "", f"![length]({images['length']})"]
    return "\n".join(lines) + "\n"


def write(report: dict, out_dir) -> list:
    """Write report.json, report.md and the PNG plots into ``out_dir`` (created); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    causal = report["compared"] == "logits"
    images = {}
    for name, entry in report["backends"].items():
        images[f"layers_{name}"] = f"layers_{name}.png"
        _plot_layers(name, entry["layers"], out / images[f"layers_{name}"])
        if entry.get("knobs"):
            images[f"knobs_{name}"] = f"knobs_{name}.png"
            _plot_knobs(name, entry["knobs"], causal, out / images[f"knobs_{name}"])
    if any(entry["length"] for entry in report["backends"].values()):
        images["length"] = "length.png"
        _plot_length(report, out / images["length"])
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "report.md").write_text(markdown(report, images), encoding="utf-8")
    return [out / "report.json", out / "report.md"] + [out / f for f in images.values()]


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_tests.report", description=__doc__.split("\n\n")[0])
    common.add_model_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for report.md, report.json, plots")
    parser.add_argument("--lengths", type=int, nargs="*", metavar="N", help="length sweep (default per model)")
    parser.add_argument("--no-knobs", action="store_true", help="skip the knob sweeps")
    parser.add_argument("--no-checks", action="store_true", help="skip the behaviour checks")
    args = parser.parse_args(argv)
    model, tokenizer, _, _, backends = common.setup_from_args(args)
    report = build(args.model, model, tokenizer, backends, num_texts=args.num_texts, seq_len=args.seq_len,
                   lengths=args.lengths, knobs=not args.no_knobs, checks=not args.no_checks)
    for path in write(report, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
