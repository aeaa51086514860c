// Tensor-core building blocks (sm_80+) on top of common/ptx.cuh (the mma.sync, ldmatrix and cp.async instructions):
// fragment loads, tf32 splits, 16-bit pair packing, tile copies. Pure CUDA.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k8"), with g = lane / 4 and
// t = lane % 4; a 32-bit register holding a 16-bit pair keeps the lower column (or k) index in its
// low half:
//   m16n8k16 (f16 / bf16): A (16 x 16, row-major) a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..),
//                          a3 = (g + 8, 2t + 8..);  B (16 x 8, k x n) b0 = (k 2t..2t+1, n g), b1 = (k 2t + 8.., n g)
//   m16n8k8 (tf32):        A a0 = (g, t), a1 = (g + 8, t), a2 = (g, t + 4), a3 = (g + 8, t + 4);
//                          B b0 = (k t, n g), b1 = (k t + 4, n g)
//   C / D (16 x 8, fp32):  c0, c1 = (g, 2t..2t+1), c2, c3 = (g + 8, 2t..2t+1)
// The C layout of two adjacent n-tiles (columns 16j..16j+15) is the A layout of a k-step: scores
// computed by one product feed the next without shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/ptx.cuh"

namespace hfab {
namespace mma {

// x in two tf32 halves by truncation: hi = x's top 11 significand bits, lo = the top 11 of x - hi (exact in fp32),
// so |x - hi - lo| < 2^-20 |x|. Three instructions (LOP3, FADD, LOP3) where two cvt.rna.tf32 cost nine on sm_90.
__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
  constexpr uint32_t kTf32Bits = 0xffffe000u;  // sign, exponent, 10 mantissa bits
  hi = __float_as_uint(x) & kTf32Bits;
  lo = __float_as_uint(x - __uint_as_float(hi)) & kTf32Bits;
}

// acc += a b with both operands in two tf32 halves: hi hi + hi lo + lo hi (fp32-accurate products).
__device__ __forceinline__ void mma_tf32x3(float (&acc)[4], const uint32_t (&ahi)[4], const uint32_t (&alo)[4],
                                           const uint32_t (&bhi)[2], const uint32_t (&blo)[2]) {
  m16n8k8_tf32(acc, ahi, bhi);
  m16n8k8_tf32(acc, ahi, blo);
  m16n8k8_tf32(acc, alo, bhi);
}

// Sum and max over the four lanes of a quad (the lanes holding one row of an mma C fragment).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Two values rounded to T and packed: `lo` in the low 16 bits (the lower column index).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The two values of a pack2 word, as floats (exact).
template <typename T> __device__ __forceinline__ float2 unpack2(uint32_t w);
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t w) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// x = hi + lo with hi = T(x) and lo = T(x - hi): two 16-bit operands that carry about twice the bits.
template <typename T> __device__ __forceinline__ void split(float x, T& hi, T& lo);
template <> __device__ __forceinline__ void split<__half>(float x, __half& hi, __half& lo) {
  hi = __float2half_rn(x);
  lo = __float2half_rn(x - __half2float(hi));
}
template <> __device__ __forceinline__ void split<__nv_bfloat16>(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}
// split() of two values at once, each half packed as pack2 packs them: the same bits as split() of each.
template <typename T> __device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack2<T>(x0, x1);
  const float2 h = unpack2<T>(hi);
  lo = pack2<T>(x0 - h.x, x1 - h.y);
}

// m16n8k16 fragments of a row-major 16-bit tile in shared memory (`pitch` elements per row; the tile, pitch and k0
// 16-byte multiples, as ldmatrix needs every row address aligned), in the layouts above: the registers that 32-bit
// loads of each element pair give, from one ldmatrix instead of four (A) or two (B) loads (scripts/ldsm_fragments.py).
// A: rows r0..r0 + 15, columns k0..k0 + 15.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int pitch, int r0, int k0, int lane) {
  ldsm_x4(a, tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * pitch + k0 + (lane >> 4) * 8);
}
// B of one n-tile of a [n][k] tile: rows (n) n0..n0 + 7, columns (k) k0..k0 + 15.
template <typename T>
__device__ __forceinline__ void load_b(uint32_t (&b)[2], const T* tile, int pitch, int n0, int k0, int lane) {
  ldsm_x2(b, tile + (n0 + (lane & 7)) * pitch + k0 + ((lane >> 3) & 1) * 8);
}
// B of two n-tiles of a [n][k] tile, rows n0.. into b[0] and rows n1.. into b[1], columns k0..k0 + 15.
template <typename T>
__device__ __forceinline__ void load_b2(uint32_t (&b)[2][2], const T* tile, int pitch, int n0, int n1, int k0,
                                        int lane) {
  const T* row = tile + ((lane >> 4 ? n1 : n0) + (lane & 7)) * pitch;
  ldsm_x4(b[0][0], b[0][1], b[1][0], b[1][1], row + k0 + ((lane >> 3) & 1) * 8);
}

