// One warpgroup's D = A B (64 x 64 x 16) through common/wgmma.cuh, from tiles it writes into dynamic shared memory
// (`wgmma_smem`, 4 KB) as grids of core matrices (8 rows x 16 bytes; rows of core matrices kRowCores bytes apart,
// their k columns, or for an MN-major B their n columns, kColCores apart). The same source runs on the H200
// (scripts/wgmma_check.cu) and in the emulator (tests/ops/test_wgmma_emulation.py). Include common/wgmma.cuh first
// (the GPU's or the emulator's).
#pragma once

namespace wgmma_check {

constexpr int kM = 64, kN = 64, kK = 16;
constexpr uint32_t kRowCores = 256;
constexpr uint32_t kColCores = 128;
constexpr int kSharedBytes = (kM + kN) * kK * 2;

// Element index (16-bit units) of (row, k) of a K-major tile.
__host__ __device__ inline int k_major_index(int row, int k) {
  return ((row / 8) * kRowCores + (k / 8) * kColCores + (row % 8) * 16 + (k % 8) * 2) / 2;
}
// Element index of (k, n) of an MN-major tile: core matrices of 8 k rows x 8 n values, 8 n apart at kRowCores.
__host__ __device__ inline int mn_major_index(int k, int n) {
  return ((n / 8) * kRowCores + (k / 8) * kColCores + (k % 8) * 16 + (n % 8) * 2) / 2;
}

// a: row-major m x k. b: n x k (K-major, TRANS_B = false) or k x n (MN-major), row-major. The descriptors' (k, mn)
// fields: a_fields, b_fields. out: the 128 threads' 32 accumulators each, in register order.
template <typename T, bool TRANS_B>
__global__ void product(const T* a, const T* b, float* out, uint2 a_fields, uint2 b_fields) {
  extern __shared__ __align__(128) char wgmma_smem[];
  T* sa = reinterpret_cast<T*>(wgmma_smem);
  T* sb = sa + kM * kK;
  for (int e = threadIdx.x; e < kM * kK; e += blockDim.x) sa[k_major_index(e / kK, e % kK)] = a[e];
  for (int e = threadIdx.x; e < kN * kK; e += blockDim.x) {
    if (TRANS_B) sb[mn_major_index(e / kN, e % kN)] = b[e];
    else sb[k_major_index(e / kK, e % kK)] = b[e];
  }
  hfab::wgmma::fence_shared_for_async();
  __syncthreads();
  float d[kN / 8][4] = {};
  hfab::wgmma::fence();
  hfab::wgmma::mma<kN, T, TRANS_B>(d, hfab::wgmma::descriptor(sa, a_fields.x, a_fields.y),
                                     hfab::wgmma::descriptor(sb, b_fields.x, b_fields.y), false);
  hfab::wgmma::commit_group();
  hfab::wgmma::wait_group<0>();
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i / 4][i % 4];
}

// Position (row, col) of D that accumulator i of thread tid holds (csrc/common/wgmma.cuh's layout).
__host__ __device__ inline void accumulator_position(int tid, int i, int& row, int& col) {
  const int w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
  row = 16 * w + g + 8 * ((i % 4) / 2);
  col = 8 * (i / 4) + 2 * t + i % 2;
}

}  // namespace wgmma_check
