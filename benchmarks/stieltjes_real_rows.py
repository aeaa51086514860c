"""Start values for the Stieltjes pole solver on REAL attention score rows (SmolLM2-135M, BBC news; CPU, float64).

Follow-up to ``benchmarks.stieltjes_fused_start`` (synthetic Gaussian rows), which found C_laplace (two online exp
sums in sweep 1, a quadrature-model start, then one clamped Halley step) within 1e-3 at order 4. Here the rows are
SmolLM2-135M-Instruct's own causal score rows:

- the model (fp32, ``load_smollm2``) runs ``--articles`` whole BBC news articles of at least ``--tokens`` tokens
  (single articles, evenly spaced over those long enough, truncated to ``--tokens``; fewer if fewer qualify);
- forward pre-hooks on ``self_attn`` of the chosen layers take its input hidden states and position embeddings and
  recompute q, k, v exactly as ``LlamaAttention.forward`` does (q_proj / k_proj / v_proj, transformers'
  ``apply_rotary_pos_emb``; GQA: k, v repeated per group like ``repeat_kv``), in fp32 as the model does; a forward
  hook checks, on the first article, that o_proj(softmax(q k^T / sqrt(D)) v) from them equals the module's output;
- score rows s_i = q_i . k_j / sqrt(D) (j <= i, causal) are formed in float64 for sampled positions i (every
  ``--stride``-th row ending at the last one, plus a few short rows), x = s - max s; v = the layer's value rows
  (float64, the head's kv group); rows of one length (all articles, layers, heads) are solved as one batch;
- per order: the exact root (``root_by_bisection``), then ref2 / jensen2 / ref3 / ref1 / C_laplace / C_top exactly
  as in ``stieltjes_fused_start.final_lambda`` and ``default`` (``solve_lambda`` with ``-default_newton_iter``: the
  library's default at that order, with its extra steps for rows whose last step was large), and the relative output error of each row (``output_error``'s formula,
  per row, with that row's own v).

Prints per order a table: layer, worst error per scheme and where (article, head, position), the share of rows
above 1e-3, and whether C_laplace's start ever left [1, n^(1/order)] or was not finite.

    PYTHONPATH=. .venv/bin/python -m benchmarks.stieltjes_real_rows [--tokens 1024] [--articles 4] [--stride 16]
"""
from __future__ import annotations

import argparse
import math
import time
from collections import defaultdict

import torch

from benchmarks.stieltjes_fused_start import first_iterate, final_lambda, laplace_start
from hf_attention_backends.ops.stieltjes.op import default_newton_iter
from hf_attention_backends.ops.stieltjes.reference import solve_lambda
from benchmarks.stieltjes_solver import extra_step_rows, output_error, root_by_bisection

SCHEME_NAMES = ("ref2", "jensen2", "ref3", "ref1", "C_laplace", "C_top", "default")
NO_START = ("ref2", "jensen2", "ref3", "default")  # schemes whose lambda_1 the report does not print
TOL = 1e-3


