"""transformers integration: ``hfab_*`` attention + mask functions (registered at import), enable/disable.

See README.md in this folder for the contract (mask classification, guards, per-module attributes).
"""
from .adapters import ATTENTION_FUNCTIONS, BACKENDS, implementation_name, register
from .config import CONFIGS, make_config
from .enable import disable_backend, enable_backend

register()

__all__ = ["enable_backend", "disable_backend", "make_config", "CONFIGS", "BACKENDS", "ATTENTION_FUNCTIONS",
           "implementation_name", "register"]
