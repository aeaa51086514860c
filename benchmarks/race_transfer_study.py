"""How far attention transfer can bring one SmolLM2 layer on RACE, and whether the objective matters (CPU).

The recipes' transfer stage trains q_proj, k_proj and beta so that each converted layer's attention output matches
softmax's (MSE). Hedgehog-style distillation matches the attention rows instead (KL of the softmax row to RACE's
normalised kernel row). Per chosen layer this script captures the layer's inputs (hidden states after the input
norm, RoPE cos / sin) and its softmax output on ``--texts`` news articles (the last quarter held out), then trains a
copy of the layer's q_proj and k_proj (lr ``--lr``; beta per head at 1e-2; o_proj too for ``mse+o``) with Adam on
batches of 4 training rows for ``--steps`` steps, per objective:

- ``mse``: sum |O - O_softmax|^2 / sum |O_softmax|^2 of the layer output (what the transfer stage minimises);
- ``kl``: the mean over rows of KL(softmax row || RACE row), the teacher's rows from the original projections;
- ``mse+o``: ``mse`` with o_proj trainable as well (``transfer.train: [q_proj, k_proj, o_proj]``).

It prints the relative output error on the training and the held-out rows every 100 steps. Float32; RACE in the
library's feature map (``race_features``) and the layer's own planes (``make_planes(L, P, D, seed=layer)``), causal,
as the N x N kernel matrix.

    PYTHONPATH=. .venv/bin/python -m benchmarks.race_transfer_study [--layers 7 20] [--steps 600] [--texts 32]
"""
from __future__ import annotations

import argparse
import copy
import json
from typing import Optional

import torch
from torch import Tensor, nn

OBJECTIVES = ("mse", "kl", "mse+o")


