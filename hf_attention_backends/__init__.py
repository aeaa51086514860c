"""hf_attention_backends: Nyström, Stieltjes, RACE and exact attention for HuggingFace transformers.

Importing the package registers the ``hfab::*`` torch ops and the ``hfab_<backend>`` attention
functions with transformers' AttentionInterface / AttentionMaskInterface.
"""
from .ops import exact_attention, make_planes, nystrom_attention, race_attention, stieltjes_attention
from .backends import disable_backend, enable_backend
from .backends.race_cache import RaceCache, race_cache
from .convert import convert, from_pretrained
from . import nn

__version__ = "0.1.0"

__all__ = [
    "nystrom_attention", "stieltjes_attention", "race_attention", "exact_attention", "make_planes",
    "enable_backend", "disable_backend", "race_cache", "RaceCache", "convert", "from_pretrained", "nn", "__version__",
]
