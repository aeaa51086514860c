"""The fine-tuning recipe: a YAML file with the sections below, validated once into dataclasses.

Every key is optional (defaults in the dataclasses); an unknown section or key, a wrong type or an
out-of-range value raises :class:`ConfigError` naming ``section.key``, the value and what is supported.
The ``convert`` options are checked by the backend's own config (``backends/config.py``).

```yaml
output_dir: runs/name          # checkpoints/, log.csv, log.jsonl, curves.png, summary.json
seed: 0
model:     {name: smollm2 | minilm | tiny_llama | tiny_bert | /local/folder, dtype: float32 | bfloat16}
convert:   {backend: race, layers: null, options: {num_planes: 4, per_head_beta: true}}
calibrate: {enabled: true, batches: 2, race_betas: null, stieltjes_orders: null, stieltjes_temperatures: null,
            steps: 0, lr: 0.01}
data:      {source: news | file.jsonl | file.txt | folder, documents: 256, eval_documents: 16, min_chars: 0,
            text_field: text, seq_len: 256, batch_size: 8, eval_batch_size: 8, train_unit: rows | sentences,
            eval_unit: rows | sentences, shift_windows: false, teacher_rows: 0, teacher_prompt: 32,
            teacher_temperature: 1.0, teacher_batch: 64}
transfer:  {steps: 100, lr: 0.01, train: [], train_lr: null}  # train: extra parameter-name substrings, e.g.
                                                              # [q_proj]; train_lr: their lr (null = lr)
fine_tune: {steps: 200, lr: 1e-4, method: lora | full | none, lora_r: 8, lora_alpha: 16,
            lora_target_modules: [q_proj, k_proj, v_proj, o_proj], lm_weight: 1.0, kl_weight: 0.0,
            hidden_weight: 0.0, embedding_weight: 0.0, temperature: 1.0, train_hfab: true}
train:     {grad_accum: 1, warmup_steps: 0, clip: 1.0, weight_decay: 0.0, mixed_precision: null | no | bf16 | fp16,
            log_every: 10, eval_every: 0, eval_batches: null, gradient_checkpointing: false,
            save_every: 0, keep_checkpoints: 2, keep_best: false, tensorboard: false, plot: true}
```

A recipe can be changed from the command line without copying it: ``--set section.key=value`` (repeatable;
the value is read as YAML, so ``3e-4``, ``true``, ``null`` and ``[q_proj, k_proj]`` work; a deeper path such as
``convert.options.num_tables=8`` reaches the backend options). See :func:`apply_overrides`.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from hf_attention_backends.backends.config import make_config


class ConfigError(ValueError):
    """A recipe value that is missing, unknown, of the wrong type or out of range."""


@dataclass
class ModelSpec:
    """name: smollm2, minilm, tiny_llama, tiny_bert (random, byte tokenizer) or a local model folder."""
    name: str = "tiny_llama"
    dtype: str = "float32"


@dataclass
class ConvertSpec:
    """The ``hf_attention_backends.convert`` call: backend, layers (None = all), backend options."""
    backend: str = "race"
    layers: Optional[list] = None
    options: dict = field(default_factory=dict)


@dataclass
class CalibrateSpec:
    """``hf_attention_backends.calibrate.calibrate`` on ``batches`` training batches before training."""
    enabled: bool = False
    batches: int = 2
    race_betas: Optional[list] = None
    stieltjes_orders: Optional[list] = None
    stieltjes_temperatures: Optional[list] = None
    steps: int = 0
    lr: float = 1e-2


@dataclass
class DataSpec:
    """Local text only; see ``finetune.data.load_documents`` for the accepted sources. ``train_unit`` (training
    documents) and ``eval_unit`` (held-out documents): each document cut into rows of ``seq_len`` tokens
    (``rows``), or one row per sentence (``sentences``, ``finetune.data.split_sentences``; a sentence longer
    than ``seq_len`` continues in the next row). ``shift_windows``: from the second epoch on, each training
    document's rows after its first start a random number of tokens earlier, drawn per epoch and document
    (``finetune.data.ShiftedRows``: other contexts for the same tokens when the corpus repeats; the number of rows
    stays fixed). ``teacher_rows`` (causal LMs): that many extra training rows
    sampled from the softmax teacher, each prompted by the first ``teacher_prompt`` tokens of a training row and
    continued to ``seq_len`` at ``teacher_temperature``, ``teacher_batch`` rows at a time (``finetune.synthetic``;
    cached in ``output_dir``). More text where the corpus is small: fine-tuning otherwise repeats it."""
    source: str = "news"
    documents: int = 64
    eval_documents: int = 8
    min_chars: int = 0
    text_field: str = "text"
    seq_len: int = 128
    batch_size: int = 4
    eval_batch_size: int = 4
    train_unit: str = "rows"
    eval_unit: str = "rows"
    shift_windows: bool = False
    teacher_rows: int = 0
    teacher_prompt: int = 32
    teacher_temperature: float = 1.0
    teacher_batch: int = 64


@dataclass
class TransferSpec:
    """Stage 1: train the ``hfab_*`` parameters (plus parameters whose name contains a ``train`` entry) at
    ``lr``; ``train_lr``: the learning rate of the named (pretrained) parameters, ``None`` = ``lr``."""
    steps: int = 0
    lr: float = 1e-2
    train: list = field(default_factory=list)
    train_lr: Optional[float] = None


@dataclass
class FineTuneSpec:
    """Stage 2: LoRA (peft), full or no fine-tuning with LM loss + KL to the teacher's logits + hidden MSE +
    (1 - cosine) of the mean-pooled last hidden states (``embedding_weight``, for encoders)."""
    steps: int = 0
    lr: float = 1e-4
    method: str = "lora"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lm_weight: float = 1.0
    kl_weight: float = 0.0
    hidden_weight: float = 0.0
    embedding_weight: float = 0.0
    temperature: float = 1.0
    train_hfab: bool = True


@dataclass
class TrainSpec:
    """Optimisation shared by both stages; ``mixed_precision`` None leaves it to the accelerate config.

    ``save_every``: a resumable checkpoint every N optimizer steps of a stage and at each stage's end (0 =
    none); ``keep_checkpoints``: how many of the newest to keep (0 = all). ``keep_best``: the fine-tune stage
    also evaluates at its last step and ends with the trainable parameters of its best held-out evaluation
    (lowest perplexity; highest cosine for encoders), so a schedule that overfits keeps its best point; needs
    ``eval_every`` > 0. ``tensorboard``: also write
    TensorBoard scalars (needs the ``tensorboard`` package); ``plot``: write ``curves.png`` at the end.
    """
    grad_accum: int = 1
    warmup_steps: int = 0
    clip: float = 1.0
    weight_decay: float = 0.0
    mixed_precision: Optional[str] = None
    log_every: int = 10
    eval_every: int = 0
    eval_batches: Optional[int] = None
    gradient_checkpointing: bool = False
    save_every: int = 0
    keep_checkpoints: int = 2
    keep_best: bool = False
    tensorboard: bool = False
    plot: bool = True


@dataclass
class Recipe:
    output_dir: str = "runs/finetune"
    seed: int = 0
    model: ModelSpec = field(default_factory=ModelSpec)
    convert: ConvertSpec = field(default_factory=ConvertSpec)
    calibrate: CalibrateSpec = field(default_factory=CalibrateSpec)
    data: DataSpec = field(default_factory=DataSpec)
    transfer: TransferSpec = field(default_factory=TransferSpec)
    fine_tune: FineTuneSpec = field(default_factory=FineTuneSpec)
    train: TrainSpec = field(default_factory=TrainSpec)


DTYPES = ("float32", "bfloat16", "float16")
METHODS = ("lora", "full", "none")
TEXT_UNITS = ("rows", "sentences")
MIXED_PRECISION = ("no", "bf16", "fp16")


# configs/ of the source checkout, or of an installed wheel (setup.py ships it as hf_attention_backends/configs/):
# either way one folder above this file's package folder.
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"
CONFIG_KINDS = ("finetune", "accelerate")


def bundled_configs(kind: str = "finetune") -> dict[str, Path]:
    """{name: path} of the YAML files shipped in ``configs/<kind>/`` (kind: ``finetune`` recipes or ``accelerate``
    launch configs), sorted by name; empty where the folder is missing."""
    if kind not in CONFIG_KINDS:
        raise ValueError(f"kind={kind!r} is not supported; supported: {', '.join(CONFIG_KINDS)}")
    folder = CONFIGS_DIR / kind
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def recipe_path(config) -> Path:
    """``config`` itself when it is a file, else the bundled recipe of that name (``smollm2_race`` or
    ``smollm2_race.yaml``, :func:`bundled_configs`); ConfigError naming the bundled recipes otherwise."""
    path = Path(config)
    if path.is_file():
        return path
    bundled = bundled_configs("finetune")
    if path.parent == Path(".") and path.stem in bundled and path.suffix in ("", ".yaml"):
        return bundled[path.stem]
    raise ConfigError(f"config={str(config)!r} is neither a file nor a bundled recipe; bundled: "
                      f"{', '.join(bundled) or 'none (configs/finetune not found)'}")


def load_recipe(path, overrides=()) -> Recipe:
    """Read a YAML recipe (a path, or the name of a bundled one: :func:`recipe_path`), apply ``overrides``
    (``"section.key=value"`` strings, see :func:`apply_overrides`) and validate it; ConfigError for anything
    malformed."""
    path = recipe_path(path)
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    return recipe_from_dict(apply_overrides(data, overrides))


def apply_overrides(data: Any, overrides) -> Any:
    """``data`` (a parsed recipe) with each ``"dotted.path=value"`` of ``overrides`` set in order; the value is
    parsed as YAML (``"fine_tune.lr=3e-4"``, ``"transfer.train=[q_proj]"``, ``"calibrate.race_betas=null"``).
    Missing sections are created; unknown keys are left to :func:`recipe_from_dict`, which names them.
    ConfigError for an entry without ``=``, an empty path component, or a path through a non-mapping value."""
    overrides = list(overrides or ())
    if not overrides:
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"recipe must be a mapping, got {type(data).__name__} ({data!r})")
    data = copy.deepcopy(data)
    for entry in overrides:
        path, sep, text = str(entry).partition("=")
        keys = path.strip().split(".")
        if not sep or not all(k.strip() for k in keys):
            raise ConfigError(f"--set {entry!r}: expected section.key=value, e.g. fine_tune.lr=3e-4")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {entry!r}: the value is not valid YAML ({e})") from None
        node = data
        for depth, key in enumerate(keys[:-1]):
            key = key.strip()
            child = node.setdefault(key, {})
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                where = ".".join(k.strip() for k in keys[:depth + 1])
                raise ConfigError(f"--set {entry!r}: {where} is {child!r}, not a mapping")
            node = child
        node[keys[-1].strip()] = value
    return data


def recipe_from_dict(data: Any) -> Recipe:
    """Validate a parsed recipe (dict of sections) into a :class:`Recipe`."""
    recipe = _build(Recipe, "recipe", data)
    _check(recipe)
    return recipe


def _build(cls, where: str, data: Any):
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__} ({data!r})")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; supported: {sorted(fields)}")
    values = {}
    defaults = cls()
    for name, value in data.items():
        default = getattr(defaults, name)
        key = name if where == "recipe" else f"{where}.{name}"
        if dataclasses.is_dataclass(default):
            values[name] = _build(type(default), name, value)
        else:
            values[name] = _typed(key, value, default, fields[name].type)
    return cls(**values)


def _typed(key: str, value, default, annotation: str):
    if value is None:
        if "Optional" in str(annotation):
            return None
        raise ConfigError(f"{key} must not be null")
    want = type(default) if default is not None else None
    if want is None and "float" in str(annotation):  # Optional[float]
        want = float
    if want is None:  # other Optional fields: checked in _check
        return value
    if want is float and isinstance(value, str):
        value = _yaml11_float(value)
    if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if want is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} must be an int, got {type(value).__name__} ({value!r})")
    if not isinstance(value, want):
        raise ConfigError(f"{key} must be a {want.__name__}, got {type(value).__name__} ({value!r})")
    return value


def _yaml11_float(text: str):
    """``float(text)`` for numbers PyYAML (YAML 1.1) leaves as strings, such as ``3e-4`` (no dot); else ``text``."""
    try:
        return float(text) if text.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity") else text
    except ValueError:
        return text


def _positive(key: str, value, zero_ok: bool = False):
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{key}={value} must be {'>= 0' if zero_ok else '> 0'}")


def _check(r: Recipe) -> None:
    if r.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={r.model.dtype!r} is not supported; supported: {', '.join(DTYPES)}")
    if r.convert.layers is not None and (not isinstance(r.convert.layers, list) or
                                         not all(isinstance(i, int) and not isinstance(i, bool)
                                                 for i in r.convert.layers)):
        raise ConfigError(f"convert.layers={r.convert.layers!r} must be null or a list of layer indices")
    try:
        make_config(r.convert.backend, **r.convert.options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"convert: {err}") from err
    for key in ("race_betas", "stieltjes_orders", "stieltjes_temperatures"):
        grid = getattr(r.calibrate, key)
        if grid is not None and (not isinstance(grid, list) or not grid or
                                 not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                                         for v in grid)):
            raise ConfigError(f"calibrate.{key}={grid!r} must be null or a non-empty list of positive numbers")
    if r.calibrate.stieltjes_temperatures is not None and not (
            r.convert.backend == "stieltjes" and r.convert.options.get("per_head_temperature")):
        raise ConfigError("calibrate.stieltjes_temperatures needs convert.backend: stieltjes with options "
                          "per_head_temperature: true (it searches the per-head hfab_temperature)")
    _positive("calibrate.batches", r.calibrate.batches)
    _positive("calibrate.steps", r.calibrate.steps, zero_ok=True)
    for key in ("documents", "eval_documents", "seq_len", "batch_size", "eval_batch_size"):
        _positive(f"data.{key}", getattr(r.data, key))
    for key in ("train_unit", "eval_unit"):
        if getattr(r.data, key) not in TEXT_UNITS:
            raise ConfigError(f"data.{key}={getattr(r.data, key)!r} is not supported; supported: "
                              f"{', '.join(TEXT_UNITS)}")
    if r.data.seq_len < 2:
        raise ConfigError(f"data.seq_len={r.data.seq_len} must be >= 2 (a next-token target needs two tokens)")
    _positive("data.min_chars", r.data.min_chars, zero_ok=True)
    _positive("data.teacher_rows", r.data.teacher_rows, zero_ok=True)
    for key in ("teacher_prompt", "teacher_temperature", "teacher_batch"):
        _positive(f"data.{key}", getattr(r.data, key))
    if r.data.teacher_rows and r.data.teacher_prompt >= r.data.seq_len:
        raise ConfigError(f"data.teacher_prompt={r.data.teacher_prompt} must be < data.seq_len={r.data.seq_len} "
                          "(the teacher continues each prompt to seq_len tokens)")
    if r.data.teacher_rows and r.data.train_unit != "rows":
        raise ConfigError(f"data.teacher_rows={r.data.teacher_rows} needs data.train_unit: rows (sampled rows are "
                          f"seq_len tokens long), got {r.data.train_unit!r}")
    if r.data.shift_windows and r.data.teacher_rows:
        raise ConfigError(f"data.shift_windows=true with data.teacher_rows={r.data.teacher_rows} is not supported "
                          "(sampled rows have no document to shift); set one of them off")
    for stage in ("transfer", "fine_tune"):
        spec = getattr(r, stage)
        _positive(f"{stage}.steps", spec.steps, zero_ok=True)
        _positive(f"{stage}.lr", spec.lr)
    if not all(isinstance(name, str) and name for name in r.transfer.train):
        raise ConfigError(f"transfer.train={r.transfer.train!r} must be a list of parameter-name substrings")
    if r.transfer.train_lr is not None:
        _positive("transfer.train_lr", r.transfer.train_lr)
        if not r.transfer.train:
            raise ConfigError(f"transfer.train_lr={r.transfer.train_lr!r} has no parameter to act on: "
                              "transfer.train is empty")
    ft = r.fine_tune
    if ft.method not in METHODS:
        raise ConfigError(f"fine_tune.method={ft.method!r} is not supported; supported: {', '.join(METHODS)}")
    weights = ("lm_weight", "kl_weight", "hidden_weight", "embedding_weight")
    for key in weights:
        _positive(f"fine_tune.{key}", getattr(ft, key), zero_ok=True)
    if ft.steps and ft.method != "none" and sum(getattr(ft, key) for key in weights) == 0:
        raise ConfigError(f"fine_tune.steps > 0 but {', '.join(weights)} are all 0; set one > 0")
    if ft.steps and ft.method == "none" and not ft.train_hfab:
        raise ConfigError("fine_tune.steps > 0 with method='none' and train_hfab=false trains nothing; set "
                          "method to lora or full, train_hfab to true, or steps to 0")
    _positive("fine_tune.temperature", ft.temperature)
    _positive("fine_tune.lora_r", ft.lora_r)
    _positive("fine_tune.lora_alpha", ft.lora_alpha)
    if ft.method == "lora" and (not ft.lora_target_modules or
                                not all(isinstance(m, str) and m for m in ft.lora_target_modules)):
        raise ConfigError(f"fine_tune.lora_target_modules={ft.lora_target_modules!r} must name at least one module")
    t = r.train
    _positive("train.grad_accum", t.grad_accum)
    _positive("train.warmup_steps", t.warmup_steps, zero_ok=True)
    _positive("train.clip", t.clip, zero_ok=True)
    _positive("train.weight_decay", t.weight_decay, zero_ok=True)
    _positive("train.log_every", t.log_every)
    _positive("train.eval_every", t.eval_every, zero_ok=True)
    _positive("train.save_every", t.save_every, zero_ok=True)
    _positive("train.keep_checkpoints", t.keep_checkpoints, zero_ok=True)
    if t.keep_best and not (t.eval_every and r.fine_tune.steps):
        raise ConfigError(f"train.keep_best=true needs train.eval_every > 0 and fine_tune.steps > 0 (got eval_every="
                          f"{t.eval_every}, fine_tune.steps={r.fine_tune.steps}): it keeps the fine-tune stage's best "
                          "evaluation")
    if t.eval_batches is not None and (isinstance(t.eval_batches, bool) or not isinstance(t.eval_batches, int)
                                       or t.eval_batches < 1):
        raise ConfigError(f"train.eval_batches={t.eval_batches!r} must be null (all) or an int >= 1")
    if t.mixed_precision is False:  # YAML 1.1 reads an unquoted `no` as false
        t.mixed_precision = "no"
    if t.mixed_precision is not None and t.mixed_precision not in MIXED_PRECISION:
        raise ConfigError(f"train.mixed_precision={t.mixed_precision!r} is not supported; supported: null "
                          f"(from the accelerate config), {', '.join(MIXED_PRECISION)}")
