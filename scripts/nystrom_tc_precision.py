"""Precision of the tensor-core Nyström backward's buffer gradients (csrc/nystrom/nystrom_tc_bwd_kernels.cuh), on the CPU.

1. The k1 kernel's arithmetic in float64: inputs rounded to fp16 / bf16, the fp32 keys (landmarks) and values
   (W = Z (K3 v) from the reference) as 16-bit high parts plus residuals, P and dS in halves, fp32 sums; the error of
   d vals = K1ᵀ dO and d keys = dS1ᵀ q_s against float64, next to the all-fp32 arithmetic of the CUDA-core kernels
   and the dtype's rounding.
2. How far such an error moves dq, dk, dv: float64 autograd through the reference's math with noise of a given
   relative size added to the gradients of W and of the landmark keys, at the shape of
   tests/ops/test_nystrom_cuda.py::test_newton_iterations[20].
3. Newton–Schulz with its products as the tensor-core kernels compute them (`NsProducts`, m <= 64: both operands in
   two tf32 halves, hi hi + hi lo + lo hi) against all-fp32 products and float64: the error of the output
   K1 (Z (K3 v)), where |W| / |out| amplifies the error of Z.
4. The Newton–Schulz VJP through the steps (nystrom_ns_bwd_kernel's formula) with its fp32 products as 3xTF32 and as
   fp32, the two products with A in float64 rounded to fp32 (as the kernel): the error of dA and of the last dZ
   against float64, for a random dL/dZ.
5. The dk/dv kernel's two split products (dv = K3ᵀ dW0, dk = dS3ᵀ Q̃: both operands in halves of the input dtype,
   hi hi + hi lo + lo hi) against the same products with one residual product dropped: each error over the GPU
   tests' bound (3x the fp32 reference rounded to the dtype, + 1e-5), the worst over inputs x0.05..x10, N 333..4097,
   m 16 and 64.
Run: python scripts/nystrom_tc_precision.py (CPU, a few seconds). csrc/nystrom/NOTES.md quotes its output."""
import torch

from hf_attention_backends.ops.nystrom.reference import k2_inverse, repeat_kv, segment_means


def rounded(x, dtype):
    return x.float().to(dtype).double()


