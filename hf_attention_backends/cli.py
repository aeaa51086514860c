"""The ``hfab`` command.

``hfab verify``: switch a real model's attention to each backend and measure how far its outputs move
from the model's own softmax attention (all-MiniLM-L6-v2 vs eager by default; ``--model smollm2``:
SmolLM2-135M-Instruct vs sdpa); ``--report DIR`` adds the model_tests report (report.md, report.json, PNG
plots). ``hfab info``: versions, the CUDA extension, which ops have CUDA kernels. ``hfab finetune``: run a
fine-tuning recipe (``finetune/``) in this one process; for several GPUs use ``accelerate launch``.

Exit status: 0 on success, 2 on a usage error, an unsupported choice (the message says what is supported)
or a missing offline asset package.
Tables go to stdout, progress bars and notes to stderr; ``--json -`` writes JSON to stdout instead of the table.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import sys
import time
from typing import Optional

import torch

from .backends.config import CONFIGS, make_config

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    causal: bool
    baseline: str  # the attn_implementation the backends are compared with
    backends: tuple
    default_texts: int


MODELS = {
    "minilm": ModelSpec(causal=False, baseline="eager", backends=("nystrom", "stieltjes", "race", "exact"),
                        default_texts=8),
    "smollm2": ModelSpec(causal=True, baseline="sdpa", backends=("stieltjes", "race", "exact"), default_texts=4),
}

# (option dest = config field, type, help); a knob goes to every selected backend whose config has the field
KNOBS = (
    ("num_landmarks", int, "nystrom: number of landmarks m"),
    ("newton_iter", int, "nystrom and stieltjes: solver iterations"),
    ("kappa_star", float, "nystrom: ridge condition number target (0 = none)"),
    ("order", float, "stieltjes: order of the power law"),
    ("num_planes", int, "race: hyperplanes per table P"),
    ("num_tables", int, "race: hash tables L"),
    ("beta", float, "race: soft-hash temperature (default D**-0.5)"),
    ("seed", int, "race: seed of the fixed planes"),
)


class CliError(Exception):
    """An unsupported choice: reported as one line on stderr with exit status 2."""


def main(argv: Optional[list] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ValueError, NotImplementedError, ModuleNotFoundError, OSError) as err:
        print(f"hfab {args.command}: error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfab", description=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True)

    verify = sub.add_parser("verify", help="compare each backend with softmax attention on a real model",
                            description="Run a real model with its own softmax attention and with each backend "
                                        "on real text; report output differences and time per forward.")
    verify.add_argument("--model", choices=sorted(MODELS), default="minilm",
                        help="minilm: all-MiniLM-L6-v2 vs eager (default); smollm2: SmolLM2-135M-Instruct vs sdpa")
    verify.add_argument("--backend", action="append", metavar="NAME[,NAME]",
                        help="backend(s) to verify, repeatable or comma separated (default: all that fit the model)")
    verify.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    verify.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (default float32)")
    verify.add_argument("--num-texts", type=int, metavar="N",
                        help="sentences (minilm, default 8) or articles (smollm2, default 4)")
    verify.add_argument("--seq-len", type=int, default=256, metavar="N",
                        help="smollm2: tokens per article (default 256); --report: per article for both models")
    verify.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="forwards timed per backend (after one warm-up when > 1); the median is reported")
    for name, kind, text in KNOBS:
        verify.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, metavar=kind.__name__.upper(),
                            help=text)
    verify.add_argument("--check-reference", action="store_true",
                        help="with --device cuda: also run each backend on the CPU (the PyTorch reference ops) in "
                             "float32 and in --dtype, and gate the GPU output: mean|Δ| to the float32 reference <= "
                             "2x the reference's own --dtype error (exit 1 on failure)")
    verify.add_argument("--decode-tokens", type=int, default=0, metavar="N",
                        help="causal models: also generate N tokens greedily after each text's first half with the "
                             "backend's decode cache (RaceCache for race) and compare them with one full forward "
                             "(token agreement, max |Δlogit|); default 0 = skip")
    verify.add_argument("--json", metavar="PATH|-", help="also write the results as JSON to PATH (- = stdout only)")
    verify.add_argument("--report", metavar="DIR",
                        help="also run the model_tests checks (per-layer parity, behaviour, knob and length sweeps, "
                             "exact gates) on --num-texts (default 4) news articles of --seq-len tokens and write "
                             "report.md, report.json and PNG plots into DIR")
    verify.set_defaults(func=run_verify)

    info = sub.add_parser("info", help="versions, CUDA extension, ops with CUDA kernels")
    info.add_argument("--json", metavar="PATH|-", help="also write the report as JSON to PATH (- = stdout only)")
    info.set_defaults(func=run_info)

    finetune = sub.add_parser("finetune", help="run a fine-tuning recipe (configs/finetune/*.yaml) in one process",
                              description="Convert a model, calibrate it and win its quality back (attention "
                                          "transfer, then LoRA/full fine-tuning) as the YAML recipe says, in this "
                                          "one process (CPU or one GPU). " + FINETUNE_LAUNCH)
    finetune.add_argument("--config", metavar="YAML|NAME",
                          help="the recipe: a YAML file, or the name of a bundled one (see --list)")
    finetune.add_argument("--list", action="store_true",
                          help="print the bundled recipes and accelerate launch configs with their paths, then exit")
    finetune.add_argument("--output-dir", metavar="DIR", help="overrides the recipe's output_dir")
    finetune.add_argument("--resume", metavar="DIR|latest",
                          help="continue from a checkpoint folder (<output_dir>/checkpoints/<stage>-<step>) or the "
                               "newest one under output_dir")
    finetune.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                          help="change one recipe value (YAML), repeatable: --set fine_tune.lr=3e-4 "
                               "--set convert.options.num_tables=8")
    finetune.set_defaults(func=run_finetune)
    return parser


FINETUNE_LAUNCH = ("Several GPUs (DDP or FSDP, one or many nodes): accelerate launch --config_file "
                   "configs/accelerate/{multi_gpu,fsdp}.yaml finetune/train.py --config <recipe> (the same flags; "
                   "from an installed wheel: -m hf_attention_backends.finetune.train, config paths from --list).")


def finetune_module():
    """The recipe runner: ``hf_attention_backends.finetune.train`` when installed so, else ``finetune/train.py`` of
    the source checkout this package runs from (an editable install); CliError when neither exists."""
    import importlib
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("hf_attention_backends.finetune") is not None:
        return importlib.import_module("hf_attention_backends.finetune.train")
    root = Path(__file__).resolve().parents[1]
    if (root / "finetune" / "train.py").is_file():
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        return importlib.import_module("finetune.train")
    raise CliError("the finetune recipes are not installed: install the package from a source checkout with "
                   "finetune/ mapped to hf_attention_backends.finetune (setup.py), or run finetune/train.py")


def run_finetune(args) -> int:
    train = finetune_module()
    if args.list:
        from importlib import import_module

        config = import_module(train.__name__.rsplit(".", 1)[0] + ".config")
        for kind in config.CONFIG_KINDS:
            print(f"{kind}:")
            for name, path in config.bundled_configs(kind).items():
                print(f"  {name:<22} {path}")
        return 0
    if args.config is None:
        raise CliError("hfab finetune needs --config YAML|NAME (or --list for the bundled recipes)")
    print(f"hfab finetune: one process on {'cuda' if torch.cuda.is_available() else 'cpu'}. {FINETUNE_LAUNCH}",
          file=sys.stderr)
    recipe = train.load_recipe(args.config, args.overrides)
    if args.output_dir:
        recipe.output_dir = args.output_dir
    summary = train.run(recipe, resume=args.resume)
    print(json.dumps({"output_dir": recipe.output_dir, "final": summary.get("final")}))
    return 0


def parse_backends(values: Optional[list], model: str) -> list:
    """Flatten repeatable / comma separated --backend values; check each fits the model."""
    spec = MODELS[model]
    if not values:
        return list(spec.backends)
    names = []
    for value in values:
        for name in (part.strip() for part in value.split(",")):
            if name and name not in names:
                names.append(name)
    for name in names:
        if name not in CONFIGS:
            raise CliError(f"--backend {name!r} is not a backend; supported: {', '.join(CONFIGS)}")
        if name not in spec.backends:
            raise CliError(f"--backend {name!r} does not fit --model {model} (a causal LM; {name} is non-causal "
                           f"only); supported for {model}: {', '.join(spec.backends)}")
    if not names:
        raise CliError(f"--backend names no backend; supported for {model}: {', '.join(spec.backends)}")
    return names


def backend_configs(backends: list, args) -> dict:
    """{backend: knobs given on the command line that its config accepts}, validated; unused knobs raise."""
    given = {name: getattr(args, name) for name, _, _ in KNOBS if getattr(args, name) is not None}
    configs, used = {}, set()
    for backend in backends:
        fields = {f.name for f in dataclasses.fields(CONFIGS[backend])}
        configs[backend] = {k: v for k, v in given.items() if k in fields}
        make_config(backend, **configs[backend])
        used |= set(configs[backend])
    unused = sorted(set(given) - used)
    if unused:
        options = ", ".join("--" + name.replace("_", "-") for name in unused)
        raise CliError(f"{options} does not apply to the selected backend(s) {', '.join(backends)}")
    return configs


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CliError(f"--device {name!r} is not a device; supported: cpu, cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device {name!r} is not supported; supported: cpu, cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError(f"--device {name!r} but CUDA is not available (torch {torch.__version__}); use --device cpu")
    return device


def timed(forward, repeats: int, device: torch.device):
    """(output of the first timed call, median seconds per call over ``repeats`` calls).

    With repeats > 1 an untimed warm-up call comes first (lazy initialisation, kernel loading).
    """
    times, result = [], None
    for i in range(repeats + (repeats > 1)):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i or repeats == 1:
            times.append(time.perf_counter() - start)
            result = out if result is None else result
    return result, statistics.median(times)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, N, C), (B, N) bool -> (B, C): mean over real tokens (the sentence-transformers embedding)."""
    weights = mask.to(torch.float64).unsqueeze(-1)
    return (hidden.double() * weights).sum(1) / weights.sum(1)


