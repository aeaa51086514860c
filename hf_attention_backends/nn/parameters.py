"""The tensors a backend adds to an attention module, built in one place for ``convert`` and the nn modules.

| backend | name | kind | shape | initial value |
|---|---|---|---|---|
| race | ``planes`` | persistent buffer, never trained | (L, P, D) | ``make_planes(L, P, D, seed=seed + seed_offset)`` |
| race | ``beta`` | Parameter | () or (Hq,) with ``per_head_beta`` | ``config.beta``, else D**-0.5 |
| nystrom | ``conv_weight`` | Parameter, only if ``conv_kernel_size > 0`` | (Hq, ks) | zeros |
| stieltjes | ``temperature`` | Parameter, only with ``per_head_temperature`` | (Hq,) | ones |

The Nyström conv weight starts at zero so that a freshly converted layer computes exactly the plain
Nyström output; fine-tuning then learns the depthwise-conv residual. The Stieltjes temperature multiplies head h's
query (so its scores) by ``temperature[h]`` (:func:`temperature_scaled`); exact adds nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..backends.config import NystromConfig, RaceConfig, StieltjesConfig
from ..ops import make_planes


def add_backend_parameters(module: nn.Module, config, *, num_heads: int, head_dim: int, prefix: str = "",
                           seed_offset: int = 0, device=None, dtype: Optional[torch.dtype] = None) -> list[str]:
    """Register the backend's tensors (table above) on ``module`` as ``prefix + name``; returns the names.

    config: a backends.config dataclass (``make_config(backend, ...)``). num_heads: query heads Hq.
    seed_offset: added to the RACE seed (``convert`` passes the layer index so layers get different planes).
    device, dtype: of the new tensors (default: CPU, torch's default dtype).
    """
    dtype = dtype or torch.get_default_dtype()
    added = []
    if isinstance(config, RaceConfig):
        planes = make_planes(config.num_tables, config.num_planes, head_dim, seed=config.seed + seed_offset)
        module.register_buffer(prefix + "planes", planes.to(device=device, dtype=dtype), persistent=True)
        beta = head_dim ** -0.5 if config.beta is None else float(config.beta)
        shape = (num_heads,) if config.per_head_beta else ()
        module.register_parameter(prefix + "beta", nn.Parameter(torch.full(shape, beta, device=device, dtype=dtype)))
        added += [prefix + "planes", prefix + "beta"]
    elif isinstance(config, NystromConfig) and config.conv_kernel_size > 0:
        weight = torch.zeros(num_heads, config.conv_kernel_size, device=device, dtype=dtype)
        module.register_parameter(prefix + "conv_weight", nn.Parameter(weight))
        added.append(prefix + "conv_weight")
    elif isinstance(config, StieltjesConfig) and config.per_head_temperature:
        ones = torch.ones(num_heads, device=device, dtype=dtype)
        module.register_parameter(prefix + "temperature", nn.Parameter(ones))
        added.append(prefix + "temperature")
    return added


def temperature_scaled(query: Tensor, temperature: Optional[Tensor]) -> Tensor:
    """query (B, Hq, N, D) with head h multiplied by temperature[h] ((Hq,); None: query unchanged)."""
    if temperature is None:
        return query
    return query * temperature.to(query.dtype).view(1, -1, 1, 1)
