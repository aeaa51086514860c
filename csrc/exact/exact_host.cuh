// Host side of the exact kernels shared by exact_fwd.cu and exact_bwd.cu: validation at the op
// boundary (clear errors naming the argument, its value and what is supported), Params, dispatch.
#pragma once

#include <optional>
#include <type_traits>

#include "common/host.cuh"
#include "exact/exact_kernels.cuh"

namespace hfab {
namespace exact {

// Validated inputs, prepared for 16-byte loads; keeps the (possibly copied) tensors alive.
struct Inputs {
  at::Tensor q, k, v, mask;  // mask undefined when there is none
  Params p{};
};

inline Inputs prepare(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& key_padding_mask, bool causal, double scale) {
  const c10::Device device = q.device();
  check_qkv(op, q, k, v, device);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, " (CUDA kernel): dtype ", dtype,
              " is not supported; supported: float16 (every GPU from sm_60), bfloat16 (sm_80 and newer). "
              "Cast q, k, v to float16, or run on the CPU reference");
  if (dtype == at::kBFloat16) {
    const int major = compute_capability_major(device);
    TORCH_CHECK(major >= 8, op, " (CUDA kernel): bfloat16 needs an sm_80 or newer GPU; ", device,
                " is sm_", major, "x. Use float16 on this GPU");
  }
  const int64_t d = q.size(3);
  check_head_dim(op, d);
  check_grid_limits(op, q.size(0), q.size(1), q.size(2), k.size(2));

  Inputs in;
  in.q = vector_readable(q);
  in.k = vector_readable(k);
  in.v = vector_readable(v);
  Params& p = in.p;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const at::Tensor& m = *key_padding_mask;
    check_key_padding_mask(op, m, k, device);
    in.mask = m.contiguous();
    p.key_padding_mask = reinterpret_cast<const unsigned char*>(in.mask.data_ptr());
    p.kpm_stride = in.mask.stride(0);
  }
  bind_qkv(p, in.q, in.k, in.v);
  p.hq = static_cast<int>(q.size(1));
  p.groups = static_cast<int>(q.size(1) / k.size(1));
  p.nq = static_cast<int>(q.size(2));
  p.nk = static_cast<int>(k.size(2));
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = causal ? 1 : 0;
  return in;
}



}  // namespace exact
}  // namespace hfab