def hidden_metrics(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict:
    """|Δ| of last_hidden_state over real tokens; cosine of the mean-pooled embeddings."""
    diff = (out.double() - ref.double()).abs()[mask]  # (tokens, C)
    cos = torch.nn.functional.cosine_similarity(mean_pool(out, mask), mean_pool(ref, mask), dim=-1)
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "cosine_mean": cos.mean().item(), "cosine_min": cos.min().item()}


def perplexity(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> float:
    """exp(mean next-token NLL) over positions whose target is a real token (fp32 log-softmax)."""
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:],
                                            reduction="none")  # (B, N-1)
    target = mask[:, 1:]
    return math.exp(nll[target].double().mean().item())


def logit_metrics(out: torch.Tensor, ref: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """|Δlogit| and top-1 agreement over real positions; perplexity of ``out``.

    Differences are taken in fp32: an fp64 copy of (B, N, V) logits would be large.
    """
    diff = (out.float() - ref.float()).abs()[mask]  # (tokens, V)
    agree = (out.argmax(-1) == ref.argmax(-1))[mask]
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.double().mean().item(),
            "top1_agreement": agree.double().mean().item(), "perplexity": perplexity(out, input_ids, mask)}


def _load(model_name: str, dtype, device):
    from . import models

    if model_name == "minilm":
        return models.minilm_path(), *models.load_minilm(dtype=dtype, device=device)
    if not models.smollm2_cache_dir().is_dir():
        print(f"hfab: converting the SmolLM2 GGUF checkpoint once into {models.smollm2_cache_dir()} "
              "(dequantising takes ~25 s or more)", file=sys.stderr)
    return models.smollm2_cache_dir(), *models.load_smollm2(dtype=dtype, device=device)


