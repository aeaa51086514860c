from .op import nystrom_attention

__all__ = ["nystrom_attention"]
