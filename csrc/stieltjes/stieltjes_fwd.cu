// CUDA impl of hfab::stieltjes_fwd (schema in hf_attention_backends/ops/stieltjes/op.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "stieltjes/stieltjes_host.cuh"

namespace hfab {
namespace stieltjes {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> stieltjes_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask,
    bool causal, double scale, double order, int64_t newton_iter) {
  constexpr const char* kOp = "hfab::stieltjes_fwd";
  const AutocastOff autocast_off;
  TORCH_CHECK(newton_iter >= -100 && newton_iter <= 100, kOp, ": newton_iter=", newton_iter,
              " is not supported; supported: -100..100 (< 0: -newton_iter steps, then extra ones where rows need them)");
  Inputs in = prepare(kOp, q, k, v, key_padding_mask, causal, scale, order);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor rowmax = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  at::Tensor lam = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, rowmax, lam};
  Params p = in.p;
  p.o = out.data_ptr();
  p.rowmax = rowmax.data_ptr<float>();
  p.lam = lam.data_ptr<float>();
  p.newton_iter = static_cast<int>(newton_iter);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dispatch(q, order, [&](auto tag, auto dim, auto iord) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value;
    using Cfg = FwdCfg<D>;
    const dim3 grid(blocks(p.nq, Cfg::BQ), p.hq, static_cast<unsigned>(q.size(0)));
    launch(stieltjes_fwd_kernel<T, D, decltype(iord)::value>, grid, sizeof(typename Cfg::Smem), stream, p);
  });
  return {out, rowmax, lam};
}

}  // namespace
}  // namespace stieltjes
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("stieltjes_fwd", &hfab::stieltjes::stieltjes_fwd_cuda); }
