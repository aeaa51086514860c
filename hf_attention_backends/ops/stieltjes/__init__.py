from .op import stieltjes_attention

__all__ = ["stieltjes_attention"]
