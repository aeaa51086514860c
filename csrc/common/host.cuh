// Host-side helpers shared by the ops' CUDA launchers: device/dtype checks and tensor preparation.
// Torch headers kept minimal (no torch/extension.h, no ATen/ATen.h, no ATen/cuda/*: those pull in
// headers the build does not need).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/strides.cuh"

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

// Raise unless q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) are CUDA tensors on `device` with one dtype and
// Hq a multiple of Hkv.
inline void check_qkv(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::Device& device) {
  check_on_device(op, "q", q, device);
  check_on_device(op, "k", k, device);
  check_on_device(op, "v", v, device);
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must have 4 dims (B, H, N, D), got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), op, ": q ", q.sizes(), " and k ", k.sizes(),
              " must agree in batch size and head dim");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": query heads Hq=", q.size(1),
              " must be a multiple of key/value heads Hkv=", k.size(1));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
}

// Raise unless `m` is a (B, Nk) bool key padding mask (True = real key) for keys `k` (B, Hkv, Nk, D) on `device`.
inline void check_key_padding_mask(const char* op, const at::Tensor& m, const at::Tensor& k, const c10::Device& device) {
  check_on_device(op, "key_padding_mask", m, device);
  TORCH_CHECK(m.scalar_type() == at::kBool, op, ": key_padding_mask.dtype=", m.scalar_type(),
              "; supported: torch.bool (True = real token)");
  TORCH_CHECK(m.dim() == 2 && m.size(0) == k.size(0) && m.size(1) == k.size(2), op, ": key_padding_mask.shape=",
              m.sizes(), "; expected (B, Nk)=(", k.size(0), ", ", k.size(2), ")");
}

// Held for the whole of every CUDA impl: its own ATen calls (fp32 landmark algebra, reductions, casts) run in the
// dtypes written, not recast by an autocast region the op was called from (a bf16 matmul would break data_ptr<float>).
struct AutocastOff {
  c10::impl::ExcludeDispatchKeyGuard guard{c10::autocast_dispatch_keyset};
};

inline Strides strides_of(const at::Tensor& t) { return Strides{t.stride(0), t.stride(1), t.stride(2)}; }

// Point a backend's Params at q, k, v (data and strides; the tensors must outlive the launch).
template <typename P>
inline void bind_qkv(P& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.sq = strides_of(q);
  p.sk = strides_of(k);
  p.sv = strides_of(v);
}

template <typename T> struct Tag { using type = T; };

// fn(std::integral_constant<int, D>{}) for head dim d in {32, 64, 128} (the callers' checks allow no other).
template <typename Fn>
decltype(auto) dispatch_head_dim(int64_t d, Fn&& fn) {
  switch (d) {
    case 32: return fn(std::integral_constant<int, 32>{});
    case 64: return fn(std::integral_constant<int, 64>{});
    default: return fn(std::integral_constant<int, 128>{});
  }
}

// fn(Tag<T>{}, std::integral_constant<int, D>{}) for q's element type and head dim: __half for float16, float for
// float32 where WITH_FLOAT, else __nv_bfloat16 (the callers' checks allow no other dtype).
template <bool WITH_FLOAT = false, typename Fn>
void dispatch_dtype_head_dim(const at::Tensor& q, Fn&& fn) {
  auto by_dim = [&](auto tag) { dispatch_head_dim(q.size(3), [&](auto dim) { fn(tag, dim); }); };
  if (q.scalar_type() == at::kHalf) return by_dim(Tag<__half>{});
  if constexpr (WITH_FLOAT) {
    if (q.scalar_type() == at::kFloat) return by_dim(Tag<float>{});
  }
  by_dim(Tag<__nv_bfloat16>{});
}

// The head dims the kernels are instantiated for (dispatch_head_dim).
inline void check_head_dim(const char* op, int64_t d) {
  TORCH_CHECK(d == 32 || d == 64 || d == 128, op, " (CUDA kernel): head dim D=", d,
              " is not supported; supported: 32, 64, 128");
}

