// CUDA impl of hfab::race_fwd (schema in hf_attention_backends/ops/race/op.py).
#include <torch/library.h>

#include "race/race_host.cuh"

namespace hfab {
namespace race {
namespace {

at::Tensor race_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& planes,
                         const at::Tensor& beta, const std::optional<at::Tensor>& key_padding_mask, bool causal) {
  constexpr const char* kOp = "hfab::race_fwd";
  const AutocastOff autocast_off;
  Inputs in = prepare(kOp, q, k, v, planes, beta, key_padding_mask, causal);
  const c10::cuda::CUDAGuard guard(q.device());
  const auto contiguous = q.options().memory_format(at::MemoryFormat::Contiguous);
  if (q.numel() == 0 || k.size(2) == 0) return at::zeros(q.sizes(), contiguous);  // no key: every row is 0
  Params p = in.p;
  const bool tensor_cores = tc_forward_applies(q, p, q.device());
  // causal with Nq - Nk >= 64: the tensor-core kernels leave the rows of query tiles before the first key
  at::Tensor out = tensor_cores && causal && p.kappa0 < 0 ? at::zeros(q.sizes(), contiguous)
                                                          : at::empty(q.sizes(), contiguous);
  p.out = out.data_ptr();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor kstate, kz;
  if (tensor_cores) make_vector_readable(in, p);
  dispatch_dtype_head_dim<true>(q, [&](auto tag, auto dim) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value;
    if constexpr (!std::is_same_v<T, float>) {
      if (tensor_cores) return tc_forward<T, D>(kOp, p, kstate, kz, f32, q.size(0), q.device(), stream);
    }
    key_states<T, D>(kOp, p, kstate, kz, f32, q.size(0), q.device(), stream);
    const dim3 grid(p.nqt, p.hq, static_cast<unsigned>(q.size(0)));
    launch(kOp, race_out_fwd_kernel<T, D>, grid, Layout::out(p.lp), p, q.device(), stream);
  });
  return out;
}

}  // namespace
}  // namespace race
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("race_fwd", &hfab::race::race_fwd_cuda); }