def halves(x, dtype):
    hi = rounded(x, dtype)
    return hi, rounded(x - hi, dtype)


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def buffer_gradient_errors(dtype, scale_in, m, n, iters, d=64, seed=0):
    """(|W| / |out|, d vals error fp32 / tensor cores, d keys error fp32 / tensor cores) against float64."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (rounded(torch.randn(n, d, generator=g, dtype=torch.float64) * s, dtype)
                     for s in (scale_in, scale_in, scale_in, 1.0))
    r = d ** -0.25
    q_land, k_land = segment_means(q * r, m), segment_means(k * r, m)
    k2 = torch.softmax(q_land @ k_land.T, -1)
    k3 = torch.softmax(q_land @ (k * r).T, -1)
    w = k2_inverse(k2, iters, 0.0) @ (k3 @ v)

    def grads(p_of, dp_of, split):
        p = p_of()
        dp = dp_of()
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        if split is None:
            return p.T @ dout.to(p.dtype), ds.T @ q.to(p.dtype) * r
        f = torch.float32
        ph, pl = halves(p, split)
        sh, sl = halves(ds, split)
        return ((ph.to(f).T @ dout.to(f) + pl.to(f).T @ dout.to(f)).double(),
                ((sh.to(f).T @ q.to(f) + sl.to(f).T @ q.to(f)) * r).double())

    exact = grads(lambda: torch.softmax(q @ k_land.T * r, -1), lambda: dout @ w.T, None)
    f = torch.float32
    fp32 = [x.double() for x in grads(lambda: torch.softmax(q.to(f) @ k_land.to(f).T * r, -1),
                                      lambda: dout.to(f) @ w.to(f).T, None)]
    kh, kl = halves(k_land, dtype)
    vh, vl = halves(w, dtype)
    tc = grads(lambda: torch.softmax((q.to(f) @ kh.to(f).T + q.to(f) @ kl.to(f).T) * r, -1),
               lambda: dout.to(f) @ vh.to(f).T + dout.to(f) @ vl.to(f).T, dtype)
    ratio = (w.abs().max() / (torch.softmax(q @ k_land.T * r, -1) @ w).abs().max()).item()
    return ratio, [(relative(a.double(), e), relative(b, e)) for a, b, e in zip(fp32, tc, exact)]


def gradient_sensitivity(eps, seed=1):
    """Relative change of (dq, dk, dv) when noise of relative size eps is added to dL/dW and dL/dK̃ (float64)."""
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, n, d, m, iters = 2, 2, 1, 100, 32, 8, 20
    q, k, v, dout = (torch.randn(b, h, n, d, generator=g).half().double() for h in (hq, hkv, hkv, hq))
    r = d ** -0.25

    def run(noise):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        qs, ks = leaves[0] * r, leaves[1] * r
        k_land = repeat_kv(segment_means(ks, m), hq) * 1.0
        q_land = segment_means(qs, m)
        k2 = torch.softmax(q_land @ k_land.transpose(-1, -2), -1)
        k3 = torch.softmax(q_land @ repeat_kv(ks, hq).transpose(-1, -2), -1)
        w = k2_inverse(k2, iters, 0.0) @ (k3 @ repeat_kv(leaves[2], hq))
        if noise:
            gen = torch.Generator().manual_seed(seed)
            for t in (w, k_land):
                t.register_hook(lambda gr: gr + noise * gr.abs().amax()
                                * torch.randn(gr.shape, generator=gen, dtype=gr.dtype))
        out = torch.softmax(qs @ k_land.transpose(-1, -2), -1) @ w
        return torch.autograd.grad(out, leaves, dout)

    clean = run(0.0)
    return [relative(a, c) for a, c in zip(run(eps), clean)]


def tf32_halves(x):
    """x (fp32) as two tf32 parts by truncation, as mma::tf32_split: hi keeps sign, exponent and 10 mantissa bits."""
    def truncate(t):
        return (t.contiguous().view(torch.int32) & -8192).view(torch.float32)  # 0xffffe000
    hi = truncate(x)
    return hi, truncate(x - hi)


def product_3xtf32(a, b):
    """a b (fp32) from hi hi + hi lo + lo hi, each exact in float64, the sum rounded to fp32."""
    (ah, al), (bh, bl) = tf32_halves(a), tf32_halves(b)
    return (ah.double() @ bh.double() + ah.double() @ bl.double() + al.double() @ bh.double()).float()


def newton_schulz(a, iters, product):
    """The kernels' Newton–Schulz (Z₀ = Aᵀ / ‖A‖₁‖A‖∞, Z ← ¼ Z (13I − M (15I − M (7I − M))), M = A Z)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    z = a.T / (a.abs().sum(0).max() * a.abs().sum(1).max())
    for _ in range(iters):
        mz = product(a, z)
        t = 15 * eye - product(mz, 7 * eye - mz)
        z = product(0.25 * z, 13 * eye - product(mz, t))
    return z


def newton_schulz_vjp(a, zs, gz, product):
    """(dA through the steps, dL/dZ₀) as nystrom_ns_bwd_kernel: the products with A in float64, rounded to a's dtype."""
    def with_a(x, y):
        return (x.double() @ y.double()).to(x.dtype)
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    da = torch.zeros_like(a)
    for z in reversed(zs[:-1]):
        mz = with_a(a, z)
        t1 = 7 * eye - mz
        t2 = 15 * eye - product(mz, t1)
        t3 = 13 * eye - product(mz, t2)
        dz = 0.25 * product(gz, t3.T)
        dv = -0.25 * product(z.T, gz)
        du = -product(mz.T, dv)
        dm = product(dv, t2.T) + product(du, t1.T) - product(mz.T, du)
        da = da + product(dm, z.T)
        gz = dz + with_a(a.T, dm)
    return da, gz


