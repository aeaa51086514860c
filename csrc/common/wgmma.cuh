// Hopper warpgroup mma (wgmma.mma_async, sm_90a) through inline PTX: shared-memory matrix descriptors without
// swizzling, the fence / commit / wait that order the asynchronous products, and m64nNk16 (N 32, 64, 128) with fp16
// or bf16 operands, A from shared memory or registers, fp32 accumulators. Checked against the hardware by
// scripts/wgmma_check.cu (operand layouts, descriptor offsets, accumulator layout of m64n64k16 with A in shared
// memory). The instructions exist on sm_90a targets only: there `HFAB_HAS_WGMMA` is defined, and a kernel picks its
// wgmma path with it at compile time; compiled for another GPU the functions trap.
//
// Operands in shared memory are made of core matrices: 8 rows of 16 bytes (8 16-bit values), 128 contiguous bytes.
// K-major (the k index contiguous, as A row-major or B stored n by k): value (r, k) of a tile lies in core matrix
// (r / 8, k / 8) at byte (r % 8) 16 + (k % 8) 2 of it; MN-major (B stored k by n, TRANS_B): value (k, n) in core
// matrix (n / 8, k / 8) at byte (k % 8) 16 + (n % 8) 2. In both, the descriptor's leading byte offset is the distance
// between core matrices adjacent in k, its stride byte offset the distance between those adjacent in m or n
// (scripts/wgmma_check.cu on the H200, 2026-12-04: both other assignments give wrong products).
//
// Accumulators (m64nN, fp32): warp w of the warpgroup holds rows 16 w .. 16 w + 15 in the m16n8 C layout of mma.sync
// for each 8-column block j: d[4 j + i] = D[16 w + g + 8 (i / 2)][8 j + 2 t + i % 2], g = lane / 4, t = lane % 4
// (checked on the H200 by the same script).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HFAB_HAS_WGMMA 1
#define HFAB_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#elif defined(__CUDA_ARCH__)
#define HFAB_WGMMA_ASM(...) __trap()
#else
#define HFAB_WGMMA_ASM(...) (void)0
#endif

namespace hfab {
namespace wgmma {

// Whether this compilation takes the wgmma products (an sm_90a target, or the emulator's HFAB_EMULATE_WGMMA); else
// mma.sync. Kernels choose with `if constexpr`: no host dispatch.
#if defined(HFAB_HAS_WGMMA)
inline constexpr bool kEnabled = true;
#else
inline constexpr bool kEnabled = false;
#endif

// 64-bit descriptor of a no-swizzle operand tile at shared address `tile` (16-byte aligned): bits 0-13 the address,
// 16-29 the leading byte offset (k_bytes: between core matrices adjacent in k), 32-45 the stride byte offset
// (mn_bytes: adjacent in m or n), all in 16-byte units; swizzle mode (bits 62-63) 0.
__device__ __forceinline__ uint64_t descriptor(const void* tile, uint32_t k_bytes, uint32_t mn_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  return static_cast<uint64_t>((addr >> 4) & 0x3fffu) | (static_cast<uint64_t>((k_bytes >> 4) & 0x3fffu) << 16) |
         (static_cast<uint64_t>((mn_bytes >> 4) & 0x3fffu) << 32);
}

// Generic-proxy shared-memory writes (st.shared, cp.async after its wait) made visible to the async proxy that wgmma
// reads through; then a barrier before the product.
__device__ __forceinline__ void fence_shared_for_async() {
  HFAB_WGMMA_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Orders this thread's accumulator register writes before the next wgmma reads them.
__device__ __forceinline__ void fence() { HFAB_WGMMA_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit_group() { HFAB_WGMMA_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N of the warpgroup's committed groups are still running.
template <int N>
__device__ __forceinline__ void wait_group() {
  HFAB_WGMMA_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

#define HFAB_WGMMA_D16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define HFAB_WGMMA_D16_OPERANDS(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3])
#define HFAB_WGMMA_SS_N32(type) \
  HFAB_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." type "." type " " HFAB_WGMMA_D16 \
                 ", %16, %17, p, 1, 1, 0, %19;\n}\n" \
                 : HFAB_WGMMA_D16_OPERANDS(d) \
                 : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TRANS_B ? 1 : 0))
#define HFAB_WGMMA_RS_N32(type) \
  HFAB_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." type "." type " " HFAB_WGMMA_D16 \
                 ", {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n" \
                 : HFAB_WGMMA_D16_OPERANDS(d) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)), \
                   "n"(TRANS_B ? 1 : 0))
#define HFAB_WGMMA_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define HFAB_WGMMA_D32_OPERANDS(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define HFAB_WGMMA_SS_N64(type) \
  HFAB_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type " " HFAB_WGMMA_D32 \
                 ", %32, %33, p, 1, 1, 0, %35;\n}\n" \
                 : HFAB_WGMMA_D32_OPERANDS(d) \
                 : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TRANS_B ? 1 : 0))
#define HFAB_WGMMA_RS_N64(type) \
  HFAB_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type " " HFAB_WGMMA_D32 \
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
                 : HFAB_WGMMA_D32_OPERANDS(d) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)), \
                   "n"(TRANS_B ? 1 : 0))
#define HFAB_WGMMA_D64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63}"
#define HFAB_WGMMA_D64_OPERANDS(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), \
  "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), \
  "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), \
  "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
  "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), \
  "+f"(d[15][3])
