// CUDA impl of hfab::stieltjes_bwd (schema in hf_attention_backends/ops/stieltjes/op.py).
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "stieltjes/stieltjes_host.cuh"

namespace hfab {
namespace stieltjes {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> stieltjes_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rowmax,
    const at::Tensor& lam, const at::Tensor& u, const at::Tensor& lsum,
    const std::optional<at::Tensor>& key_padding_mask, bool causal, double scale, double order) {
  constexpr const char* kOp = "hfab::stieltjes_bwd";
  const AutocastOff autocast_off;
  Inputs in = prepare(kOp, q, k, v, key_padding_mask, causal, scale, order);
  check_on_device(kOp, "dout", dout, q.device());
  TORCH_CHECK(dout.sizes() == q.sizes(), kOp, ": dout ", dout.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), kOp, ": dout must have q's dtype ", q.scalar_type(), ", got ",
              dout.scalar_type());
  const at::IntArrayRef rows = q.sizes().slice(0, 3);
  const c10::Device device = q.device();
  const at::Tensor rowmax_c = saved_state(kOp, "rowmax", rowmax, rows, device);
  const at::Tensor lam_c = saved_state(kOp, "lam", lam, rows, device);
  const at::Tensor lsum_c = saved_state(kOp, "lsum", lsum, rows, device);
  const at::Tensor u_c = saved_state(kOp, "u", u, q.sizes(), device);
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor dout_r = vector_readable(dout);
  const auto contiguous = at::MemoryFormat::Contiguous;
  at::Tensor dq = at::empty(q.sizes(), q.options().memory_format(contiguous));
  at::Tensor dk = at::empty(k.sizes(), k.options().memory_format(contiguous));
  at::Tensor dv = at::empty(v.sizes(), v.options().memory_format(contiguous));
  at::Tensor delta = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));

  Params p = in.p;
  p.dout = dout_r.data_ptr();
  p.sdo = strides_of(dout_r);
  p.rowmax = const_cast<float*>(rowmax_c.data_ptr<float>());
  p.lam = const_cast<float*>(lam_c.data_ptr<float>());
  p.delta = delta.data_ptr<float>();
  p.lsum = const_cast<float*>(lsum_c.data_ptr<float>());
  p.u = const_cast<float*>(u_c.data_ptr<float>());
  p.o = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  const unsigned batch = static_cast<unsigned>(q.size(0));
  const unsigned hkv = static_cast<unsigned>(k.size(1));
  const bool any_query = dq.numel() > 0, any_key = dk.numel() > 0;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  dispatch(q, order, [&](auto tag, auto dim, auto iord) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value, IORD = decltype(iord)::value;
    if (any_query) {  // dq, and the per-row delta the dk/dv kernel reads
      using Cfg = DqCfg<D>;
      launch(stieltjes_dq_kernel<T, D, IORD>, dim3(blocks(p.nq, Cfg::BQ), p.hq, batch), sizeof(typename Cfg::Smem),
             stream, p);
    }
    if (any_key) {  // with no query every dk, dv is 0: the kernel writes them all the same
      using Cfg = DkvCfg<D>;
      launch(stieltjes_dkv_kernel<T, D, IORD>, dim3(blocks(p.nk, Cfg::BK), hkv, batch), sizeof(typename Cfg::Smem),
             stream, p);
    }
  });
  return {dq, dk, dv};
}

}  // namespace
}  // namespace stieltjes
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("stieltjes_bwd", &hfab::stieltjes::stieltjes_bwd_cuda); }
