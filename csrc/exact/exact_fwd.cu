// CUDA impl of hfab::exact_fwd (schema in hf_attention_backends/ops/exact/op.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "exact/exact_host.cuh"

namespace hfab {
namespace exact {
namespace {

std::tuple<at::Tensor, at::Tensor> exact_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const std::optional<at::Tensor>& key_padding_mask, bool causal,
                                                  double scale) {
  constexpr const char* kOp = "hfab::exact_fwd";
  const AutocastOff autocast_off;
  Inputs in = prepare(kOp, q, k, v, key_padding_mask, causal, scale);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  Params p = in.p;
  p.o = out.data_ptr();
  p.lse_out = lse.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dispatch_dtype_head_dim(q, [&](auto tag, auto dim) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value;
    using Tiles = FwdTiles<D>;
    const dim3 grid(blocks(p.nq, Tiles::BQ), p.hq, static_cast<unsigned>(q.size(0)));
    exact_attn_fwd_kernel<T, D, Tiles::BQ, Tiles::BK><<<grid, kTileThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse};
}

}  // namespace
}  // namespace exact
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("exact_fwd", &hfab::exact::exact_fwd_cuda); }
