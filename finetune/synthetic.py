"""Training rows sampled from the softmax teacher (``data.teacher_rows``).

The offline corpus is small (SmolLM2 on ~1.1M news tokens overfits after a few epochs), and a converted
model learns from the teacher's distribution as much as from the text: each sampled row starts with the first
``prompt`` tokens of a training row and continues with tokens drawn from the teacher at ``temperature``, one
forward per token over a key/value cache. :func:`teacher_rows` caches the rows in the run's folder, so a
resumed run trains on the same rows without sampling again.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm


def pick_prompts(rows: dict, count: int, prompt: int, seed: int) -> torch.Tensor:
    """(count, prompt) long: the first ``prompt`` tokens of training rows with at least that many real tokens,
    in a seeded random order, cycled when ``count`` exceeds them. ValueError if no row is long enough."""
    full = (rows["attention_mask"][:, :prompt].sum(1) == prompt).nonzero().flatten()
    if len(full) == 0:
        raise ValueError(f"data.teacher_prompt={prompt}: no training row has that many tokens")
    order = full[torch.randperm(len(full), generator=torch.Generator().manual_seed(seed))]
    return rows["input_ids"][order.repeat((count + len(order) - 1) // len(order))[:count], :prompt]


@torch.no_grad()
def sample_rows(model, prompts: torch.Tensor, seq_len: int, *, temperature: float = 1.0, batch: int = 64,
                seed: int = 0, pad_token_id: int = 0, eos_token_id: Optional[int] = None, autocast=None,
                progress: bool = True) -> dict:
    """Rows of ``seq_len`` tokens: each prompt (R, P) continued by ``seq_len - P`` tokens sampled from ``model``
    (a causal LM) at ``temperature``, ``batch`` rows per pass. Returns ``input_ids``, ``attention_mask`` and
    ``labels`` as :func:`finetune.data.tokenize_rows` does; after a sampled ``eos_token_id`` a row is padding.
    The draws come from a generator seeded with ``seed`` on the model's device: the same rows for the same
    model, prompts and seed. ``autocast``: a context manager factory for the forwards (e.g. bf16)."""
    count, plen = prompts.shape
    if not 0 < plen < seq_len:
        raise ValueError(f"prompt length {plen} must be in 1..{seq_len - 1} for seq_len={seq_len}")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    autocast = autocast or contextlib.nullcontext
    was_training = model.training
    model.eval()
    out = []
    for start in tqdm(range(0, count, batch), desc="teacher rows", disable=not progress):
        ids = prompts[start:start + batch].to(device)
        cache = None
        for _ in range(seq_len - plen):
            with autocast():
                step = model(input_ids=ids if cache is None else ids[:, -1:], past_key_values=cache, use_cache=True)
            cache = step.past_key_values
            probs = torch.softmax(step.logits[:, -1].float() / temperature, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
        out.append(ids.cpu())
    model.train(was_training)
    input_ids = torch.cat(out)
    attention_mask = torch.ones_like(input_ids)
    if eos_token_id is not None:  # the tokens after a sampled eos
        eos = (input_ids[:, plen:] == eos_token_id).long()
        attention_mask[:, plen:] = (eos.cumsum(1) - eos == 0).long()
    input_ids = input_ids.masked_fill(attention_mask == 0, pad_token_id)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100)}


def teacher_rows(accelerator, teacher, tokenizer, train_rows: dict, spec, seq_len: int, seed: int, cache_dir: Path,
                 model_name: str, log=None) -> dict:
    """``spec.teacher_rows`` rows sampled by :func:`sample_rows` from prompts of ``train_rows``
    (:func:`pick_prompts`), read from ``cache_dir/teacher_rows.pt`` when it holds rows of the same settings (model,
    prompts, temperature, length, seed), else sampled on the main process and written there; every process returns
    the same rows."""
    prompts = pick_prompts(train_rows, spec.teacher_rows, spec.teacher_prompt, seed)
    settings = {"model": model_name, "prompts": hashlib.sha1(prompts.numpy().tobytes()).hexdigest(),
                "rows": spec.teacher_rows, "temperature": spec.teacher_temperature, "seq_len": seq_len, "seed": seed}
    path = Path(cache_dir) / "teacher_rows.pt"

    def cached() -> Optional[dict]:
        if not path.is_file():
            return None
        saved = torch.load(path, map_location="cpu")
        return saved["rows"] if saved.get("settings") == settings else None

    if accelerator.is_main_process and cached() is None:
        start = time.monotonic()
        rows = sample_rows(teacher, prompts, seq_len, temperature=spec.teacher_temperature, batch=spec.teacher_batch,
                           seed=seed, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=getattr(tokenizer, "eos_token_id", None), autocast=accelerator.autocast,
                           progress=accelerator.is_local_main_process)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"settings": settings, "rows": rows}, path)
        if log is not None:
            log.event(event="teacher_rows", rows=spec.teacher_rows, seconds=round(time.monotonic() - start, 1),
                      real_tokens=int(rows["attention_mask"].sum()))
    accelerator.wait_for_everyone()
    rows = cached()
    assert rows is not None, f"{path} was written by the main process"
    return rows


def concat_rows(*parts: dict) -> dict:
    """The rows of several :func:`finetune.data.tokenize_rows`-style dicts, in order (their shared keys)."""
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    return {k: torch.cat([p[k] for p in parts]) for k in keys}
