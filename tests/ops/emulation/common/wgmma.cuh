// csrc/common/wgmma.cuh for g++ (cuda_on_cpu.h): the same functions, the products computed by each thread from the
// shared tiles when issued (as if they completed at once; fence, commit and wait have nothing left to order). The
// descriptor is the hardware's: a 14-bit shared address (16-byte units) and the two core-matrix distances, so a
// kernel's descriptor arithmetic is emulated as the GPU reads it. Shared addresses count from emu::shared_window,
// which the harness points at the block's dynamic shared memory before a launch.
#pragma once

#include <cassert>
#include <cstdint>
#include <cstring>

#if defined(HFAB_EMULATE_WGMMA)
#define HFAB_HAS_WGMMA 1  // kernels take their wgmma paths (csrc/common/wgmma.cuh defines it for sm_90a)
#endif

namespace emu {
inline const char* shared_window = nullptr;
}  // namespace emu

namespace hfab {
namespace wgmma {

#if defined(HFAB_HAS_WGMMA)
inline constexpr bool kEnabled = true;
#else
inline constexpr bool kEnabled = false;
#endif

inline uint64_t descriptor(const void* tile, uint32_t k_bytes, uint32_t mn_bytes) {
  assert(emu::shared_window != nullptr && "the harness sets emu::shared_window");
  const auto addr = static_cast<uint32_t>(static_cast<const char*>(tile) - emu::shared_window);
  return static_cast<uint64_t>((addr >> 4) & 0x3fffu) | (static_cast<uint64_t>((k_bytes >> 4) & 0x3fffu) << 16) |
         (static_cast<uint64_t>((mn_bytes >> 4) & 0x3fffu) << 32);
}

inline void fence_shared_for_async() {}
inline void fence() {}
inline void commit_group() {}
template <int N>
inline void wait_group() {}

namespace emulated {

// Value (row, k) of a K-major no-swizzle tile (row: m or n), or with mn_major (k, row) of an MN-major one, as the
// descriptor addresses it.
template <typename T>
float operand(uint64_t desc, int row, int k, bool mn_major) {
  const char* base = emu::shared_window + ((desc & 0x3fffu) << 4);
  const uint32_t k_bytes = ((desc >> 16) & 0x3fffu) << 4, mn_bytes = ((desc >> 32) & 0x3fffu) << 4;
  const int inner = mn_major ? (k % 8) * 16 + (row % 8) * 2 : (row % 8) * 16 + (k % 8) * 2;
  T v;
  std::memcpy(&v, base + (row / 8) * mn_bytes + (k / 8) * k_bytes + inner, sizeof(T));
  return static_cast<float>(v);
}

// The accumulators of this thread (csrc/common/wgmma.cuh's layout) of D (+)= A B, 64 x N x 16, A's element (row, k)
// from `elem_a`, B's (n, k) from the descriptor: each summed in double over k and added to d once.
template <int N, typename T, bool TRANS_B, typename ElemA>
void product(float (&d)[N / 8][4], ElemA elem_a, uint64_t b, bool accumulate) {
  const int lane = threadIdx.x % 32, w = (threadIdx.x % 128) / 32, g = lane / 4, t = lane % 4;
  for (int j = 0; j < N / 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * w + g + 8 * (i / 2), col = 8 * j + 2 * t + i % 2;
      double sum = 0.0;
      for (int k = 0; k < 16; ++k) sum += static_cast<double>(elem_a(row, k)) * operand<T>(b, col, k, TRANS_B);
      d[j][i] = static_cast<float>((accumulate ? static_cast<double>(d[j][i]) : 0.0) + sum);
    }
}

}  // namespace emulated

// d (+)= A B, 64 x N x 16, A from shared memory (csrc/common/wgmma.cuh).
template <int N, typename T, bool TRANS_B>
void mma(float (&d)[N / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma::mma: N is 32, 64 or 128");
  emulated::product<N, T, TRANS_B>(d, [&](int row, int k) { return emulated::operand<T>(a, row, k, false); }, b,
                                   accumulate);
}

// The same with A from registers: this warp's 16 rows, gathered from its lanes in mma.sync's A fragment layout.
template <int N, typename T, bool TRANS_B>
void mma_regs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma::mma_regs: N is 32, 64 or 128");
  struct Regs {
    uint32_t r[4];
  };
  const auto all = emu::gather(Regs{{a[0], a[1], a[2], a[3]}});
  const auto elem_a = [&](int row, int k) {  // row: 16 w + r, this warp's
    const int r = row % 16, lane = (r % 8) * 4 + (k % 8) / 2, reg = r / 8 + 2 * (k / 8);
    const uint32_t word = all[lane].r[reg];
    const auto bits = static_cast<uint16_t>(k % 2 ? word >> 16 : word & 0xffffu);
    T v;
    std::memcpy(&v, &bits, 2);
    return static_cast<float>(v);
  };
  emulated::product<N, T, TRANS_B>(d, elem_a, b, accumulate);
}

}  // namespace wgmma
}  // namespace hfab
