// Host-side helpers shared by the ops' CUDA launchers: device/dtype checks and tensor preparation.
// Torch headers kept minimal (no torch/extension.h, no ATen/ATen.h, no ATen/cuda/*: those pull in
// headers the build does not need).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace hfab {

// `t` if kernels can read it with 16-byte vector loads (last dim contiguous, every other stride a
// multiple of 8 elements, base 16-byte aligned), else a contiguous copy of it.
inline at::Tensor vector_readable(const at::Tensor& t) {
  bool ok = reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;  // a stride never multiplied by a non-zero index
    ok = ok && (d == t.dim() - 1 ? t.stride(d) == 1 : t.stride(d) % 8 == 0);
  }
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Raise unless `t` is a CUDA tensor on `device`.
inline void check_on_device(const char* op, const char* name, const at::Tensor& t, const c10::Device& device) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, op, ": all tensors must be on one CUDA device; q is on ", device, ", ",
              name, " on ", t.device());
}

inline int compute_capability_major(const c10::Device& device) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()));
  return major;
}

}  // namespace hfab
