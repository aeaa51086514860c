"""Order-independent diagnosis of the H200 segfault in test_float32_and_head_dims_raise_clear_errors.

Seen once (torch 2.11, python 3.12): the test segfaulted inside pytest after ~100 other CUDA tests,
while the same call in a fresh process raised the expected RuntimeError. Each step below runs in
its own subprocess with faulthandler on, so a crash names its step instead of killing the script:

  fresh         the failing calls alone (dtype float32, head dims 16/48/256): must raise cleanly
  after-work    the same calls after kernel launches like the earlier tests (fwd + bwd, GQA, padding,
                bf16, ragged N) with a device synchronize and a memory check in between
  after-graph   the same calls after a CUDA graph capture and replay on a side stream
  pytest-alone  pytest of the one test, then of the test file up to it (-x)

  python scripts/repro_exact_error.py [STEP ...]          (default: all steps)

For a native backtrace of a crashing step: gdb -batch -ex run -ex bt --args python <this> STEP.
For out-of-bounds device accesses: compute-sanitizer --tool memcheck python <this> after-work.
"""
import faulthandler
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST = "tests/ops/test_exact_cuda.py"


def error_calls():
    import torch
    q = torch.randn(1, 2, 8, 64, device="cuda")
    for dtype, d, text in ((torch.float32, 64, "dtype Float is not supported"),
                           (torch.float16, 16, "head dim D=16"), (torch.float16, 48, "head dim D=48"),
                           (torch.float16, 256, "head dim D=256")):
        t = torch.randn(1, 2, 8, d, device="cuda").to(dtype) if d != 64 else q.to(dtype)
        try:
            torch.ops.hfab.exact_fwd(t, t, t, None, False, 0.1)
        except RuntimeError as err:
            assert text in str(err), f"unexpected message: {err}"
            print(f"  raised as expected: {str(err).splitlines()[0][:100]}")
        else:
            raise AssertionError(f"no error for dtype={dtype}, D={d}")


def work():
    import torch
    for dtype in (torch.float16, torch.bfloat16):
        for n, d, hq, hkv in ((7, 32, 4, 2), (333, 64, 6, 1), (2049, 128, 4, 2), (65, 64, 3, 3)):
            q = torch.randn(2, hq, n, d, device="cuda", dtype=dtype)
            k = torch.randn(2, hkv, n, d, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            mask = torch.rand(2, n, device="cuda") > 0.2
            for causal in (False, True):
                out, lse = torch.ops.hfab.exact_fwd(q, k, v, mask, causal, d ** -0.5)
                grads = torch.ops.hfab.exact_bwd(torch.randn_like(q), q, k, v, out, lse, mask, causal, d ** -0.5)
                torch.cuda.synchronize()
                assert all(bool(torch.isfinite(g).all()) for g in grads), (dtype, n, d, causal)
    print(f"  work done; memory allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB")


def graph():
    import torch
    q = torch.randn(2, 4, 333, 64, device="cuda", dtype=torch.float16)
    k, v = q[:, :2].clone(), q[:, 2:].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.ops.hfab.exact_fwd(q, k, v, None, True, 0.125)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.hfab.exact_fwd(q, k, v, None, True, 0.125)
    g.replay()
    torch.cuda.synchronize()
    print(f"  graph captured and replayed; capturing now: {torch.cuda.is_current_stream_capturing()}")


def step(name):
    faulthandler.enable()
    import hf_attention_backends  # noqa: F401  (loads the extension, registers the CUDA kernels)
    if name == "after-work":
        work()
    elif name == "after-graph":
        graph()
    error_calls()


def pytest_steps():
    node = f"{TEST}::test_float32_and_head_dims_raise_clear_errors"
    for args in ([node], [TEST, "-x", "-k", "not compile and not opcheck and not graphs"]):
        cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        rc = subprocess.call(cmd, cwd=ROOT)
        print(f"pytest {' '.join(args)}: rc={rc}" + (" (signal: crashed)" if rc < 0 else ""))


def main(argv):
    steps = argv or ["fresh", "after-work", "after-graph", "pytest-alone"]
    if len(steps) == 1 and steps[0] in ("fresh", "after-work", "after-graph"):
        step(steps[0])
        return 0
    failed = []
    for name in steps:
        if name == "pytest-alone":
            pytest_steps()
            continue
        print(f"== {name}")
        rc = subprocess.call([sys.executable, "-X", "faulthandler", os.path.abspath(__file__), name], cwd=ROOT)
        print(f"== {name}: rc={rc}" + (" (signal: crashed)" if rc < 0 else ""))
        failed += [name] if rc != 0 else []
    print("failed steps:", ", ".join(failed) or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
