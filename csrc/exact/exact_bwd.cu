// CUDA impl of hfab::exact_bwd (schema in hf_attention_backends/ops/exact/op.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "exact/exact_host.cuh"

namespace hfab {
namespace exact {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> exact_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask, bool causal, double scale) {
  constexpr const char* kOp = "hfab::exact_bwd";
  const AutocastOff autocast_off;
  Inputs in = prepare(kOp, q, k, v, key_padding_mask, causal, scale);
  check_on_device(kOp, "dout", dout, q.device());
  check_on_device(kOp, "out", out, q.device());
  check_on_device(kOp, "lse", lse, q.device());
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), kOp, ": dout ", dout.sizes(), " and out ",
              out.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), kOp,
              ": dout and out must have q's dtype ", q.scalar_type(), ", got ", dout.scalar_type(), " and ",
              out.scalar_type());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, kOp, ": lse.dtype=", lse.scalar_type(),
              "; supported: torch.float32 (as returned by hfab::exact_fwd)");
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
              kOp, ": lse.shape=", lse.sizes(), "; expected (B, Hq, Nq)");
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor dout_r = vector_readable(dout), out_r = vector_readable(out), lse_c = lse.contiguous();
  const auto contiguous = at::MemoryFormat::Contiguous;
  at::Tensor dq = at::empty(q.sizes(), q.options().memory_format(contiguous));
  at::Tensor dk = at::empty(k.sizes(), k.options().memory_format(contiguous));
  at::Tensor dv = at::empty(v.sizes(), v.options().memory_format(contiguous));
  at::Tensor delta = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));

  Params p = in.p;
  p.out = out_r.data_ptr();
  p.dout = dout_r.data_ptr();
  p.so = strides_of(out_r);
  p.sdo = strides_of(dout_r);
  p.lse = lse_c.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.o = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  const unsigned batch = static_cast<unsigned>(q.size(0));
  const unsigned hkv = static_cast<unsigned>(k.size(1));
  const bool any_query = dq.numel() > 0, any_key = dk.numel() > 0;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dispatch_dtype_head_dim(q, [&](auto tag, auto dim) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value;
    if (any_query) {
      const dim3 rows(blocks(int64_t{p.hq} * p.nq, kTileThreads / 32), batch);
      exact_delta_bwd_kernel<T, D><<<rows, kTileThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      using Dq = DqTiles<D>;
      const dim3 grid(blocks(p.nq, Dq::BQ), p.hq, batch);
      exact_dq_bwd_kernel<T, D, Dq::BQ, Dq::BK><<<grid, kTileThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (any_key) {  // with no query every dK, dV is 0: the kernel writes them all the same
      using Dkv = DkvTiles<D>;
      const dim3 grid(blocks(p.nk, Dkv::BK), hkv, batch);
      exact_dkv_bwd_kernel<T, D, Dkv::BK, Dkv::BQ><<<grid, kTileThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace exact
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("exact_bwd", &hfab::exact::exact_bwd_cuda); }
