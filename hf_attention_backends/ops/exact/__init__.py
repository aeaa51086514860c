from .op import exact_attention

__all__ = ["exact_attention"]
