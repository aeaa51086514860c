// CUDA-core FMA rates of the GPU (the limits the exact kernels are measured against), for
// benchmarks/bench_exact.py: packed half (__hfma2, 2 fp16 FMAs) and fp32 (fmaf). Plain C entry points
// called through ctypes: no op, no schema.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace hfab {
namespace exact {
namespace {

constexpr int kProbeThreads = 256;
constexpr int kProbeChains = 8;  // independent FMA chains per thread (hides the FMA latency)
constexpr int kProbeUnroll = 8;  // FMA rounds per loop trip: the loop's own instructions stay ~3% of the issue

__device__ __forceinline__ __half2 fma_step(__half2 a, __half2 mul, __half2 add) { return __hfma2(a, mul, add); }
__device__ __forceinline__ float fma_step(float a, float mul, float add) { return fmaf(a, mul, add); }
__device__ __forceinline__ __half2 plus(__half2 a, __half2 b) { return __hadd2(a, b); }
__device__ __forceinline__ float plus(float a, float b) { return a + b; }

template <typename V> __device__ __forceinline__ V splat(float x);
template <> __device__ __forceinline__ __half2 splat<__half2>(float x) { return __floats2half2_rn(x, x); }
template <> __device__ __forceinline__ float splat<float>(float x) { return x; }
template <typename V> V host_splat(float x);
template <> __half2 host_splat<__half2>(float x) { return __half2(__float2half_rn(x), __float2half_rn(x)); }
template <> float host_splat<float>(float x) { return x; }

// a <- a * 0.5 + 0.25 converges to 0.5: no overflow, no denormals; `iters` at run time keeps the loop.
// mul and add arrive as kernel arguments: with compile-time constants ptxas emits the immediate form of
// HFMA2, which issues at half the rate on sm_90 (measured 66 against 130 TFLOP/s on the H200).
template <typename V>
__global__ void __launch_bounds__(kProbeThreads) fma_probe_kernel(V* out, int iters, V mul, V add) {
  V a[kProbeChains];
#pragma unroll
  for (int c = 0; c < kProbeChains; ++c) a[c] = splat<V>(0.001f * (threadIdx.x + c));
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int u = 0; u < kProbeUnroll; ++u)
#pragma unroll
      for (int c = 0; c < kProbeChains; ++c) a[c] = fma_step(a[c], mul, add);
  }
  V sum = a[0];
#pragma unroll
  for (int c = 1; c < kProbeChains; ++c) sum = plus(sum, a[c]);
  out[blockIdx.x * kProbeThreads + threadIdx.x] = sum;
}

// Times `blocks` x 256 threads x `iters` x 64 FMA instructions on the legacy default stream; writes the
// milliseconds of the timed launch (after one warm-up) to *ms. Returns the cudaError_t code.
template <typename V> int time_probe(int blocks, int iters, float* ms) {
  V* out = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t err = cudaMalloc(&out, sizeof(V) * blocks * kProbeThreads);
  if (err == cudaSuccess) err = cudaEventCreate(&start);
  if (err == cudaSuccess) err = cudaEventCreate(&stop);
  if (err == cudaSuccess) {
    const V mul = host_splat<V>(0.5f), add = host_splat<V>(0.25f);
    fma_probe_kernel<V><<<blocks, kProbeThreads>>>(out, iters, mul, add);
    cudaEventRecord(start);
    fma_probe_kernel<V><<<blocks, kProbeThreads>>>(out, iters, mul, add);
    cudaEventRecord(stop);
    err = cudaEventSynchronize(stop);
  }
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaEventElapsedTime(ms, start, stop);
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (out) cudaFree(out);
  return static_cast<int>(err);
}

}  // namespace
}  // namespace exact
}  // namespace hfab

// Each launch runs blocks x 256 threads x iters x 64 FMA instructions: __hfma2 (4 FLOPs each) here,
// fmaf (2 FLOPs each) in hfab_ffma_probe.
extern "C" __attribute__((visibility("default"))) int hfab_hfma2_probe(int blocks, int iters, float* ms) {
  return hfab::exact::time_probe<__half2>(blocks, iters, ms);
}

extern "C" __attribute__((visibility("default"))) int hfab_ffma_probe(int blocks, int iters, float* ms) {
  return hfab::exact::time_probe<float>(blocks, iters, ms);
}
