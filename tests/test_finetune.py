import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from accelerate import Accelerator
from transformers.modeling_outputs import BaseModelOutput

import hf_attention_backends as hfab
from hf_attention_backends.calibrate import TeacherForcing, converted_layers, forward_kwargs
from finetune.config import ConfigError, Recipe, bundled_configs, load_recipe, recipe_from_dict, recipe_path
from finetune.data import (ByteTokenizer, ShiftedRows, encode, load_documents, row_starts, split_documents,
                           split_sentences, texts_in_unit, tokenize_rows)
from finetune.models import load_model
from finetune.checkpoint import EpochSampler, check_compatible, list_checkpoints, resolve_resume
from finetune.logs import CSV_COLUMNS, RunLog, read_csv
from finetune.synthetic import concat_rows, pick_prompts, sample_rows
from finetune.train import (BestKeeper, drop_unused, embedding_loss, lr_groups, next_token_nll, run, run_stage,
                            trainable)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "finetune" / "tiny_smoke.yaml"


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "finetune").glob("*.yaml")))
def test_shipped_recipes_validate(name):
    load_recipe(ROOT / "configs" / "finetune" / name)


def test_bundled_recipes_by_name(tmp_path, monkeypatch):
    """A recipe name (with or without .yaml) reads the shipped file; a file of that name in the working directory
    wins; a path with a folder or an unknown name is an error that lists the bundled names."""
    assert set(bundled_configs("finetune")) == {p.stem for p in (ROOT / "configs" / "finetune").glob("*.yaml")}
    assert set(bundled_configs("accelerate")) == {p.stem for p in (ROOT / "configs" / "accelerate").glob("*.yaml")}
    monkeypatch.chdir(tmp_path)
    assert recipe_path("tiny_smoke") == recipe_path("tiny_smoke.yaml") == SMOKE.resolve()
    assert load_recipe("tiny_smoke", ["fine_tune.lr=3e-4"]) == load_recipe(SMOKE, ["fine_tune.lr=3e-4"])
    (tmp_path / "tiny_smoke.yaml").write_text("seed: 7\n")
    assert load_recipe("tiny_smoke.yaml").seed == 7
    for bad in ("nonexistent", "sub/tiny_smoke.yaml", "tiny_smoke.yml"):
        with pytest.raises(ConfigError, match=r"neither a file nor a bundled recipe; bundled: .*tiny_smoke"):
            recipe_path(bad)
    with pytest.raises(ValueError, match="kind='models' is not supported"):
        bundled_configs("models")


@pytest.mark.parametrize("data, match", [
    ({"modle": {}}, r"unknown key\(s\) \['modle'\] in recipe"),
    ({"data": {"seq_len": "long"}}, r"data.seq_len must be an int, got str"),
    ({"data": {"batch_size": 0}}, r"data.batch_size=0 must be > 0"),
    ({"transfer": {"lr": True}}, r"transfer.lr must be a float, got bool"),
    ({"convert": {"backend": "nystrom", "options": {"num_landmarks": 0}}}, r"convert: num_landmarks=0"),
    ({"convert": {"backend": "race", "options": {"order": 4}}}, r"convert: unknown option\(s\) \['order'\]"),
    ({"fine_tune": {"method": "qlora"}}, r"fine_tune.method='qlora' is not supported; supported: lora, full"),
    ({"fine_tune": {"steps": 3, "lm_weight": 0}}, r"lm_weight, kl_weight, hidden_weight, embedding_weight are all 0"),
    ({"train": {"mixed_precision": "fp8"}}, r"train.mixed_precision='fp8' is not supported"),
    ({"calibrate": {"race_betas": [0.1, 0]}}, r"calibrate.race_betas=\[0.1, 0\] must be null or a non-empty"),
    ({"model": {"dtype": "int8"}}, r"model.dtype='int8' is not supported"),
    ({"data": []}, r"data must be a mapping, got list"),
    ({"calibrate": {"stieltjes_temperatures": [1.0]}}, r"needs convert.backend: stieltjes with options per_head_temp"),
    ({"train": {"save_every": -1}}, r"train.save_every=-1 must be >= 0"),
    ({"data": {"eval_unit": "words"}}, r"data.eval_unit='words' is not supported; supported: rows, sentences"),
    ({"transfer": {"train_lr": 1e-4}}, r"transfer.train_lr=0.0001 has no parameter to act on: transfer.train is emp"),
    ({"transfer": {"train": ["q_proj"], "train_lr": 0}}, r"transfer.train_lr=0.0 must be > 0"),
    ({"transfer": {"train": ["q_proj"], "train_lr": "fast"}}, r"transfer.train_lr must be a float, got str"),
    ({"data": {"train_unit": "pages"}}, r"data.train_unit='pages' is not supported; supported: rows, sentences"),
    ({"train": {"keep_best": True}}, r"train.keep_best=true needs train.eval_every > 0 and fine_tune.steps > 0"),
    ({"data": {"teacher_rows": 4, "seq_len": 32, "teacher_prompt": 32}}, r"data.teacher_prompt=32 must be < data.seq"),
    ({"data": {"teacher_rows": 4, "train_unit": "sentences"}}, r"data.teacher_rows=4 needs data.train_unit: rows"),
    ({"data": {"teacher_rows": -1}}, r"data.teacher_rows=-1 must be >= 0"),
    ({"data": {"teacher_temperature": 0}}, r"data.teacher_temperature=0.0 must be > 0"),
    ({"data": {"shift_windows": True, "teacher_rows": 4}}, r"data.shift_windows=true with data.teacher_rows=4 is no"),
    ({"data": {"shift_windows": "yes"}}, r"data.shift_windows must be a bool, got str"),
])
def test_config_validation_errors(data, match):
    with pytest.raises(ConfigError, match=match):
        recipe_from_dict(data)


def test_overrides_set_values_at_any_depth(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {name: tiny_llama}\nconvert: {backend: race, options: {num_planes: 4}}\n"
                    "fine_tune: {lr: 0.0001}\n")
    recipe = load_recipe(path, ["fine_tune.lr=3e-4", "convert.options.num_tables=8", "transfer.train=[q_proj]",
                                "data.train_unit=sentences", "seed=7", "calibrate.race_betas=null"])
    assert recipe.fine_tune.lr == 3e-4 and recipe.seed == 7 and recipe.transfer.train == ["q_proj"]
    assert recipe.convert.options == {"num_planes": 4, "num_tables": 8}
    assert recipe.data.train_unit == "sentences" and recipe.calibrate.race_betas is None
    assert load_recipe(path).fine_tune.lr == 1e-4, "the file is not changed"


