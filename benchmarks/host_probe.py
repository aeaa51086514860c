"""Host time of the Nyström op's pieces on a GPU machine: µs per call to enqueue (no synchronize inside the loop)
and µs per call of wall time, for the C++ forward and backward, the public function with and without autograd, and
small ATen calls for scale. ``python -m benchmarks.host_probe`` (CUDA only); NOTES.md of csrc/nystrom quotes it."""
import time

import torch

import hf_attention_backends  # noqa: F401 (loads the extension)
from hf_attention_backends.ops.nystrom import op as nop


def per_call(fn, calls: int = 300) -> tuple[float, float]:
    """(µs per call until the host has enqueued ``calls`` calls, µs per call until the GPU has run them)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return 1e6 * (enqueued - start) / calls, 1e6 * (done - start) / calls


def main() -> None:
    dev = "cuda"
    for (B, H, N, D) in ((4, 16, 1024, 128), (1, 4, 256, 64)):
        q, k, v = [torch.randn(B, H, N, D, device=dev, dtype=torch.float16) for _ in range(3)]
        g = torch.randn_like(q)
        h = (64, 6, 0.0, D ** -0.5)
        _, state = torch.ops.hfab.nystrom_fwd.default(q, k, v, None, None, *h)
        qq, kk, vv = [t.detach().requires_grad_(True) for t in (q, k, v)]
        x = torch.zeros(16, device=dev)
        cases = {
            "check_args": lambda: nop._check_args(q, k, v, 64, 6, 0.0, None, None, None),
            "op fwd (torch.ops)": lambda: torch.ops.hfab.nystrom_fwd.default(q, k, v, None, None, *h),
            "op bwd with state": lambda: torch.ops.hfab.nystrom_bwd.default(g, q, k, v, None, None, *h, state),
            "op bwd recompute": lambda: torch.ops.hfab.nystrom_bwd.default(g, q, k, v, None, None, *h, []),
            "public fwd no_grad": lambda: torch.no_grad()(nop.nystrom_attention)(q, k, v),
            "public fwd with grad": lambda: nop.nystrom_attention(qq, kk, vv),
            "public fwd+bwd": lambda: torch.autograd.grad(nop.nystrom_attention(qq, kk, vv), [qq, kk, vv], g),
            "21 x torch.empty": lambda: [torch.empty(64, device=dev) for _ in range(21)],
            "26 x add_": lambda: [x.add_(1) for _ in range(26)],
            "10 x small matmul": lambda: [torch.matmul(x.view(4, 4), x.view(4, 4)) for _ in range(10)],
        }
        print(f"B{B} H{H} N{N} D{D}: host us per call to enqueue / wall us per call")
        for name, fn in cases.items():
            enq, wall = per_call(fn)
            print(f"  {name:24s} {enq:8.1f} {wall:8.1f}")


if __name__ == "__main__":
    main()
