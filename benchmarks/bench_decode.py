"""Decode throughput of a causal LM with its decode state: sdpa + StaticCache against RACE + RaceCache.

    python -m benchmarks.bench_decode --model smollm2 --batch 32 --context 32768 --steps 64
    python -m benchmarks.bench_decode --model tiny --device cpu --no-graphs     # the harness on a CPU

Both providers prefill ``context`` random tokens (no padding; only the last position's logits are formed),
then time greedy decode steps. A step takes the input ids, positions and cache position from static
buffers, writes its argmax back as the next ids and advances the positions in place, so on CUDA it is
captured once in a CUDA graph and replayed (``--no-graphs``: run eagerly). sdpa: transformers'
``StaticCache`` sized ``context + steps`` (keys and values of every token). race: the model switched with
``enable_backend(model, "race")`` and :func:`hf_attention_backends.race_cache` (running sums per layer,
constant in context). Rows go to the benchmark CSV (case ``decode_<model>``, mode ``decode``,
``median_ms`` per step for the whole batch, ``params`` with tokens/s and the decode-state bytes per sequence).
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from . import report, timing

PROVIDERS = ("sdpa", "race")


def tiny_llama(device, dtype):
    """A random 2-layer Llama with GQA and head dim 32 (the smallest the CUDA kernels take)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=128, max_position_embeddings=1 << 20)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def load_model(name: str, device, dtype):
    if name == "tiny":
        return tiny_llama(device, dtype)
    if name == "smollm2":
        from hf_attention_backends.models import load_smollm2

        return load_smollm2(dtype=dtype, device=device)[0]
    raise ValueError(f"--model {name!r} is not supported; supported: smollm2, tiny")


def make_cache(model, provider: str, max_len: int):
    """The decode cache of ``provider`` on ``model`` (switched to it beforehand)."""
    if provider == "race":
        import hf_attention_backends as hfab

        return hfab.race_cache(model)
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=max_len)


def state_bytes_per_sequence(cache, batch: int) -> int:
    """Bytes of every tensor the cache's layers hold, divided by the batch."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "num", "den"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total // batch


class Decoder:
    """Greedy decode steps over static buffers: ``ids`` (B, 1), ``pos`` (B, 1), ``cache_pos`` (1,) and, for a
    static KV cache, a (1, 1, 1, max_len) bool key mask (4D: transformers uses it as is, with no host-side
    checks that a CUDA graph capture would refuse)."""

    def __init__(self, model, cache, first_ids: torch.Tensor, context: int, max_len: Optional[int] = None):
        self.model, self.cache = model, cache
        self.ids = first_ids.clone()
        self.pos = torch.full_like(first_ids, context)
        self.cache_pos = torch.full((1,), context, dtype=torch.long, device=first_ids.device)
        self.mask = None
        if max_len is not None:
            self.mask = (torch.arange(max_len, device=first_ids.device) < context).view(1, 1, 1, max_len)
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    def step(self) -> None:
        if self.mask is not None:
            self.mask.index_fill_(-1, self.cache_pos, True)  # the new token's key slot
        out = self.model(input_ids=self.ids, position_ids=self.pos, cache_position=self.cache_pos,
                         attention_mask=self.mask, past_key_values=self.cache, use_cache=True)
        self.ids.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        self.pos.add_(1)
        self.cache_pos.add_(1)

    def capture(self, warmup: int = 2) -> None:
        """Run ``warmup`` eager steps on a side stream (allocator and lazy init), then capture one step."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def __call__(self) -> None:
        if self.graph is None:
            self.step()
        else:
            self.graph.replay()


