// csrc/common/wgmma.cuh for g++ (cuda_on_cpu.h): the same functions, the products computed by each thread from the
// shared tiles when issued (as if they completed at once; fence, commit and wait have nothing left to order). The
// descriptor is the hardware's: a 14-bit shared address (16-byte units) and the two core-matrix distances, so a
// kernel's descriptor arithmetic is emulated as the GPU reads it. Shared addresses count from emu::shared_window,
// which the harness points at the block's dynamic shared memory before a launch.
#pragma once

#include <cassert>
#include <cstdint>
#include <cstring>

namespace emu {
inline const char* shared_window = nullptr;
}  // namespace emu

namespace hfab {
namespace wgmma {

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

}  // namespace emulated

// d (+)= A B, 64 x 64 x 16 (csrc/common/wgmma.cuh): this thread's 32 accumulators, each summed in double over k and
// added to d once.
template <typename T, bool TRANS_B>
void m64n64k16(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  const int lane = threadIdx.x % 32, w = (threadIdx.x % 128) / 32, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 32; ++i) {
    const int row = 16 * w + g + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
    double sum = 0.0;
    for (int k = 0; k < 16; ++k)
      sum += static_cast<double>(emulated::operand<T>(a, row, k, false)) * emulated::operand<T>(b, col, k, TRANS_B);
    d[i] = static_cast<float>((accumulate ? static_cast<double>(d[i]) : 0.0) + sum);
  }
}

}  // namespace wgmma
}  // namespace hfab