def _texts(args, spec: ModelSpec):
    from . import models

    n = spec.default_texts if args.num_texts is None else args.num_texts
    if n < 1:
        raise CliError(f"--num-texts {n} must be >= 1")
    if args.model == "minilm":
        return models.corpus()[0], models.sentences(n)
    if args.seq_len < 2:
        raise CliError(f"--seq-len {args.seq_len} must be >= 2 (perplexity needs a next token)")
    # ~4.5 characters per token in English news: most selected articles fill seq_len tokens
    return models.corpus()[0], models.news_articles(n, min_chars=5 * args.seq_len)


def run_verify(args) -> int:
    from tqdm.auto import tqdm

    from . import disable_backend, enable_backend

    spec = MODELS[args.model]
    backends = parse_backends(args.backend, args.model)
    configs = backend_configs(backends, args)
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]
    if args.repeats < 1:
        raise CliError(f"--repeats {args.repeats} must be >= 1")
    if args.decode_tokens < 0 or (args.decode_tokens and not spec.causal):
        raise CliError(f"--decode-tokens {args.decode_tokens} needs a causal model and N >= 0 "
                       f"(--model {args.model} is {'causal' if spec.causal else 'an encoder'})")
    if args.check_reference and device.type != "cuda":
        raise CliError(f"--check-reference compares the GPU kernels with the CPU reference; it needs --device "
                       f"cuda[:N], got --device {args.device!r}")
    corpus_name, texts = _texts(args, spec)
    path, model, tokenizer = _load(args.model, dtype, device)

    max_length = args.seq_len if spec.causal else None  # None: the model's limit (512 for MiniLM)
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    mask = batch["attention_mask"].bool()
    def forward():
        return compared_output(model, batch, spec.causal)

    if spec.causal:
        def metrics(out, ref):
            return logit_metrics(out, ref, batch["input_ids"], mask)
    else:
        def metrics(out, ref):
            return hidden_metrics(out, ref, mask)

    ref, ref_time = timed(forward, args.repeats, device)
    baseline = {"name": spec.baseline, "time_s": ref_time}
    if spec.causal:
        baseline["perplexity"] = perplexity(ref, batch["input_ids"], mask)
    results, outputs = [], {}
    for backend in tqdm(backends, desc=f"hfab verify {args.model}", file=sys.stderr, disable=None):
        try:
            enable_backend(model, backend, **configs[backend])
            try:
                out, seconds = timed(forward, args.repeats, device)
                decode = _decode_check(model, batch, backend, args.decode_tokens) if args.decode_tokens else None
            finally:
                disable_backend(model)
        except (ValueError, NotImplementedError) as err:
            raise CliError(f"--backend {backend}: {err}") from err
        results.append({"backend": backend, "config": configs[backend], "time_s": seconds, **metrics(out, ref)})
        if decode is not None:
            results[-1]["decode"] = decode
        outputs[backend] = out

    report = {
        "command": "verify", "model": args.model, "model_path": str(path), "device": str(device),
        "dtype": args.dtype, "compared": "logits" if spec.causal else "last_hidden_state",
        "texts": {"corpus": corpus_name, "count": len(texts), "tokens": int(mask.sum()),
                  "seq_len": args.seq_len if spec.causal else None},
        "baseline": baseline, "results": results, "versions": _versions(),
    }
    if "exact" in backends:
        report["exact_gates"] = _exact_gates(model, batch)
    if args.check_reference:
        report["reference_check"] = _reference_check(args, ref, outputs, configs, dict(batch), metrics)
    _emit(report, _verify_table(report) + _gates_table(report.get("exact_gates"))
          + _reference_table(report.get("reference_check")) + _decode_table(results), args.json)
    if args.report:
        _write_report(args, model, tokenizer, backends, configs, report)
    failed = False
    if "exact_gates" in report and not report["exact_gates"]["passed"]:
        print("hfab verify: the exact backend failed a gate (table above)", file=sys.stderr)
        failed = True
    if "reference_check" in report and not report["reference_check"]["passed"]:
        print("hfab verify: a backend's GPU output is farther from the CPU reference than allowed (table above)",
              file=sys.stderr)
        failed = True
    return int(failed)