#define HFAB_WGMMA_SS_N128(type) \
  HFAB_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " " HFAB_WGMMA_D64 \
                 ", %64, %65, p, 1, 1, 0, %67;\n}\n" \
                 : HFAB_WGMMA_D64_OPERANDS(d) \
                 : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TRANS_B ? 1 : 0))
#define HFAB_WGMMA_RS_N128(type) \
  HFAB_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." type "." type " " HFAB_WGMMA_D64 \
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
                 : HFAB_WGMMA_D64_OPERANDS(d) \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)), \
                   "n"(TRANS_B ? 1 : 0))
#define HFAB_WGMMA_BY_N(kind)                                          \
  if constexpr (N == 32) HFAB_WGMMA_##kind##_N32(HFAB_WGMMA_TYPE_NAME); \
  else if constexpr (N == 64) HFAB_WGMMA_##kind##_N64(HFAB_WGMMA_TYPE_NAME); \
  else HFAB_WGMMA_##kind##_N128(HFAB_WGMMA_TYPE_NAME)

// d (+)= A B, 64 x N x 16 (N = 32, 64 or 128), T = __half or __nv_bfloat16, fp32 accumulators (d[j][i] = the
// accumulator 4 j + i of the layout above), B from shared memory (descriptor), K-major or, with TRANS_B, MN-major.
// `mma`: A from shared memory (K-major descriptor). `mma_regs`: A from registers, each warp its 16 rows in the A
// fragment layout of mma.sync m16n8k16 (a[0]: row g, k 2t and 2t + 1; a[1]: row g + 8; a[2], a[3]: the same rows at
// k + 8). accumulate = false: d = A B. Asynchronous: fence() before (after any write to d or a), commit_group() and
// wait_group() before d is read or a is written.
template <int N, typename T, bool TRANS_B>
__device__ __forceinline__ void mma(float (&d)[N / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma::mma: N is 32, 64 or 128");
  if constexpr (std::is_same_v<T, __half>) {
#define HFAB_WGMMA_TYPE_NAME "f16"
    HFAB_WGMMA_BY_N(SS);
#undef HFAB_WGMMA_TYPE_NAME
  } else {
#define HFAB_WGMMA_TYPE_NAME "bf16"
    HFAB_WGMMA_BY_N(SS);
#undef HFAB_WGMMA_TYPE_NAME
  }
}
template <int N, typename T, bool TRANS_B>
__device__ __forceinline__ void mma_regs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b, bool accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma::mma_regs: N is 32, 64 or 128");
  if constexpr (std::is_same_v<T, __half>) {
#define HFAB_WGMMA_TYPE_NAME "f16"
    HFAB_WGMMA_BY_N(RS);
#undef HFAB_WGMMA_TYPE_NAME
  } else {
#define HFAB_WGMMA_TYPE_NAME "bf16"
    HFAB_WGMMA_BY_N(RS);
#undef HFAB_WGMMA_TYPE_NAME
  }
}

#undef HFAB_WGMMA_BY_N
#undef HFAB_WGMMA_SS_N32
#undef HFAB_WGMMA_RS_N32
#undef HFAB_WGMMA_D16
#undef HFAB_WGMMA_D16_OPERANDS
#undef HFAB_WGMMA_SS_N64
#undef HFAB_WGMMA_RS_N64
#undef HFAB_WGMMA_D32
#undef HFAB_WGMMA_D32_OPERANDS
#undef HFAB_WGMMA_SS_N128
#undef HFAB_WGMMA_RS_N128
#undef HFAB_WGMMA_D64
#undef HFAB_WGMMA_D64_OPERANDS
#undef HFAB_WGMMA_ASM

}  // namespace wgmma
}  // namespace hfab
