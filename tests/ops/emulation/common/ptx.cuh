// CPU stand-ins for csrc/common/ptx.cuh under cuda_on_cpu.h (the same functions, by this folder coming first on the
// include path). The warp-wide instructions gather every lane's operands (emu::gather) and give each lane what the
// PTX ISA says it holds. mma: products exact, summed in double, added to the fp32 accumulator once (at least as
// accurate as the tensor cores); tf32 operands use their top 19 bits. cp.async reads its source at once and
// writes shared memory only at the wait that covers its group (emu::copy_async).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace hfab {

inline float rcp_approx(float x) { return 1.0f / x; }

namespace mma {
namespace emulated {

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float half_of(uint32_t w, int hi, __half) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(hi ? w >> 16 : w & 0xffffu)));
}
inline float half_of(uint32_t w, int hi, __nv_bfloat16) { return bits_to_float((hi ? w >> 16 : w & 0xffffu) << 16); }

struct Frag {
  uint32_t a[4], b[2];
};

// d += A B for one lane, A (16 x K) and B (K x 8) assembled from every lane's fragments by `elem_a` / `elem_b`.
template <int K, typename EA, typename EB>
void product(float (&d)[4], const Frag& mine, EA elem_a, EB elem_b) {
  const auto all = emu::gather(mine);
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    double sum = 0.0;
    for (int k = 0; k < K; ++k) sum += static_cast<double>(elem_a(all, row, k)) * elem_b(all, k, col);
    d[i] = static_cast<float>(static_cast<double>(d[i]) + sum);
  }
}

// m16n8k16: a_r = (g + 8 (r % 2), 2t + 8 (r / 2) + {0, 1}), b_r = (k 2t + 8r + {0, 1}, n g).
template <typename T>
void m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  const Frag mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  auto elem_a = [](const std::array<Frag, 32>& all, int row, int k) {
    const int lane = (row % 8) * 4 + (k % 8) / 2, reg = row / 8 + 2 * (k / 8);
    return half_of(all[lane].a[reg], k % 2, T{});
  };
  auto elem_b = [](const std::array<Frag, 32>& all, int k, int n) {
    const int lane = n * 4 + (k % 8) / 2, reg = k / 8;
    return half_of(all[lane].b[reg], k % 2, T{});
  };
  product<16>(d, mine, elem_a, elem_b);
}

}  // namespace emulated

inline void m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], __half) {
  emulated::m16n8k16<__half>(d, a, b);
}
inline void m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], __nv_bfloat16) {
  emulated::m16n8k16<__nv_bfloat16>(d, a, b);
}

// m16n8k8 tf32: a_r = (g + 8 (r % 2), t + 4 (r / 2)), b_r = (k t + 4r, n g).
inline void m16n8k8_tf32(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  using emulated::Frag;
  const Frag mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}};
  auto tf32 = [](uint32_t u) { return emulated::bits_to_float(u & 0xffffe000u); };
  auto elem_a = [&](const std::array<Frag, 32>& all, int row, int k) {
    return tf32(all[(row % 8) * 4 + k % 4].a[row / 8 + 2 * (k / 4)]);
  };
  auto elem_b = [&](const std::array<Frag, 32>& all, int k, int n) { return tf32(all[n * 4 + k % 4].b[k / 4]); };
  emulated::product<8>(d, mine, elem_a, elem_b);
}

// Round to nearest, ties away from zero, at 10 mantissa bits (finite x).
inline uint32_t to_tf32(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (u + 0x1000u) & 0xffffe000u;
}

// Register i of lane l: the 32-bit word at column pair l % 4 of row l / 4 of matrix i (whose row r lane 8i + r gave).
inline void ldsm_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, const void* p) {
  emu::require_aligned(p, 16);
  const auto rows = emu::gather(static_cast<const unsigned char*>(p));
  const int lane = threadIdx.x % 32;
  uint32_t* out[4] = {&r0, &r1, &r2, &r3};
  for (int i = 0; i < 4; ++i) std::memcpy(out[i], rows[8 * i + lane / 4] + 4 * (lane % 4), 4);
}
inline void ldsm_x4(uint32_t (&r)[4], const void* p) { ldsm_x4(r[0], r[1], r[2], r[3], p); }
template <int N> inline void ldsm_trans(uint32_t (&r)[N], const void* p) {
  if (threadIdx.x % 32 < 8 * N) emu::require_aligned(p, 16);  // the lanes whose addresses the N matrices take
  const auto rows = emu::gather(static_cast<const unsigned char*>(p));
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < N; ++i) {
    uint16_t lo, hi;  // transposed: elements (2 (lane % 4) + {0, 1}, lane / 4) of matrix i
    std::memcpy(&lo, rows[8 * i + 2 * (lane % 4)] + 2 * (lane / 4), 2);
    std::memcpy(&hi, rows[8 * i + 2 * (lane % 4) + 1] + 2 * (lane / 4), 2);
    r[i] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
  }
}
inline void ldsm_x4_trans(uint32_t (&r)[4], const void* p) { ldsm_trans<4>(r, p); }
inline void ldsm_x2_trans(uint32_t (&r)[2], const void* p) { ldsm_trans<2>(r, p); }
inline void ldsm_x2(uint32_t (&r)[2], const void* p) {
  if (threadIdx.x % 32 < 16) emu::require_aligned(p, 16);
  const auto rows = emu::gather(static_cast<const unsigned char*>(p));
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < 2; ++i) std::memcpy(&r[i], rows[8 * i + lane / 4] + 4 * (lane % 4), 4);
}

inline void cp_async16(void* dst, const void* src, bool valid) {
  emu::require_aligned(dst, 16);
  if (valid) emu::require_aligned(src, 16);
  emu::copy_async(dst, valid ? src : nullptr);
}
inline void cp_async_commit() { emu::commit_copies(); }
inline void cp_async_wait_all() { emu::land_copies_but_newest(0); }
template <int N> inline void cp_async_wait_prior() { emu::land_copies_but_newest(N); }

}  // namespace mma
}  // namespace hfab
