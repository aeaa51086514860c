// CUDA impl of hfab::nystrom_bwd (schema in hf_attention_backends/ops/nystrom/op.py): the exact gradient of
// nystrom_fwd through every Newton–Schulz iterate. Landmarks, real-token positions, K2, the NS iterates and
// W = Z W0 come from the forward's kernels (nystrom_inverse_fwd_kernel saves the iterates); the NS VJP and
// the N-sized products are ATen fp32 on the current stream (K1 (B, Hq, N, slots) and K3
// (B, Hq, m, N) are materialised: O(N m) extra memory). NOTES.md: the fused kernels that replace them.
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include "nystrom/nystrom_host.cuh"

namespace hfab {
namespace nystrom {
namespace {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// dS = P (dP - rowsum(P dP)) for a row softmax P.
at::Tensor softmax_vjp(const at::Tensor& p, const at::Tensor& dp) { return p.mul(dp.sub(p.mul(dp).sum(-1, true))); }

at::Tensor tr(const at::Tensor& x) { return x.transpose(-1, -2); }

// fp32 copies of the inputs and the real-token mask (B, N).
struct F32 {
  at::Tensor qs, ks, vf, real;  // q √scale (B, Hq, N, D), k √scale and v (B, Hkv, N, D)
};

// p3 = K3 (B, Hq, m, N) for landmark sequences, else undefined.
Grads backward(Inputs& in, State& st, const at::Tensor& dout, const F32& f, const at::Tensor& p3) {
  const int64_t B = in.batch, N = in.n, D = in.d, S = st.slots;
  const auto i64 = in.q.options().dtype(at::kLong);
  const at::Tensor &qs = f.qs, &ks = f.ks, &vf = f.vf, &real = f.real;
  const at::Tensor dof = dout.to(at::kFloat).contiguous();
  const at::Tensor rank = in.mask.defined() ? st.cumsum.to(at::kLong).sub(1)
                                            : at::arange(N, i64).unsqueeze(0).expand({B, N});
  const at::Tensor n_real = in.mask.defined() ? st.n_real.to(at::kLong) : at::full({B}, N, i64);

  // out = P1 vals, P1 = softmax(q_s keysᵀ) over the nvalid first slots
  const at::Tensor valid = at::arange(S, i64).unsqueeze(0).lt(st.nvalid.to(at::kLong).unsqueeze(1));  // (B, S)
  const at::Tensor p1 = masked_softmax(qs.matmul(tr(st.keys)), valid.view({B, 1, 1, S}));  // (B, Hq, N, S)
  const at::Tensor dvals = tr(p1).matmul(dof);
  const at::Tensor ds1 = softmax_vjp(p1, dof.matmul(tr(st.vals)));
  at::Tensor dqs = ds1.matmul(st.keys);
  const at::Tensor dkeys = tr(ds1).matmul(qs);  // (B, Hq, S, D)

  // exact sequences: slot r holds the r-th real token
  const at::Tensor ex = st.exact.view({B, 1, 1, 1});
  const at::Tensor sel = real.logical_and(st.exact.view({B, 1})).logical_and(rank.lt(S)).view({B, 1, N, 1});
  const at::Tensor slot_of = rank.clamp(0, S - 1).view({B, 1, N, 1}).expand({B, in.hkv, N, D});
  at::Tensor dks = ungroup(in, dkeys.masked_fill(ex.logical_not(), 0.0)).gather(2, slot_of).masked_fill(
      sel.logical_not(), 0.0);
  at::Tensor dv = ungroup(in, dvals.masked_fill(ex.logical_not(), 0.0)).gather(2, slot_of).masked_fill(
      sel.logical_not(), 0.0);

  if (st.nystrom) {  // landmark sequences: keys = K̃, vals = W = Z W0, W0 = K3 v
    const at::Tensor dklg0 = dkeys.masked_fill(ex, 0.0);
    const at::Tensor dw = dvals.masked_fill(ex, 0.0);
    const at::Tensor ksg = group(in, ks), vg = group(in, vf);
    const at::Tensor dz = dw.matmul(tr(st.w0));
    const at::Tensor dw0 = tr(st.z).matmul(dw);
    dv = dv.add(ungroup(in, tr(p3).matmul(dw0)));
    const at::Tensor ds3 = softmax_vjp(p3, dw0.matmul(tr(vg)));
    at::Tensor dql = ds3.matmul(ksg);
    dks = dks.add(ungroup(in, tr(ds3).matmul(st.q_land)));
    const at::Tensor ds2 = softmax_vjp(st.k2, k2_inverse_backward(st.ns, dz));
    dql = dql.add(ds2.matmul(st.k_land_g));
    const at::Tensor dkl = ungroup(in, dklg0.add(tr(ds2).matmul(st.q_land)));  // (B, Hkv, m, D)
    // segment means: real token i of a landmark sequence gets dL[l(i)] / |segment l(i)|
    const at::Tensor seg = n_real.div(in.m, "floor").clamp_min(1).unsqueeze(1);
    const at::Tensor lt = rank.div(seg, "floor").clamp(0, in.m - 1);  // (B, N)
    const at::Tensor spread = st.counts.clamp_min(1.0).reciprocal().gather(1, lt)
                                  .masked_fill(real.logical_and(st.exact.logical_not().view({B, 1})).logical_not(), 0.0)
                                  .view({B, 1, N, 1});
    dqs = dqs.add(dql.gather(2, lt.view({B, 1, N, 1}).expand({B, in.hq, N, D})).mul(spread));
    dks = dks.add(dkl.gather(2, lt.view({B, 1, N, 1}).expand({B, in.hkv, N, D})).mul(spread));
  }

  at::Tensor dconv = at::empty({0}, in.q.options());
  if (in.conv.defined()) {  // out[i] += Σ_t w[h, t] v_masked[i + t - c]
    const int64_t ks_ = in.conv.size(1), c = ks_ / 2;
    const at::Tensor realv = real.view({B, 1, N, 1});
    const at::Tensor vp = at::constant_pad_nd(group(in, vf).masked_fill(realv.logical_not(), 0.0), {0, 0, c, c});
    const at::Tensor dop = at::constant_pad_nd(dof, {0, 0, c, c});
    std::vector<at::Tensor> cols;
    at::Tensor dvm = at::zeros_like(dof);
    for (int64_t tap = 0; tap < ks_; ++tap) {
      cols.push_back(dof.mul(vp.slice(2, tap, tap + N)).sum({0, 2, 3}));
      dvm = dvm.add(in.conv.select(1, tap).view({1, in.hq, 1, 1}).mul(dop.slice(2, 2 * c - tap, 2 * c - tap + N)));
    }
    dconv = at::stack(cols, 1).to(in.conv_dtype).contiguous();
    dv = dv.add(ungroup(in, dvm).masked_fill(realv.logical_not(), 0.0));
  }
  return {dqs.mul(in.root).to(in.q.scalar_type()).contiguous(), dks.mul(in.root).to(in.k.scalar_type()).contiguous(),
          dv.to(in.v.scalar_type()).contiguous(), dconv};
}

Grads nystrom_bwd_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& conv_weight, const std::optional<at::Tensor>& key_padding_mask,
                       int64_t num_landmarks, int64_t newton_iter, double kappa_star, double scale) {
  constexpr const char* kOp = "hfab::nystrom_bwd";
  Inputs in = prepare(kOp, q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale);
  check_on_device(kOp, "dout", dout, q.device());
  TORCH_CHECK(dout.sizes() == q.sizes(), kOp, ": dout ", dout.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), kOp, ": dout.dtype=", dout.scalar_type(), " must be q's dtype ",
              q.scalar_type());
  const c10::cuda::CUDAGuard guard(q.device());
  const auto contiguous = at::MemoryFormat::Contiguous;
  if (q.numel() == 0) {  // no query (B, Hq or N is 0): every gradient is 0
    at::Tensor dconv = in.conv.defined() ? at::zeros(in.conv.sizes(), in.q.options().dtype(in.conv_dtype))
                                         : at::empty({0}, q.options());
    return {at::zeros(q.sizes(), q.options().memory_format(contiguous)),
            at::zeros(k.sizes(), k.options().memory_format(contiguous)),
            at::zeros(v.sizes(), v.options().memory_format(contiguous)), dconv};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  Grads grads;
  dispatch(q, [&](auto tag, auto dim) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value;
    State st = landmark_state<T, D>(in, stream);
    F32 f;
    f.qs = in.q.to(at::kFloat).mul(in.root).contiguous();  // one layout: strided views give the same bits
    f.ks = in.k.to(at::kFloat).mul(in.root).contiguous();
    f.vf = in.v.to(at::kFloat).contiguous();
    f.real = in.mask.defined() ? in.mask : at::full({in.batch, in.n}, true, q.options().dtype(at::kBool));
    at::Tensor p3, w0;
    if (st.nystrom) {  // K3 materialised in fp32 (the backward needs it), W0 = K3 v
      p3 = masked_softmax(st.q_land.matmul(tr(group(in, f.ks))), f.real.view({in.batch, 1, 1, in.n}));
      w0 = p3.matmul(group(in, f.vf));
    }
    finish_state<D>(in, st, w0, true, stream);
    grads = backward(in, st, dout, f, p3);
  });
  return grads;
}

}  // namespace
}  // namespace nystrom
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("nystrom_bwd", &hfab::nystrom::nystrom_bwd_cuda); }
