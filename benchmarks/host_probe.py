"""Host time per call of each backend's public function on a GPU machine, at shapes small enough that the GPU waits
for the host: µs per call to enqueue (no synchronize inside the loop) and µs per call of wall time, under no_grad,
with autograd, and forward + backward; for Nyström also its ops' C++ forward and backward, and small ATen calls for
scale. ``python -m benchmarks.host_probe [--calls 300]``; csrc/nystrom/NOTES.md quotes it. ``--device cpu --tiny``
checks the script itself on a machine without a GPU (the CPU references; Nyström's ops are CUDA-only there)."""
import argparse
import time

import torch

import hf_attention_backends as hfab

from .timing import synchronize

SHAPES = ((4, 16, 1024, 128), (1, 4, 256, 64))  # (B, H, N, D)
TINY_SHAPES = ((1, 2, 80, 32),)
BACKENDS = ("exact", "stieltjes", "race", "nystrom")


def per_call(fn, calls: int, device: torch.device) -> tuple[float, float]:
    """(µs per call until the host has enqueued ``calls`` calls, µs per call until the device has run them)."""
    for _ in range(2):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    enqueued = time.perf_counter()
    synchronize(device)
    done = time.perf_counter()
    return 1e6 * (enqueued - start) / calls, 1e6 * (done - start) / calls


def public_functions(d: int, device: torch.device) -> dict:
    """name -> attention(q, k, v) with each backend's defaults (RACE: P 4, L 4, beta 1)."""
    planes = hfab.make_planes(4, 4, d).to(device)
    return {
        "exact": lambda q, k, v: hfab.exact_attention(q, k, v, causal=True),
        "stieltjes": lambda q, k, v: hfab.stieltjes_attention(q, k, v, causal=True),
        "race": lambda q, k, v: hfab.race_attention(q, k, v, planes=planes, beta=1.0, causal=True),
        "nystrom": lambda q, k, v: hfab.nystrom_attention(q, k, v, num_landmarks=64),
    }


def probe_cases(b: int, h: int, n: int, d: int, device: torch.device, backends=BACKENDS) -> dict:
    """name -> callable: the public functions of ``backends`` three ways, Nyström's ops (CUDA), and ATen calls for
    scale."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(3))
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    dout = torch.randn_like(q)
    cases = {}
    for name, fn in public_functions(d, device).items():
        if name not in backends:
            continue
        cases[f"{name} fwd no_grad"] = lambda fn=fn: torch.no_grad()(fn)(q, k, v)
        cases[f"{name} fwd with grad"] = lambda fn=fn: fn(*leaves)
        cases[f"{name} fwd+bwd"] = lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, dout)
    if device.type == "cuda" and "nystrom" in backends:
        hyper = (64, 6, 0.0, d ** -0.5)
        _, state = torch.ops.hfab.nystrom_fwd.default(q, k, v, None, None, *hyper)
        cases["nystrom op fwd"] = lambda: torch.ops.hfab.nystrom_fwd.default(q, k, v, None, None, *hyper)
        cases["nystrom op bwd, saved state"] = lambda: torch.ops.hfab.nystrom_bwd.default(dout, q, k, v, None, None,
                                                                                         *hyper, state)
    x = torch.zeros(16, device=device)
    cases["21 x torch.empty"] = lambda: [torch.empty(64, device=device) for _ in range(21)]
    cases["26 x add_"] = lambda: [x.add_(1) for _ in range(26)]
    cases["10 x small matmul"] = lambda: [torch.matmul(x.view(4, 4), x.view(4, 4)) for _ in range(10)]
    return cases


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help=f"shape {TINY_SHAPES[0]} instead of {SHAPES}")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated: the backends whose functions to time (a build may hold only some)")
    args = parser.parse_args(argv)
    backends = tuple(args.backends.split(","))
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"--backends {args.backends!r}: unknown {sorted(unknown)}; supported: {', '.join(BACKENDS)}")
    device = torch.device(args.device)
    for b, h, n, d in TINY_SHAPES if args.tiny else SHAPES:
        print(f"B{b} H{h} N{n} D{d} on {device}: host µs per call to enqueue / wall µs per call")
        for name, fn in probe_cases(b, h, n, d, device, backends).items():
            enqueued, wall = per_call(fn, args.calls, device)
            print(f"  {name:28s} {enqueued:8.1f} {wall:8.1f}")


if __name__ == "__main__":
    main()