def compared_output(model, batch, causal: bool) -> torch.Tensor:
    """What verify compares: the logits of a causal LM (no cache), else the encoder's last hidden state."""
    return model(**batch, use_cache=False).logits if causal else model(**batch).last_hidden_state


def _decode_check(model, batch, backend: str, new_tokens: int) -> dict:
    """Greedy generate() of ``new_tokens`` after the first half of the shortest text (the same prefix length for
    every row, no padding), with RaceCache for race and transformers' default cache otherwise, against one full
    forward over the generated sequences: the fraction of generated tokens that are the full forward's argmax,
    and the largest |Δlogit| between the decode steps and the full forward."""
    from . import race_cache

    ids = batch["input_ids"]
    prefix = max(1, int(batch["attention_mask"].sum(-1).min()) // 2)
    prompt = ids[:, :prefix]
    with torch.inference_mode():
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=model.config.eos_token_id,
                             past_key_values=race_cache(model) if backend == "race" else None)
        steps = torch.stack(gen.logits, dim=1).float()  # (B, new_tokens, V)
        full = model(input_ids=gen.sequences, use_cache=False).logits[:, prefix - 1:-1].float()
    agree = (full.argmax(-1) == gen.sequences[:, prefix:]).double().mean().item()
    return {"prefix": prefix, "new_tokens": new_tokens, "cache": "RaceCache" if backend == "race" else "default",
            "token_agreement": agree, "max_abs_logit_diff": (steps - full).abs().max().item()}


