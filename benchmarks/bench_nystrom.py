"""Nyström attention (non-causal), fp16, newton_iter=6: a long case (B=1, H=4, D=64, m=32,
N=64K..2M), a wide one (B=4, H=16, D=128, m=64, N=4K..128K) and the wide shape at short N (512..4K) for issue 4's
crossover length against SDPA (target <= 2,048; benchmarks.report prints it)."""
import torch

from .registry import Case, register_case

_K = 1024

register_case(Case(backend="nystrom", name="nystrom_long", dtype=torch.float16, batch=1, heads=4, head_dim=64,
                   sizes=tuple(n * _K for n in (64, 128, 256, 512, 1024, 2048)), quick_sizes=(64 * _K, 256 * _K),
                   options={"num_landmarks": 32, "newton_iter": 6}, tiny_options={"num_landmarks": 8}))
register_case(Case(backend="nystrom", name="nystrom_wide", dtype=torch.float16, batch=4, heads=16, head_dim=128,
                   sizes=tuple(n * _K for n in (4, 8, 16, 32, 64, 128)), quick_sizes=(4 * _K, 16 * _K),
                   options={"num_landmarks": 64, "newton_iter": 6}, tiny_options={"num_landmarks": 8}))
register_case(Case(backend="nystrom", name="nystrom_crossover", dtype=torch.float16, batch=4, heads=16, head_dim=128,
                   sizes=(512, _K, 2 * _K, 4 * _K), quick_sizes=(_K, 2 * _K, 4 * _K),
                   options={"num_landmarks": 64, "newton_iter": 6}, tiny_options={"num_landmarks": 8}))
