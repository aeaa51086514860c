"""The four attention ops. Importing this registers every ``hfab::*`` op, loads the compiled
CUDA kernels when present and guards the ops that have none (see ``_registry``)."""
from .._ext import load_extension
from ._registry import install_cuda_guards, registered_ops
from .exact import exact_attention

load_extension()
install_cuda_guards()

__all__ = ["exact_attention", "registered_ops"]
