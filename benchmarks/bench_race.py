"""RACE attention, bf16, B=1, H=8, D=64, P=4 planes, L=4 tables, T=64K..2M, causal and not; D=128 and D=32 causal.

The planes are the fixed seeded buffer of ``hfab.make_planes``; beta is a learnable 0-dim fp32
tensor (D**-0.5) that gets a gradient in fwd+bwd, as in training.
"""
import torch

from .registry import Case, register_case

_K = 1024
NUM_TABLES, NUM_PLANES = 4, 4


def race_tensors(case: Case, device: torch.device) -> dict:
    import hf_attention_backends as hfab
    planes = hfab.make_planes(NUM_TABLES, NUM_PLANES, case.head_dim, seed=0).to(device)
    beta = torch.tensor(case.head_dim ** -0.5, dtype=torch.float32, device=device)
    return {"planes": planes, "beta": beta}


for _causal in (True, False):
    register_case(Case(backend="race", name="race_causal" if _causal else "race", dtype=torch.bfloat16, batch=1,
                       heads=8, head_dim=64, sizes=tuple(n * _K for n in (64, 128, 256, 512, 1024, 2048)),
                       quick_sizes=(64 * _K, 256 * _K), options={"causal": _causal}, make_tensors=race_tensors,
                       trainable=("beta",)))

# issue 6's non-causal bandwidth row: B=4, H=16, D=64, T=65,536 (>= 70% of the HBM copy ceiling)
register_case(Case(backend="race", name="race_b4h16", dtype=torch.bfloat16, batch=4, heads=16, head_dim=64,
                   sizes=(64 * _K,), quick_sizes=(64 * _K,), options={"causal": False}, make_tensors=race_tensors,
                   trainable=("beta",)))

# head dims 128 (most 7B-class models) and 32 (small models): the tensor-core kernels' largest and smallest tiles,
# each with its own register and shared-memory budget (blocks per SM)
for _d in (128, 32):
    register_case(Case(backend="race", name=f"race_causal_d{_d}", dtype=torch.bfloat16, batch=1, heads=8, head_dim=_d,
                       sizes=(64 * _K, 256 * _K), quick_sizes=(64 * _K,), options={"causal": True},
                       make_tensors=race_tensors, trainable=("beta",)))
