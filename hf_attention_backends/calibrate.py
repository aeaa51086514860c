"""Calibration at conversion: per converted layer, pick the knobs that bring its attention output closest to softmax.

The softmax teacher is the converted model itself: :class:`TeacherForcing` hooks every converted attention
module and, in the same forward pass, recomputes that module with transformers' sdpa on the same inputs
(the adapters' ``hfab_left_out`` path, ``backends/adapters.py``). The hook returns the teacher's output, so
every layer sees the hidden states of the softmax model and layers are scored (and trained) independently::

    model = hfab.convert(model, "race", per_head_beta=True)
    report = calibrate(model, batches, steps=20)      # batches: dicts of forward kwargs
    report["before"], report["after"]                 # {layer: relative error}
    keep = worst_layers(report, 8)                    # a hybrid plan: these 8 back to softmax, convert the rest

Error of layer i: ``sum((out - ref)**2) / sum(ref**2)`` over the real tokens (``attention_mask`` of the batch)
of the attention module's first output (the projected output for Llama-like families, the context before
``attention.output.dense`` for BERT). Knobs:

- RACE: ``hfab_beta`` by a grid per layer (one forward per candidate scores every layer), then optionally
  ``steps`` Adam steps on every ``hfab_*`` parameter (per-head beta, Nyström conv weight).
- Stieltjes: ``order`` by a grid, one order for the whole model (recorded in ``config.hfab_plan``, so it
  survives ``save_pretrained`` / ``from_pretrained``); the per-layer best orders are reported only, since
  the plan has one config for all layers. Then, when the model was converted with
  ``per_head_temperature=True``, ``hfab_temperature`` per layer and head: one pass over the heads, each a
  1-D grid search with the other heads fixed (one forward per candidate scores every layer); a head keeps
  its value unless a candidate lowers its layer's error. Then optionally ``steps`` Adam steps as for RACE.
- Nyström: ``steps`` Adam steps on ``hfab_conv_weight`` (from ``convert(..., conv_kernel_size=k)``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .integrations import attention_layers, head_dims

__all__ = ["TeacherForcing", "calibrate", "layer_errors", "converted_layers", "forward_kwargs", "worst_layers",
           "DEFAULT_STIELTJES_ORDERS",
           "DEFAULT_STIELTJES_TEMPERATURES", "DEFAULT_RACE_BETA_FACTORS"]

DEFAULT_STIELTJES_ORDERS = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
DEFAULT_STIELTJES_TEMPERATURES = (0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0)
DEFAULT_RACE_BETA_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)  # times D**-0.5
_MIN_BETA = 1e-4  # also the floor of a Stieltjes temperature


def converted_layers(model) -> list[tuple[int, torch.nn.Module]]:
    """[(layer, attention module)] of the layers running an hfab backend; ValueError if there are none."""
    layers = [(i, m) for i, m in attention_layers(model) if getattr(m, "hfab_backend", None) is not None]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no converted attention layer; call hf_attention_backends."
                         "convert(model, backend) first")
    return layers


def worst_layers(report: dict, count: int) -> list[int]:
    """The ``count`` layers with the largest error after calibration (``report["after"]`` of :func:`calibrate`), in
    layer order: the layers to leave on softmax in a hybrid plan. ValueError unless 0 <= count < the layers."""
    errors = report["after"]
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < len(errors):
        raise ValueError(f"count={count!r} must be an int in [0, {len(errors)}) (the report's converted layers)")
    worst = sorted(errors, key=lambda idx: (-errors[idx], idx))[:count]
    return sorted(int(idx) for idx in worst)


class TeacherForcing:
    """Context manager: during each forward of ``model``, score every converted layer against softmax.

    On entry, the current values of the attention modules' trainable parameters that are not ``hfab_*``
    (e.g. q/k projections or LoRA weights named for training) are snapshotted; the teacher runs with that
    snapshot, so training them moves the student only. ``token_mask`` (B, N) bool/int, 1 = real token, set
    before each forward (None = every token counts). After a forward, ``terms[layer]`` holds
    ``(squared error sum, reference squared sum, element count)``; the first carries gradients.

    ``student_graph=True``: each layer passes on ``teacher + 0 · student``: the teacher's values, and a graph
    through which the backward reaches every layer with zero gradient (the terms keep theirs), so the model's
    output requires grad (FSDP only runs its backward hooks, which gather the weights and reduce the gradients,
    for outputs that take part in the backward).
    """

    def __init__(self, model, student_graph: bool = False):
        self.modules = converted_layers(model)
        self.student_graph = student_graph
        self.token_mask: Optional[Tensor] = None
        self.terms: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._handles = []
        self._originals: dict[int, dict[str, Tensor]] = {}
        self._in_teacher = False
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """Forwards inside run the student alone (no teacher, no terms): evaluation in the middle of training."""
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    def __enter__(self):
        for idx, module in self.modules:
            self._originals[idx] = {n: p.detach().clone() for n, p in module.named_parameters()
                                    if p.requires_grad and not n.rsplit(".", 1)[-1].startswith("hfab_")}
            self._handles.append(module.register_forward_hook(self._hook(idx), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._originals.clear()

    def losses(self) -> dict[int, Tensor]:
        """{layer: mean squared error} of the last forward (differentiable)."""
        return {i: err / count for i, (err, _, count) in self.terms.items()}

    def _snapshot_like_live(self, idx, module) -> dict[str, Tensor]:
        """The snapshot in the dtype the live parameters have now (FSDP's mixed precision casts them to bf16)."""
        live = dict(module.named_parameters())
        return {n: t.to(live[n].dtype) if n in live else t for n, t in self._originals[idx].items()}

    def _teacher(self, idx, module, args, kwargs) -> Tensor:
        backend = module.__dict__.pop("hfab_backend")
        module.hfab_left_out = True
        self._in_teacher = True
        try:
            with torch.no_grad():
                out = torch.func.functional_call(module, self._snapshot_like_live(idx, module), args, kwargs)
        finally:
            self._in_teacher = False
            del module.hfab_left_out
            module.hfab_backend = backend
        return out[0] if isinstance(out, tuple) else out

    def _hook(self, idx):
        def hook(module, args, kwargs, output):
            if self._in_teacher or self._paused:
                return None
            if kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None:
                raise ValueError(f"layer {idx} received a KV cache; run the forward with use_cache=False (the "
                                 "teacher recomputes the layer and would append to the cache twice)")
            student = output[0] if isinstance(output, tuple) else output
            teacher = self._teacher(idx, module, args, kwargs)
            mask = self.token_mask
            if mask is None:
                weight = torch.ones(student.shape[:-1], device=student.device, dtype=torch.float32)
            else:
                if tuple(mask.shape) != tuple(student.shape[:-1]):
                    raise ValueError(f"token_mask has shape {tuple(mask.shape)}; expected {tuple(student.shape[:-1])} "
                                     "(batch, sequence) of the forward's inputs")
                weight = mask.to(device=student.device, dtype=torch.float32)
            weight = weight.unsqueeze(-1)
            diff = (student.float() - teacher.float()) ** 2
            count = weight.sum() * student.shape[-1]
            self.terms[idx] = ((diff * weight).sum(), ((teacher.float() ** 2) * weight).sum(), count)
            if self.student_graph:
                teacher = teacher + 0.0 * student
            return (teacher,) + tuple(output[1:]) if isinstance(output, tuple) else teacher
        return hook


def forward_kwargs(model, batch: dict) -> dict:
    """``batch`` without ``labels``, with ``use_cache=False`` for models that cache keys and values."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    if hasattr(model.config, "use_cache"):
        kwargs["use_cache"] = False
    return kwargs


def _forward(model, forcing: TeacherForcing, batch: dict) -> None:
    forcing.token_mask = batch.get("attention_mask")
    forcing.terms = {}
    model(**forward_kwargs(model, batch))


def layer_errors(model, batches: Sequence[dict]) -> dict[int, float]:
    """{layer: relative error} of every converted layer over ``batches`` (dicts of forward kwargs), no grad."""
    sums: dict[int, list[float]] = {}
    with torch.no_grad(), TeacherForcing(model) as forcing:
        for batch in batches:
            _forward(model, forcing, batch)
            for idx, (err, ref, _) in forcing.terms.items():
                acc = sums.setdefault(idx, [0.0, 0.0])
                acc[0] += float(err)
                acc[1] += float(ref)
    return {idx: err / max(ref, 1e-30) for idx, (err, ref) in sorted(sums.items())}


def calibrate(model, batches: Iterable[dict], *, race_betas: Optional[Sequence[float]] = None,
              stieltjes_orders: Optional[Sequence[float]] = None, temperatures: Optional[Sequence[float]] = None,
              steps: int = 0, lr: float = 1e-2) -> dict:
    """Tune the converted layers of ``model`` (in place) on a few calibration batches; returns a report.

    Args:
        model: a model returned by ``hf_attention_backends.convert`` (RACE, Stieltjes, Nyström or exact).
        batches: dicts of forward kwargs on the model's device (``input_ids``, ``attention_mask``, ...); a
            few batches of real text are enough. ``labels`` are ignored.
        race_betas: RACE beta candidates (default ``DEFAULT_RACE_BETA_FACTORS`` × D**-0.5); per layer the
            best is written into ``hfab_beta`` (every head).
        stieltjes_orders: Stieltjes order candidates (default ``DEFAULT_STIELTJES_ORDERS``); the best for
            the summed error is set on every converted layer and in ``model.config.hfab_plan``.
        temperatures: Stieltjes per-head temperature candidates (default ``DEFAULT_STIELTJES_TEMPERATURES``),
            searched after the order when the layers have ``hfab_temperature`` (``convert(...,
            per_head_temperature=True)``); passing them for layers without it is a ValueError.
        steps: Adam steps (lr ``lr``) on every ``hfab_*`` parameter after the grid, minimising the summed
            per-layer MSE; RACE beta and Stieltjes temperatures are kept >= 1e-4. Only the ``hfab_*`` parameters change; if the steps
            raise the summed error, the values before them are restored (``choices["steps_kept"]`` False).

    Returns:
        ``{"backend", "before": {layer: err}, "after": {layer: err}, "choices": {...}}``; for Stieltjes,
        ``choices["order"]``, ``choices["best_order_per_layer"]`` and, with temperatures,
        ``choices["temperature"]`` ({layer: [one per head]}); for RACE ``choices["beta"]`` per layer.

    Raises ValueError for a model with no converted layer, no batches, or an empty/non-positive grid.
    """
    batches = list(batches)
    if not batches:
        raise ValueError("batches is empty; pass at least one dict of forward kwargs")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r} must be an int >= 0")
    modules = converted_layers(model)
    backends = {m.hfab_backend for _, m in modules}
    if len(backends) != 1:
        raise ValueError(f"converted layers run several backends {sorted(backends)}; calibrate one at a time")
    backend = backends.pop()
    was_training = model.training
    model.eval()
    try:
        before = layer_errors(model, batches)
        choices: dict = {}
        if backend == "race":
            choices["beta"] = _grid_race(model, modules, batches, race_betas)
        elif backend == "stieltjes":
            choices.update(_grid_stieltjes(model, modules, batches, stieltjes_orders))
            if temperatures is not None or any(getattr(m, "hfab_temperature", None) is not None for _, m in modules):
                choices["temperature"] = _grid_temperature(model, modules, batches, temperatures)
        after = layer_errors(model, batches)
        if steps:
            params = _hfab_parameters(modules)
            saved = [p.detach().clone() for p in params]
            choices["steps"] = _fit(model, modules, batches, steps, lr)
            fitted = layer_errors(model, batches)
            choices["steps_kept"] = sum(fitted.values()) <= sum(after.values())
            if choices["steps_kept"]:
                after = fitted
            else:  # too large a learning rate: keep the grid's values
                with torch.no_grad():
                    for p, value in zip(params, saved):
                        p.copy_(value)
    finally:
        model.train(was_training)
    return {"backend": backend, "before": before, "after": after, "choices": choices}


def _check_grid(name: str, values) -> list[float]:
    values = [float(v) for v in values]
    if not values or min(values) <= 0:
        raise ValueError(f"{name}={values} must be a non-empty list of positive numbers")
    return values


def _grid_race(model, modules, batches, betas) -> dict[int, float]:
    if betas is None:
        betas = [f * head_dims(model)[2] ** -0.5 for f in DEFAULT_RACE_BETA_FACTORS]
    betas = _check_grid("race_betas", betas)
    for idx, module in modules:
        if getattr(module, "hfab_beta", None) is None:
            raise ValueError(f"layer {idx} has no hfab_beta parameter; convert the model with hf_attention_backends."
                             "convert (enable_backend alone adds no learnable beta)")
    scores = []
    for beta in betas:
        with torch.no_grad():
            for _, module in modules:
                module.hfab_beta.fill_(beta)
        scores.append(layer_errors(model, batches))
    best = {idx: betas[min(range(len(betas)), key=lambda j: scores[j][idx])] for idx, _ in modules}
    with torch.no_grad():
        for idx, module in modules:
            module.hfab_beta.fill_(best[idx])
    return best


def _grid_stieltjes(model, modules, batches, orders) -> dict:
    orders = _check_grid("stieltjes_orders", DEFAULT_STIELTJES_ORDERS if orders is None else orders)
    base = modules[0][1].hfab_config

    def set_order(order):
        config = dataclasses.replace(base, order=order)  # validates order >= 1
        for _, module in modules:
            module.hfab_config = config

    scores = []
    for order in orders:
        set_order(order)
        scores.append(layer_errors(model, batches))
    best = min(range(len(orders)), key=lambda j: sum(scores[j].values()))
    set_order(orders[best])
    plan = getattr(model.config, "hfab_plan", None)
    if plan is not None:
        plan["config"]["order"] = orders[best]
    per_layer = {idx: orders[min(range(len(orders)), key=lambda j: scores[j][idx])] for idx, _ in modules}
    return {"order": orders[best], "best_order_per_layer": per_layer}


def _grid_temperature(model, modules, batches, temperatures) -> dict[int, list[float]]:
    temperatures = _check_grid("temperatures", DEFAULT_STIELTJES_TEMPERATURES if temperatures is None
                               else temperatures)
    for idx, module in modules:
        if getattr(module, "hfab_temperature", None) is None:
            raise ValueError(f"layer {idx} has no hfab_temperature parameter; convert the model with "
                             "hf_attention_backends.convert(model, 'stieltjes', per_head_temperature=True)")
    current = layer_errors(model, batches)
    for head in range(modules[0][1].hfab_temperature.numel()):
        best = {idx: (current[idx], float(m.hfab_temperature.detach()[head])) for idx, m in modules}
        for value in temperatures:
            with torch.no_grad():
                for _, module in modules:
                    module.hfab_temperature[head] = value
            for idx, err in layer_errors(model, batches).items():
                if err < best[idx][0]:
                    best[idx] = (err, value)
        with torch.no_grad():
            for idx, module in modules:
                module.hfab_temperature[head] = best[idx][1]
        current = {idx: err for idx, (err, _) in best.items()}
    return {idx: m.hfab_temperature.detach().tolist() for idx, m in modules}


def _hfab_parameters(modules) -> list[torch.nn.Parameter]:
    return [p for _, m in modules for n, p in m.named_parameters(recurse=False) if n.startswith("hfab_")]


def _fit(model, modules, batches, steps: int, lr: float) -> list[float]:
    params = _hfab_parameters(modules)
    if not params:
        raise ValueError("steps > 0 but the converted layers have no hfab_* parameters to fit (exact adds none; "
                         "Stieltjes needs per_head_temperature=True, Nyström conv_kernel_size > 0)")
    frozen = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.Adam(params, lr=lr)
    history = []
    try:
        with TeacherForcing(model) as forcing:
            for batch in itertools.islice(itertools.cycle(batches), steps):
                _forward(model, forcing, batch)
                loss = sum(forcing.losses().values())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                with torch.no_grad():
                    for _, module in modules:
                        for name in ("hfab_beta", "hfab_temperature"):
                            value = getattr(module, name, None)
                            if value is not None:
                                value.clamp_(min=_MIN_BETA)
                history.append(float(loss.detach()))
    finally:
        optimizer.zero_grad()  # leave no gradient behind for the caller's next optimizer step
        for p, flag in frozen.items():
            p.requires_grad_(flag)
    return history
