// Packed-half FMA rate of the GPU (the CUDA-core limit the exact kernels are measured against), for
// benchmarks/bench_exact.py. A plain C entry point called through ctypes: no op, no schema.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

namespace hfab {
namespace exact {
namespace {

constexpr int kProbeThreads = 256;
constexpr int kProbeChains = 8;  // independent __hfma2 chains per thread (hides the FMA latency)

// a <- a * 0.5 + 0.25 converges to 0.5: no overflow, no denormals; `iters` at run time keeps the loop.
__global__ void __launch_bounds__(kProbeThreads) hfma2_probe_kernel(__half2* out, int iters) {
  const __half2 mul = __floats2half2_rn(0.5f, 0.5f), add = __floats2half2_rn(0.25f, 0.25f);
  __half2 a[kProbeChains];
#pragma unroll
  for (int c = 0; c < kProbeChains; ++c) a[c] = __floats2half2_rn(0.001f * (threadIdx.x + c), 0.002f * c);
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < kProbeChains; ++c) a[c] = __hfma2(a[c], mul, add);
  }
  __half2 sum = a[0];
#pragma unroll
  for (int c = 1; c < kProbeChains; ++c) sum = __hadd2(sum, a[c]);
  out[blockIdx.x * kProbeThreads + threadIdx.x] = sum;
}

}  // namespace
}  // namespace exact
}  // namespace hfab

// Times `blocks` x 256 threads x `iters` x 8 __hfma2 (4 FLOPs each) on the current device's legacy
// default stream; writes the milliseconds of the timed launch (after one warm-up) to *ms. Returns the
// cudaError_t code (0 = success).
extern "C" __attribute__((visibility("default"))) int hfab_hfma2_probe(int blocks, int iters, float* ms) {
  using hfab::exact::hfma2_probe_kernel;
  using hfab::exact::kProbeThreads;
  __half2* out = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaError_t err = cudaMalloc(&out, sizeof(__half2) * blocks * kProbeThreads);
  if (err == cudaSuccess) err = cudaEventCreate(&start);
  if (err == cudaSuccess) err = cudaEventCreate(&stop);
  if (err == cudaSuccess) {
    hfma2_probe_kernel<<<blocks, kProbeThreads>>>(out, iters);
    cudaEventRecord(start);
    hfma2_probe_kernel<<<blocks, kProbeThreads>>>(out, iters);
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