def _reference_check(args, ref, outputs: dict, configs: dict, batch: dict, metrics) -> dict:
    """Each backend's GPU output against the same backend in float32 on the CPU (the PyTorch reference ops).

    The yardstick is the reference's own rounding: the same backend on the CPU in the model's dtype against
    float32 (the op tests' rule, on the whole model). A backend passes when its GPU mean|Δ| to the float32
    reference is at most twice that. The softmax baseline's GPU-vs-CPU distance is reported for scale.
    """
    from . import disable_backend, enable_backend

    _, cpu_model, _ = _load(args.model, torch.float32, torch.device("cpu"))
    cpu_low = copy.deepcopy(cpu_model).to(DTYPES[args.dtype])
    cpu_batch = {key: value.cpu() for key, value in batch.items()}

    def run(model):
        return compared_output(model, cpu_batch, MODELS[args.model].causal).to(ref.device)

    def with_backend(model, backend):
        enable_backend(model, backend, **configs[backend])
        try:
            return run(model)
        finally:
            disable_backend(model)

    check = {"rule": "mean|Δ|(GPU kernels, CPU float32) <= 2 x mean|Δ|(CPU in the model dtype, CPU float32)",
             "backends": {}}
    with torch.inference_mode():
        check["baseline_gpu_vs_cpu"] = metrics(ref, run(cpu_model))
        for backend, out in outputs.items():
            exact32 = with_backend(cpu_model, backend)
            got, own = metrics(out, exact32), metrics(with_backend(cpu_low, backend), exact32)
            limit = 2.0 * own["mean_abs_diff"]
            check["backends"][backend] = {**got, "reference_in_dtype": own, "limit_mean_abs": limit,
                                          "passed": got["mean_abs_diff"] <= limit}
    check["passed"] = all(entry["passed"] for entry in check["backends"].values())
    return check


def _decode_table(results: list) -> str:
    rows = [r for r in results if "decode" in r]
    if not rows:
        return ""
    lines = ["", "greedy decode with the backend's cache vs one full forward over the generated tokens:"]
    for r in rows:
        d = r["decode"]
        lines.append(f"  {r['backend']:<10} {d['new_tokens']} tokens after {d['prefix']} ({d['cache']} cache): "
                     f"token agreement {d['token_agreement']:.2%}, max|Δlogit| {d['max_abs_logit_diff']:.3e}")
    return "\n".join(lines)


def _reference_table(check: Optional[dict]) -> str:
    if check is None:
        return ""
    lines = ["", "GPU kernels vs the float32 CPU reference (limit: 2 x the CPU reference's own error in the model "
                 f"dtype; softmax baseline GPU vs CPU: mean|Δ| {check['baseline_gpu_vs_cpu']['mean_abs_diff']:.3e}):"]
    for backend, entry in check["backends"].items():
        verdict = "pass" if entry["passed"] else "FAIL"
        lines.append(f"  {backend:<10} mean|Δ| {entry['mean_abs_diff']:.3e} <= {entry['limit_mean_abs']:.3e}  "
                     f"max|Δ| {entry['max_abs_diff']:.3e}  {verdict}")
    return "\n".join(lines)


def _exact_gates(model, batch) -> dict:
    """The exact backend's envelope gates: eager, sdpa and exact on the same batch (model_tests.metrics)."""
    from .model_tests import outputs

    return outputs.exact_gates(model, dict(batch))


