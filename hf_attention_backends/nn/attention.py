"""Self-contained multi-head attention modules on the package's ops, for building new models.

Each module owns q/k/v/o projections (``nn.Linear``, optional bias), supports GQA
(``num_kv_heads`` divides ``num_heads``) and calls the public op of its backend:

    attn = RACEAttention(hidden_size=256, num_heads=8, num_kv_heads=2, causal=True, num_planes=4)
    y = attn(x, key_padding_mask=mask)      # x (B, N, 256) -> y (B, N, 256)

The config of each module is its shape fields (:class:`AttentionConfig`) plus the backend's knobs,
inherited from ``backends.config`` (same names, same validation as ``enable_backend``/``convert``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Optional

from torch import Tensor, nn

from ..backends.config import CONFIGS, ExactConfig, NystromConfig, RaceConfig, StieltjesConfig, make_config
from ..ops import exact_attention, nystrom_attention, race_attention, stieltjes_attention
from ..ops._common import check_positive_int
from .parameters import add_backend_parameters, temperature_scaled


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Shape of a multi-head attention layer.

    hidden_size: model width (input and output features). num_heads: query heads Hq.
    num_kv_heads: key/value heads Hkv (None = num_heads; must divide num_heads: GQA/MQA).
    head_dim: D (None = hidden_size // num_heads, which must then divide exactly).
    bias: biases on the four projections. causal: causal mask (not for Nyström).
    """
    hidden_size: int
    num_heads: int
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    bias: bool = True
    causal: bool = False

    backend: ClassVar[str] = "exact"
    causal_supported: ClassVar[bool] = True

    def __post_init__(self):
        check_positive_int("hidden_size", self.hidden_size)
        check_positive_int("num_heads", self.num_heads)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        check_positive_int("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                                 "pass head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        check_positive_int("head_dim", self.head_dim)
        for name in ("bias", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.causal and not self.causal_supported:
            raise ValueError(f"causal=True is not supported by {self.backend} attention; supported: causal=False")
        backend_post_init = getattr(super(), "__post_init__", None)
        if backend_post_init is not None:
            backend_post_init()

    @property
    def backend_config(self):
        """The backend's knobs alone, as the ``backends.config`` dataclass ``enable_backend`` uses."""
        fields = dataclasses.fields(CONFIGS[self.backend])
        return make_config(self.backend, **{f.name: getattr(self, f.name) for f in fields})


@dataclass(frozen=True, kw_only=True)
class ExactAttentionConfig(AttentionConfig, ExactConfig):
    """Exact softmax attention: shape fields only."""
    backend: ClassVar[str] = "exact"


@dataclass(frozen=True, kw_only=True)
class NystromAttentionConfig(AttentionConfig, NystromConfig):
    """Shape fields plus NystromConfig's (num_landmarks, newton_iter, kappa_star, conv_kernel_size); non-causal."""
    backend: ClassVar[str] = "nystrom"
    causal_supported: ClassVar[bool] = False


@dataclass(frozen=True, kw_only=True)
class StieltjesAttentionConfig(AttentionConfig, StieltjesConfig):
    """Shape fields plus StieltjesConfig's (order, newton_iter)."""
    backend: ClassVar[str] = "stieltjes"


@dataclass(frozen=True, kw_only=True)
class RACEAttentionConfig(AttentionConfig, RaceConfig):
    """Shape fields plus RaceConfig's (num_planes, num_tables, beta, seed, per_head_beta)."""
    backend: ClassVar[str] = "race"


class _BackendAttention(nn.Module):
    """Projections, head split/merge and boundary checks shared by the four modules.

    Construct with a config or with its fields as keywords (not both). Subclasses set ``config_class``
    and implement ``_attend(q, k, v, key_padding_mask)`` on (B, H, N, D) tensors.
    """
    config_class: ClassVar[type] = AttentionConfig

    def __init__(self, config: Optional[AttentionConfig] = None, **kwargs):
        super().__init__()
        if config is None:
            config = self.config_class(**kwargs)
        elif kwargs:
            raise TypeError(f"pass either config or keyword fields, not both (got config and {sorted(kwargs)})")
        if type(config) is not self.config_class:
            raise TypeError(f"config must be a {self.config_class.__name__}, got {type(config).__name__}")
        self.config = c = config
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.bias)
        add_backend_parameters(self, c.backend_config, num_heads=c.num_heads, head_dim=c.head_dim)

    def forward(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """x: (B, N, hidden_size) floating point. key_padding_mask: optional (B, N) bool, True = real token.

        Returns (B, N, hidden_size) in x's dtype. Outputs at padded positions are computed but carry no meaning.
        """
        c = self.config
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a (B, N, hidden_size={c.hidden_size}) tensor, got {shape}")
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, c.num_heads, c.head_dim).transpose(1, 2)  # (B, Hq, N, D)
        k = self.k_proj(x).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, N, D)
        v = self.v_proj(x).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        out = self._attend(q, k, v, key_padding_mask)  # (B, Hq, N, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, c.num_heads * c.head_dim))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return repr(self.config)


class ExactAttention(_BackendAttention):
    """Exact softmax attention (:func:`hf_attention_backends.exact_attention`)."""
    config_class = ExactAttentionConfig

    def _attend(self, q, k, v, key_padding_mask):
        return exact_attention(q, k, v, causal=self.config.causal, key_padding_mask=key_padding_mask)


class NystromAttention(_BackendAttention):
    """Nyström attention (:func:`hf_attention_backends.nystrom_attention`), non-causal.

    With ``conv_kernel_size > 0`` it owns ``conv_weight`` (num_heads, ks), initialised to zero.
    """
    config_class = NystromAttentionConfig

    def _attend(self, q, k, v, key_padding_mask):
        c = self.config
        return nystrom_attention(q, k, v, num_landmarks=c.num_landmarks, newton_iter=c.newton_iter,
                                 kappa_star=c.kappa_star, conv_weight=getattr(self, "conv_weight", None),
                                 key_padding_mask=key_padding_mask)


class StieltjesAttention(_BackendAttention):
    """Stieltjes attention (:func:`hf_attention_backends.stieltjes_attention`).

    With ``per_head_temperature`` it owns ``temperature`` (num_heads,), initialised to one, multiplying each
    head's scores.
    """
    config_class = StieltjesAttentionConfig

    def _attend(self, q, k, v, key_padding_mask):
        c = self.config
        q = temperature_scaled(q, getattr(self, "temperature", None))
        return stieltjes_attention(q, k, v, order=c.order, newton_iter=c.newton_iter, causal=c.causal,
                                   key_padding_mask=key_padding_mask)


class RACEAttention(_BackendAttention):
    """RACE attention (:func:`hf_attention_backends.race_attention`).

    Owns the fixed buffer ``planes`` (num_tables, num_planes, head_dim) from ``make_planes(..., seed=seed)``
    (give each layer of a stack its own seed) and the learnable ``beta`` (() or (num_heads,) with per_head_beta).
    """
    config_class = RACEAttentionConfig

    def _attend(self, q, k, v, key_padding_mask):
        return race_attention(q, k, v, planes=self.planes, beta=self.beta, causal=self.config.causal,
                              key_padding_mask=key_padding_mask)
