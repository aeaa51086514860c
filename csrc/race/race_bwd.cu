// CUDA impl of hfab::race_bwd (schema in hf_attention_backends/ops/race/op.py); the kernels are launched
// from race_bwd_{f16,bf16,f32}.cu.
#include <torch/library.h>

#include "race/race_host.cuh"

namespace hfab {
namespace race {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> race_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& planes,
    const at::Tensor& beta, const std::optional<at::Tensor>& key_padding_mask, bool causal) {
  constexpr const char* kOp = "hfab::race_bwd";
  const AutocastOff autocast_off;
  Inputs in = prepare(kOp, q, k, v, planes, beta, key_padding_mask, causal);
  check_on_device(kOp, "dout", dout, q.device());
  TORCH_CHECK(dout.sizes() == q.sizes(), kOp, ": dout ", dout.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), kOp, ": dout.dtype=", dout.scalar_type(), " must be q's dtype ",
              q.scalar_type());
  const c10::cuda::CUDAGuard guard(q.device());
  const auto contiguous = at::MemoryFormat::Contiguous;
  const auto f32 = q.options().dtype(at::kFloat);
  if (q.numel() == 0 || k.numel() == 0) {  // no query or no key: every gradient is 0
    return {at::zeros(q.sizes(), q.options().memory_format(contiguous)),
            at::zeros(k.sizes(), k.options().memory_format(contiguous)),
            at::zeros(v.sizes(), v.options().memory_format(contiguous)),
            at::zeros(beta.sizes(), beta.options().memory_format(contiguous))};
  }
  Params p = in.p;
  const bool tensor_cores = tc_backward_applies(q, p, q.device());
  const bool tc_keys = tensor_cores && tc_key_side_applies(q, p, q.device());
  at::Tensor dout_r = unit_last_stride(dout);
  if (tensor_cores) {  // the tensor-core kernels read q, k, v, dout with 16-byte vectors
    make_vector_readable(in, p);
    dout_r = vector_readable(dout_r);
  }
  // causal with Nq - Nk >= 64: the tensor-core dq kernel never visits the query tiles before the first key
  const bool unvisited = tensor_cores && causal && p.kappa0 < 0;
  const auto alloc = [&](at::IntArrayRef sizes, const at::TensorOptions& options) {
    return unvisited ? at::zeros(sizes, options) : at::empty(sizes, options);
  };
  at::Tensor dq = alloc(q.sizes(), q.options().memory_format(contiguous));
  at::Tensor dk = at::empty(k.sizes(), k.options().memory_format(contiguous));
  at::Tensor dv = at::empty(v.sizes(), v.options().memory_format(contiguous));
  const int64_t batch = q.size(0);
  p.dout = dout_r.data_ptr();
  p.sdo = strides_of(dout_r);
  p.out = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  at::Tensor den = alloc({batch, p.hq, p.nq}, f32);
  at::Tensor cq = alloc({batch, p.hq, p.nq}, f32);
  const int qslots = (tc_keys ? tc_query_groups(p) : p.nqt) + 1;
  at::Tensor qstate = at::empty({batch, p.hq, qslots, p.features, q.size(3)}, f32);
  at::Tensor qz = at::empty({batch, p.hq, qslots, p.features}, f32);
  at::Tensor dkv_scratch;  // GQA on the tensor-core key side: dk, dv summed over a group's q heads in fp32
  if (tc_keys && p.groups > 1) {
    dkv_scratch = at::empty({2, batch, k.size(1), p.nk, q.size(3)}, f32);
    p.dk_scratch = dkv_scratch[0].data_ptr<float>();
    p.dv_scratch = dkv_scratch[1].data_ptr<float>();
  }
  at::Tensor part_q = alloc({batch, p.hq, p.nqt}, f32);
  at::Tensor part_k = at::empty({batch, p.hq, p.nkc}, f32);
  at::Tensor dbeta_h = at::empty({p.hq}, f32);
  at::Tensor dbeta_total = at::empty({}, f32);
  p.den = den.data_ptr<float>();
  p.cq = cq.data_ptr<float>();
  p.qstate = qstate.data_ptr<float>();
  p.qz = qz.data_ptr<float>();
  p.dbeta_q = part_q.data_ptr<float>();
  p.dbeta_k = part_k.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  const int64_t hkv = k.size(1);
  dispatch_head_dim(q.size(3), [&](auto dim) {  // prepare() allowed only 32, 64, 128
    constexpr int D = decltype(dim)::value;
    if (q.scalar_type() == at::kHalf)
      backward_kernels<__half, D>(kOp, p, batch, hkv, tensor_cores, tc_keys, q.device(), stream);
    else if (q.scalar_type() == at::kBFloat16)
      backward_kernels<__nv_bfloat16, D>(kOp, p, batch, hkv, tensor_cores, tc_keys, q.device(), stream);
    else
      backward_kernels<float, D>(kOp, p, batch, hkv, false, false, q.device(), stream);
  });
  race_dbeta_bwd_kernel<<<p.hq, kThreads, 0, stream>>>(p.dbeta_q, p.dbeta_k, static_cast<int>(batch), p.hq, p.nqt,
                                                        p.nkc, dbeta_h.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (beta.dim() == 0) {
    race_dbeta_total_kernel<<<1, 1, 0, stream>>>(dbeta_h.data_ptr<float>(), p.hq, dbeta_total.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor dbeta = (beta.dim() == 0 ? dbeta_total : dbeta_h).to(beta.scalar_type());
  return {dq, dk, dv, dbeta};
}

}  // namespace
}  // namespace race
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("race_bwd", &hfab::race::race_bwd_cuda); }
