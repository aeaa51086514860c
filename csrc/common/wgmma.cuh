// Hopper warpgroup mma (wgmma.mma_async, sm_90a) through inline PTX: shared-memory matrix descriptors without
// swizzling, the fence / commit / wait that order the asynchronous products, and m64n64k16 with fp16 or bf16
// operands and fp32 accumulators. Checked against the hardware by scripts/wgmma_check.cu (operand layouts, descriptor
// offsets, accumulator layout); no kernel takes it yet (issue 4, csrc/nystrom/NOTES.md "Next for N 131K"). The
// instructions exist on sm_90a targets only (`__CUDA_ARCH_FEAT_SM90_ALL`): compiled for another GPU the functions
// trap, so the kernels that call them must be built for sm_90a and launched on sm_90 devices only.
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
#define HFAB_WGMMA_ASM(...) asm volatile(__VA_ARGS__)
#elif defined(__CUDA_ARCH__)
#define HFAB_WGMMA_ASM(...) __trap()
#else
#define HFAB_WGMMA_ASM(...) (void)0
#endif

namespace hfab {
namespace wgmma {

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

#define HFAB_WGMMA_D32                                                                                                \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "    \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define HFAB_WGMMA_D32_OPERANDS(d)                                                                                    \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),          \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),          \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),         \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (+)= A B, 64 x 64 x 16, T = __half or __nv_bfloat16, A and B from shared memory (descriptors); accumulate =
// false: d = A B. TRANS_B: B's tile is MN-major (the n index contiguous) instead of K-major. Asynchronous: fence()
// before, commit_group() and wait_group() before d is read.
#define HFAB_WGMMA_M64N64K16(type)                                                                                    \
  HFAB_WGMMA_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." type "." type " " HFAB_WGMMA_D32                         \
               ", %32, %33, p, 1, 1, 0, %35;\n}\n"                                                                    \
               : HFAB_WGMMA_D32_OPERANDS(d)                                                                           \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(TRANS_B ? 1 : 0))
template <typename T, bool TRANS_B>
__device__ __forceinline__ void m64n64k16(float (&d)[32], uint64_t a, uint64_t b, bool accumulate) {
  if constexpr (std::is_same_v<T, __half>) HFAB_WGMMA_M64N64K16("f16");
  else HFAB_WGMMA_M64N64K16("bf16");
}

#undef HFAB_WGMMA_M64N64K16
#undef HFAB_WGMMA_D32
#undef HFAB_WGMMA_D32_OPERANDS
#undef HFAB_WGMMA_ASM

}  // namespace wgmma
}  // namespace hfab
