"""The four attention ops. Importing this registers every ``hfab::*`` op, loads the compiled
CUDA kernels when present and guards the ops that have none (see ``_registry``)."""
from .._ext import load_extension
from ._registry import install_cuda_guards, registered_ops
from .exact import exact_attention
from .nystrom import nystrom_attention
from .race import make_planes, race_attention
from .stieltjes import stieltjes_attention

load_extension()
install_cuda_guards()

__all__ = ["exact_attention", "nystrom_attention", "race_attention", "make_planes", "stieltjes_attention",
           "registered_ops"]
