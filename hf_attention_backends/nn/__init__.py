"""Attention modules for new models built on the package's ops (see ``attention.py``)."""
from .attention import (AttentionConfig, ExactAttention, ExactAttentionConfig, NystromAttention,
                        NystromAttentionConfig, RACEAttention, RACEAttentionConfig, StieltjesAttention,
                        StieltjesAttentionConfig)
from .parameters import add_backend_parameters

__all__ = ["AttentionConfig", "ExactAttention", "ExactAttentionConfig", "NystromAttention", "NystromAttentionConfig",
           "RACEAttention", "RACEAttentionConfig", "StieltjesAttention", "StieltjesAttentionConfig",
           "add_backend_parameters"]