// fn(n, b) for the n-tiles n < min(NN, ncount) in order, b the B fragment of n-tile n (rows 8n..) of a [n][k] tile,
// columns k0..k0 + 15: two n-tiles per ldmatrix.x4 where both are wanted, else one by .x2.
template <int NN, typename T, typename Fn>
__device__ __forceinline__ void for_each_b(const T* tile, int pitch, int k0, int ncount, int lane, Fn&& fn) {
#pragma unroll
  for (int n = 0; n < NN; n += 2) {
    if (n + 1 < NN && n + 1 < ncount) {
      uint32_t b[2][2];
      load_b2(b, tile, pitch, 8 * n, 8 * n + 8, k0, lane);
      fn(n, b[0]);
      fn(n + 1, b[1]);
    } else if (n < ncount) {  // a path of its own: a pair that either load may fill costs moves
      uint32_t b[2];
      load_b(b, tile, pitch, 8 * n, k0, lane);
      fn(n, b);
    }
  }
}

// A of an m16n8k16 from a row-major [k][m] tile, transposed (A = tile^T: rows m0..m0 + 15, columns k0..k0 + 15), by
// ldmatrix.trans.
template <typename T>
__device__ __forceinline__ void load_a_trans(uint32_t (&a)[4], const T* tile, int pitch, int m0, int k0, int lane) {
  ldsm_x4_trans(a, tile + (k0 + (lane & 7) + (lane >> 4) * 8) * pitch + m0 + ((lane >> 3) & 1) * 8);
}

// fn(n, b) for the n-tiles n < NN in order, b the B fragment of n-tile n (columns 8n..8n + 7) of a row-major [k][n]
// tile, rows k0..k0 + 15, by ldmatrix.trans: two n-tiles per .x4, a lone last one by .x2.
template <int NN, typename T, typename Fn>
__device__ __forceinline__ void for_each_b_trans(const T* tile, int pitch, int k0, int lane, Fn&& fn) {
  const T* row = tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * pitch;
#pragma unroll
  for (int n = 0; n < NN; n += 2) {
    if (n + 1 < NN) {
      uint32_t b[4];
      ldsm_x4_trans(b, row + 8 * (n + (lane >> 4)));
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      fn(n, b0);
      fn(n + 1, b1);
    } else {
      uint32_t b[2];
      ldsm_x2_trans(b, row + 8 * n);
      fn(n, b);
    }
  }
}

// Element offset of (row, col) in a tile of D columns laid out as wgmma's no-swizzle core matrices (common/wgmma.cuh):
// 8-row groups 8 D elements apart, their 8-column core matrices 64 apart, a core matrix's rows 8 apart.
template <int D> __host__ __device__ __forceinline__ int core_at(int row, int col) {
  return (row / 8) * 8 * D + (col / 8) * 64 + (row % 8) * 8 + col % 8;
}

// A thread's share of a block copying ROWS rows of D 16-bit elements in 16-byte chunks into a shared tile with rows
// D + 8 elements apart (CORE: in core matrices, core_at): chunk chunk() of rows row() + kPass i, i < kIters. Addresses
// are formed once per copy and advanced by kPass rows (no division per chunk; a 64-bit add per global address,
// constant shared offsets).
template <int ROWS, int D, int THREADS, bool PER_WARP = false, bool CORE = false> struct RowChunks {
  static constexpr int kChunks = D / 8, kPass = THREADS / kChunks, kIters = ROWS / kPass;
  static constexpr int kBatch = kIters < 4 ? kIters : 4;  // loads in flight per thread before their stores
  static_assert(THREADS % kChunks == 0 && ROWS % kPass == 0 && kIters % kBatch == 0, "tile shapes");
  static_assert(!CORE || kPass % 8 == 0, "core-matrix tiles advance by whole 8-row groups");
  // this thread's index among the THREADS that copy: the block's, or its lane for a warp's own rows (PER_WARP)
  static __device__ __forceinline__ unsigned tid() { return PER_WARP ? threadIdx.x % 32u : threadIdx.x; }
  static __device__ __forceinline__ int row() { return tid() / kChunks; }
  static __device__ __forceinline__ uint4* dst(void* tile, int i) {  // this thread's chunk of pass i
    const int at = CORE ? core_at<D>(row(), 8 * (tid() % kChunks)) + kPass * i * D
                        : (row() + kPass * i) * (D + 8) + 8 * (tid() % kChunks);
    return reinterpret_cast<uint4*>(static_cast<char*>(tile) + 2 * at);
  }
  template <typename T> static __device__ __forceinline__ const T* src(const T* x, long long stride, int row0) {
    return x + (row0 + row()) * stride + 8 * (tid() % kChunks);
  }
};

