// Checks csrc/common/wgmma.cuh on an sm_90 GPU before any kernel relies on it: one warpgroup computes D = A B
// (64 x 64 x 16, fp16 and bf16, B K-major and MN-major) from tiles it wrote into shared memory as a grid of core
// matrices (8 rows x 16 bytes; rows of 8 core matrices 256 bytes apart, k (or, MN-major, n) columns of them 128
// apart), and every accumulator register is compared with the float64 product at the position wgmma.cuh's comment
// gives it. Each case runs with both assignments of the two core-matrix strides to each descriptor's leading and
// stride fields (four runs); the output says which the hardware reads, and the exit status is 0 only if, in every
// case, exactly one run gives the exact product (small integers: every product and sum is exact in fp32).
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Icsrc scripts/wgmma_check.cu -o /tmp/wgmma_check
//   /tmp/wgmma_check
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "common/wgmma.cuh"

namespace {

constexpr int kM = 64, kN = 64, kK = 16;
constexpr uint32_t kRowCores = 256;  // bytes between core matrices 8 rows apart (m, or n for a K-major B)
constexpr uint32_t kColCores = 128;  // bytes between core matrices 8 columns apart (k, or n for an MN-major B)

// Element index (in 16-bit units) of (row, col) of a tile whose 16-byte core-matrix rows run along col.
__host__ __device__ int core_index(int row, int col) {
  return ((row / 8) * kRowCores + (col / 8) * kColCores + (row % 8) * 16 + (col % 8) * 2) / 2;
}

// Element index of (k, n) of an MN-major tile: core matrices of 8 k rows x 8 n values, 8 n apart at kRowCores.
__host__ __device__ int mn_major_index(int k, int n) {
  return ((n / 8) * kRowCores + (k / 8) * kColCores + (k % 8) * 16 + (n % 8) * 2) / 2;
}

// a: row-major m x k. b: n x k (K-major, TRANS_B = false) or k x n (MN-major), row-major. The descriptors' leading
// and stride fields: a_fields, b_fields. out: the 128 threads' 32 accumulators each, in register order.
template <typename T, bool TRANS_B>
__global__ void product(const T* a, const T* b, float* out, uint2 a_fields, uint2 b_fields) {
  __shared__ __align__(128) T sa[kM * kK];
  __shared__ __align__(128) T sb[kN * kK];
  for (int e = threadIdx.x; e < kM * kK; e += blockDim.x) sa[core_index(e / kK, e % kK)] = a[e];
  for (int e = threadIdx.x; e < kN * kK; e += blockDim.x) {
    if (TRANS_B) sb[mn_major_index(e / kN, e % kN)] = b[e];
    else sb[core_index(e / kK, e % kK)] = b[e];
  }
  hfab::wgmma::fence_shared_for_async();
  __syncthreads();
  float d[32];
  for (float& x : d) x = 0.f;
  hfab::wgmma::fence();
  hfab::wgmma::m64n64k16<T, TRANS_B>(d, hfab::wgmma::descriptor(sa, a_fields.x, a_fields.y),
                                     hfab::wgmma::descriptor(sb, b_fields.x, b_fields.y), false);
  hfab::wgmma::commit_group();
  hfab::wgmma::wait_group<0>();
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i];
}

#define CHECK(call)                                                                                          \
  do {                                                                                                       \
    cudaError_t err_ = (call);                                                                               \
    if (err_ != cudaSuccess) {                                                                               \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));                    \
      std::exit(2);                                                                                          \
    }                                                                                                        \
  } while (0)

// Mismatching registers (of 4,096) of one run against the float64 product at the documented positions.
template <typename T, bool TRANS_B>
int mismatches(uint2 a_fields, uint2 b_fields, std::mt19937& rng, T (*to_t)(float)) {
  std::uniform_int_distribution<int> value(-8, 8);
  std::vector<float> a(kM * kK), b(kN * kK);
  for (float& x : a) x = static_cast<float>(value(rng));
  for (float& x : b) x = static_cast<float>(value(rng));
  std::vector<T> at(a.size()), bt(b.size());
  for (size_t i = 0; i < a.size(); ++i) at[i] = to_t(a[i]);
  for (size_t i = 0; i < b.size(); ++i) bt[i] = to_t(b[i]);
  T *da, *db;
  float* dout;
  CHECK(cudaMalloc(&da, at.size() * sizeof(T)));
  CHECK(cudaMalloc(&db, bt.size() * sizeof(T)));
  CHECK(cudaMalloc(&dout, 128 * 32 * sizeof(float)));
  CHECK(cudaMemcpy(da, at.data(), at.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, bt.data(), bt.size() * sizeof(T), cudaMemcpyHostToDevice));
  product<T, TRANS_B><<<1, 128>>>(da, db, dout, a_fields, b_fields);
  CHECK(cudaGetLastError());
  std::vector<float> out(128 * 32);
  CHECK(cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(da));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dout));
  int bad = 0;
  for (int tid = 0; tid < 128; ++tid) {
    const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    for (int i = 0; i < 32; ++i) {
      const int row = 16 * w + g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
      double ref = 0.0;
      for (int k = 0; k < kK; ++k) ref += double(a[row * kK + k]) * (TRANS_B ? b[k * kN + col] : b[col * kK + k]);
      bad += out[tid * 32 + i] != ref;
    }
  }
  return bad;
}

template <typename T, bool TRANS_B>
bool check(const char* name, T (*to_t)(float)) {
  std::mt19937 rng(1);
  const uint2 assignments[2] = {{kColCores, kRowCores}, {kRowCores, kColCores}};  // (leading, stride) bytes
  int matching = 0;
  for (const uint2& fa : assignments)
    for (const uint2& fb : assignments) {
      const int bad = mismatches<T, TRANS_B>(fa, fb, rng, to_t);
      std::printf("%-17s A leading %3u stride %3u, B leading %3u stride %3u: %4d of 4096 differ%s\n", name, fa.x,
                  fa.y, fb.x, fb.y, bad, bad == 0 ? "  <- the hardware's reading" : "");
      matching += bad == 0;
    }
  return matching == 1;
}

__half to_half(float x) { return __float2half(x); }
__nv_bfloat16 to_bf16(float x) { return __float2bfloat16(x); }

}  // namespace

int main() {
  bool ok = check<__half, false>("fp16, B K-major", to_half);
  ok &= check<__half, true>("fp16, B MN-major", to_half);
  ok &= check<__nv_bfloat16, false>("bf16, B K-major", to_bf16);
  ok &= check<__nv_bfloat16, true>("bf16, B MN-major", to_bf16);
  std::printf("%s\n", ok ? "wgmma check: PASS" : "wgmma check: FAIL");
  return ok ? 0 : 1;
}
