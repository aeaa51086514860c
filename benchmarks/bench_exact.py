"""Exact softmax attention (FlashAttention-2 on CUDA cores): B=1, H=16, causal, fp16, D=64 and 128."""
import torch

from .registry import Case, register_case

for _d in (64, 128):
    register_case(Case(backend="exact", name=f"exact_d{_d}_causal", dtype=torch.float16, batch=1, heads=16,
                       head_dim=_d, sizes=(2048, 4096), quick_sizes=(2048, 4096), options={"causal": True}))