def pick_articles(tokenizer, n: int, tokens: int) -> tuple[list[torch.Tensor], int]:
    """n articles' first ``tokens`` ids, among the single articles with >= tokens tokens (evenly spaced); and how
    many qualified."""
    from hf_attention_backends.models import corpus

    _, texts = corpus("bbc")
    long = []
    for text in texts:
        if len(text) < 2.5 * tokens:  # ~4.3 chars per token in this corpus: these cannot reach ``tokens``
            continue
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() >= tokens:
            long.append(ids[:tokens])
    n = min(n, len(long))
    return [long[i * len(long) // n] for i in range(n)], len(long)


def capture_qkv(model, ids: torch.Tensor, layers, check: bool) -> tuple[dict, float]:
    """{layer: (q, k, v)} each (H, T, D) fp32, k and v repeated per kv group; and the largest relative difference
    between the module's output and one recomputed from them (nan if not checked)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    got, diffs, handles = {}, [], []

    def pre_hook(module, args, kwargs, layer):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hidden).view(shape).transpose(1, 2)
        k = module.k_proj(hidden).view(shape).transpose(1, 2)
        v = module.v_proj(hidden).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = module.num_key_value_groups
        got[layer] = (q[0].clone(), repeat_kv(k, groups)[0].clone(), repeat_kv(v, groups)[0].clone())

    def post_hook(module, args, kwargs, output, layer):
        q, k, v = (t.double() for t in got[layer])
        t = q.shape[1]
        s = q @ k.transpose(-1, -2) * module.scaling
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = (s.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)
        mine = o @ module.o_proj.weight.double().T
        theirs = output[0][0].double()
        diffs.append(((mine - theirs).norm(dim=-1) / theirs.norm(dim=-1)).max().item())

    for layer in layers:
        attn = model.model.layers[layer].self_attn
        handles.append(attn.register_forward_pre_hook(
            lambda m, a, kw, layer=layer: pre_hook(m, a, kw, layer), with_kwargs=True))
        if check:
            handles.append(attn.register_forward_hook(
                lambda m, a, kw, out, layer=layer: post_hook(m, a, kw, out, layer), with_kwargs=True))
    try:
        with torch.no_grad():
            model.model(input_ids=ids[None])  # the base model: the lm_head is not needed
    finally:
        for h in handles:
            h.remove()
    return got, (max(diffs) if diffs else float("nan"))


def row_errors(x: torch.Tensor, v: torch.Tensor, order: float, lam: torch.Tensor, exact: torch.Tensor):
    """``output_error`` per row, each row with its own v (rows, n, dv)."""
    def out(l):
        p = (l[:, None] - x).pow(-order)
        return torch.einsum("rn,rnd->rd", p, v) / p.sum(dim=-1, keepdim=True)
    o, oe = out(lam), out(exact)
    return (o - oe).norm(dim=-1) / oe.norm(dim=-1)


def positions(tokens: int, stride: int) -> list[int]:
    return sorted({0, 1, 3, 7, *range(stride - 1, tokens, stride), tokens - 1})


def extra_step_blocks(q: torch.Tensor, k: torch.Tensor, scale: float, order: float, windows: int = 4,
                      block: int = 64) -> tuple[float, float]:
    """(share of rows, share of query blocks) that the adaptive default sends to an extra step, over ``windows``
    blocks of ``block`` consecutive causal rows spread over the sequence, for every (article and layer, head) of q, k
    (A*L, H, T, D): a forward kernel block of such rows sweeps the keys once more when any of its rows does."""
    tokens = q.shape[2]
    starts = [block + i * (tokens - 2 * block) // max(1, windows - 1) for i in range(windows)]
    rows = blocks = 0
    for s0 in starts:
        hit = torch.zeros(q.shape[0] * q.shape[1], dtype=torch.bool)
        for i in range(s0, s0 + block):
            s = torch.einsum("bhd,bhnd->bhn", q[:, :, i], k[:, :, :i + 1]) * scale
            _, extra = extra_step_rows((s - s.max(dim=-1, keepdim=True).values).reshape(-1, i + 1), order)
            hit |= extra
            rows += int(extra.sum())
        blocks += int(hit.sum())
    return rows / (len(starts) * block * len(hit)), blocks / (len(starts) * len(hit))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per article (default 1024)")
    ap.add_argument("--articles", type=int, default=4, help="articles (default 4)")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 5, 10, 15, 20, 29])
    ap.add_argument("--stride", type=int, default=16, help="sample every stride-th row (default 16)")
    ap.add_argument("--orders", type=float, nargs="+", default=[4.0, 8.0])
    ap.add_argument("--bisect-steps", type=int, default=80, help="exact root: bisection steps (default 80)")
    ap.add_argument("--blocks", action="store_true",
                    help="also: rows and 64-row query blocks that the adaptive default steps again")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    from hf_attention_backends.models import load_smollm2

    model, tokenizer = load_smollm2(dtype=torch.float32)
    articles, qualified = pick_articles(tokenizer, args.articles, args.tokens)
    print(f"{len(articles)} articles of {args.tokens} tokens ({qualified} BBC articles have >= {args.tokens} tokens); "
          f"layers {args.layers}; model loaded + articles picked in {time.perf_counter() - t0:.0f} s")

    t1 = time.perf_counter()
    qkv = {}  # (article, layer) -> (q, k, v)
    for a, ids in enumerate(articles):
        got, diff = capture_qkv(model, ids, args.layers, check=(a == 0))
        if a == 0:
            print(f"hook check (article 0): max relative difference, module output vs recomputed from the captured "
                  f"q, k, v: {diff:.1e}")
        for layer, t in got.items():
            qkv[a, layer] = t
    heads, _, dim = next(iter(qkv.values()))[0].shape
    scale = dim ** -0.5
    keys = list(qkv)  # row order inside a batch: (article, layer) then head
    q_all = torch.stack([qkv[key][0] for key in keys]).double()  # (A*L, H, T, D)
    k_all = torch.stack([qkv[key][1] for key in keys]).double()
    v_all = torch.stack([qkv[key][2] for key in keys]).double()
    del qkv
    print(f"forward passes: {time.perf_counter() - t1:.0f} s; {len(keys) * heads} rows per position, head dim {dim}")

    t2 = time.perf_counter()
    pos = positions(args.tokens, args.stride)
    # worst[(order, scheme, layer)] = [err, article, head, position]; also count of rows above TOL
    worst = defaultdict(lambda: [-1.0, None, None, None])
    above = defaultdict(int)
    rows_seen = defaultdict(int)
    lap = {o: {"raw_out": 0, "raw_nonfinite": 0, "start_out": 0, "final_nonfinite": 0, "below1": 0} for o in
           args.orders}
    worst_detail = {}  # (order, scheme) -> (err, n, exact, lambda_1, final)
    checked = False
    for i in pos:
        n = i + 1
        s = torch.einsum("bhd,bhnd->bhn", q_all[:, :, i], k_all[:, :, :n]) * scale  # (A*L, H, n)
        x = (s - s.max(dim=-1, keepdim=True).values).reshape(-1, n)
        v = v_all[:, :, :n].reshape(-1, n, dim)
        qn = q_all[:, :, i].norm(dim=-1).reshape(-1)
        kmax = k_all[:, :, :n].norm(dim=-1).max(dim=-1).values.reshape(-1)
        pole = qn * kmax * scale + 1.0 - s.max(dim=-1).values.reshape(-1)  # only the A_* schemes use it
        for order in args.orders:
            exact = root_by_bisection(x, order, steps=args.bisect_steps)
            upper = n ** (1.0 / order)
            raw = laplace_start(x, order)
            info = lap[order]
            info["raw_nonfinite"] += int((~torch.isfinite(raw)).sum())
            info["raw_out"] += int(((raw < 1) | (raw > upper * (1 + 1e-12))).sum())
            for scheme in SCHEME_NAMES:
                lam = (solve_lambda(x, torch.ones_like(x, dtype=torch.bool), order, -default_newton_iter(order))
                       if scheme == "default" else final_lambda(scheme, x, pole, order))
                err = row_errors(x, v, order, lam, exact)
                if not checked:  # the per-row formula is output_error's
                    assert math.isclose(err[:1].max().item(), output_error(x[:1], v[0], order, lam[:1], exact[:1]),
                                        rel_tol=1e-9, abs_tol=1e-300)
                    checked = True
                if scheme == "C_laplace":
                    start = first_iterate(scheme, x, pole, order)
                    info["start_out"] += int(((start < 1) | (start > upper * (1 + 1e-12))
                                              | ~torch.isfinite(start)).sum())
                    info["final_nonfinite"] += int((~torch.isfinite(lam)).sum())
                    info["below1"] += int((lam < 1).sum())
                err = torch.where(torch.isfinite(err), err, torch.full_like(err, float("inf")))
                for r in range(len(keys)):
                    block = err[r * heads:(r + 1) * heads]
                    h = int(block.argmax())
                    art, layer = keys[r]
                    w = worst[order, scheme, layer]
                    if block[h].item() > w[0]:
                        w[:] = [block[h].item(), art, h, i]
                    above[order, scheme, layer] += int((block > TOL).sum())
                    rows_seen[order, scheme, layer] += heads
                j = int(err.argmax())
                if (order, scheme) not in worst_detail or err[j].item() > worst_detail[order, scheme][0]:
                    start = lam[j] if scheme in NO_START else first_iterate(scheme, x[j:j + 1], pole[j:j + 1], order)[0]
                    worst_detail[order, scheme] = (err[j].item(), n, exact[j].item(), start.item(), lam[j].item())
    print(f"solver study: {time.perf_counter() - t2:.0f} s over {len(pos)} positions "
          f"({pos[:6]} ... {pos[-2:]}); v = the layer's value rows")

    layers = sorted({layer for _, layer in keys})
    for order in args.orders:
        print(f"\norder {order:g}: worst relative output error vs the exact root [article/head/position]; "
              f"(rows > {TOL:g} / rows)")
        print("| layer | " + " | ".join(SCHEME_NAMES) + " |")
        print("|---|" + "---|" * len(SCHEME_NAMES))
        for layer in layers + ["all"]:
            cells = []
            for scheme in SCHEME_NAMES:
                cand = [(worst[order, scheme, l], l) for l in (layers if layer == "all" else [layer])]
                (err, art, h, i), l = max(cand, key=lambda c: c[0][0])
                cnt = sum(above[order, scheme, l2] for l2 in (layers if layer == "all" else [layer]))
                tot = sum(rows_seen[order, scheme, l2] for l2 in (layers if layer == "all" else [layer]))
                where = f"a{art}/h{h}/p{i}" + (f"/L{l}" if layer == "all" else "")
                cells.append(f"{err:.1e} [{where}] ({cnt}/{tot})")
            print(f"| {layer} | " + " | ".join(cells) + " |")
        info = lap[order]
        print(f"C_laplace at order {order:g}: laplace_start outside [1, n^(1/order)]: {info['raw_out']}, non-finite: "
              f"{info['raw_nonfinite']}; start max(Jensen, it) outside or non-finite: {info['start_out']}; "
              f"final lambda non-finite: {info['final_nonfinite']}, < 1: {info['below1']}")
        for scheme in SCHEME_NAMES:
            err, n, ex, st, fin = worst_detail[order, scheme]
            start = "" if scheme in NO_START else f"lambda_1 {st:.6g} ({st / ex - 1:+.2%}), "
            print(f"  worst {scheme}: err {err:.1e}, n {n}, exact root {ex:.6g}, {start}"
                  f"final {fin:.6g} ({fin / ex - 1:+.1e})")
    if args.blocks:
        for order in args.orders:
            rows, blocks = extra_step_blocks(q_all, k_all, scale, order)
            print(f"order {order:g}, the adaptive default: {rows:.3f} of the rows and {blocks:.3f} of the 64-row query "
                  "blocks (4 per article, layer and head) take an extra step")
    print(f"\nran {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
