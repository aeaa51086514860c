// Checks csrc/common/wgmma.cuh on an sm_90 GPU before any kernel relies on it: one warpgroup computes D = A B
// (64 x 64 x 16, fp16 and bf16, B K-major and MN-major; tests/ops/emulation/wgmma_product.cuh, which the emulator's
// test runs too), and every accumulator register is compared with the float64 product at the position wgmma.cuh's
// comment gives it. Each case runs with both assignments of the two core-matrix strides to each descriptor's leading
// and stride fields (four runs); the output says which the hardware reads, and the exit status is 0 only if, in every
// case, exactly one run gives the exact product (small integers: every product and sum is exact in fp32).
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Icsrc -Itests/ops/emulation scripts/wgmma_check.cu \
//     -o /tmp/wgmma_check
//   /tmp/wgmma_check
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/wgmma.cuh"
#include "wgmma_product.cuh"

namespace {

using namespace wgmma_check;

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
  product<T, TRANS_B><<<1, 128, kSharedBytes>>>(da, db, dout, a_fields, b_fields);
  CHECK(cudaGetLastError());
  std::vector<float> out(128 * 32);
  CHECK(cudaMemcpy(out.data(), dout, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(da));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dout));
  int bad = 0;
  for (int tid = 0; tid < 128; ++tid) {
    for (int i = 0; i < 32; ++i) {
      int row, col;
      accumulator_position(tid, i, row, col);
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
