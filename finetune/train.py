"""Convert a softmax checkpoint, then win its quality back: attention transfer, then LoRA/full fine-tuning.

    accelerate launch --config_file configs/accelerate/single_gpu.yaml finetune/train.py \\
        --config configs/finetune/smollm2_race.yaml
    python finetune/train.py --config configs/finetune/tiny_smoke.yaml        # one process, CPU or one GPU
    accelerate launch -m hf_attention_backends.finetune.train --config smollm2_race  # installed wheel, bundled recipe

Steps (the recipe, ``finetune/config.py``, says which run):

1. load the model (the softmax teacher, kept frozen) and local text; rows never mix documents
   (``finetune/data.py``); ``data.eval_documents`` documents are held out; ``data.teacher_rows`` more training
   rows are sampled from the teacher (``finetune/synthetic.py``);
2. ``hf_attention_backends.convert`` a copy (the student); optionally ``calibrate`` it;
3. attention transfer (``transfer.steps``): only ``hfab_*`` parameters and those whose name contains a
   ``transfer.train`` entry are trained, so that each converted layer's attention output matches softmax on
   the teacher's hidden states (mean over layers of the per-layer MSE, teacher computed in the same forward
   by :class:`hf_attention_backends.calibrate.TeacherForcing`);
4. fine-tuning (``fine_tune.steps``): LoRA (peft, merged at the end), full, or ``hfab_*`` only, with
   ``lm_weight`` × next-token loss + ``kl_weight`` × KL(teacher ‖ student) of the logits at temperature T
   (× T²) + ``hidden_weight`` × MSE of the last hidden state + ``embedding_weight`` × (1 − cosine of the
   mean-pooled last hidden states); real tokens only.

Accelerate handles devices, DDP/FSDP and mixed precision; gradient accumulation, warm-up + cosine schedule and
clipping per stage. Losses are means over the real tokens of the global micro-batch (:func:`token_mean`), so P
processes with batch b train like one with batch P·b (``finetune/README.md``). Output in ``output_dir``:
``log.csv`` (step, stage, loss, lr, grad_norm, evaluation metrics, tokens/s, elapsed; ``finetune/logs.py``),
``log.jsonl`` (every event, calibration report included),
``tensorboard/`` (``train.tensorboard``), ``curves.png`` (``train.plot``), ``checkpoints/<stage>-<step>/``
(``train.save_every``; resume with ``--resume <folder>|latest``, ``finetune/checkpoint.py``),
``calibration.json``, ``teacher_rows.pt`` (``data.teacher_rows``), ``transfer/`` and ``final/``
(``save_pretrained`` of the converted model, loadable with ``hf_attention_backends.from_pretrained``),
``probe.pt`` (the first held-out batch and the final model's output on it) and ``summary.json``. Evaluation on
held-out rows: perplexity for causal LMs, mean-pooled embedding cosine to the teacher for encoders; before
conversion (teacher), after conversion, after each stage.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # `python finetune/train.py`: run it as the package's module
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from finetune.train import main

    sys.exit(main())

import argparse
import copy
import dataclasses
import json
import math
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

import hf_attention_backends as hfab
from hf_attention_backends.calibrate import TeacherForcing, calibrate, converted_layers, forward_kwargs

from .checkpoint import EpochSampler, check_compatible, read_state, resolve_resume, save_checkpoint
from .config import ConfigError, Recipe, load_recipe
from .data import RowDataset, ShiftedRows, load_documents, split_documents, texts_in_unit, tokenize_rows
from .logs import RunLog, plot_curves, stage_rank, tensorboard_writer_class
from .models import load_model
from .synthetic import concat_rows, teacher_rows


def token_mean(accelerator, total, count):
    """The mean over the global micro-batch (every process's rows) from this process's ``total`` and ``count``.

    Returns ``total × P / Σ_processes count`` (count clamped to >= 1): DDP averages the P gradients and the
    logged loss is the mean over processes, so both equal the single-process mean over the same rows however
    the real tokens split between processes (``total / count`` per process would weight them per process).
    """
    count = accelerator.reduce(count.detach().to(torch.float32), "sum")
    return total * accelerator.num_processes / count.clamp(min=1)


def uses_fsdp(accelerator) -> bool:
    """Whether the launch wraps the model with FSDP (``configs/accelerate/fsdp.yaml``)."""
    return accelerator.distributed_type == DistributedType.FSDP


def set_reshard_after_forward(model, reshard: bool):
    """FSDP2 units of ``model`` keep (False) or free (True) their gathered weights after the forward.

    The transfer stage keeps them (its model is not used afterwards): its loss reaches the q/k projections inside
    each layer, not through the layer's output, so the backward may reach a projection before FSDP has gathered
    its weights again.
    """
    for module in model.modules():
        if hasattr(module, "set_reshard_after_forward"):
            module.set_reshard_after_forward(reshard, recurse=False)


def full_state_dict(model) -> dict:
    """``model``'s full state dict on every process, gathered from its FSDP2 shards where it has them."""
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def merged_lora(accelerator, model, template=None):
    """The PEFT ``model`` with its LoRA weights merged. ``template`` (FSDP): an unsharded copy of ``model`` made before
    sharding; it receives the trained state (gathered in full on every process) and is merged instead."""
    if template is None:
        return model.merge_and_unload()
    template.load_state_dict(full_state_dict(model))
    return template.merge_and_unload().to(accelerator.device)


def masked_mean(accelerator, values, mask):
    """Mean of ``values`` (B, N) over ``mask`` (B, N) = 1 of every process's micro-batch (:func:`token_mean`)."""
    mask = mask.to(values.dtype)
    return token_mean(accelerator, (values * mask).sum(), mask.sum())


def next_token_nll(logits, labels):
    """(sum of next-token NLL, token count) over labels != -100; logits (B, N, V), labels (B, N)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                          reduction="sum")
    return nll, (labels != -100).sum()


def logit_kl(accelerator, student, teacher, mask, temperature: float):
    """KL(teacher ‖ student) per token at ``temperature``, × T², averaged over the real tokens of every
    process's micro-batch."""
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    s = F.log_softmax(student.float() / temperature, dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    return masked_mean(accelerator, kl, mask) * temperature ** 2


def last_hidden(out):
    return out.last_hidden_state if getattr(out, "last_hidden_state", None) is not None else out.hidden_states[-1]


def mean_pool(hidden, mask):
    mask = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


def pooled_cosine(out, ref, mask):
    """(B,) cosine between the mean-pooled (real tokens) last hidden states of two model outputs, in fp32."""
    return F.cosine_similarity(mean_pool(last_hidden(out).float(), mask), mean_pool(last_hidden(ref).float(), mask),
                               dim=-1)


def embedding_loss(accelerator, out, ref, mask):
    """1 - :func:`pooled_cosine`, the mean over the global micro-batch's rows that hold a real token: the
    encoders' evaluation metric as a loss (the hidden MSE also weighs norms and single tokens)."""
    real_rows = (mask.sum(1) > 0).to(torch.float32)
    return token_mean(accelerator, ((1 - pooled_cosine(out, ref, mask)) * real_rows).sum(), real_rows.sum())


@torch.no_grad()
def evaluate(accelerator, model, teacher, loader, causal: bool, max_batches=None) -> dict:
    """Held-out metrics of ``model`` (every process evaluates all rows, so no gather is needed).

    Causal LMs: ``ppl`` (exp of the mean next-token NLL) and ``top1_agreement`` with the teacher; encoders:
    ``cosine``, the mean over rows of the cosine between mean-pooled last hidden states of model and teacher.
    """
    was_training = model.training
    model.eval()
    nll, count, agree, real, cos, rows = 0.0, 0, 0, 0, 0.0, 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        kwargs = forward_kwargs(accelerator.unwrap_model(model), batch)  # a DDP wrapper has no .config
        with accelerator.autocast():
            out = model(**kwargs)
            ref = teacher(**kwargs) if teacher is not None and teacher is not model else None
        mask = batch["attention_mask"]
        if causal:
            s, c = next_token_nll(out.logits, batch["labels"])
            nll, count = nll + float(s), count + int(c)
            if ref is not None:
                agree += int(((out.logits.argmax(-1) == ref.logits.argmax(-1)) & (mask == 1)).sum())
        elif ref is not None:
            cos += float(pooled_cosine(out, ref, mask).sum())
        rows += len(mask)
        real += int(mask.sum())
    model.train(was_training)
    if causal:
        metrics = {"ppl": math.exp(nll / max(count, 1))}
        if teacher is not None and teacher is not model:
            metrics["top1_agreement"] = agree / max(real, 1)
        return metrics
    return {"cosine": cos / max(rows, 1)} if teacher is not None and teacher is not model else {}


def is_added(name: str) -> bool:
    """Whether parameter ``name`` is one the conversion added (``hfab_*``)."""
    return name.rsplit(".", 1)[-1].startswith("hfab_")


def drop_unused(accelerator, model, params: list, loss_fn, batch) -> tuple:
    """``params`` that receive a gradient from ``loss_fn(model, batch)`` (one probe forward/backward, RNG state
    restored, gradients cleared), and the names of the others, which are frozen: DDP refuses parameters that
    take no part in the loss (an encoder's pooler when the loss reads the last hidden state)."""
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), accelerator.autocast():
        loss_fn(model, batch).backward()
    used = [p for p in params if p.grad is not None]
    names = {id(p): n for n, p in model.named_parameters()}
    unused = [names.get(id(p), "?") for p in params if p.grad is None]
    for p in params:
        p.requires_grad_(p.grad is not None)
        p.grad = None
    return used, unused


def trainable(model, names=(), within=None) -> list:
    """Freeze ``model`` except ``hfab_*`` parameters and those whose name contains one of ``names``; with
    ``within`` (modules), only the named parameters inside those modules (attention transfer: the converted
    layers; a softmax layer left out of the plan must not move to please the converted layers after it)."""
    allowed = None if within is None else {id(p) for m in within for p in m.parameters()}
    params = []
    for name, p in model.named_parameters():
        named = any(n in name for n in names) and (allowed is None or id(p) in allowed)
        keep = is_added(name) or named
        p.requires_grad_(keep)
        if keep:
            params.append(p)
    return params


def lr_groups(model, params: list, named_lr: Optional[float]) -> list:
    """``params`` as AdamW parameter groups: the ``hfab_*`` parameters at the stage's learning rate and the
    others (those a ``transfer.train`` entry named) at ``named_lr``; ``None``: ``params`` unchanged (one lr)."""
    if named_lr is None:
        return params
    chosen = {id(p) for p in params}
    added, named = [], []
    for name, p in model.named_parameters():
        if id(p) in chosen:
            (added if is_added(name) else named).append(p)
    return [g for g in ({"params": added}, {"params": named, "lr": named_lr}) if g["params"]]


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This process's part of parameter ``p`` (its shard under FSDP2's DTensor parameters)."""
    return p.to_local() if hasattr(p, "to_local") else p


class BestKeeper:
    """The trainable parameters at a stage's best held-out evaluation (``train.keep_best``): lowest ``ppl``, or highest
    ``cosine`` for encoders. Each process keeps a CPU copy of its own part of each parameter (its shards under FSDP),
    so restoring needs no communication; checkpoints carry the copy (``best-<process>.pt``) for an exact resume."""

    def __init__(self, params: list):
        self.params = params
        self.step: Optional[int] = None
        self.metrics: Optional[dict] = None
        self.saved: Optional[list] = None

    @staticmethod
    def score(metrics: dict) -> float:
        return -metrics["ppl"] if "ppl" in metrics else metrics["cosine"]

    def offer(self, step: int, metrics: dict) -> None:
        if self.metrics is None or self.score(metrics) > self.score(self.metrics):
            self.step, self.metrics = step, metrics
            self.saved = [local_tensor(p).detach().to("cpu", copy=True) for p in self.params]

    def restore(self) -> None:
        assert self.saved is not None, "restore before any evaluation was offered"
        with torch.no_grad():
            for p, saved in zip(self.params, self.saved):
                local_tensor(p).copy_(saved)

    def position(self) -> dict:
        return {"step": self.step, "metrics": self.metrics}

    def write(self, path: Path, process: int) -> None:
        torch.save(self.saved, Path(path) / f"best-{process}.pt")

    def read(self, path: Path, process: int, position: dict) -> None:
        self.step, self.metrics = position["step"], position["metrics"]
        self.saved = torch.load(Path(path) / f"best-{process}.pt")


def set_data_epoch(loader, prepared, epoch: int) -> None:
    """The epoch of the next pass over ``loader`` (prepared by accelerate as ``prepared``): its
    :class:`EpochSampler`'s order and its :class:`finetune.data.ShiftedRows`' rows. accelerate's loader sets its
    sampler's epoch from its own pass counter at the start of each pass, and a ``skip_first_batches`` copy starts
    from the original's counter, so the counter is set too: else a resume past the first epoch would replay
    another epoch's order."""
    if hasattr(prepared, "set_epoch"):
        prepared.set_epoch(epoch)
    if isinstance(loader.sampler, EpochSampler):
        loader.sampler.set_epoch(epoch)
    if isinstance(loader.dataset, ShiftedRows):
        loader.dataset.set_epoch(epoch)