def capture_layer(model, batch: dict, layer: int) -> dict[str, Tensor]:
    """The inputs and output of ``model.model.layers[layer].self_attn`` in one forward: hidden (B, N, C), cos, sin
    (RoPE), out (B, N, C)."""
    module = model.model.layers[layer].self_attn
    captured = {}

    def before(_, args, kwargs):
        captured["hidden"] = kwargs["hidden_states"].detach()
        captured["cos"], captured["sin"] = (t.detach() for t in kwargs["position_embeddings"])

    def after(_, args, kwargs, output):
        captured["out"] = output[0].detach()

    handles = [module.register_forward_pre_hook(before, with_kwargs=True),
               module.register_forward_hook(after, with_kwargs=True)]
    try:
        with torch.no_grad():
            model(**batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured


class LayerStudent(nn.Module):
    """A Llama attention layer on causal RACE with its own copies of q_proj, k_proj and o_proj (v_proj shared, frozen)
    and a beta per query head."""

    def __init__(self, module, planes: Tensor, beta: float):
        super().__init__()
        config = module.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = module.head_dim
        self.q_proj, self.k_proj, self.o_proj = (copy.deepcopy(m) for m in (module.q_proj, module.k_proj, module.o_proj))
        self.v_proj = module.v_proj
        self.register_buffer("planes", planes)
        self.beta = nn.Parameter(torch.full((self.heads,), float(beta)))

    def heads_of(self, proj, x: Tensor, heads: int) -> Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """(output (B, N, C), RACE's attention rows (B, H, N, N))."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        from hf_attention_backends.ops.race.reference import race_features

        q = self.heads_of(self.q_proj, hidden, self.heads)
        k = self.heads_of(self.k_proj, hidden, self.kv_heads)
        v = self.heads_of(self.v_proj, hidden, self.kv_heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        w = (race_features(q, self.planes, self.beta) @ race_features(k, self.planes, self.beta).transpose(-1, -2))
        w = w.tril()
        rows = w / w.sum(-1, keepdim=True).clamp_min(1e-30)
        out = (rows @ v).transpose(1, 2).flatten(2)
        return self.o_proj(out), rows


def softmax_rows(module, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The layer's causal softmax attention rows (B, H, N, N) from its own projections."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = module.config
    b, n, _ = hidden.shape
    with torch.no_grad():
        q = module.q_proj(hidden).view(b, n, config.num_attention_heads, module.head_dim).transpose(1, 2)
        k = module.k_proj(hidden).view(b, n, config.num_key_value_heads, module.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(config.num_attention_heads // config.num_key_value_heads, 1)
        scores = (q @ k.transpose(-1, -2)) * module.scaling
        causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
        return torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)


def relative_error(student: LayerStudent, data: dict, rows: Tensor, chunk: int = 4) -> float:
    """sum |O - O_softmax|^2 / sum |O_softmax|^2 over ``rows`` of the captured batch."""
    err = ref = 0.0
    with torch.no_grad():
        for i in range(0, len(rows), chunk):
            sel = rows[i:i + chunk]
            out, _ = student(data["hidden"][sel], data["cos"], data["sin"])
            err += float(((out - data["out"][sel]) ** 2).sum())
            ref += float((data["out"][sel] ** 2).sum())
    return err / ref


def objective_loss(objective: str, out: Tensor, rows: Tensor, target_out: Tensor, target_rows: Tensor) -> Tensor:
    if objective == "kl":
        t = target_rows
        return (t * (t.clamp_min(1e-30).log() - rows.clamp_min(1e-30).log())).sum(-1).mean()
    return ((out - target_out) ** 2).sum() / (target_out ** 2).sum()


def transfer(module, data: dict, layer: int, objective: str, steps: int, lr: float, train_rows: Tensor,
             test_rows: Tensor, planes_per_table: int = 6, tables: int = 1, batch: int = 4, seed: int = 0,
             every: int = 100) -> list[dict]:
    """Train a LayerStudent of ``module`` towards the captured softmax layer; [{step, train, test}] every ``every``."""
    from hf_attention_backends import make_planes

    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is not supported; supported: {', '.join(OBJECTIVES)}")
    torch.manual_seed(seed)
    student = LayerStudent(module, make_planes(tables, planes_per_table, module.head_dim, seed=layer),
                           beta=2.0 * module.head_dim ** -0.5)
    target_rows = softmax_rows(module, data["hidden"], data["cos"], data["sin"]) if objective == "kl" else None
    projections = [*student.q_proj.parameters(), *student.k_proj.parameters()]
    if objective == "mse+o":
        projections += list(student.o_proj.parameters())
    for p in student.parameters():
        p.requires_grad_(False)
    for p in projections + [student.beta]:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam([{"params": [student.beta], "lr": 1e-2}, {"params": projections, "lr": lr}])
    curve = [{"step": 0, "train": relative_error(student, data, train_rows),
              "test": relative_error(student, data, test_rows)}]
    for step in range(1, steps + 1):
        sel = train_rows[torch.randint(0, len(train_rows), (batch,))]
        out, rows = student(data["hidden"][sel], data["cos"], data["sin"])
        loss = objective_loss(objective, out, rows, data["out"][sel],
                              None if target_rows is None else target_rows[sel])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            student.beta.clamp_(min=1e-4)
        if step % every == 0 or step == steps:
            curve.append({"step": step, "train": relative_error(student, data, train_rows),
                          "test": relative_error(student, data, test_rows)})
    return curve


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[7, 20])
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-4, help="q_proj, k_proj (and o_proj) learning rate")
    parser.add_argument("--texts", type=int, default=32, help="articles of --seq-len tokens; the last quarter held out")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--planes", type=int, default=6)
    parser.add_argument("--tables", type=int, default=1)
    parser.add_argument("--json", help="write every curve here")
    args = parser.parse_args(argv)
    if args.texts < 4:
        parser.error(f"--texts={args.texts} must be >= 4 (a quarter is held out)")
    from benchmarks.race_sink_study import full_articles
    from hf_attention_backends import models

    model, tokenizer = models.load_smollm2(attn_implementation="sdpa")
    batch = full_articles(tokenizer, args.texts, args.seq_len)
    held_out = args.texts // 4
    train_rows, test_rows = torch.arange(args.texts - held_out), torch.arange(args.texts - held_out, args.texts)
    curves = {}
    for layer in args.layers:
        data = capture_layer(model, batch, layer)
        for objective in args.objectives:
            curve = transfer(model.model.layers[layer].self_attn, data, layer, objective, args.steps, args.lr,
                             train_rows, test_rows, args.planes, args.tables)
            curves[f"{layer}/{objective}"] = curve
            print(f"layer {layer:>2} {objective:<6} " + "  ".join(
                f"{c['step']}: {c['train']:.3f}/{c['test']:.3f}" for c in curve), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "curves": curves}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
