// Device building blocks for CUDA-core attention kernels: 16-bit element pairs, shared-memory tiles
// (16-bit, or converted to fp32 once at load) and register-blocked tile products with fp32 accumulation.
//
// Pure CUDA (no torch, no std headers) so that NVRTC can compile it for sm_60 (scripts/nvrtc_check.py).
// Uses nothing above Pascal: no tensor cores, no cp.async, no ldmatrix.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace hfab {

// +infinity (INFINITY needs <cmath>, which NVRTC lacks)
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }

constexpr int kTileThreads = 256;  // every tiled kernel runs a 16 x 16 thread grid: tx = tid % 16, ty = tid / 16

// A pair of 16-bit elements (one 32-bit word) to float2, and back with round-to-nearest.
template <typename T> struct Pair;

template <> struct Pair<__half> {
  static __device__ __forceinline__ float2 to_float2(unsigned w) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
  static __device__ __forceinline__ unsigned from_float2(float2 f) {
    __half2 h = __float22half2_rn(f);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

template <> struct Pair<__nv_bfloat16> {
  static __device__ __forceinline__ float2 to_float2(unsigned w) {  // exact: bf16 is the top half of fp32
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ unsigned from_float2(float2 f) {
    __nv_bfloat162 h = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<const unsigned*>(&h);
  }
};

// ROWS x D 16-bit elements stored as D/2 words per row plus two pad words: 16 threads reading 8 bytes
// (4 elements) from 16 different rows hit 32 different banks.
template <int ROWS, int D> struct __align__(16) Tile {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  static constexpr int kRows = ROWS, kD = D;
  unsigned w[ROWS][D / 2 + 2];
};

// ROWS x D elements converted to fp32 once when loaded (no conversion per use), rows padded by 4
// floats: 8 threads reading 16 bytes from 8 different rows hit 32 different banks.
template <int ROWS, int D> struct __align__(16) FTile {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  static constexpr int kRows = ROWS, kD = D;
  float v[ROWS][D + 4];
};

template <bool C, typename A, typename B> struct Select { using type = A; };
template <typename A, typename B> struct Select<false, A, B> { using type = B; };

// FTile when F32 (faster, twice the shared memory), else Tile.
template <bool F32, int ROWS, int D> using TileOf = typename Select<F32, FTile<ROWS, D>, Tile<ROWS, D>>::type;

// ROWS x COLS fp32 (probabilities or dS), rows padded by 4 floats: float4 reads stay aligned and the
// two row groups of a warp fall on different banks.
template <int ROWS, int COLS> struct __align__(16) ScoreTile {
  static_assert(COLS % 4 == 0, "columns must be a multiple of 4");
  float v[ROWS][COLS + 4];
};

// 16-byte chunk k of row `row` (zero for row >= n) of a matrix with rows `stride` elements apart.
template <typename T>
__device__ __forceinline__ uint4 load_chunk(const T* base, long long stride, int row, int k, int n) {
  if (row >= n) return make_uint4(0u, 0u, 0u, 0u);
  return __ldg(reinterpret_cast<const uint4*>(base + (long long)row * stride) + k);
}

// A block's copy of ROWS rows of D 16-bit elements in 16-byte chunks: this thread's chunk i is c = tid + 256 i,
// row c / (D/8), chunk c % (D/8) of the row.
template <int ROWS, int D> struct TileChunks {
  static constexpr int kChunks = D / 8, kTotal = ROWS * kChunks;
  static constexpr int kIters = (kTotal + kTileThreads - 1) / kTileThreads;
  static __device__ __forceinline__ int index(int i) { return threadIdx.x + i * kTileThreads; }
  static __device__ __forceinline__ bool used(int i) { return kTotal % kTileThreads == 0 || index(i) < kTotal; }
};

// This thread's chunks of rows [row0, row0 + ROWS) of a matrix with D contiguous elements per row, rows `stride`
// elements apart (rows >= n are zero), into registers. Needs base 16-byte aligned and stride % 8 == 0 (the host
// checks).
template <int ROWS, int D, typename T>
__device__ __forceinline__ void fetch_tile(uint4 (&x)[TileChunks<ROWS, D>::kIters], const T* base, long long stride,
                                           int row0, int n) {
  using C = TileChunks<ROWS, D>;
#pragma unroll
  for (int i = 0; i < C::kIters; ++i) {
    const int c = C::index(i);
    x[i] = C::used(i) ? load_chunk(base, stride, row0 + c / C::kChunks, c % C::kChunks, n) : make_uint4(0u, 0u, 0u, 0u);
  }
}

// Chunk k (elements 8k .. 8k + 7) of row r from its 16 loaded bytes: as loaded into a Tile, converted into an FTile.
template <typename T, int ROWS, int D>
__device__ __forceinline__ void put_chunk(Tile<ROWS, D>& t, int r, int k, uint4 x) {
  *reinterpret_cast<uint2*>(&t.w[r][4 * k]) = make_uint2(x.x, x.y);
  *reinterpret_cast<uint2*>(&t.w[r][4 * k + 2]) = make_uint2(x.z, x.w);
}

template <typename T, int ROWS, int D>
__device__ __forceinline__ void put_chunk(FTile<ROWS, D>& t, int r, int k, uint4 x) {
  const float2 a = Pair<T>::to_float2(x.x), b = Pair<T>::to_float2(x.y);
  const float2 e = Pair<T>::to_float2(x.z), f = Pair<T>::to_float2(x.w);
  *reinterpret_cast<float4*>(&t.v[r][8 * k]) = make_float4(a.x, a.y, b.x, b.y);
  *reinterpret_cast<float4*>(&t.v[r][8 * k + 4]) = make_float4(e.x, e.y, f.x, f.y);
}

// The fetched chunks into a Tile or FTile.
template <typename T, typename TileT>
__device__ __forceinline__ void store_tile(TileT& t, const uint4 (&x)[TileChunks<TileT::kRows, TileT::kD>::kIters]) {
  using C = TileChunks<TileT::kRows, TileT::kD>;
#pragma unroll
  for (int i = 0; i < C::kIters; ++i)
    if (C::used(i)) put_chunk<T>(t, C::index(i) / C::kChunks, C::index(i) % C::kChunks, x[i]);
}

// Rows [row0, row0 + ROWS) into a Tile or FTile: every load of this thread in flight before the first store (a store
// right after its load would wait out each load's latency in turn).
template <typename T, typename TileT>
__device__ __forceinline__ void load_tile(TileT& t, const T* base, long long stride, int row0, int n) {
  uint4 x[TileChunks<TileT::kRows, TileT::kD>::kIters];
  fetch_tile<TileT::kRows, TileT::kD>(x, base, stride, row0, n);
  store_tile<T>(t, x);
}

// Two tiles of the same rows (K and V, Q and dO): both tiles' loads in flight before the stores.
template <typename T, typename TileA, typename TileB>
__device__ __forceinline__ void load_tiles(TileA& a, const T* base_a, long long stride_a, TileB& b, const T* base_b,
                                           long long stride_b, int row0, int n) {
  uint4 xa[TileChunks<TileA::kRows, TileA::kD>::kIters], xb[TileChunks<TileB::kRows, TileB::kD>::kIters];
  fetch_tile<TileA::kRows, TileA::kD>(xa, base_a, stride_a, row0, n);
  fetch_tile<TileB::kRows, TileB::kD>(xb, base_b, stride_b, row0, n);
  store_tile<T>(a, xa);
  store_tile<T>(b, xb);
}

// Elements [4s, 4s + 4) of row r as fp32.
template <typename T, int ROWS, int D>
__device__ __forceinline__ float4 quad(const Tile<ROWS, D>& t, int r, int s) {
  const uint2 w = *reinterpret_cast<const uint2*>(&t.w[r][2 * s]);
  const float2 a = Pair<T>::to_float2(w.x), b = Pair<T>::to_float2(w.y);
  return make_float4(a.x, a.y, b.x, b.y);
}

template <typename T, int ROWS, int D>
__device__ __forceinline__ float4 quad(const FTile<ROWS, D>& t, int r, int s) {
  return *reinterpret_cast<const float4*>(&t.v[r][4 * s]);
}

// Elements 2c and 2c + 1 of row r as fp32.
template <typename T, int ROWS, int D>
__device__ __forceinline__ float2 pair(const Tile<ROWS, D>& t, int r, int c) {
  return Pair<T>::to_float2(t.w[r][c]);
}

template <typename T, int ROWS, int D>
__device__ __forceinline__ float2 pair(const FTile<ROWS, D>& t, int r, int c) {
  return *reinterpret_cast<const float2*>(&t.v[r][2 * c]);
}

// acc[i][j] = sum_d A[ty*TR + i][d] * B[tx + 16*j][d]   (A B^T on a TR x TC register block, fp32 FMA;
// A, B: Tile or FTile of the same D)
template <typename T, int TR, int TC, typename TA, typename TB>
__device__ __forceinline__ void tile_dot(float (&acc)[TR][TC], const TA& a, const TB& b, int ty, int tx) {
  static_assert(TA::kD == TB::kD, "tile head dims differ");
#pragma unroll
  for (int i = 0; i < TR; ++i)
#pragma unroll
    for (int j = 0; j < TC; ++j) acc[i][j] = 0.f;
#pragma unroll 2
  for (int s = 0; s < TA::kD / 4; ++s) {
    float4 av[TR], bv[TC];
#pragma unroll
    for (int i = 0; i < TR; ++i) av[i] = quad<T>(a, ty * TR + i, s);
#pragma unroll
    for (int j = 0; j < TC; ++j) bv[j] = quad<T>(b, tx + 16 * j, s);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        float x = fmaf(av[i].x, bv[j].x, acc[i][j]);
        x = fmaf(av[i].y, bv[j].y, x);
        x = fmaf(av[i].z, bv[j].z, x);
        acc[i][j] = fmaf(av[i].w, bv[j].w, x);
      }
  }
}

// acc[i][c] += sum_k P[ty*TR + i][k] * B[k][pair tx + 16*c]   (P B with P fp32; pair = 2 columns; B: Tile
// or FTile)
template <typename T, int TR, int TD, int RP, int COLS, typename TB>
__device__ __forceinline__ void tile_accumulate(float2 (&acc)[TR][TD], const ScoreTile<RP, COLS>& p, const TB& b,
                                                int ty, int tx) {
  static_assert(COLS <= TB::kRows && TD * 32 == TB::kD, "tile shapes");
#pragma unroll 2
  for (int k = 0; k < COLS; k += 4) {
    float4 pv[TR];
#pragma unroll
    for (int i = 0; i < TR; ++i) pv[i] = *reinterpret_cast<const float4*>(&p.v[ty * TR + i][k]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int c = 0; c < TD; ++c) {
        const float2 bv = pair<T>(b, k + kk, tx + 16 * c);
#pragma unroll
        for (int i = 0; i < TR; ++i) {
          const float pk = kk == 0 ? pv[i].x : kk == 1 ? pv[i].y : kk == 2 ? pv[i].z : pv[i].w;
          acc[i][c].x = fmaf(pk, bv.x, acc[i][c].x);
          acc[i][c].y = fmaf(pk, bv.y, acc[i][c].y);
        }
      }
    }
  }
}

// Reductions over the 16 threads sharing a ty (one half-warp: lanes differ in bits 0..3 only).
__device__ __forceinline__ float halfwarp_max(float x) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float halfwarp_sum(float x) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Write a TD-pair register row scaled by `mul` to a contiguous output row of D elements.
template <typename T, int TD>
__device__ __forceinline__ void store_row(T* row, const float2 (&acc)[TD], float mul, int tx) {
  unsigned* w = reinterpret_cast<unsigned*>(row);
#pragma unroll
  for (int c = 0; c < TD; ++c) w[tx + 16 * c] = Pair<T>::from_float2(make_float2(acc[c].x * mul, acc[c].y * mul));
}

}  // namespace hfab
