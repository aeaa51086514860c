"""hf_attention_backends: Nyström, Stieltjes, RACE and exact attention for HuggingFace transformers."""
from .ops import exact_attention

__version__ = "0.1.0"

__all__ = ["exact_attention", "__version__"]
