// CUDA impl of hfab::nystrom_fwd (schema in hf_attention_backends/ops/nystrom/op.py).
#include <torch/library.h>

#include "nystrom/nystrom_host.cuh"

namespace hfab {
namespace nystrom {
namespace {

// (out, state): state = StateLayout's two tensors for hfab::nystrom_bwd (none when q is empty).
std::tuple<at::Tensor, std::vector<at::Tensor>> nystrom_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& conv_weight,
    const std::optional<at::Tensor>& key_padding_mask, int64_t num_landmarks, int64_t newton_iter, double kappa_star,
    double scale) {
  constexpr const char* kOp = "hfab::nystrom_fwd";
  const AutocastOff autocast_off;
  Inputs in = prepare(kOp, q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return {out, {}};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  std::vector<at::Tensor> state;
  dispatch_dtype_head_dim(q, [&](auto tag, auto dim) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value;
    State st = landmark_state<T, D>(in, stream);
    finish_state<T, D>(in, st, stream);
    in.p.out = out.data_ptr();
    in.p.out_lse = st.lse1.data_ptr<float>();
    if (buffer_attention_on_tensor_cores<D>(in, q.device())) {
      launch_query_tiles(tc::nystrom_out_tc_fwd_kernel<T, D, 1>, tc::OutSmem<D>::bytes(in.p.slots),
                         tc::nystrom_out_tc_fwd_kernel<T, D, 2>, tc::OutSmem<D>::bytes(in.p.slots, 2), in.p, in,
                         q.device(), stream);
    } else {
      const dim3 grid(static_cast<unsigned>(div_up(in.n, OutTiles<D>::BQ)), static_cast<unsigned>(in.hq),
                      static_cast<unsigned>(in.batch));
      nystrom_out_fwd_kernel<T, D><<<grid, kThreads, 0, stream>>>(in.p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    state = st.tensors;
  });
  return {out, state};
}

}  // namespace
}  // namespace nystrom
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("nystrom_fwd", &hfab::nystrom::nystrom_fwd_cuda); }