def _gates_table(gates: Optional[dict]) -> str:
    if gates is None:
        return ""
    env = gates["envelope"]
    lines = ["", f"exact vs eager, gates from the sdpa-vs-eager envelope (mean|Δ| {env['mean_abs']:.3e}, "
                 f"p99.99|Δ| {env['p9999_abs']:.3e}):"]
    for name, gate in gates.items():
        if isinstance(gate, dict) and "limit" in gate:
            bound = ">=" if name == "top1_accuracy" else "<="
            verdict = "pass" if gate["passed"] else "FAIL"
            lines.append(f"  {name:<14} {gate['value']:.4e} {bound} {gate['limit']:.4e}  {verdict}")
    return "\n".join(lines)


def _write_report(args, model, tokenizer, backends: list, configs: dict, verified: dict) -> None:
    """``--report DIR``: model_tests.report on the loaded model; ``verified`` goes into report.json as "verify"."""
    from .model_tests import report as model_report  # the repo's model_tests/, installed under this name

    num_texts = 4 if args.num_texts is None else args.num_texts
    print(f"hfab: writing the verification report into {args.report}", file=sys.stderr)
    report = model_report.build(args.model, model, tokenizer, backends, configs, num_texts=num_texts,
                                seq_len=args.seq_len)
    report["verify"] = verified
    for path in model_report.write(report, args.report):
        print(f"hfab: wrote {path}", file=sys.stderr)


def _verify_table(report: dict) -> str:
    causal = report["compared"] == "logits"
    columns = [("backend", "backend", "{}"), ("max_abs_diff", "max|Δ|", "{:.3e}"),
               ("mean_abs_diff", "mean|Δ|", "{:.3e}")]
    columns += ([("top1_agreement", "top-1 agree", "{:.2%}"), ("perplexity", "perplexity", "{:.3f}")] if causal
                else [("cosine_mean", "cos mean", "{:.6f}"), ("cosine_min", "cos min", "{:.6f}")])
    columns.append(("time_s", "ms/forward", "{:.1f}"))
    base = report["baseline"]
    rows = [{**base, "backend": f"{base['name']} (baseline)"}] + report["results"]
    cells = [[fmt.format(row[key] * (1000 if key == "time_s" else 1)) if key in row else "-"
              for key, _, fmt in columns] for row in rows]
    headers = [header for _, header, _ in columns]
    widths = [max(len(x) for x in column) for column in zip(headers, *cells)]
    texts, plural = report["texts"], "s" * (report["texts"]["count"] != 1)
    title = (f"{report['model']} ({report['compared']}, {report['dtype']}, {report['device']}): "
             f"{texts['count']} text{plural} from {texts['corpus']}, {texts['tokens']} real tokens")
    lines = [title] + ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                       for row in [headers] + cells]
    return "\n".join(lines)


def _versions() -> dict:
    import transformers

    from . import __version__

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"hf_attention_backends": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda, "gpu": gpu}


def run_info(args) -> int:
    from . import _ext
    from .ops._registry import has_cuda_kernel, registered_ops

    loaded = _ext.extension_loaded()
    report = {
        "command": "info", "versions": _versions(), "cuda_available": torch.cuda.is_available(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "extension_loaded": loaded, "extension_error": None if loaded else str(_ext.extension_error()),
        "ops": {op: {"cuda_kernel": has_cuda_kernel(op)} for op in registered_ops()},
    }
    versions = report["versions"]
    lines = [f"hf_attention_backends {versions['hf_attention_backends']}",
             f"torch {versions['torch']} (CUDA build: {versions['cuda'] or 'none'})",
             f"transformers {versions['transformers']}",
             f"CUDA device: {report['cuda_device'] or 'none'}"]
    lines.append("CUDA extension: " + ("loaded" if loaded else f"not loaded ({report['extension_error']})"))
    lines += [f"  {op}: CUDA kernel {'yes' if v['cuda_kernel'] else 'no'}" for op, v in report["ops"].items()]
    _emit(report, "\n".join(lines), args.json)
    return 0


def _emit(report: dict, table: str, json_path: Optional[str]) -> None:
    """Table to stdout; JSON to ``json_path`` ("-": JSON to stdout, table to stderr)."""
    print(table, file=sys.stderr if json_path == "-" else sys.stdout)
    if json_path is None:
        return
    text = json.dumps(report, indent=2)
    if json_path == "-":
        print(text)
    else:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