// Grids with batch and query heads in their y/z dimensions and 32-bit row indices.
inline void check_grid_limits(const char* op, int64_t batch, int64_t heads, int64_t nq, int64_t nk) {
  TORCH_CHECK(heads <= 65535 && batch <= 65535, op, ": B=", batch, " and Hq=", heads,
              " must each be <= 65535 (CUDA grid limits)");
  TORCH_CHECK(nq < (int64_t{1} << 30) && nk < (int64_t{1} << 30), op, ": sequence lengths must be < 2^30, got Nq=",
              nq, ", Nk=", nk);
}

inline unsigned blocks(int64_t n, int per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

inline int compute_capability_major(const c10::Device& device) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()));
  return major;
}

// Dynamic shared memory one block may opt in to on `device`, in bytes.
inline int shared_memory_limit(const c10::Device& device) {
  int limit = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index()));
  return limit;
}

inline int multiprocessor_count(const c10::Device& device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device.index()));
  return count;
}

// Lets `kernel` launch with `bytes` of dynamic shared memory on the current device (needed above 48 KB). The
// cudaFuncSetAttribute call runs once per kernel, device and larger size: a few µs of host time saved per launch.
inline void opt_in_shared_memory(const void* kernel, int bytes) {
  if (bytes <= 48 * 1024) return;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> granted;
  const std::lock_guard<std::mutex> lock(mutex);
  int& have = granted[{kernel, device}];
  if (have >= bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  have = bytes;
}

// Blocks of `kernel` the current device runs at once with `threads` threads and `bytes` of dynamic shared memory:
// its SM count times the occupancy calculator's blocks per SM (at least one). Cached per kernel, device and shape.
inline int64_t resident_blocks(const void* kernel, int threads, int bytes) {
  opt_in_shared_memory(kernel, bytes);
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, int>, int64_t> known;
  const std::lock_guard<std::mutex> lock(mutex);
  int64_t& blocks = known[{kernel, device, threads, bytes}];
  if (blocks == 0) {
    int per_sm = 0, sms = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, bytes));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    blocks = static_cast<int64_t>(std::max(per_sm, 1)) * sms;
  }
  return blocks;
}

// Work on a pooled side stream, concurrent with what the caller enqueues next on its own stream: the side stream
// first waits for everything enqueued on `main` so far; join() makes `main` wait for the side work. ATen ops inside
// run() go to the side stream and allocate from its pool; a tensor the side work hands to `main` must be
// handed_over() (the caching allocator then keeps its memory until `main` is done with it). Tensors of `main` the side
// work reads must stay referenced until join(). enabled = false: the side work runs on `main` in the order enqueued
// (an A/B switch: a profile then shows each kernel's time without the overlap).
class SideStream {
 public:
  SideStream(const c10::cuda::CUDAStream& main, bool enabled)
      : main_(main), side_(enabled ? side_stream(main.device_index()) : main), enabled_(enabled) {
    if (enabled_) wait_for(side_, main_);
  }
  template <typename Work>
  auto run(Work&& work) const {
    const c10::cuda::CUDAStreamGuard guard(side_);
    return work(side_.stream());
  }
  const at::Tensor& handed_over(const at::Tensor& t) const {
    if (enabled_) t.record_stream(main_.unwrap());
    return t;
  }
  void join() const {
    if (enabled_) wait_for(main_, side_);
  }

 private:
  // `waiter` waits for the work enqueued on `done` so far (an event per device and thread, re-recorded each time:
  // a wait binds to the record before it).
  static void wait_for(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& done) {
    thread_local std::map<c10::DeviceIndex, cudaEvent_t> events;
    cudaEvent_t& event = events[done.device_index()];
    if (event == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event, done.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(waiter.stream(), event, 0));
  }

  // One pooled stream per device for every call: the caching allocator keeps its blocks per stream, so a new pool
  // stream per call (they rotate through 32) would cudaMalloc afresh for its first 32 calls.
  static c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
    static std::mutex mutex;
    static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = streams.find(device);
    if (it == streams.end()) it = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
    return it->second;
  }

  c10::cuda::CUDAStream main_;
  c10::cuda::CUDAStream side_;
  bool enabled_;
};

// Whether environment variable `name` is set to `value` (the kernels' A/B switches).
inline bool env_is(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env != nullptr && std::string(env) == value;
}

}  // namespace hfab
