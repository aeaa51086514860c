// CUDA impl of hfab::stieltjes_fwd (schema in hf_attention_backends/ops/stieltjes/op.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "stieltjes/stieltjes_host.cuh"

namespace hfab {
namespace stieltjes {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> stieltjes_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask,
    bool causal, double scale, double order, int64_t newton_iter, bool backward_state) {
  constexpr const char* kOp = "hfab::stieltjes_fwd";
  const AutocastOff autocast_off;
  TORCH_CHECK(newton_iter >= -100 && newton_iter <= 100, kOp, ": newton_iter=", newton_iter,
              " is not supported; supported: -100..100 (< 0: -newton_iter steps, then extra ones where rows need them)");
  Inputs in = prepare(kOp, q, k, v, key_padding_mask, causal, scale, order);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor rowmax = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  at::Tensor lam = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  const auto state_options = q.options().dtype(at::kFloat);
  at::Tensor u = backward_state ? at::empty(q.sizes(), state_options) : at::empty({0}, state_options);
  at::Tensor lsum = backward_state ? at::empty({q.size(0), q.size(1), q.size(2)}, state_options)
                                   : at::empty({0}, state_options);
  if (out.numel() == 0) return {out, rowmax, lam, u, lsum};
  Params p = in.p;
  p.o = out.data_ptr();
  p.rowmax = rowmax.data_ptr<float>();
  p.lam = lam.data_ptr<float>();
  p.newton_iter = static_cast<int>(newton_iter);
  if (backward_state) {
    p.u = u.data_ptr<float>();
    p.lsum = lsum.data_ptr<float>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dispatch(q, order, [&](auto tag, auto dim, auto iord) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value, IORD = decltype(iord)::value;
    using Cfg = FwdCfg<D>;
    const dim3 grid(blocks(p.nq, Cfg::BQ), p.hq, static_cast<unsigned>(q.size(0)));
    const size_t smem = sizeof(typename Cfg::Smem);
    if (backward_state) launch(stieltjes_fwd_kernel<T, D, IORD, true>, grid, smem, stream, p);
    else launch(stieltjes_fwd_kernel<T, D, IORD, false>, grid, smem, stream, p);
  });
  return {out, rowmax, lam, u, lsum};
}

}  // namespace
}  // namespace stieltjes
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("stieltjes_fwd", &hfab::stieltjes::stieltjes_fwd_cuda); }
