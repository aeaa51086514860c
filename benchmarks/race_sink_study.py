"""How far RACE's attention output is from softmax's on SmolLM2's own q, k, v, with and without a sink term (CPU).

The recipes' calibration reports a relative error above 1 for most SmolLM2 layers converted to RACE: the RACE
output is further from the softmax output than a zero output would be. This study tests one explanation, attention
sinks: softmax heads put much of each row's mass on the first token, whose value row is small, so their outputs are
short vectors; RACE's kernel is at most L per key (each table's features sum to 1), so it cannot give one key most
of a row's mass and its output is close to a mean of v, a long vector.

A sink term is a per-head mass s in the denominator, O_i = sum_j k_ij v_j / (sum_j k_ij + s): a virtual key that
every query sees with kernel value s and value 0. Per converted layer and head this script measures, over
``--texts`` news articles of ``--seq-len`` tokens (all real tokens, causal):

- ``sink share``: the mean softmax mass on token 0 (rows from ``--skip-rows`` on);
- ``|O|^2 / |v|^2``: how short the softmax outputs are against the value rows;
- ``plain``: the relative error sum |O_race - O_softmax|^2 / sum |O_softmax|^2 at the head's best beta of the grid
  (D^-0.5 x ``BETA_FACTORS``; the recipes' calibration searches the same factors and ends with Adam steps);
- ``sink``: the same with the best (beta, s) of the grid, s = c x the head's mean denominator, c in ``SINK_FACTORS``;
- ``scale``: the control: the plain output times the best constant per head (least squares), which a fine-tuned
  o_proj can learn without any new term. A sink shrinks each row by den_i / (den_i + s), more where the row's kernel
  mass is small; if the sink did no better than a constant, fine-tuning would already have it.

``--perplexity`` checks the end-to-end effect of the constant on its own: SmolLM2 converted (P, L, per-head beta),
calibrated as the recipes do (the beta grid, then Adam steps) on ``--texts`` articles, then each converted layer's
``o_proj`` times the factor of ``OUTPUT_FACTORS`` that minimises that layer's teacher-forced error
(:func:`scale_outputs`, the softmax teacher keeping the original weights); held-out perplexity on 16 other articles after each step.

q and k are captured after the rotary embedding through transformers' attention interface (a registered attention
function that records its inputs and runs sdpa); the errors are computed in float64 with the library's feature map
(``race_features``) and planes (``make_planes(L, P, D, seed=layer)``, as a converted layer with seed 0 draws them).

    PYTHONPATH=. .venv/bin/python -m benchmarks.race_sink_study [--planes 6] [--tables 1] [--texts 4] [--seq-len 256]
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Optional

import torch
from torch import Tensor

OUTPUT_FACTORS = (0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0)
BETA_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
SINK_FACTORS = (0.0, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
CAPTURE = "hfab_race_sink_study_capture"


def capture_qkv(model, batch: dict) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
    """{layer: (q, k, v)} of one forward of ``model`` on ``batch``: the attention function's inputs (after RoPE)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query.detach(), key.detach(), value.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE, capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        with torch.no_grad():
            model(**batch, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return captured


def race_num_den(q: Tensor, k: Tensor, v: Tensor, planes: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Causal RACE numerator (B, H, N, D) and denominator (B, H, N, 1) from the explicit N x N kernel matrix."""
    from hf_attention_backends.ops.race.reference import race_features

    b = torch.tensor(beta, dtype=q.dtype)
    w = race_features(q, planes, b) @ race_features(k, planes, b).transpose(-1, -2)
    w = w.tril()
    return w @ v, w.sum(-1, keepdim=True)


def head_study(q: Tensor, k: Tensor, v: Tensor, planes: Tensor, skip_rows: int,
               beta_factors=BETA_FACTORS, sink_factors=SINK_FACTORS) -> dict[str, Tensor]:
    """Per head (q's heads; k, v repeated for GQA), float64: sink share, |O|^2/|v|^2, best plain and sink errors."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    n, d = q.shape[2], q.shape[3]
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    prob = torch.softmax(scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf")), -1)
    teacher = (prob @ v)[:, :, skip_rows:]
    ref = (teacher ** 2).sum((0, 2, 3))
    best_plain = torch.full_like(ref, float("inf"))
    best_sink, best_scale = best_plain.clone(), best_plain.clone()
    for factor in beta_factors:
        num, den = race_num_den(q, k, v, planes, factor * d ** -0.5)
        num, den = num[:, :, skip_rows:], den[:, :, skip_rows:]
        mean_den = den.mean((0, 2, 3)).view(1, -1, 1, 1)
        plain = num / den
        cross, own = (plain * teacher).sum((0, 2, 3)), (plain ** 2).sum((0, 2, 3))
        best_scale = torch.minimum(best_scale, 1 - cross ** 2 / (own * ref))  # at the constant cross / own
        for c in sink_factors:
            err = ((num / (den + c * mean_den) - teacher) ** 2).sum((0, 2, 3)) / ref
            if c == 0:
                best_plain = torch.minimum(best_plain, err)
            best_sink = torch.minimum(best_sink, err)
    return {"sink_share": prob[:, :, skip_rows:, 0].mean((0, 2)),
            "out_to_v": ref / (v[:, :, skip_rows:] ** 2).sum((0, 2, 3)),
            "plain": best_plain, "sink": best_sink, "scale": best_scale}


def study(planes_per_table: int, tables: int, texts: int, seq_len: int, skip_rows: int) -> list[dict]:
    """One row per SmolLM2 layer: the head means of ``head_study``."""
    from hf_attention_backends import make_planes, models

    model, tokenizer = models.load_smollm2(attn_implementation="sdpa")
    batch = tokenizer(models.news_articles(texts, min_chars=6 * seq_len), truncation=True, max_length=seq_len,
                      padding=True, return_tensors="pt")
    if not bool(batch["attention_mask"].all()):
        raise ValueError(f"an article is shorter than seq_len={seq_len} tokens; lower --seq-len")
    rows = []
    for layer, (q, k, v) in sorted(capture_qkv(model, batch).items()):
        planes = make_planes(tables, planes_per_table, q.shape[-1], seed=layer, dtype=torch.float64)
        stats = head_study(q, k, v, planes, skip_rows)
        rows.append({"layer": layer, **{name: float(x.mean()) for name, x in stats.items()}})
        print(format_row(rows[-1]), flush=True)
    return rows


def scale_outputs(model, batches: list, factors=OUTPUT_FACTORS) -> dict[int, float]:
    """Multiply each converted layer's ``o_proj`` weight by the factor that minimises its teacher-forced relative
    error on ``batches``; {layer: factor}. One ``TeacherForcing`` context for every factor, entered with the o_proj
    weights trainable, so that the softmax teacher keeps the original weights while the student's are scaled (one
    forward per factor scores every layer)."""
    from hf_attention_backends.calibrate import TeacherForcing, converted_layers, forward_kwargs

    modules = dict(converted_layers(model))
    weights = {idx: m.o_proj.weight.detach().clone() for idx, m in modules.items()}
    trainable = {idx: m.o_proj.weight.requires_grad for idx, m in modules.items()}
    best = {idx: (float("inf"), 1.0) for idx in modules}
    for module in modules.values():
        module.o_proj.weight.requires_grad_(True)  # snapshotted by TeacherForcing: the teacher's stay the originals
    try:
        with torch.no_grad(), TeacherForcing(model) as forcing:
            for factor in factors:
                for idx, module in modules.items():
                    module.o_proj.weight.copy_(weights[idx] * factor)
                sums = {idx: [0.0, 0.0] for idx in modules}
                for batch in batches:
                    forcing.token_mask, forcing.terms = batch.get("attention_mask"), {}
                    model(**forward_kwargs(model, batch))
                    for idx, (err, ref, _) in forcing.terms.items():
                        sums[idx][0] += float(err)
                        sums[idx][1] += float(ref)
                for idx, (err, ref) in sums.items():
                    best[idx] = min(best[idx], (err / max(ref, 1e-30), factor))
            for idx, module in modules.items():
                module.o_proj.weight.copy_(weights[idx] * best[idx][1])
    finally:
        for idx, module in modules.items():
            module.o_proj.weight.requires_grad_(trainable[idx])
    return {idx: factor for idx, (_, factor) in best.items()}


def perplexity(model, batch: dict, rows_per_forward: int = 4) -> float:
    """exp of the mean next-token loss over the real tokens of ``batch`` (input_ids, attention_mask)."""
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, batch["input_ids"].shape[0], rows_per_forward):
            part = {k: v[i:i + rows_per_forward] for k, v in batch.items()}
            labels = part["input_ids"].masked_fill(part["attention_mask"] == 0, -100)
            n = float((labels[:, 1:] != -100).sum())
            total += float(model(**part, labels=labels, use_cache=False).loss) * n
            count += n
    return math.exp(total / count)


def perplexity_study(planes_per_table: int, tables: int, texts: int, seq_len: int) -> dict:
    """Held-out perplexity of SmolLM2: softmax, converted, calibrated, then with the per-layer output factor."""
    import hf_attention_backends as hfab
    from hf_attention_backends import models
    from hf_attention_backends.calibrate import calibrate, layer_errors

    model, tokenizer = models.load_smollm2(attn_implementation="sdpa")
    enc = tokenizer(models.news_articles(texts + 16, min_chars=6 * seq_len), truncation=True, max_length=seq_len,
                    padding=True, return_tensors="pt")
    batches = [{k: v[i:i + 4] for k, v in enc.items()} for i in range(0, texts, 4)]
    held_out = {k: v[texts:] for k, v in enc.items()}
    result = {"softmax": perplexity(model, held_out)}
    model = hfab.convert(model, "race", num_planes=planes_per_table, num_tables=tables, per_head_beta=True)
    result["converted"] = perplexity(model, held_out)
    calibrate(model, batches, steps=20, lr=1e-2)
    errors = layer_errors(model, batches)
    result.update(calibrated=perplexity(model, held_out), calibrated_error=sum(errors.values()) / len(errors))
    result["factors"] = scale_outputs(model, batches)
    errors = layer_errors(model, batches)
    result.update(scaled=perplexity(model, held_out), scaled_error=sum(errors.values()) / len(errors))
    return result


def format_row(row: dict) -> str:
    return (f"{row['layer']:>5} {row['sink_share']:>10.3f} {row['out_to_v']:>11.3f} {row['plain']:>8.3f} "
            f"{row['sink']:>8.3f} {row['scale']:>8.3f}")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--planes", type=int, default=6, help="P, planes per table (default 6)")
    parser.add_argument("--tables", type=int, default=1, help="L, tables (default 1)")
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--skip-rows", type=int, default=8, help="first rows left out (few keys)")
    parser.add_argument("--perplexity", action="store_true", help="the end-to-end check of the output factor instead")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.perplexity:
        if args.texts % 4:
            parser.error(f"--texts={args.texts} must be a multiple of 4 with --perplexity (calibration batches of 4)")
        result = perplexity_study(args.planes, args.tables, args.texts, args.seq_len)
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if not 0 <= args.skip_rows < args.seq_len:
        parser.error(f"--skip-rows={args.skip_rows} must lie in [0, --seq-len)")
    print(f"RACE P={args.planes} L={args.tables} vs softmax, SmolLM2, {args.texts} x {args.seq_len} tokens; "
          "head means per layer")
    print(f"{'layer':>5} {'sink share':>10} {'|O|^2/|v|^2':>11} {'plain':>8} {'sink':>8} {'scale':>8}")
    rows = study(args.planes, args.tables, args.texts, args.seq_len, args.skip_rows)
    mean = {name: sum(r[name] for r in rows) / len(rows) for name in ("sink_share", "out_to_v", "plain", "sink", "scale")}
    print(format_row({"layer": "mean", **mean}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"planes": args.planes, "tables": args.tables, "texts": args.texts, "seq_len": args.seq_len,
                       "skip_rows": args.skip_rows, "layers": rows, "mean": mean}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
