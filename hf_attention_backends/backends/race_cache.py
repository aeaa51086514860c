"""O(1)-per-token decode for RACE layers: a transformers ``Cache`` that keeps RACE's recurrent state.

Usage::

    cache = hfab.race_cache(model)                   # model converted / enabled with "race" (hybrid plans too)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=256)

What is kept. RACE is linear attention: O_i = Φ(q_i)·Σ_j Φ(k_j) v_jᵀ / Φ(q_i)·Σ_j Φ(k_j) over the allowed
keys j. Causal decode therefore needs only the running sums num = Σ Φ(k_j) v_jᵀ (S × Dv) and
den = Σ Φ(k_j) (S), S = L·2^P, per layer and per (batch, state head), never the keys and values. They are
kept in fp32 (fp64 for fp64 models, see ``ops._common.compute_dtype``). State heads: Φ(k) depends on the
key and on beta; with a scalar beta (the default) every query head of a GQA group shares Φ(k_j), so the
state is per kv head and the group's query heads read it without a repeat; with a per-head beta
(``per_head_beta=True``) Φ(k_j) differs per query head, so the state is per query head. Memory per
sequence and RACE layer: H_state · S · (Dv + 1) numbers whatever the context length. Layers left out of a
hybrid plan keep the layer ``DynamicCache(config=model.config)`` would give them (an ordinary dynamic KV
layer, or its sliding-window variant), so they run transformers' sdpa exactly as without this cache.

Design, from transformers 5.18's ``cache_utils``:

- A ``Cache`` holds one layer object per decoder layer; ``LlamaAttention`` (and every llama-like family,
  GPT-2) calls ``past_key_values.update(k, v, layer_idx)`` and hands what it returns, untouched, to the
  attention function as ``key`` / ``value``. The attention function receives the module and the kwargs,
  never the cache. :class:`RaceStateLayer` (a ``CacheLayerMixin``) therefore stores nothing in ``update``:
  it returns the new keys and values themselves (Nk = Nq) and records "this key tensor belongs to me" in a
  weak identity map. The RACE adapter (``adapters.py``) looks the key it received up in that map
  (:func:`pending_layer`); found, it runs :func:`attend`, which consumes the hand-off, reads the state and
  folds the new keys in. Identity, not a module attribute: a forward without this cache can never meet a
  stale state, and the map holds no strong reference (entries die with the key tensor).
- Prefill (empty state): the output is the ordinary causal RACE op on the prompt (the same op, kernel on
  CUDA, as a forward without cache, so prefill logits are those of the full forward); then every real
  prompt key is folded into the state (padded keys are multiplied by 0: with left padding they add nothing).
- Later calls (decode, Nq = 1, or a continuation chunk of Nq tokens): Φ(q) reads the state, plus a causal
  Φ(q)Φ(k)ᵀ product inside the chunk, in chunks of ``CHUNK`` tokens, each folded in after it is read.
  One token costs O(H·S·D) whatever the context: plain PyTorch, the same code on CPU and CUDA tensors.
- The mask: transformers sizes it from ``get_mask_sizes`` (kv_length = tokens seen + Nq, as a dynamic
  layer would), so sdpa layers of a hybrid plan and the RACE layers share one mask; the RACE path uses its
  last Nk columns, the padding of the new keys (the earlier columns are already folded in).
- The consistency check: each ``update`` refuses to run while the previous hand-off was never consumed,
  i.e. the layer's attention did not run RACE (a plan that changed after the cache was built, a family
  whose attention function gets different tensors): an error instead of attention over the new token only.
- generate() picks a cache class only from ``cache_implementation`` (transformers' own names) or
  ``DynamicCache(config)``, which dispatches on ``config.layer_types`` (also used by models to choose
  masks); neither is a supported per-model hook, and patching generate is ruled out, so the cache is
  passed explicitly: ``past_key_values=race_cache(model)``. Without it, generate uses a DynamicCache and
  RACE layers recompute over all keys (correct, O(N) per token).

Supported: greedy and sampling, beam search (``reorder_cache`` indexes the state by beam),
``batch_repeat_interleave`` / ``batch_select_indices``, left or right padding in the prompt, reuse of a
filled cache for a continuation, CPU and CUDA. Refused with a clear error: non-causal layers, sliding-window
RACE layers (a running sum cannot forget old keys), ``crop`` / rollback by a nonzero number of tokens
(assisted and prompt-lookup decoding need it), offloading, ``torch.compile`` of the forward (the cache is
not compileable, so generate never auto-compiles with it). CUDA graphs: a decode step updates the state in
place and needs no host synchronisation, so a step over static input buffers can be captured and replayed
(``benchmarks/bench_decode.py`` does this; prefill runs eagerly first).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from .. import integrations
from ..ops import race_attention
from ..ops._common import compute_dtype, repeat_kv
from ..ops.race.reference import race_features

CHUNK = 64
_PENDING = WeakIdKeyDictionary()  # key tensor returned by RaceStateLayer.update -> that layer


class RaceStateLayer(CacheLayerMixin):
    """One RACE layer's decode state: ``num`` (B, H_state, S, Dv) and ``den`` (B, H_state, S), fp32 (fp64
    for fp64 inputs), allocated at the first forward; ``seen`` = tokens handed in so far (padding included,
    the length transformers' masks count). ``keys`` / ``values`` stay None."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num: Optional[Tensor] = None
        self.den: Optional[Tensor] = None
        self.seen = 0
        self._pending: Optional[tuple[Tensor, Tensor]] = None

    def __repr__(self):
        return f"RaceStateLayer(layer={self.layer_idx}, seen={self.seen})"

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Hand the new keys/values (B, Hkv, Nq, D) to this layer's RACE attention call; returns them as is."""
        if torch.compiler.is_compiling():
            raise NotImplementedError("RaceCache does not support torch.compile (its hand-off to the attention "
                                      "function is Python state); run generate without compile, or without RaceCache")
        if self._pending is not None:
            raise RuntimeError(
                f"RaceCache layer {self.layer_idx}: the previous update was never read by a RACE attention call, so "
                "this layer's attention does not run RACE (the model's plan changed after race_cache(model) was "
                "built, or a forward failed midway). Build a new cache with hf_attention_backends.race_cache(model)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._pending = (key_states, value_states)
        _PENDING[key_states] = self
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def take(self, key: Tensor, value: Tensor) -> None:
        """Consume the hand-off of ``update`` (the attention call got exactly these tensors)."""
        pending, self._pending = self._pending, None
        assert pending is not None and pending[0] is key and pending[1] is value, "RACE hand-off mismatch"

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.num = self.den = self._pending = None
        self.seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise NotImplementedError(
                f"RaceCache.crop({tokens_to_remove}) is not supported: a RACE layer keeps running sums, not the "
                "tokens, so it cannot roll back; supported: crop(0). Assisted / prompt-lookup decoding and other "
                "rollbacks need a DynamicCache (generate without past_key_values)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select(lambda t: t[indices])

    def offload(self):
        raise NotImplementedError("RaceCache does not support offloading (its state is already constant in context)")

    def prefetch(self):
        raise NotImplementedError("RaceCache does not support offloading (its state is already constant in context)")

    def _select(self, fn) -> None:
        if self.num is not None:
            self.num, self.den = fn(self.num), fn(self.den)


class RaceCache(Cache):
    """A ``Cache`` for a model with RACE layers: :class:`RaceStateLayer` for every layer that runs RACE, the
    layer ``DynamicCache(config=model.config)`` would create for every other layer. Build it with
    :func:`race_cache`; pass it as ``past_key_values=`` to ``generate`` or to the model's forward."""

    def __init__(self, model):
        config = model.config.get_text_config(decoder=True)
        if not integrations.is_causal(model):
            raise ValueError(f"RaceCache needs a causal (decoder) model; model_type={config.model_type!r} is "
                             "not causal here, and decoding a non-causal model has no meaning")
        layers = list(DynamicCache(config=config).layers)
        race_layers = []
        for i, module in integrations.attention_layers(model):
            idx = getattr(module, "layer_idx", i)
            if idx is None or idx >= len(layers):
                raise ValueError(f"attention layer {i} has layer_idx={idx}; the cache has {len(layers)} layers")
            if _runs_race(model, module):
                if getattr(layers[idx], "is_sliding", False):
                    raise NotImplementedError(
                        f"layer {idx} is a sliding-window layer (window {config.sliding_window}); a RACE state "
                        "cannot forget keys that leave the window. Leave sliding layers on sdpa "
                        "(convert(..., layers=[...]))")
                layers[idx] = RaceStateLayer(idx)
                race_layers.append(idx)
        if not race_layers:
            raise ValueError(f"{type(model).__name__} has no layer running RACE (attn_implementation="
                             f"{config._attn_implementation!r}); convert it first: "
                             "hf_attention_backends.convert(model, 'race') or enable_backend(model, 'race')")
        self.race_layers = race_layers
        super().__init__(layers=layers)


def race_cache(model) -> RaceCache:
    """A fresh :class:`RaceCache` for ``model`` (one per generate call / batch of sequences).

    ``model`` is a causal transformers model whose attention runs RACE in at least one layer
    (``convert(model, "race", layers=...)``, ``enable_backend(model, "race", ...)`` or
    ``attn_implementation="hfab_race"``). Raises ValueError for a model without RACE layers or a non-causal
    model, NotImplementedError for a sliding-window RACE layer.
    """
    return RaceCache(model)


def _runs_race(model, module) -> bool:
    backend = getattr(module, "hfab_backend", None)
    if backend is not None:
        return backend == "race"
    return not getattr(module, "hfab_left_out", False) and model.config._attn_implementation == "hfab_race"


def pending_layer(key: Tensor) -> Optional[RaceStateLayer]:
    """The :class:`RaceStateLayer` whose ``update`` returned ``key`` and is waiting for it, else None."""
    if torch.compiler.is_compiling():
        return None
    layer = _PENDING.get(key)
    return layer if layer is not None and layer._pending is not None and layer._pending[0] is key else None


def new_key_mask(layer: RaceStateLayer, attention_mask, key: Tensor, what: str):
    """The columns of a (B, 1, ·, seen) mask that belong to the Nk new keys (earlier ones are folded in)."""
    if attention_mask is None or not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4:
        return attention_mask
    if attention_mask.shape[-1] != layer.seen:
        raise ValueError(f"{what}: the attention mask covers {attention_mask.shape[-1]} keys, but the RaceCache layer "
                         f"has seen {layer.seen} tokens; pass the 2D attention_mask of the whole sequence so far")
    return attention_mask[..., layer.seen - key.shape[2]:]


def attend(layer: RaceStateLayer, query: Tensor, key: Tensor, value: Tensor, *, planes: Tensor, beta,
           key_padding_mask: Optional[Tensor], causal: bool, sliding_window, what: str) -> Tensor:
    """RACE attention of the new tokens against the layer's state, then fold the new keys in.

    query (B, Hq, Nq, D), key/value (B, Hkv, Nq, D) (the new tokens only), planes (L, P, D), beta a float or
    a Tensor () or (Hq,), key_padding_mask (B, Nq) bool (True = real) or None. Returns (B, Hq, Nq, Dv) in
    query.dtype. Bottom-right causal: new token i sees every folded token and new tokens j <= i.
    """
    layer.take(key, value)
    if not causal:
        raise NotImplementedError(f"{what}: RaceCache with a non-causal layer is not supported (a decode state only "
                                  "makes sense for causal attention); supported: causal layers")
    if sliding_window is not None:
        raise NotImplementedError(f"{what}: sliding_window={sliding_window} is not supported with RaceCache (a running "
                                  "sum cannot forget old keys); leave sliding layers on sdpa")
    b, hq, nq, _ = query.shape
    assert key.shape[2] == nq, "a RaceStateLayer returns the new keys only"
    ct = compute_dtype(query.dtype)
    # a float becomes a tensor by a fill kernel, not a host-to-device copy (which a CUDA graph capture refuses)
    beta_t = beta.to(query.device, ct) if isinstance(beta, Tensor) else torch.full((), float(beta), dtype=ct,
                                                                                 device=query.device)
    heads = hq if beta_t.dim() == 1 else key.shape[1]  # Φ(k) per query head iff beta is per head
    planes_c = planes.to(ct)
    phk = race_features(repeat_kv(key, heads).to(ct), planes_c, beta_t)  # (B, Hs, Nq, S)
    if key_padding_mask is not None:
        phk = phk * key_padding_mask[:, None, :, None].to(ct)
    v = repeat_kv(value, heads).to(ct)  # (B, Hs, Nq, Dv)
    if layer.num is None:
        out = race_attention(query, key, value, planes=planes, beta=beta, causal=True,
                             key_padding_mask=key_padding_mask)
        layer.num = torch.matmul(phk.transpose(-1, -2), v)
        layer.den = phk.sum(dim=-2)
        return out
    phq = race_features(query.to(ct), planes_c, beta_t).unflatten(1, (heads, hq // heads))  # (B, Hs, G, Nq, S)
    outs = []
    for start in range(0, nq, CHUNK):
        sl = slice(start, start + CHUNK)
        q_c, k_c, v_c = phq[:, :, :, sl], phk[:, :, None, sl], v[:, :, None, sl]
        a = torch.tril(torch.matmul(q_c, k_c.transpose(-1, -2)))  # (B, Hs, G, C, C)
        num = torch.matmul(a, v_c) + torch.matmul(q_c, layer.num[:, :, None])
        den = a.sum(dim=-1, keepdim=True) + torch.matmul(q_c, layer.den[:, :, None, :, None])
        ok = den > 0
        outs.append(torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num)))
        layer.num.add_(torch.matmul(phk[:, :, sl].transpose(-1, -2), v[:, :, sl]))  # in place: CUDA-graph replays
        layer.den.add_(phk[:, :, sl].sum(dim=-2))  # keep updating the same buffers
    return torch.cat(outs, dim=3).flatten(1, 2).to(query.dtype)
