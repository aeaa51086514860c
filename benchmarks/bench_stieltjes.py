"""Stieltjes attention, bf16, order 4, D=64, causal and not: B=4, H=8, N=2K..8K and B=1, H=8, N=16K."""
import torch

from .registry import Case, register_case

for _causal in (False, True):
    _suffix = "_causal" if _causal else ""
    register_case(Case(backend="stieltjes", name=f"stieltjes{_suffix}", dtype=torch.bfloat16, batch=4, heads=8,
                       head_dim=64, sizes=(2048, 4096, 8192), quick_sizes=(2048, 4096),
                       options={"order": 4.0, "causal": _causal}))
    register_case(Case(backend="stieltjes", name=f"stieltjes_long{_suffix}", dtype=torch.bfloat16, batch=1, heads=8,
                       head_dim=64, sizes=(16384,), quick_sizes=(16384,), options={"order": 4.0, "causal": _causal}))
