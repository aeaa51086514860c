// The warpgroup product of wgmma_product.cuh (the kernel scripts/wgmma_check.cu runs on the H200) on the CPU through
// this folder's common/wgmma.cuh. A C interface for ctypes (tests/ops/test_wgmma_emulation.py): a (64 x 16) and b
// (64 x 16 K-major, or 16 x 64 MN-major with trans_b) row-major fp32 values, rounded to fp16 (bf16 = 0) or bf16;
// out: 128 threads x 32 accumulators in register order.
#include <vector>

#include "harness.h"

namespace wgmma_check {
alignas(128) thread_local char wgmma_smem[4096];
}  // namespace wgmma_check

#include "common/wgmma.cuh"
#include "wgmma_product.cuh"

namespace {

template <typename T, bool TRANS_B>
int run(const float* a, const float* b, float* out, uint2 a_fields, uint2 b_fields) {
  using namespace wgmma_check;
  static_assert(kSharedBytes <= sizeof(wgmma_smem));
  std::vector<T> at(a, a + kM * kK), bt(b, b + kN * kK);
  emu::shared_window = wgmma_smem;
  return emu::launch(dim3(1, 1, 1), 128, [&] { product<T, TRANS_B>(at.data(), bt.data(), out, a_fields, b_fields); })
             ? 0 : 2;
}

}  // namespace

extern "C" int wgmma_product(int bf16, int trans_b, unsigned a_k, unsigned a_mn, unsigned b_k, unsigned b_mn,
                             const float* a, const float* b, float* out) {
  const uint2 fa{a_k, a_mn}, fb{b_k, b_mn};
  if (bf16) return trans_b ? run<__nv_bfloat16, true>(a, b, out, fa, fb) : run<__nv_bfloat16, false>(a, b, out, fa, fb);
  return trans_b ? run<__half, true>(a, b, out, fa, fb) : run<__half, false>(a, b, out, fa, fb);
}