def run_stage(stage: str, accelerator, model, params, loss_fn, loader, steps: int, lr: float, recipe: Recipe,
              log: Optional[RunLog], evaluate_fn, *, save: Optional[Callable[[dict, Optional[BestKeeper]], None]] = None,
              resume: Optional[tuple[Path, dict]] = None,
              keep_best: bool = False) -> tuple[object, list[float], Optional[BestKeeper]]:
    """``steps`` optimizer steps of AdamW on ``params`` (tensors, or groups from :func:`lr_groups`) minimising
    ``loss_fn(wrapped_model, batch)``.

    Warm-up + cosine schedule, clipping at ``train.clip`` (0 = none; the gradient norm is logged either way),
    ``train.grad_accum`` micro-batches per step; every ``train.log_every`` steps a log row (loss averaged over
    the step's micro-batches and the processes), every ``train.eval_every`` an evaluation (0 = never). When
    ``loader.sampler`` is an :class:`EpochSampler` (or ``loader.dataset`` a :class:`finetune.data.ShiftedRows`) its
    epoch is set before each pass over the data (:func:`set_data_epoch`).

    save: called with the position (stage, step, epoch, batch_in_epoch, scheduler state, losses, the best
    evaluation's step and metrics) and the BestKeeper (or None, to write its copy with the checkpoint) every
    ``train.save_every`` steps and at the last step (``run`` writes the checkpoint); resume: (checkpoint
    folder, its trainer_state) of this stage: the accelerate state is loaded after ``prepare`` and the loop
    continues from the saved data position. Starts with ``accelerator.free_memory()``, so the accelerate
    state of the previous stage is not saved with this one's. keep_best: every evaluation, and one at the
    last step, is offered to a :class:`BestKeeper`, whose parameters the stage ends with (logged as a
    ``best_step`` event).
    Returns (the prepared model, per-step losses from step 1, the BestKeeper or None).
    """
    if not params:
        raise ConfigError(f"{stage}.steps={steps} but no parameter is trainable in this stage (e.g. Stieltjes adds "
                          "none unless per_head_temperature: name some in transfer.train, or set the steps to 0)")
    t = recipe.train
    accelerator.free_memory()
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, t.warmup_steps, steps)
    wrapped, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    clip_params = [p for p in wrapped.parameters() if p.requires_grad]  # FSDP may have replaced the tensors
    optimizer.zero_grad()  # a gradient left by earlier code (calibration) must not enter the first step
    step, epoch, skip, losses = 0, 0, 0, []
    best = BestKeeper(clip_params) if keep_best else None
    if resume is not None:
        path, state = resume
        if state["step"] > steps:
            raise ValueError(f"checkpoint {path} is at {stage} step {state['step']} but {stage}.steps={steps}")
        accelerator.load_state(str(path))
        scheduler.load_state_dict(state["scheduler"])
        step, epoch, skip, losses = state["step"], state["epoch"], state["batch_in_epoch"], list(state["losses"])
        if best is not None and state.get("best"):
            best.read(path, accelerator.process_index, state["best"])
    wrapped.train()
    bar = tqdm(total=steps, initial=step, desc=stage, disable=not accelerator.is_local_main_process)
    micro, tokens, since = [], 0, time.time()
    while step < steps:
        set_data_epoch(loader, prepared, epoch)
        batch_in_epoch = skip
        for batch in accelerator.skip_first_batches(prepared, skip) if skip else prepared:
            batch_in_epoch += 1
            with accelerator.accumulate(wrapped):
                loss = loss_fn(wrapped, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(clip_params, t.clip if t.clip > 0 else math.inf)
                optimizer.step()
                optimizer.zero_grad()
            micro.append(loss.detach().float())
            tokens += int(batch["attention_mask"].sum())
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            losses.append(float(accelerator.reduce(torch.stack(micro).mean(), "mean")))
            micro = []
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
            if step % t.log_every == 0 or step == steps:
                seen = float(accelerator.reduce(torch.tensor(float(tokens), device=accelerator.device), "sum"))
                now = time.time()
                if log is not None:
                    log.metrics(stage, step, loss=losses[-1], lr=scheduler.get_last_lr()[0],
                                grad_norm=float(grad_norm), tokens_per_s=round(seen / max(now - since, 1e-9), 1))
                tokens, since = 0, now
            due = t.eval_every and (step % t.eval_every == 0 and step < steps or best is not None and step == steps)
            if due and (log is not None or best is not None):
                metrics = evaluate_fn(wrapped)
                if log is not None:
                    log.metrics(stage, step, eval=metrics)
                if best is not None:
                    best.offer(step, metrics)
            if save is not None and t.save_every and (step % t.save_every == 0 or step == steps):
                save({"stage": stage, "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                      "scheduler": scheduler.state_dict(), "losses": losses,
                      "best": best.position() if best is not None else None}, best)
            if step >= steps:
                break
        else:  # the pass ended: the next one starts at its first batch
            epoch, skip = epoch + 1, 0
            continue
        break
    bar.close()
    if best is not None:
        best.restore()
        if log is not None:
            log.event(stage=stage, best_step=best.step, best=best.metrics)
    return wrapped, losses, best


def save(accelerator, model, tokenizer, path: Path) -> None:
    """``save_pretrained`` of the unwrapped converted model (main process writes) plus the tokenizer; the state
    dict comes from ``accelerator.get_state_dict`` (gathered in full under FSDP; every process must call)."""
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(path, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
                              state_dict=state_dict)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(path)


def run(recipe: Recipe, resume: Optional[str] = None) -> dict:
    """Run a validated recipe; returns the summary written to ``output_dir/summary.json``.

    resume: a checkpoint folder or ``"latest"`` (``finetune/checkpoint.py``): the data, conversion and
    calibration are redone (deterministic), the stages before the checkpoint's are skipped (their results
    come from the checkpoint) and its stage continues from the saved step with the saved model, optimizer,
    scheduler, RNG states and data position.
    """
    t, ft, d = recipe.train, recipe.fine_tune, recipe.data
    out_dir = Path(recipe.output_dir)
    resume_path = resolve_resume(resume, out_dir) if resume else None
    state = read_state(resume_path) if resume_path else None
    if state is not None and not getattr(recipe, state["stage"]).steps:
        raise ValueError(f"checkpoint {resume_path} is in stage {state['stage']!r} but the recipe has "
                         f"{state['stage']}.steps=0")
    if t.tensorboard:
        tensorboard_writer_class()  # fail before any work
    accelerator = Accelerator(gradient_accumulation_steps=t.grad_accum,
                              **({} if t.mixed_precision is None else {"mixed_precision": t.mixed_precision}))
    if state is not None:
        check_compatible(state, num_processes=accelerator.num_processes, batch_size=d.batch_size,
                         grad_accum=t.grad_accum, seed=recipe.seed)
    set_seed(recipe.seed)
    log = RunLog(out_dir, accelerator.is_main_process, tensorboard=t.tensorboard,
                 resume_at=None if state is None else (state["stage"], state["step"]),
                 elapsed_before=0.0 if state is None else state["elapsed_s"])
    log.event(event="recipe", recipe=dataclasses.asdict(recipe),  # as run: after --set overrides
              launch={"processes": accelerator.num_processes, "distributed": str(accelerator.distributed_type),
                      "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device)})
    fsdp = uses_fsdp(accelerator)
    if state is not None:
        log.event(event="resume", checkpoint=str(resume_path), stage=state["stage"], step=state["step"])

    teacher, tokenizer, causal = load_model(recipe.model.name, recipe.model.dtype, recipe.seed)
    if not causal and ft.steps and (ft.lm_weight or ft.kl_weight):
        raise ConfigError(f"model.name={recipe.model.name!r} is an encoder without logits: fine_tune.lm_weight and "
                          "kl_weight must be 0 (use hidden_weight or embedding_weight)")
    if not causal and d.teacher_rows:
        raise ConfigError(f"model.name={recipe.model.name!r} is an encoder: data.teacher_rows={d.teacher_rows} "
                          "samples text from a causal LM teacher; set it to 0")
    documents = load_documents(d.source, d.documents + d.eval_documents, min_chars=d.min_chars,
                               text_field=d.text_field)
    train_docs, eval_docs = split_documents(documents, d.eval_documents)
    train_texts = texts_in_unit(train_docs, d.train_unit)
    train_tokens = None if d.shift_windows else tokenize_rows(train_texts, tokenizer, d.seq_len)
    eval_rows = RowDataset(tokenize_rows(texts_in_unit(eval_docs, d.eval_unit), tokenizer, d.seq_len))
    c = recipe.convert
    student = hfab.convert(teacher, c.backend, c.layers, **c.options)
    teacher.to(accelerator.device).requires_grad_(False)
    student.to(accelerator.device)
    if d.teacher_rows:  # never with shift_windows (config check)
        train_tokens = concat_rows(train_tokens, teacher_rows(accelerator, teacher, tokenizer, train_tokens, d,
                                                              d.seq_len, recipe.seed, out_dir, recipe.model.name, log))
    train_rows = ShiftedRows(train_texts, tokenizer, d.seq_len, recipe.seed) if d.shift_windows else \
        RowDataset(train_tokens)
    # own generators: iterating a loader draws its base seed from them, not from the global RNG
    train_loader = torch.utils.data.DataLoader(train_rows, batch_size=d.batch_size,
                                               sampler=EpochSampler(len(train_rows), recipe.seed),
                                               generator=torch.Generator().manual_seed(recipe.seed))
    first_rows = next(iter(torch.utils.data.DataLoader(train_rows, d.batch_size)))  # epoch 0's, for drop_unused
    eval_loader = torch.utils.data.DataLoader(eval_rows, batch_size=d.eval_batch_size,
                                              generator=torch.Generator().manual_seed(recipe.seed))
    log.event(event="data", train_rows=len(train_rows), eval_rows=len(eval_rows), train_documents=len(train_docs),
              eval_documents=len(eval_docs), train_unit=d.train_unit, eval_unit=d.eval_unit,
              teacher_rows=d.teacher_rows)

    def evaluate_fn(model):
        return evaluate(accelerator, model, teacher, eval_loader, causal, t.eval_batches)

    summary = {"backend": c.backend, "model": recipe.model.name}
    if state is not None:
        summary = state["summary"]
    else:
        if causal:
            summary["teacher"] = evaluate(accelerator, teacher, None, eval_loader, causal, t.eval_batches)
            log.metrics("teacher", 0, eval=summary["teacher"])
        summary["converted"] = evaluate_fn(student)
        log.metrics("converted", 0, eval=summary["converted"])

    if recipe.calibrate.enabled:  # redone on resume: the Stieltjes order lives in the config, not the state
        cal = recipe.calibrate
        global_batch = d.batch_size * accelerator.num_processes  # every process calibrates on the same rows
        batches = [{k: v.to(accelerator.device) for k, v in b.items()}
                   for _, b in zip(range(cal.batches), torch.utils.data.DataLoader(train_rows, global_batch))]
        with accelerator.autocast():  # the training precision (the Stieltjes kernels take fp16/bf16 only)
            report = calibrate(student, batches, race_betas=cal.race_betas, stieltjes_orders=cal.stieltjes_orders,
                               temperatures=cal.stieltjes_temperatures, steps=cal.steps, lr=cal.lr)
        if state is None:
            log.event(stage="calibrate", report=report)
            if accelerator.is_main_process:
                (out_dir / "calibration.json").write_text(json.dumps(report, indent=1))
            summary["calibrated"] = evaluate_fn(student)
            log.metrics("calibrated", 0, eval=summary["calibrated"])

    def saver(position: dict, best: Optional[BestKeeper] = None) -> None:
        full = {**position, "sampler_seed": recipe.seed, "num_processes": accelerator.num_processes,
                "batch_size": d.batch_size, "grad_accum": t.grad_accum, "summary": summary,
                "elapsed_s": log.elapsed()}
        extra = None if best is None or best.saved is None else lambda path: best.write(path, accelerator.process_index)
        path = save_checkpoint(accelerator, out_dir, full, t.keep_checkpoints, extra)
        log.event(event="checkpoint", path=str(path), stage=position["stage"], step=position["step"])

    def resume_for(stage: str):
        return (resume_path, state) if state is not None and state["stage"] == stage else None

    model = student
    start = stage_rank(state["stage"]) if state is not None else 0
    if recipe.transfer.steps and start <= stage_rank("transfer"):
        params = lr_groups(student, trainable(student, recipe.transfer.train,
                                              within=[m for _, m in converted_layers(student)]),
                           recipe.transfer.train_lr)
        with TeacherForcing(student, student_graph=fsdp) as forcing:
            def transfer_loss(wrapped, batch):
                forcing.token_mask, forcing.terms = batch["attention_mask"], {}
                if fsdp:
                    set_reshard_after_forward(wrapped, False)
                out = wrapped(**forward_kwargs(student, batch))
                loss = sum(token_mean(accelerator, err, count) for err, _, count in forcing.terms.values()) / len(
                    forcing.terms)
                return loss + 0.0 * out[0].float().sum() if fsdp else loss  # FSDP: the output joins the backward

            def evaluate_student(wrapped):
                with forcing.paused():
                    return evaluate_fn(wrapped)

            model, losses, _ = run_stage("transfer", accelerator, student, params, transfer_loss, train_loader,
                                         recipe.transfer.steps, recipe.transfer.lr, recipe, log, evaluate_student,
                                         save=saver, resume=resume_for("transfer"))
        summary["transfer"] = {"first_loss": losses[0], "last_loss": losses[-1], "eval": evaluate_fn(model)}
        log.metrics("transfer", recipe.transfer.steps, eval=summary["transfer"]["eval"])
        save(accelerator, model, tokenizer, out_dir / "transfer")
        if fsdp:  # FSDP fixes dtypes and unit classes when it first wraps: the next stage starts from a new copy
            accelerator.wait_for_everyone()
            student = model = hfab.from_pretrained(out_dir / "transfer", dtype=getattr(torch, recipe.model.dtype))
            model.to(accelerator.device)
        else:
            model = accelerator.unwrap_model(model)

    if ft.steps:
        model = accelerator.unwrap_model(model)
        if ft.method == "lora":
            from peft import LoraConfig, get_peft_model

            trainable(model)
            model = get_peft_model(model, LoraConfig(r=ft.lora_r, lora_alpha=ft.lora_alpha, lora_dropout=0.0,
                                                     target_modules=list(ft.lora_target_modules)))
        for name, p in model.named_parameters():
            is_hfab = is_added(name)
            if ft.method == "full":
                p.requires_grad_(True if not is_hfab else ft.train_hfab)
            elif is_hfab:
                p.requires_grad_(ft.train_hfab)
            elif ft.method == "none":
                p.requires_grad_(False)
        # FSDP shards the weights LoRA merges into: the merge happens on an unsharded CPU copy (one per process)
        template = copy.deepcopy(model).cpu() if fsdp and ft.method == "lora" else None
        if t.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
        need_hidden = (ft.hidden_weight > 0 or ft.embedding_weight > 0) and causal

        def finetune_loss(wrapped, batch):
            kwargs = forward_kwargs(student, batch)
            if need_hidden:
                kwargs["output_hidden_states"] = True
            out = wrapped(**kwargs)
            mask = batch["attention_mask"]
            loss = torch.zeros((), device=mask.device)
            if ft.lm_weight:
                nll, count = next_token_nll(out.logits, batch["labels"])
                loss = loss + ft.lm_weight * token_mean(accelerator, nll, count)
            if ft.kl_weight or ft.hidden_weight or ft.embedding_weight:
                with torch.no_grad():
                    ref = teacher(**kwargs)
                if ft.kl_weight:
                    loss = loss + ft.kl_weight * logit_kl(accelerator, out.logits, ref.logits, mask, ft.temperature)
                if ft.hidden_weight:
                    err = ((last_hidden(out).float() - last_hidden(ref).float()) ** 2).mean(-1)
                    loss = loss + ft.hidden_weight * masked_mean(accelerator, err, mask)
                if ft.embedding_weight:
                    loss = loss + ft.embedding_weight * embedding_loss(accelerator, out, ref, mask)
            return loss

        params, unused = drop_unused(accelerator, model, params, finetune_loss,
                                     {k: v.to(accelerator.device) for k, v in first_rows.items()})
        if unused:
            log.event(stage="fine_tune", frozen_unused=unused)
        model, losses, best = run_stage("fine_tune", accelerator, model, params, finetune_loss, train_loader,
                                        ft.steps, ft.lr, recipe, log, evaluate_fn, save=saver,
                                        resume=resume_for("fine_tune"), keep_best=t.keep_best)
        model = accelerator.unwrap_model(model)
        if t.gradient_checkpointing:
            model.gradient_checkpointing_disable()
        if ft.method == "lora":
            model = merged_lora(accelerator, model, template)
        summary["fine_tune"] = {"first_loss": losses[0], "last_loss": losses[-1]}
        if best is not None:
            summary["fine_tune"]["kept_best"] = best.position()

    summary["final"] = evaluate_fn(model)
    log.metrics("final", 0, eval=summary["final"])
    save(accelerator, model, tokenizer, out_dir / "final")
    probe = next(iter(eval_loader))
    kwargs = forward_kwargs(model, {k: v.to(accelerator.device) for k, v in probe.items()})
    with torch.no_grad():  # every process runs it: an FSDP forward is collective
        out = model.eval()(**kwargs)
    if accelerator.is_main_process:
        torch.save({"inputs": {k: v.cpu() for k, v in kwargs.items() if torch.is_tensor(v)},
                    "output": (out.logits if causal else last_hidden(out)).cpu()}, out_dir / "probe.pt")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if t.plot:
            plot_curves(out_dir / "log.csv", out_dir / "curves.png")
    log.close()
    accelerator.wait_for_everyone()
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="YAML recipe: a file, or the name of a bundled one (configs/finetune/<name>.yaml)")
    parser.add_argument("--output-dir", help="overrides the recipe's output_dir")
    parser.add_argument("--resume", metavar="DIR|latest",
                        help="continue from a checkpoint folder (<output_dir>/checkpoints/<stage>-<step>) or the "
                             "newest one under output_dir")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="change one recipe value (YAML), repeatable: --set fine_tune.lr=3e-4 "
                             "--set convert.options.num_tables=8")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.config, args.overrides)
    if args.output_dir:
        recipe.output_dir = args.output_dir
    run(recipe, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