def newton_schulz_vjp_errors(scale_in, m, iters, d=64, seed=0):
    """(cond(K2), VJP error with fp32 products, with 3xTF32 products) against float64, for a random dL/dZ."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(m, d, generator=g, dtype=torch.float64) * scale_in for _ in range(2))
    a = torch.softmax(q @ k.T / d ** 0.5, -1)
    gz = torch.randn(m, m, generator=g, dtype=torch.float64)
    zs, z = [], a.T / (a.abs().sum(0).max() * a.abs().sum(1).max())
    for _ in range(iters + 1):
        zs.append(z)
        mz = a @ z
        z = 0.25 * z @ (13 * torch.eye(m, dtype=a.dtype) - mz @ (15 * torch.eye(m, dtype=a.dtype)
                                                                   - mz @ (7 * torch.eye(m, dtype=a.dtype) - mz)))
    exact = newton_schulz_vjp(a, zs, gz, torch.matmul)
    zs32 = [z.float() for z in zs]

    def error(product):
        got = newton_schulz_vjp(a.float(), zs32, gz.float(), product)
        return max(relative(x.double(), e) for x, e in zip(got, exact))
    return torch.linalg.cond(a).item(), error(torch.matmul), error(product_3xtf32)


def newton_schulz_output_errors(dtype, scale_in, m, n, iters, d=64, seed=0):
    """(|W| / |out|, out error with fp32 products, with 3xTF32 products) against float64."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (rounded(torch.randn(n, d, generator=g, dtype=torch.float64) * scale_in, dtype) for _ in range(3))
    r = d ** -0.25
    q_land, k_land = segment_means(q * r, m), segment_means(k * r, m)
    k1 = torch.softmax(q * r @ k_land.T, -1)
    k2 = torch.softmax(q_land @ k_land.T, -1)
    w0 = torch.softmax(q_land @ (k * r).T, -1) @ v
    outs = [k1 @ (newton_schulz(k2.to(dt), iters, product).double() @ w0)
            for dt, product in ((torch.float64, torch.matmul), (torch.float32, torch.matmul),
                                (torch.float32, product_3xtf32))]
    ratio = ((newton_schulz(k2, iters, torch.matmul) @ w0).abs().max() / outs[0].abs().max()).item()
    return ratio, relative(outs[1], outs[0]), relative(outs[2], outs[0])


