from .op import make_planes, race_attention

__all__ = ["make_planes", "race_attention"]
