"""Loads the compiled extension ``hf_attention_backends._C`` (CUDA kernels), if it was built."""
from __future__ import annotations

import importlib
import warnings

import torch

_state = {"loaded": False, "error": None}


def load_extension() -> bool:
    """Import ``_C`` once. On a CUDA machine a failed load is reported once, as a warning."""
    if _state["loaded"] or _state["error"] is not None:
        return _state["loaded"]
    try:
        importlib.import_module("hf_attention_backends._C")
        _state["loaded"] = True
    except ImportError as err:
        _state["error"] = err
        if torch.cuda.is_available():
            warnings.warn(
                f"hf_attention_backends: the CUDA extension could not be loaded ({err}); CUDA inputs will "
                "raise NotImplementedError unless HFAB_REFERENCE_ON_CUDA=1. Rebuild with "
                "`HFAB_BUILD_CUDA=1 pip install -e .` (see README).", RuntimeWarning, stacklevel=2)
    return _state["loaded"]


def extension_loaded() -> bool:
    return _state["loaded"]


def extension_error():
    return _state["error"]