@torch.inference_mode()
def prefill(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Run the prompt (B, N) through the model into ``cache``; returns the greedy next ids (B, 1)."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].argmax(-1, keepdim=True)


def run_provider(model, provider: str, *, batch: int, context: int, steps: int, graphs: bool, seed: int = 0,
                 tokens: Optional[list] = None) -> dict:
    """Prefill + ``steps`` timed decode steps for one provider; the result row's numbers.

    ``tokens``: when a list, the ids of every decode step are appended to it ((B,) each).
    """
    import hf_attention_backends as hfab

    device = next(model.parameters()).device
    if provider == "race":
        hfab.enable_backend(model, "race")
    try:
        max_len = context + steps + 4  # + the capture's warm-up steps
        cache = make_cache(model, provider, max_len)
        g = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        first = prefill(model, cache, ids)
        with torch.inference_mode():
            decoder = Decoder(model, cache, first, context, max_len if provider == "sdpa" else None)
            if graphs:
                decoder.capture()
            def step(_):
                decoder()
                if tokens is not None:
                    tokens.append(decoder.ids[:, 0].clone())

            times = timing.times_ms(step, 0, steps, device)
        per_seq = state_bytes_per_sequence(cache, batch)
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    finally:
        if provider == "race":
            hfab.disable_backend(model)
    median, p20, p80 = timing.summarize(times)
    return {"median_ms": median, "p20_ms": p20, "p80_ms": p80,
            "tokens_per_s": batch * 1e3 / median, "state_bytes_per_seq": per_seq, "peak_mem_MB": peak,
            "reps": len(times)}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny (random, for the harness)")
    parser.add_argument("--providers", default=",".join(PROVIDERS), help="comma list of sdpa, race")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, action="append", help="prompt length(s) (default 32768)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-graphs", action="store_true", help="eager decode steps (always on a CPU)")
    parser.add_argument("--out", help="CSV to append to (default benchmarks/results/<device>.csv)")
    args = parser.parse_args(argv)
    providers = [p for p in args.providers.split(",") if p]
    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown or not providers:
        parser.error(f"--providers {args.providers!r}: supported: {', '.join(PROVIDERS)}")
    for name, value in (("--batch", args.batch), ("--steps", args.steps)):
        if value < 1:
            parser.error(f"{name} {value} must be >= 1")
    contexts = args.context or [32768]
    if min(contexts) < 1:
        parser.error(f"--context {min(contexts)} must be >= 1")
    device = torch.device(args.device)
    graphs = device.type == "cuda" and not args.no_graphs
    model = load_model(args.model, device, getattr(torch, args.dtype))
    env = report.environment(device)
    out = args.out or f"{report.RESULTS_DIR}/{report.device_slug(device)}.csv"
    cfg = model.config
    for context in contexts:
        for provider in providers:
            row = {**dict.fromkeys(report.COLUMNS, ""), **env, "backend": "race", "case": f"decode_{args.model}",
                   "dtype": args.dtype.replace("bfloat16", "bf16").replace("float16", "fp16"), "B": args.batch,
                   "H": cfg.num_attention_heads, "Hkv": cfg.num_key_value_heads, "N": context,
                   "D": cfg.hidden_size // cfg.num_attention_heads, "causal": True, "provider": provider,
                   "mode": "decode", "input_sets": 1}
            try:
                res = run_provider(model, provider, batch=args.batch, context=context, steps=args.steps,
                                   graphs=graphs)
                row.update(status="ok", median_ms=f"{res['median_ms']:.4f}", p20_ms=f"{res['p20_ms']:.4f}",
                           p80_ms=f"{res['p80_ms']:.4f}", peak_mem_MB=f"{res['peak_mem_MB']:.1f}", reps=res["reps"],
                           params=f"graphs={graphs};tokens_per_s={res['tokens_per_s']:.1f};"
                                  f"state_bytes_per_seq={res['state_bytes_per_seq']}")
                print(f"{provider:>5} context {context:>7}: {res['median_ms']:.3f} ms/step, "
                      f"{res['tokens_per_s']:.0f} tokens/s, state {res['state_bytes_per_seq'] / 2**20:.2f} MiB/seq, "
                      f"peak {res['peak_mem_MB']:.0f} MiB")
            except torch.OutOfMemoryError as err:
                row.update(status="oom", message=str(err).splitlines()[0][:200])
                print(f"{provider:>5} context {context:>7}: out of memory")
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            report.append_row(out, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