@pytest.mark.parametrize("override, match", [
    ("fine_tune.lr", r"--set 'fine_tune.lr': expected section.key=value"),
    ("fine_tune..lr=1", r"--set 'fine_tune..lr=1': expected section.key=value"),
    ("fine_tune.lr=[1", r"--set 'fine_tune.lr=\[1': the value is not valid YAML"),
    ("seed.x=1", r"--set 'seed.x=1': seed is 0, not a mapping"),
    ("fine_tune.lrr=1", r"unknown key\(s\) \['lrr'\] in fine_tune"),
    ("fine_tune.steps=many", r"fine_tune.steps must be an int, got str"),
])
def test_override_errors_name_the_entry(tmp_path, override, match):
    path = tmp_path / "r.yaml"
    path.write_text("model: {name: tiny_llama}\nseed: 0\n")
    with pytest.raises(ConfigError, match=match):
        load_recipe(path, [override])


def test_unquoted_yaml_no_means_no_mixed_precision(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {name: tiny_llama}\ntrain: {mixed_precision: no}\n")
    assert load_recipe(path).train.mixed_precision == "no"


def test_exponent_without_dot_is_a_float(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("model: {name: tiny_llama}\nfine_tune: {lr: 3e-4}\ntransfer: {lr: 1E-2, train: [q_proj], "
                    "train_lr: 1e-3}\n")
    recipe = load_recipe(path)  # PyYAML reads 3e-4 as a string
    assert recipe.fine_tune.lr == 3e-4 and recipe.transfer.lr == 1e-2 and recipe.transfer.train_lr == 1e-3
    with pytest.raises(ConfigError, match=r"fine_tune.lr must be a float, got str \('fast'\)"):
        load_recipe(path, ["fine_tune.lr=fast"])


def test_rows_never_cross_documents():
    tok = ByteTokenizer()
    # each document uses its own letter, with lengths around and across the row length
    docs = [chr(ord("a") + i) * n for i, n in enumerate([3, 7, 8, 9, 20, 1])]
    rows = tokenize_rows(docs, tok, seq_len=8)
    ids, mask, labels = rows["input_ids"], rows["attention_mask"], rows["labels"]
    assert ids.shape[1] == 8
    rebuilt = {}
    for r in range(len(ids)):
        n = int(mask[r].sum())
        assert bool(mask[r, :n].all()) and not bool(mask[r, n:].any()), "padding only at the end"
        assert bool((ids[r, n:] == tok.pad_token_id).all()) and bool((labels[r, n:] == -100).all())
        real = ids[r, :n].tolist()
        letters = {t for t in real if t != tok.bos_token_id}
        doc = int(rows["doc_index"][r])
        assert letters <= {ord(docs[doc][0]) + 3}, f"row {r} mixes documents"
        rebuilt.setdefault(doc, []).extend(real)
    for d, text in enumerate(docs):  # every document is whole, in order (a 1-token tail row is dropped)
        full = tok.encode(text)
        kept = full if len(full) % 8 != 1 else full[:-1]
        assert rebuilt.get(d, []) == kept


@pytest.mark.parametrize("length", [1, 2, 9, 16, 17, 40])
def test_shifted_row_starts_keep_the_count_and_the_first_row(length):
    plain = row_starts(length, 8)
    assert plain == [start for start in range(0, length, 8) if length - start >= 2]  # tokenize_rows' rows
    for shift in range(8):
        starts = row_starts(length, 8, shift=shift)
        assert len(starts) == len(plain) and starts[:1] == plain[:1]
        assert all(b - a == (8 - shift if a == 0 else 8) for a, b in zip(starts, starts[1:]))
        assert all(length - start >= 2 for start in starts)  # every row keeps >= min_tokens real tokens


def test_shifted_rows_move_every_epoch_within_their_documents():
    tok = ByteTokenizer()
    docs = [text[:n] for text, n in zip(load_documents("news", 5), [3, 40, 200, 333, 90])]
    rows = ShiftedRows(docs, tok, seq_len=32, seed=7)
    plain = tokenize_rows(docs, tok, 32)
    assert torch.equal(rows.rows["input_ids"], plain["input_ids"])  # epoch 0: the unshifted rows
    seen = []
    for epoch in (1, 2, 1):
        rows.set_epoch(epoch)
        ids, mask = rows.rows["input_ids"], rows.rows["attention_mask"]
        assert len(rows) == len(plain["input_ids"]) and torch.equal(rows.rows["labels"], ids.masked_fill(mask == 0, -100))
        for r, d in enumerate(plain["doc_index"].tolist()):  # each row: a slice of its own document
            n = int(mask[r].sum())
            real, full = ids[r, :n].tolist(), tok.encode(docs[d])
            assert any(full[i:i + n] == real for i in range(len(full) - n + 1)), f"epoch {epoch} row {r}"
            if r == 0 or plain["doc_index"][r - 1] != d:
                assert real == full[:n], "a document's first row starts at its start"
        seen.append(ids.clone())
    assert not torch.equal(seen[0], plain["input_ids"]) and not torch.equal(seen[0], seen[1])
    assert torch.equal(seen[0], seen[2]), "the rows depend on (seed, epoch) only"
    rows.set_epoch(0)
    assert torch.equal(rows.rows["input_ids"], plain["input_ids"])


def test_split_sentences_keeps_closing_quotes_and_numbers():
    text = ('Profits rose 1.5% to $1.13bn. "We are pleased," he said. Was it "luck"? No!\n\n'
            '(A new paragraph.) 3 firms\nfollowed.')
    assert split_sentences(text) == ['Profits rose 1.5% to $1.13bn.', '"We are pleased," he said.',
                                     'Was it "luck"?', 'No!', '(A new paragraph.)', '3 firms followed.']


def test_sentence_rows_hold_one_sentence_each():
    docs = load_documents("news", 2)
    sentences = texts_in_unit(docs, "sentences")
    assert sentences == split_sentences(docs[0]) + split_sentences(docs[1])
    assert texts_in_unit(docs, "rows") == docs
    tok = ByteTokenizer()
    rows = tokenize_rows(sentences, tok, 1024)
    assert len(rows["input_ids"]) == len(sentences) > 10
    assert rows["attention_mask"].sum(1).tolist() == [len(encode(tok, x)) for x in sentences]


def test_load_documents_from_local_files(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"body": "first doc"}\n\n{"body": "second"}\n{"body": "third one"}\n')
    assert load_documents(str(jsonl), 2, text_field="body") == ["first doc", "second"]
    assert load_documents(str(jsonl), 2, text_field="body", min_chars=7) == ["first doc", "third one"]
    txt = tmp_path / "docs.txt"
    txt.write_text("one\n\ntwo\nthree\n")
    assert load_documents(str(txt), 3) == ["one", "two", "three"]
    with pytest.raises(ValueError, match="has 3 documents"):
        load_documents(str(txt), 4)
    with pytest.raises(ValueError, match="text_field='text'"):
        load_documents(str(jsonl), 1)
    with pytest.raises(ValueError, match="not supported"):
        load_documents(str(tmp_path / "missing.csv"), 1)
    train, held = split_documents([str(i) for i in range(10)], 3)
    assert held == ["2", "5", "8"] and len(train) == 7 and not set(train) & set(held)


def peaked_tiny_llama():
    model, tok, causal = load_model("tiny_llama")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(12.0)
    return model, tok, causal


def loader(tok, n=8):
    rows = tokenize_rows(load_documents("news", 4), tok, 32)
    data = [{k: v[i] for k, v in rows.items() if k != "doc_index"} for i in range(min(n, len(rows["input_ids"])))]
    return torch.utils.data.DataLoader(data, batch_size=4)


def test_attention_transfer_and_lm_loss_decrease():
    model, tok, causal = peaked_tiny_llama()
    assert causal
    student = hfab.convert(model, "race", num_planes=2, num_tables=2, per_head_beta=True)
    accelerator = Accelerator(cpu=True)
    recipe = Recipe()
    recipe.train.log_every = 100
    batches = loader(tok, n=4)  # one fixed batch: the losses of successive steps are comparable
    params = trainable(student, ["k_proj"])  # k_proj also exercises the teacher's frozen snapshot
    assert {n.rsplit(".", 1)[-1] for n, p in student.named_parameters() if p.requires_grad} == {"hfab_beta", "weight"}
    with TeacherForcing(student) as forcing:
        def transfer_loss(wrapped, batch):
            forcing.token_mask, forcing.terms = batch["attention_mask"], {}
            wrapped(**forward_kwargs(student, batch))
            return sum(forcing.losses().values()) / len(forcing.terms)

        _, losses, _ = run_stage("transfer", accelerator, student, params, transfer_loss, batches, 12, 0.1, recipe,
                                 None, None)
    assert len(losses) == 12
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses

    def lm_loss(wrapped, batch):
        nll, count = next_token_nll(wrapped(**forward_kwargs(student, batch)).logits, batch["labels"])
        return nll / count

    student.requires_grad_(True)
    params = list(student.parameters())
    _, losses, _ = run_stage("fine_tune", accelerator, student, params, lm_loss, batches, 8, 3e-3, recipe,
                             None, None)
    assert losses[-1] < 0.9 * losses[0], losses


def test_embedding_loss_is_one_minus_the_pooled_cosine():
    """Against a per-row float64 loop: padding is left out of the mean pool, a row without real tokens counts for
    nothing, identical outputs give 0."""
    g = torch.Generator().manual_seed(0)
    h, r = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    expected = []
    for row in range(2):
        keep = mask[row].bool()
        a, b = h[row, keep].double().mean(0), r[row, keep].double().mean(0)
        expected.append(1 - float(a @ b / (a.norm() * b.norm())))
    out, ref = BaseModelOutput(last_hidden_state=h), BaseModelOutput(last_hidden_state=r)
    accelerator = Accelerator(cpu=True)
    assert float(embedding_loss(accelerator, out, ref, mask)) == pytest.approx(sum(expected) / 2, rel=1e-5)
    assert abs(float(embedding_loss(accelerator, out, out, mask))) < 1e-6


def test_drop_unused_freezes_what_the_loss_never_reaches_and_keeps_rng_and_grads_clean():
    teacher, tok, _ = load_model("tiny_bert", seed=1)
    student = hfab.convert(load_model("tiny_bert")[0], "nystrom", num_landmarks=4, conv_kernel_size=3)
    student.head = torch.nn.Linear(4, 4)  # like MiniLM's pooler: outside the embedding loss
    accelerator = Accelerator(cpu=True)
    student.requires_grad_(True)
    params = list(student.parameters())
    batch = next(iter(loader(tok, n=4)))

    def loss_fn(wrapped, batch):
        kwargs = forward_kwargs(student, batch)
        with torch.no_grad():
            ref = teacher(**kwargs)
        return embedding_loss(accelerator, wrapped(**kwargs), ref, batch["attention_mask"])

    rng = torch.get_rng_state()
    used, unused = drop_unused(accelerator, student, params, loss_fn, batch)
    assert sorted(unused) == ["head.bias", "head.weight"]
    assert len(used) == len(params) - 2 and all(p.requires_grad for p in used)
    assert not student.head.weight.requires_grad and not student.head.bias.requires_grad
    assert all(p.grad is None for p in params) and torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("metric, scores, best_step", [("ppl", [5.0, 3.0, 4.0], 4), ("cosine", [0.5, 0.7, 0.9], 6)])
def test_keep_best_ends_the_stage_with_the_parameters_of_its_best_evaluation(metric, scores, best_step):
    """Evaluations at steps 2 and 4 (eval_every) and 6 (the last step, keep_best): the stage must end with the
    parameters the evaluation saw at the best one (lowest perplexity, highest cosine), not the last step's."""
    model, tok, _ = load_model("tiny_llama")
    student = hfab.convert(model, "race", num_planes=2, num_tables=2)
    student.requires_grad_(True)
    recipe = Recipe()
    recipe.train.log_every, recipe.train.eval_every = 100, 2
    seen, steps = {}, iter([2, 4, 6])

    def evaluate_fn(wrapped):
        step = next(steps)
        seen[step] = {n: p.detach().clone() for n, p in wrapped.named_parameters()}
        return {metric: scores[step // 2 - 1]}

    def lm_loss(wrapped, batch):
        nll, count = next_token_nll(wrapped(**forward_kwargs(student, batch)).logits, batch["labels"])
        return nll / count

    wrapped, _, best = run_stage("fine_tune", Accelerator(cpu=True), student, list(student.parameters()), lm_loss,
                                 loader(tok, n=4), 6, 3e-3, recipe, None, evaluate_fn, keep_best=True)
    assert sorted(seen) == [2, 4, 6] and best.step == best_step
    assert not torch.equal(seen[best_step]["lm_head.weight"], seen[2]["lm_head.weight"])  # training moved it
    for name, p in wrapped.named_parameters():
        assert torch.equal(p, seen[best_step][name]), name


def test_embedding_loss_trains_a_converted_encoder_towards_its_teacher():
    """A teacher with other weights (seed 1), so that the loss starts far from 0; dropout off: every step is exact."""
    teacher, tok, causal = load_model("tiny_bert", seed=1)
    assert not causal
    student = hfab.convert(load_model("tiny_bert")[0], "nystrom", num_landmarks=4, conv_kernel_size=3)
    for module in student.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    accelerator = Accelerator(cpu=True)
    recipe = Recipe()
    recipe.train.log_every = 100

    def loss_fn(wrapped, batch):
        kwargs = forward_kwargs(student, batch)
        with torch.no_grad():
            ref = teacher(**kwargs)
        return embedding_loss(accelerator, wrapped(**kwargs), ref, batch["attention_mask"])

    student.requires_grad_(True)
    _, losses, _ = run_stage("fine_tune", accelerator, student, list(student.parameters()), loss_fn,
                             loader(tok, n=4), 8, 3e-3, recipe, None, None)
    assert losses[0] > 0.5 and all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.1, losses


def test_transfer_trains_named_parameters_of_converted_layers_only():
    model, _, _ = load_model("tiny_llama")
    student = hfab.convert(model, "race", [1], num_planes=2, num_tables=2)  # layer 0 stays softmax
    params = trainable(student, ["k_proj"], within=[m for _, m in converted_layers(student)])
    names = {n for n, p in student.named_parameters() if p.requires_grad and "hfab_" not in n}
    assert names == {"model.layers.1.self_attn.k_proj.weight"} and len(params) == 1 + sum(
        "hfab_" in n for n, _ in student.named_parameters()), names
    trainable(student, ["k_proj"])
    assert student.get_parameter("model.layers.0.self_attn.k_proj.weight").requires_grad


def test_named_parameters_take_their_own_learning_rate():
    model, tok, _ = load_model("tiny_llama")
    student = hfab.convert(model, "race", num_planes=2, num_tables=2, per_head_beta=True)
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    groups = lr_groups(student, trainable(student, ["k_proj"]), 1e-5)
    assert [len(g["params"]) for g in groups] == [2, 2] and "lr" not in groups[0] and groups[1]["lr"] == 1e-5

    def loss_fn(wrapped, batch):
        return wrapped(**forward_kwargs(student, batch)).logits.float().pow(2).mean()

    run_stage("transfer", Accelerator(cpu=True), student, groups, loss_fn, loader(tok, n=4), 1, 0.1, Recipe(),
              None, None)
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in student.named_parameters()}
    # Adam's first step moves every parameter with a gradient by its learning rate
    assert all(0.09 < moved[n] <= 0.1 + 1e-6 for n in moved if "hfab_beta" in n), moved
    assert all(5e-6 < moved[n] <= 1e-5 + 1e-9 for n in moved if "k_proj" in n), moved
    assert all(moved[n] == 0 for n in moved if "q_proj" in n), moved


def test_stage_without_trainable_parameters_is_refused():
    model, tok, _ = load_model("tiny_llama")
    student = hfab.convert(model, "stieltjes")
    with pytest.raises(ConfigError, match="no parameter is trainable"):
        run_stage("transfer", Accelerator(cpu=True), student, trainable(student), None, loader(tok), 2, 0.1,
                  Recipe(), None, None)


def tiny_rows(seq_len=32, documents=4):
    return tokenize_rows(load_documents("news", documents), ByteTokenizer(), seq_len)


def test_teacher_rows_continue_their_prompts_and_repeat_with_the_seed():
    model, tokenizer, _ = load_model("tiny_llama")
    rows = tiny_rows()
    prompts = pick_prompts(rows, 10, 8, seed=0)
    assert prompts.shape == (10, 8)
    real = {tuple(r[:8].tolist()) for r, m in zip(rows["input_ids"], rows["attention_mask"]) if m[:8].all()}
    assert {tuple(p.tolist()) for p in prompts} <= real
    a = sample_rows(model, prompts, 32, batch=4, seed=1, pad_token_id=0, progress=False)
    c = sample_rows(model, prompts, 32, batch=4, seed=2, pad_token_id=0, progress=False)
    assert a["input_ids"].shape == (10, 32) and torch.equal(a["input_ids"][:, :8], prompts)
    assert torch.equal(a["attention_mask"], torch.ones(10, 32, dtype=torch.long))
    assert torch.equal(a["labels"], a["input_ids"])
    assert not torch.equal(a["input_ids"], c["input_ids"])
    assert torch.equal(a["input_ids"], sample_rows(model, prompts, 32, batch=4, seed=1, pad_token_id=0,
                                                   progress=False)["input_ids"])
    merged = concat_rows(rows, a)
    assert merged.keys() == a.keys() and len(merged["input_ids"]) == len(rows["input_ids"]) + 10


class EosAfter(torch.nn.Module):
    """A stand-in causal LM whose next token is 5 for ``k`` steps after the prompt, then always eos (2)."""

    def __init__(self, k: int, vocab: int = 8):
        super().__init__()
        self.k, self.vocab = k, vocab
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        step = 0 if past_key_values is None else past_key_values + 1
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits[..., 5 if step < self.k else 2] = 0.0
        return type("Out", (), {"logits": logits, "past_key_values": step})()


def test_teacher_rows_after_a_sampled_eos_are_padding():
    prompts = torch.tensor([[1, 7, 7], [1, 6, 6]])
    rows = sample_rows(EosAfter(2), prompts, 8, pad_token_id=0, eos_token_id=2, progress=False)
    assert rows["input_ids"].tolist() == [[1, 7, 7, 5, 5, 2, 0, 0], [1, 6, 6, 5, 5, 2, 0, 0]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]] * 2
    assert rows["labels"][:, 6:].eq(-100).all() and rows["labels"][:, :6].equal(rows["input_ids"][:, :6])
    with pytest.raises(ValueError, match="data.teacher_prompt=40: no training row"):
        pick_prompts(tiny_rows(seq_len=32), 1, 40, seed=0)


def test_run_trains_on_teacher_rows_and_reads_them_back_on_a_second_run(tmp_path):
    def recipe():
        r = smoke_recipe(tmp_path / "run", save_every=0)
        r.transfer.steps, r.fine_tune.steps, r.calibrate.enabled, r.train.plot = 1, 1, False, False
        r.data.teacher_rows, r.data.teacher_prompt, r.data.teacher_batch = 6, 8, 4
        return r

    run(recipe())
    cache = tmp_path / "run" / "teacher_rows.pt"
    saved = torch.load(cache)
    assert saved["settings"]["rows"] == 6 and saved["rows"]["input_ids"].shape == (6, 32)
    events = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    data = next(e for e in events if e.get("event") == "data")
    train_docs, _ = split_documents(load_documents("news", 8), 2)  # the smoke recipe's documents
    real_rows = len(tokenize_rows(train_docs, ByteTokenizer(), 32)["input_ids"])
    assert data["teacher_rows"] == 6 and data["train_rows"] == real_rows + 6
    assert sum(e.get("event") == "teacher_rows" for e in events) == 1
    stamp = cache.stat().st_mtime_ns
    run(recipe())
    assert cache.stat().st_mtime_ns == stamp, "the second run sampled again instead of reading the cache"
    other = recipe()
    other.data.teacher_prompt = 6  # other prompts: the cached rows no longer apply
    run(other)
    resampled = torch.load(cache)
    assert resampled["settings"]["prompts"] != saved["settings"]["prompts"]
    assert not torch.equal(resampled["rows"]["input_ids"], saved["rows"]["input_ids"])


@pytest.mark.slow
def test_train_script_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(ROOT / "finetune" / "train.py"), "--config", str(SMOKE),
                           "--output-dir", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {"teacher", "converted", "calibrated", "transfer", "fine_tune", "final"} <= set(summary)
    assert summary["final"]["ppl"] > 1
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    stages = {r.get("stage") for r in records}
    assert {"converted", "calibrate", "transfer", "fine_tune", "final"} <= stages
    assert [r["step"] for r in records if r.get("stage") == "fine_tune" and "loss" in r] == [1, 2, 3]
    for name in ("transfer", "final"):
        loaded = hfab.from_pretrained(out / name)
        assert loaded.config.hfab_plan["backend"] == "race"
    probe = torch.load(out / "probe.pt")
    with torch.no_grad():
        again = loaded.eval()(**probe["inputs"]).logits
    assert torch.equal(again, probe["output"]), "the saved model does not reload bitwise"


def smoke_recipe(out_dir, **train):
    recipe = load_recipe(SMOKE)
    recipe.output_dir = str(out_dir)
    recipe.train.save_every, recipe.train.keep_checkpoints = 2, 0
    for key, value in train.items():
        setattr(recipe.train, key, value)
    return recipe


def comparable(rows):
    """The log rows without the wall-clock columns."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("keep_best", [False, True])
def test_checkpoint_resumes_to_the_identical_next_step(tmp_path, monkeypatch, keep_best):
    # one run: 3 transfer + 3 fine-tune steps, checkpoints at step 2 and 3 of each stage, calibration first;
    # keep_best: the fine-tune checkpoints also carry the parameters of the best evaluation so far. The smoke run
    # improves at every step, so "best" is made the highest perplexity: step 2's parameters, which the resume from
    # fine_tune-000002 must read from that checkpoint to end where the first run ended.
    if keep_best:
        monkeypatch.setattr(BestKeeper, "score", staticmethod(lambda metrics: metrics["ppl"]))

    def recipe(out_dir):
        # an evaluation mid-transfer, on batches smaller than training's
        r = smoke_recipe(out_dir, eval_every=2, keep_best=keep_best)
        r.data.eval_batch_size = 3
        return r

    first = tmp_path / "first"
    summary = run(recipe(first))
    assert summary["fine_tune"].get("kept_best", {}).get("step") == (2 if keep_best else None)
    rows = read_csv(first / "log.csv")
    names = [p.name for p in list_checkpoints(first)]
    assert names == ["transfer-000002", "transfer-000003", "fine_tune-000002", "fine_tune-000003"]
    assert resolve_resume("latest", first).name == "fine_tune-000003"
    # a fresh run resumed from transfer step 2 redoes transfer step 3 and all of fine-tuning bitwise
    for checkpoint in ("transfer-000002", "fine_tune-000002"):
        again = tmp_path / checkpoint
        shutil.copytree(first, again)
        resumed = run(recipe(again), resume=str(again / "checkpoints" / checkpoint))
        assert comparable(read_csv(again / "log.csv")) == comparable(rows), checkpoint
        assert resumed == summary
        assert torch.equal(torch.load(again / "probe.pt")["output"], torch.load(first / "probe.pt")["output"])
    losses = {(r["stage"], r["step"]): r["loss"] for r in rows if "loss" in r}
    assert set(losses) == {(s, float(i)) for s in ("transfer", "fine_tune") for i in (1, 2, 3)}
    assert list(read_csv(first / "log.csv")[0]) == ["step", "stage", "ppl", "elapsed_s"]  # teacher row
    assert (first / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_keep_softmax_trains_the_hybrid_plan_chosen_by_calibration_and_resumes_it(tmp_path):
    """convert.keep_softmax: 1 on the 2-layer smoke model: the layer with the larger error after calibrating both
    (the logged all-layer report) stays on softmax, the other one is converted, calibrated, trained and saved as the
    plan; a resume from a transfer checkpoint rebuilds the same plan (from the checkpoint's summary) and ends bitwise
    where the first run ended."""
    def recipe(out_dir):
        r = smoke_recipe(out_dir, plot=False)
        r.convert.keep_softmax = 1
        return r

    first = tmp_path / "first"
    summary = run(recipe(first))
    records = [json.loads(line) for line in (first / "log.jsonl").read_text().splitlines()]
    (report,) = [r["report"] for r in records if r.get("event") == "plan_calibration"]
    errors = {int(idx): err for idx, err in report["after"].items()}
    assert sorted(errors) == [0, 1] and summary["kept_softmax"] == [max(errors, key=errors.get)]
    (plan,) = [r for r in records if r.get("event") == "plan"]
    assert plan["converted"] == [1 - summary["kept_softmax"][0]]
    assert sorted(int(i) for i in json.loads((first / "calibration.json").read_text())["after"]) == plan["converted"]
    loaded = hfab.from_pretrained(first / "final")
    assert [idx for idx, _ in converted_layers(loaded)] == plan["converted"]
    again = tmp_path / "again"
    shutil.copytree(first, again)
    assert run(recipe(again), resume=str(again / "checkpoints" / "transfer-000002")) == summary
    assert comparable(read_csv(again / "log.csv")) == comparable(read_csv(first / "log.csv"))


def test_worst_layers_and_keep_softmax_validation():
    from hf_attention_backends.calibrate import worst_layers

    report = {"after": {0: 0.5, 3: 2.0, 5: 2.0, 7: 0.1}}
    assert worst_layers(report, 0) == [] and worst_layers(report, 1) == [3] and worst_layers(report, 3) == [0, 3, 5]
    for bad in (4, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"must be an int in \[0, 4\)"):
            worst_layers(report, bad)
    with pytest.raises(ConfigError, match="convert.keep_softmax=2 picks the layers by their calibrated error"):
        recipe_from_dict({"convert": {"keep_softmax": 2}, "calibrate": {"enabled": False}})
    with pytest.raises(ConfigError, match="convert.keep_softmax=2 must be smaller than the 2 layers"):
        recipe_from_dict({"convert": {"keep_softmax": 2, "layers": [0, 1]}, "calibrate": {"enabled": True}})
    with pytest.raises(ConfigError, match="convert.keep_softmax=-1 must be >= 0"):
        recipe_from_dict({"convert": {"keep_softmax": -1}, "calibrate": {"enabled": True}})


@pytest.mark.slow
@pytest.mark.parametrize("shift", [True, False])
def test_resume_past_the_first_epoch_with_and_without_shifted_windows(tmp_path, shift):
    """Two documents in 8 rows of 512 tokens, batches of 4: each stage's 5 steps pass epochs 0, 1 and 2; a resume
    inside epoch 1 of the fine-tune stage ends bitwise where the uninterrupted run ended (with and without shifted
    windows: accelerate's loader once replayed epoch 0's order there), and from epoch 1 on the shifted run trains
    on other rows than the plain one."""
    def recipe(out_dir, shift):
        r = smoke_recipe(out_dir, plot=False)
        r.data.documents, r.data.eval_documents, r.data.seq_len = 2, 1, 512
        r.data.batch_size, r.data.eval_batch_size, r.data.shift_windows = 4, 4, shift
        r.transfer.steps = r.fine_tune.steps = 5
        r.train.save_every = 3
        return r

    first = tmp_path / "first"
    summary = run(recipe(first, shift))
    events = [json.loads(line) for line in (first / "log.jsonl").read_text().splitlines()]
    assert next(e for e in events if e.get("event") == "data")["train_rows"] == 8
    again = tmp_path / "again"
    shutil.copytree(first, again)
    assert run(recipe(again, shift), resume=str(again / "checkpoints" / "fine_tune-000003")) == summary
    assert comparable(read_csv(again / "log.csv")) == comparable(read_csv(first / "log.csv"))
    assert torch.equal(torch.load(again / "probe.pt")["output"], torch.load(first / "probe.pt")["output"])
    if not shift:
        return
    plain = tmp_path / "plain"
    run(recipe(plain, False))
    losses = [[r["loss"] for r in read_csv(path / "log.csv") if r.get("stage") == "transfer" and r.get("loss")]
              for path in (first, plain)]
    assert losses[0][:2] == losses[1][:2], "epoch 0 has the plain rows"
    assert all(a != b for a, b in zip(losses[0][2:], losses[1][2:]))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "lora"])
def test_fsdp_path_trains_like_one_process(tmp_path, monkeypatch, method):
    """The FSDP-only steps (student graph through teacher forcing, 0 x output in the transfer loss, the fine-tune
    stage restarted from the saved transfer model, LoRA merged on an unsharded copy) leave every logged value and
    the final model as without them; on one CPU process."""
    import finetune.train as train_module

    def recipe(out_dir):
        r = smoke_recipe(out_dir)
        r.fine_tune.method = method
        return r

    run(recipe(tmp_path / "plain"))
    monkeypatch.setattr(train_module, "uses_fsdp", lambda accelerator: True)
    run(recipe(tmp_path / "fsdp"))
    assert comparable(read_csv(tmp_path / "fsdp" / "log.csv")) == comparable(read_csv(tmp_path / "plain" / "log.csv"))
    assert torch.equal(torch.load(tmp_path / "fsdp" / "probe.pt")["output"],
                       torch.load(tmp_path / "plain" / "probe.pt")["output"])


def test_run_log_csv_resume_truncates_and_tensorboard_error(tmp_path, monkeypatch):
    log = RunLog(tmp_path, True)
    log.metrics("converted", 0, eval={"ppl": 9.0})
    for step in (1, 2, 3):
        log.metrics("transfer", step, loss=1.0 / step, lr=0.1, grad_norm=0.5, tokens_per_s=10.0)
    log.metrics("fine_tune", 1, loss=0.1)
    with open(tmp_path / "log.csv") as f:
        assert f.readline().strip() == ",".join(CSV_COLUMNS)
    RunLog(tmp_path, True, resume_at=("transfer", 2))  # rows after transfer step 2 are rewritten by the resume
    assert [(r["stage"], r["step"]) for r in read_csv(tmp_path / "log.csv")] == [("converted", 0), ("transfer", 1),
                                                                                 ("transfer", 2)]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ConfigError, match="train.tensorboard=true but the tensorboard package is not importable"):
        RunLog(tmp_path / "tb", True, tensorboard=True)


def test_epoch_sampler_and_resume_checks(tmp_path):
    sampler = EpochSampler(10, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(10)) and list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first and list(EpochSampler(10, seed=3)) == first
    state = {"num_processes": 1, "batch_size": 4, "grad_accum": 1, "sampler_seed": 0}
    check_compatible(state, num_processes=1, batch_size=4, grad_accum=1, seed=0)
    with pytest.raises(ValueError, match="num_processes was 1, now 2"):
        check_compatible(state, num_processes=2, batch_size=4, grad_accum=1, seed=0)
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_resume("latest", tmp_path)
    with pytest.raises(ValueError, match="is not a checkpoint folder"):
        resolve_resume(str(tmp_path), tmp_path)


def test_hfab_finetune_command_errors(tmp_path, capsys):
    from hf_attention_backends import cli

    assert Path(cli.finetune_module().__file__).resolve() == Path(sys.modules[run.__module__].__file__).resolve()
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {save_every: -1}\n")
    assert cli.main(["finetune", "--config", str(bad)]) == 2
    assert "train.save_every=-1 must be >= 0" in capsys.readouterr().err
    assert cli.main(["finetune", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "is neither a file nor a bundled recipe" in capsys.readouterr().err
    assert cli.main(["finetune"]) == 2
    assert "needs --config" in capsys.readouterr().err
    assert cli.main(["finetune", "--list"]) == 0
    listed = capsys.readouterr().out
    for kind in ("finetune", "accelerate"):
        for name, path in bundled_configs(kind).items():
            assert f"{name} " in listed and str(path) in listed and path.is_file()


def two_process_config(tmp_path) -> Path:
    """The smoke recipe with batch 2 and 2 micro-batches per step: on 2 processes the global batch of
    ``smoke_recipe(..., grad_accum=2)`` with ``data.batch_size = 4`` on one."""
    config = tmp_path / "two_processes.yaml"
    config.write_text(SMOKE.read_text().replace("  batch_size: 4\n", "  batch_size: 2\n")
                      .replace("grad_accum: 1", "grad_accum: 2") + "  plot: false\n")
    assert load_recipe(config).data.batch_size == 2 and load_recipe(config).train.grad_accum == 2
    return config


def launch_two_cpu_processes(script: Path, config: Path, out_dir: Path, *args: str, env: Optional[dict] = None):
    """``accelerate launch`` of ``script --config config --output-dir out_dir *args`` on 2 CPU (gloo) processes."""
    try:
        import accelerate.commands.launch  # noqa: F401
    except ImportError as err:
        pytest.fail(f"accelerate's launcher is a test dependency and cannot be imported: {err}")
    # accelerate's `--cpu` launches one process whatever --num_processes says; `--multi_gpu` runs torchrun,
    # and ACCELERATE_USE_CPU makes each process's Accelerator join a CPU (gloo) process group
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(script), "--config", str(config), "--output-dir", str(out_dir), *args],
                          cwd=out_dir.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def assert_same_curve(one_dir: Path, two_dir: Path, rel: float):
    """Same logged rows in the same order, and every loss, lr, grad norm and evaluation within ``rel``."""
    one, two = read_csv(one_dir / "log.csv"), read_csv(two_dir / "log.csv")
    # a second process running on its own would have written its rows too
    assert [(r["stage"], r["step"], sorted(r)) for r in two] == [(r["stage"], r["step"], sorted(r)) for r in one]
    losses = [(r["stage"], r["step"]) for r in one if "loss" in r]
    assert losses == [(s, float(i)) for s in ("transfer", "fine_tune") for i in (1, 2, 3)]
    for a, b in zip(one, two):
        for key in ("loss", "lr", "grad_norm", "ppl", "top1_agreement"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=0), (a["stage"], a["step"], key)


@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    """2 gloo processes × batch 2 vs 1 process × batch 4, both 2 micro-batches per step, same seed.

    Each step sees the same 8 rows (accelerate gives process i the batches i, i + 2, ... of the seeded order,
    so a global micro-batch is one batch of 4 in that order); only the fp32 summation and all-reduce order
    differ, ~1e-7 relative on CPU. Averaging per-process token means instead of the global token mean, or
    calibrating on different rows, shifts these losses by 7e-5 to 2e-3 relative; rtol 1e-5 separates both.
    """
    recipe = smoke_recipe(tmp_path / "one", save_every=0, grad_accum=2, plot=False)
    recipe.data.batch_size = 4
    run(recipe)
    launch_two_cpu_processes(ROOT / "finetune" / "train.py", two_process_config(tmp_path), tmp_path / "two")
    assert_same_curve(tmp_path / "one", tmp_path / "two", rel=1e-5)


def one_process_run(out_dir: Path, method: str, keep_best: bool):
    recipe = smoke_recipe(out_dir, save_every=2, grad_accum=2, plot=False, keep_best=keep_best,
                          eval_every=1 if keep_best else 0)
    recipe.data.batch_size = 4
    recipe.fine_tune.method = method
    run(recipe)


@pytest.mark.slow
@pytest.mark.parametrize("method, keep_best", [("full", True), ("lora", False)])
def test_fsdp2_two_processes_match_one_process_and_resume_exactly(tmp_path, monkeypatch, method, keep_best):
    """Real FSDP2 (``tests/fsdp_on_cpu.py``: DTensor shards over 2 gloo processes, batch 2 each) against one
    process with batch 4, 2 micro-batches per step either way: the logged curve within 1e-5 (the reduce-scatter's
    summation order is the only difference), the final model within 1e-4; full fine-tuning with ``keep_best``
    restoring each process's shards of a non-final step (the worst evaluation is made "best", as
    ``test_checkpoint_resumes_to_the_identical_next_step`` does); LoRA merged on the unsharded copy, then the fine-tune
    stage resumed from its step-2 checkpoint under FSDP bitwise equal to the uninterrupted FSDP run."""
    if keep_best:
        monkeypatch.setattr(BestKeeper, "score", staticmethod(lambda metrics: metrics["ppl"]))
    one_process_run(tmp_path / "one", method, keep_best)
    config = two_process_config(tmp_path)
    sets = ["--set", f"fine_tune.method={method}", "--set", "train.save_every=2", "--set", "train.keep_checkpoints=0"]
    if keep_best:
        sets += ["--set", "train.keep_best=true", "--set", "train.eval_every=1"]
    best_env = {"HFAB_TEST_BEST_IS_HIGHEST_PPL": "1" if keep_best else "0"}
    launcher = ROOT / "tests" / "fsdp_on_cpu.py"
    launch_two_cpu_processes(launcher, config, tmp_path / "fsdp", *sets, env=best_env)
    assert json.loads((tmp_path / "fsdp" / "log.jsonl").read_text().splitlines()[0])["launch"]["distributed"] == \
        "DistributedType.FSDP"
    assert_same_curve(tmp_path / "one", tmp_path / "fsdp", rel=1e-5)
    one_summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    fsdp_summary = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    if keep_best:
        assert one_summary["fine_tune"]["kept_best"]["step"] == fsdp_summary["fine_tune"]["kept_best"]["step"] < 3
    torch.testing.assert_close(torch.load(tmp_path / "fsdp" / "probe.pt")["output"],
                               torch.load(tmp_path / "one" / "probe.pt")["output"], rtol=1e-4, atol=1e-5)
    if not keep_best:
        again = tmp_path / "resumed"
        shutil.copytree(tmp_path / "fsdp", again)
        launch_two_cpu_processes(launcher, config, again, *sets, "--resume",
                                 str(again / "checkpoints" / "fine_tune-000002"), env=best_env)
        assert comparable(read_csv(again / "log.csv")) == comparable(read_csv(tmp_path / "fsdp" / "log.csv"))
        assert torch.equal(torch.load(again / "probe.pt")["output"], torch.load(tmp_path / "fsdp" / "probe.pt")["output"])


def _write_log(path: Path, rows: list) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = ["step,stage,loss,grad_norm,ppl"] + [",".join(str(x) for x in r) for r in rows]
    (path / "log.csv").write_text("\n".join(lines) + "\n")
    return path


def test_compare_runs_passes_within_rtol_and_fails_beyond_or_on_other_rows(tmp_path, capsys):
    from finetune import compare

    a = _write_log(tmp_path / "a", [(0, "teacher", "", "", 30.0), (2, "transfer", 1.0, 0.5, ""),
                                    (4, "transfer", 0.8, 0.4, "")])
    close = _write_log(tmp_path / "b", [(0, "teacher", "", "", 30.003), (2, "transfer", 1.001, 0.5, ""),
                                        (4, "transfer", 0.8008, 0.4002, "")])
    far = _write_log(tmp_path / "c", [(0, "teacher", "", "", 30.0), (2, "transfer", 1.05, 0.5, ""),
                                      (4, "transfer", 0.8, 0.4, "")])
    short = _write_log(tmp_path / "d", [(0, "teacher", "", "", 30.0), (2, "transfer", 1.0, 0.5, "")])
    assert compare.main([str(a), str(close), "--rtol", "2e-3"]) == 0
    assert "loss 1.000e-03" in capsys.readouterr().out
    assert compare.main([str(a), str(far), "--rtol", "2e-3"]) == 1
    assert "above --rtol" in capsys.readouterr().err
    assert compare.main([str(a), str(short)]) == 1
    assert "different rows" in capsys.readouterr().err
    assert compare.main([str(a), str(tmp_path / "missing")]) == 2


def test_compare_window_averages_training_rows_per_stage(tmp_path, capsys):
    from finetune import compare

    rows = [(0, "teacher", "", "", 30.0), (1, "transfer", 1.0, 0.5, ""), (2, "transfer", 3.0, 0.5, ""),
            (3, "transfer", 5.0, 1.5, ""), (1, "fine_tune", 7.0, 2.0, ""), (1, "fine_tune", "", "", 20.0)]
    assert [(r["stage"], r["step"], r.get("loss"), r.get("ppl")) for r in
            compare.windowed(compare.read_csv(_write_log(tmp_path / "a", rows) / "log.csv"), 2)] == [
        ("teacher", 0, None, 30.0), ("transfer", 2, 2.0, None), ("transfer", 3, 5.0, None),
        ("fine_tune", 1, 7.0, None), ("fine_tune", 1, None, 20.0)]
    a = _write_log(tmp_path / "b", [(1, "transfer", 1.0, 0.5, ""), (2, "transfer", 3.0, 0.5, "")])
    swapped = _write_log(tmp_path / "c", [(1, "transfer", 3.0, 0.5, ""), (2, "transfer", 1.0, 0.5, "")])
    assert compare.main([str(a), str(swapped)]) == 1
    assert compare.main([str(a), str(swapped), "--window", "2"]) == 0
    with pytest.raises(SystemExit):
        compare.main([str(a), str(swapped), "--window", "0"])
    capsys.readouterr()


def test_finetune_device_script_returns_the_logs_of_a_run_cut_short(tmp_path):
    """scripts/finetune_device.sh copies each run's logs into $OUT while it trains, so a device call that ends before
    the runs do (its budget or time limit) still returns the steps logged so far: here the script and its run are
    killed in the fine-tune stage of a recipe far longer than the wait."""
    out, name = tmp_path / "out", "cut"
    env = {**os.environ, "OUT": str(out), "RUNS": str(tmp_path / "runs"), "LIMIT": "600", "BUILD": "0",
           "LAUNCH": sys.executable, "PYTHONPATH": str(ROOT),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    script = ROOT / "scripts" / "finetune_device.sh"
    proc = subprocess.Popen(["bash", str(script), str(SMOKE), name, "--set fine_tune.steps=100000"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    log = out / f"{name}_log.csv"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (
                log.exists() and ",fine_tune," in log.read_text()):
            time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert log.exists(), (out / f"{name}.out").read_text()[-2000:]
    assert ",fine_tune," in log.read_text() and not (out / f"finetune-{name}.tgz").exists()