def row_halves(x, dtype):
    """x (rows, cols) float64 as the kernels split it: each row times a power of two (max in [2^14, 2^15), as
    scale_rows), then a high part and residual in dtype, scaled back."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-300))).amax(-1, keepdim=True)
    s = torch.pow(2.0, 14 - e)
    hi, lo = halves(x * s, dtype)
    return hi / s, lo / s


def key_gradient_residual_ratios(dtype, n, m, scale_in, amplify, d=64, seed=0):
    """{(gradient, variant): kernel error / the tests' bound} for dv = K3ᵀ dW0 and dk = dS3ᵀ Q̃ (keys as rows), variant
    "hi hi + hi lo + lo hi" (the kernel) or with x's or the landmark side's residual dropped; dW0 with a rank-one part
    `amplify` times larger (cancellation in dP3 - rowdot)."""
    g = torch.Generator().manual_seed(seed)
    k, v = (rounded(torch.randn(n, d, generator=g, dtype=torch.float64) * scale_in, dtype) for _ in range(2))
    r = d ** -0.25
    q_land = torch.randn(m, d, generator=g, dtype=torch.float64) * scale_in * 0.3 * r
    k3 = torch.softmax(q_land @ k.T * r, -1)
    dw0 = (torch.randn(m, d, generator=g, dtype=torch.float64)
           + amplify * torch.randn(m, 1, generator=g, dtype=torch.float64) * torch.randn(1, d, generator=g,
                                                                                      dtype=torch.float64))
    dp = dw0 @ v.T
    ds = k3 * (dp - (k3 * dp).sum(-1, keepdim=True))
    ratios = {}
    for name, x, b, mul in (("dv", k3, dw0, 1.0), ("dk", ds, q_land, r)):
        exact = x.T @ b * mul
        bound = 3 * (rounded(exact, dtype) - exact).abs().max().item() + 1e-5
        (xh, xl), (bh, bl) = row_halves(x.T, dtype), row_halves(b, dtype)
        for variant, terms in (("hi hi + hi lo + lo hi", ((xh, bh), (xh, bl), (xl, bh))),
                               ("x's residual dropped", ((xh, bh), (xh, bl))),
                               ("landmark residual dropped", ((xh, bh), (xl, bh)))):
            got = rounded(sum(a @ c for a, c in terms) * mul, dtype)
            ratios[(name, variant)] = (got - exact).abs().max().item() / bound
    return ratios


def worst_key_gradient_residual_ratios(dtype):
    worst = {}
    for n in (333, 1024, 4097):
        for m in (16, 64):
            for scale_in in (0.05, 1, 3, 10):
                for amplify in (0, 50):
                    for key, ratio in key_gradient_residual_ratios(dtype, n, m, scale_in, amplify, seed=n + m).items():
                        worst[key] = max(worst.get(key, 0.0), ratio)
    return worst


def main():
    for dtype in (torch.bfloat16, torch.float16):
        for scale_in, m, n, iters in ((1, 64, 4097, 20), (3, 32, 2049, 6), (10, 32, 333, 6), (1, 128, 4097, 20)):
            ratio, (dv, dk) = buffer_gradient_errors(dtype, scale_in, m, n, iters)
            rounding = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
            print(f"{str(dtype):15s} x{scale_in:<2} m={m:3d} N={n} NS {iters:2d} |W|/|out| {ratio:5.0f}: d vals fp32 "
                  f"{dv[0]:.1e} tensor cores {dv[1]:.1e}; d keys fp32 {dk[0]:.1e} tensor cores {dk[1]:.1e}; "
                  f"dtype rounding {rounding:.1e}")
    for eps in (3e-6, 4e-5):
        moved = ", ".join(f"{name} {x:.1e}" for name, x in zip(("dq", "dk", "dv"), gradient_sensitivity(eps)))
        print(f"noise {eps:.0e} on dL/dW and dL/dK̃ moves {moved}")
    for dtype in (torch.bfloat16, torch.float16):
        for scale_in, m, n, iters in ((1, 64, 4097, 20), (1, 64, 4097, 6), (3, 32, 2049, 6), (10, 32, 333, 6),
                                      (10, 8, 333, 20)):
            ratio, fp32, tf32x3 = newton_schulz_output_errors(dtype, scale_in, m, n, iters)
            rounding = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
            print(f"{str(dtype):15s} x{scale_in:<2} m={m:3d} N={n} NS {iters:2d} |W|/|out| {ratio:6.0f}: out with "
                  f"fp32 products {fp32:.1e}, 3xTF32 products {tf32x3:.1e}; dtype rounding {rounding:.1e}")
    for scale_in, m, iters in ((10, 8, 20), (3, 16, 20), (1, 64, 6), (3, 32, 6)):
        cond, fp32, tf32x3 = newton_schulz_vjp_errors(scale_in, m, iters)
        print(f"NS VJP x{scale_in:<2} m={m:3d} NS {iters:2d} cond(K2) {cond:8.1e}: dA, dZ0 with fp32 products {fp32:.1e}, "
              f"3xTF32 products {tf32x3:.1e}")
    for dtype in (torch.bfloat16, torch.float16):
        for (name, variant), ratio in sorted(worst_key_gradient_residual_ratios(dtype).items()):
            print(f"{str(dtype):15s} {name} {variant:26s}: worst error / the tests' bound {ratio:.2f}")


if __name__ == "__main__":
    main()
