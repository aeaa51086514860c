// Device building blocks for CUDA-core attention kernels: 16-bit element pairs, shared-memory tiles
// and register-blocked tile products with fp32 accumulation.
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

// ROWS x D 16-bit elements stored as D/2 words per row plus one pad word: 16 threads reading one
// word from 16 different rows hit 16 different banks.
template <int ROWS, int D> struct Tile {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  unsigned w[ROWS][D / 2 + 1];
};

// ROWS x COLS fp32 (probabilities or dS), rows padded by 4 floats: float4 reads stay aligned and the
// two row groups of a warp fall on different banks.
template <int ROWS, int COLS> struct __align__(16) ScoreTile {
  static_assert(COLS % 4 == 0, "columns must be a multiple of 4");
  float v[ROWS][COLS + 4];
};

// Rows [row0, row0 + ROWS) of a matrix with D contiguous elements per row, rows `stride` elements
// apart; rows >= n are zero. Needs base 16-byte aligned and stride % 8 == 0 (the host checks).
template <int ROWS, int D, typename T>
__device__ __forceinline__ void load_tile(Tile<ROWS, D>& t, const T* base, long long stride, int row0, int n) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kTileThreads) {
    const int r = c / kChunks, k = c % kChunks;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (row0 + r < n) x = __ldg(reinterpret_cast<const uint4*>(base + (long long)(row0 + r) * stride) + k);
    t.w[r][4 * k + 0] = x.x;
    t.w[r][4 * k + 1] = x.y;
    t.w[r][4 * k + 2] = x.z;
    t.w[r][4 * k + 3] = x.w;
  }
}

// acc[i][j] = sum_d A[ty*TR + i][d] * B[tx + 16*j][d]   (A B^T on a TR x TC register block, fp32 FMA)
template <typename T, int TR, int TC, int RA, int RB, int D>
__device__ __forceinline__ void tile_dot(float (&acc)[TR][TC], const Tile<RA, D>& a, const Tile<RB, D>& b,
                                         int ty, int tx) {
#pragma unroll
  for (int i = 0; i < TR; ++i)
#pragma unroll
    for (int j = 0; j < TC; ++j) acc[i][j] = 0.f;
#pragma unroll 4
  for (int p = 0; p < D / 2; ++p) {
    float2 av[TR], bv[TC];
#pragma unroll
    for (int i = 0; i < TR; ++i) av[i] = Pair<T>::to_float2(a.w[ty * TR + i][p]);
#pragma unroll
    for (int j = 0; j < TC; ++j) bv[j] = Pair<T>::to_float2(b.w[tx + 16 * j][p]);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) acc[i][j] = fmaf(av[i].y, bv[j].y, fmaf(av[i].x, bv[j].x, acc[i][j]));
  }
}

// acc[i][c] += sum_k P[ty*TR + i][k] * B[k][pair tx + 16*c]   (P B with P fp32; pair = 2 columns)
template <typename T, int TR, int TD, int RP, int COLS, int RB, int D>
__device__ __forceinline__ void tile_accumulate(float2 (&acc)[TR][TD], const ScoreTile<RP, COLS>& p,
                                                const Tile<RB, D>& b, int ty, int tx) {
  static_assert(COLS <= RB && TD * 32 == D, "tile shapes");
#pragma unroll 2
  for (int k = 0; k < COLS; k += 4) {
    float4 pv[TR];
#pragma unroll
    for (int i = 0; i < TR; ++i) pv[i] = *reinterpret_cast<const float4*>(&p.v[ty * TR + i][k]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
      for (int c = 0; c < TD; ++c) {
        const float2 bv = Pair<T>::to_float2(b.w[k + kk][tx + 16 * c]);
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