// This thread's chunks i0 .. i0 + N - 1 of a RowChunks copy (C) into val (zero where ok(row) is false), src advanced
// past them; then their stores.
template <typename C, int N, typename T, typename Ok>
__device__ __forceinline__ void fetch_chunks(uint4 (&val)[N], const T*& src, long long stride, int i0, Ok ok) {
  const int r = C::row();
#pragma unroll
  for (int i = 0; i < N; ++i, src += C::kPass * stride) {
    val[i] = make_uint4(0u, 0u, 0u, 0u);
    if (ok(r + C::kPass * (i0 + i))) val[i] = __ldg(reinterpret_cast<const uint4*>(src));
  }
}
template <typename C, int N>
__device__ __forceinline__ void store_chunks(const uint4 (&val)[N], void* tile, int i0) {
#pragma unroll
  for (int i = 0; i < N; ++i) *C::dst(tile, i0 + i) = val[i];
}

// Rows [row0, row0 + ROWS) of x (global memory, read-only while the kernel runs; D 16-bit elements per row, `stride`
// elements apart, 16-byte aligned) into a shared tile with rows D + 8 elements apart, by a block of THREADS threads;
// rows r with ok(r) false are 0. Each thread issues up to four loads before storing them (a store right after its
// load would wait out every load's latency).
template <int ROWS, int D, int THREADS, typename T, typename Ok>
__device__ __forceinline__ void load_rows(void* tile, const T* x, long long stride, int row0, Ok ok) {
  using C = RowChunks<ROWS, D, THREADS>;
  const T* src = C::src(x, stride, row0);
#pragma unroll
  for (int i0 = 0; i0 < C::kIters; i0 += C::kBatch) {
    uint4 val[C::kBatch];
    fetch_chunks<C>(val, src, stride, i0, ok);
    store_chunks<C>(val, tile, i0);
  }
}

// A whole load_rows copy held in this thread's registers between its loads (fetch) and its stores (store), so that
// other work, e.g. another copy's loads, overlaps the loads' latency: kIters 16-byte words per thread.
template <int ROWS, int D, int THREADS> struct RowsInFlight {
  using C = RowChunks<ROWS, D, THREADS>;
  uint4 val[C::kIters];
  template <typename T, typename Ok>
  __device__ __forceinline__ void fetch(const T* x, long long stride, int row0, Ok ok) {
    const T* src = C::src(x, stride, row0);
    fetch_chunks<C>(val, src, stride, 0, ok);
  }
  __device__ __forceinline__ void store(void* tile) const { store_chunks<C>(val, tile, 0); }
};

// The same by cp.async (no registers), as one committed group: completes at cp_async_wait_all. PER_WARP: THREADS = 32
// lanes of one warp copy the tile (a warp's own rows). CORE: the tile in core matrices (core_at).
template <int ROWS, int D, int THREADS, bool PER_WARP = false, bool CORE = false, typename T, typename Ok>
__device__ __forceinline__ void load_rows_async(void* tile, const T* x, long long stride, int row0, Ok ok) {
  using C = RowChunks<ROWS, D, THREADS, PER_WARP, CORE>;
  const int r = C::row();
  const T* src = C::src(x, stride, row0);
#pragma unroll
  for (int i = 0; i < C::kIters; ++i, src += C::kPass * stride) {
    const bool valid = ok(r + C::kPass * i);
    cp_async16(C::dst(tile, i), valid ? src : x, valid);
  }
  cp_async_commit();
}

// The 32-bit word at p (two 16-bit elements; p must be 4-byte aligned), e.g. a fragment register.
template <typename T> __device__ __forceinline__ uint32_t ld32(const T* p) { return *reinterpret_cast<const uint32_t*>(p); }

}  // namespace mma
}  // namespace hfab
