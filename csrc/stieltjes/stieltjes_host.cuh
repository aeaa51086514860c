// Host side of the Stieltjes kernels shared by stieltjes_fwd.cu and stieltjes_bwd.cu: validation at the op
// boundary (clear errors naming the argument, its value and what is supported), Params, dispatch, launch.
#pragma once

#include <cmath>
#include <optional>
#include <type_traits>

#include "common/host.cuh"
#include "stieltjes/stieltjes_kernels.cuh"

namespace hfab {
namespace stieltjes {

// Validated inputs, prepared for 16-byte loads; keeps the (possibly copied) tensors alive.
struct Inputs {
  at::Tensor q, k, v;
  Params p{};
};

inline Inputs prepare(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& key_padding_mask, bool causal, double scale, double order) {
  const c10::Device device = q.device();
  check_qkv(op, q, k, v, device);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, " (CUDA kernel): dtype ", dtype,
              " is not supported; supported: float16, bfloat16. Cast q, k, v to one of them, or run on the CPU "
              "reference");
  const int major = compute_capability_major(device);
  TORCH_CHECK(major >= 8, op, " (CUDA kernel): needs an sm_80 or newer GPU (tensor-core mma.sync); ", device,
              " is sm_", major, "x");
  const int64_t d = q.size(3);
  check_head_dim(op, d);
  TORCH_CHECK(std::isfinite(order) && order >= 1.0, op, ": order=", order, " is not supported; supported: a finite "
              "number >= 1");
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0, op, " (CUDA kernel): scale=", scale, " is not supported; "
              "supported: a finite number > 0");
  check_grid_limits(op, q.size(0), q.size(1), q.size(2), k.size(2));

  Inputs in;
  in.q = vector_readable(q);
  in.k = vector_readable(k);
  in.v = vector_readable(v);
  Params& p = in.p;
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const at::Tensor& m = *key_padding_mask;
    check_key_padding_mask(op, m, k, device);
    p.kpm = reinterpret_cast<const unsigned char*>(m.data_ptr());  // read through its strides
    p.kpm_sb = m.stride(0);
    p.kpm_sn = m.stride(1);
  }
  bind_qkv(p, in.q, in.k, in.v);
  p.hq = static_cast<int>(q.size(1));
  p.groups = static_cast<int>(q.size(1) / k.size(1));
  p.nq = static_cast<int>(q.size(2));
  p.nk = static_cast<int>(k.size(2));
  p.scale = static_cast<float>(scale);
  p.order = static_cast<float>(order);
  p.causal = causal ? 1 : 0;
  return in;
}

// Check an fp32 state tensor saved by hfab::stieltjes_fwd (rowmax, lam, lsum: (B, Hq, Nq); u: q's shape) against
// its expected shape; returns it contiguous.
inline at::Tensor saved_state(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef expected,
                              const c10::Device& device) {
  check_on_device(op, name, t, device);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, ".dtype=", t.scalar_type(),
              "; supported: torch.float32 (as returned by hfab::stieltjes_fwd)");
  TORCH_CHECK(t.sizes() == expected, op, ": ", name, ".shape=", t.sizes(), "; expected ", expected,
              t.numel() == 0 ? " (empty: hfab::stieltjes_fwd returns the backward's state with backward_state=True)"
                             : "");
  return t.contiguous();
}

// fn(Tag<T>{}, integral_constant<D>{}, integral_constant<IORD>{}) for q's dtype and head dim and the order
// (IORD 4 or 2: fast paths; 0: any order).
template <typename Fn>
void dispatch(const at::Tensor& q, double order, Fn&& fn) {
  auto by_order = [&](auto tag, auto dim) {
    if (order == 4.0) return fn(tag, dim, std::integral_constant<int, 4>{});
    if (order == 2.0) return fn(tag, dim, std::integral_constant<int, 2>{});
    return fn(tag, dim, std::integral_constant<int, 0>{});
  };
  dispatch_dtype_head_dim(q, by_order);
}


// Launch kernel<<<grid, kThreads, smem>>>(p) on `stream`, raising the dynamic shared memory limit when needed.
template <typename Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, cudaStream_t stream, const Params& p) {
  opt_in_shared_memory(reinterpret_cast<const void*>(kernel), static_cast<int>(smem));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace stieltjes
}  // namespace hfab
