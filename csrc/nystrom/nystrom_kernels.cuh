// Nyström attention: the kernels over the sequence (N-sized work) on CUDA cores. The m x m work
// (K2, Newton–Schulz, W = Z W0) is ATen fp32 in nystrom_host.cuh.
//
// Math (hf_attention_backends/ops/nystrom/reference.py): per sequence b with n real tokens, q_s = q·√scale,
// k_s = k·√scale; landmarks = segment means of the real rows in order (seg = n / m, the last segment takes
// the rest). Every query attends to a small fp32 key/value buffer of `slots` rows per (b, head):
//   n > m:  keys = K̃ (the k landmarks), values = W = Z (K3 v)            (Nyström)
//   n <= m: keys = the n real k_s rows, values = their v rows               (exact softmax attention)
// so out = softmax(q_s keysᵀ) values + depthwise conv residual of v (padded tokens count as 0).
//
// Kernels (256 threads; the tiled ones as a 16 x 16 grid, fp32 accumulation, scores in base 2):
//   nystrom_positions_fwd_kernel  pos[b, r] = position of the r-th real token (from the mask's cumsum)
//   nystrom_landmark_fwd_kernel   one block per (landmark, q head or kv head, batch): segment mean, x √scale
//   nystrom_k3_fwd_kernel         one block per (key split, 32 landmarks, batch x q head): online softmax of
//                                 the landmarks against the split's real keys; partial (max, sum, acc) per
//                                 split, merged in a fixed order by the host (deterministic)
//   nystrom_out_fwd_kernel        one block per (query block, q head, batch): online softmax over the key
//                                 buffer, times the value buffer, plus the conv residual, in q.dtype
#pragma once

#include "common/tile.cuh"

namespace hfab {
namespace nystrom {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 256;

struct Strides {
  long long b, h, n;  // in elements; the head dim is contiguous
};

// Everything a launch needs; q, k, v 16-byte readable (the host makes sure).
struct Params {
  const void* q;
  const void* k;
  const void* v;
  Strides sq, sk, sv;
  const unsigned char* mask;  // (B, N) bool, rows mask_stride apart; nullptr = every token real
  long long mask_stride;
  const int* n_real;  // (B,) real tokens per sequence; nullptr = N
  const int* pos;     // (B, N) contiguous: position of the r-th real token, r < n_real; nullptr = identity
  int hq, hkv, groups, n, m;  // n = N (sequence length), m = num_landmarks
  float root;                 // √scale
  float* q_land;              // (B, Hq, m, D) fp32 contiguous, scaled by √scale
  float* k_land;              // (B, Hkv, m, D)
  float* counts;              // (B, m) rows per segment
  int splits, chunk;          // K3: key splits of `chunk` positions each
  float* part_max;            // (splits, B Hq, m) base-2 running max (-inf: no real key in the split)
  float* part_sum;            // (splits, B Hq, m)
  float* part_acc;            // (splits, B Hq, m, D) unnormalised sum of p v
  const float* keys;          // (B, Hq, slots, D) fp32 contiguous, scaled by √scale
  const float* vals;          // (B, Hq, slots, D)
  const int* nvalid;          // (B,) valid rows of the key buffer
  int slots;
  const float* conv;          // (Hq, ks) fp32 contiguous; nullptr = no conv residual
  int ks;
  void* out;                  // (B, Hq, N, D) contiguous, q.dtype
};

// pos[b, cumsum[b, j] - 1] = j for every real token j. Grid: ceil(B N / 256). Static: this header is
// included by two .cu files.
static __global__ void __launch_bounds__(kThreads) nystrom_positions_fwd_kernel(const unsigned char* mask,
                                                                         long long mask_stride, const int* cumsum,
                                                                         int* pos, long long total, int n) {
  const long long idx = (long long)blockIdx.x * kThreads + threadIdx.x;
  if (idx >= total) return;
  const long long b = idx / n;
  const int j = static_cast<int>(idx % n);
  if (mask[b * mask_stride + j]) pos[b * n + cumsum[idx] - 1] = j;
}

// Rows [start, end) of segment l among n real tokens: seg = max(n / m, 1), the last segment ends at n.
// Finite (possibly empty) for n <= m, where the landmarks are unused.
__device__ __forceinline__ int2 segment_bounds(int l, int n, int m) {
  const int seg = max(n / m, 1);
  const int start = min(l * seg, n);
  const int end = l == m - 1 ? n : min(start + seg, n);
  return make_int2(start, end);
}

// Grid (m, Hq + Hkv, B): blockIdx.y < Hq averages q head y, else k head y - Hq.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) nystrom_landmark_fwd_kernel(const Params p) {
  constexpr int kChunks = D / 8, kSlots = kThreads / kChunks;  // 16-byte chunks per row; rows in flight
  __shared__ float part[kSlots][D];
  const int l = blockIdx.x, hh = blockIdx.y, b = blockIdx.z;
  const bool is_q = hh < p.hq;
  const T* base = is_q ? static_cast<const T*>(p.q) + b * p.sq.b + hh * p.sq.h
                       : static_cast<const T*>(p.k) + b * p.sk.b + (hh - p.hq) * p.sk.h;
  const long long stride = is_q ? p.sq.n : p.sk.n;
  const int n = p.n_real != nullptr ? p.n_real[b] : p.n;
  const int2 se = segment_bounds(l, n, p.m);
  const int c = threadIdx.x % kChunks, slot = threadIdx.x / kChunks;
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  for (int r = se.x + slot; r < se.y; r += kSlots) {
    const int row = p.pos != nullptr ? p.pos[(long long)b * p.n + r] : r;
    const uint4 x = __ldg(reinterpret_cast<const uint4*>(base + row * stride) + c);
    const float2 a = Pair<T>::to_float2(x.x), bb = Pair<T>::to_float2(x.y);
    const float2 e2 = Pair<T>::to_float2(x.z), f = Pair<T>::to_float2(x.w);
    acc[0] += a.x; acc[1] += a.y; acc[2] += bb.x; acc[3] += bb.y;
    acc[4] += e2.x; acc[5] += e2.y; acc[6] += f.x; acc[7] += f.y;
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) part[slot][8 * c + e] = acc[e];
  __syncthreads();
  const int count = se.y - se.x;
  const float mul = count > 0 ? p.root / count : 0.f;
  float* out = is_q ? p.q_land + (((long long)b * p.hq + hh) * p.m + l) * D
                    : p.k_land + (((long long)b * p.hkv + hh - p.hq) * p.m + l) * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float s = 0.f;
    for (int t = 0; t < kSlots; ++t) s += part[t][d];  // fixed order: deterministic
    out[d] = s * mul;
  }
  if (hh == 0 && threadIdx.x == 0) p.counts[(long long)b * p.m + l] = static_cast<float>(count);
}

// Rows [row0, row0 + ROWS) of an fp32 matrix with D contiguous floats per row; rows >= n are zero.
template <int ROWS, int D>
__device__ __forceinline__ void load_ftile_f32(FTile<ROWS, D>& t, const float* base, int row0, int n) {
  constexpr int kQuads = D / 4;
  for (int c = threadIdx.x; c < ROWS * kQuads; c += kThreads) {
    const int r = c / kQuads, k = c % kQuads;
    const float4 x = row0 + r < n ? __ldg(reinterpret_cast<const float4*>(base + (long long)(row0 + r) * D) + k)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(&t.v[r][4 * k]) = x;
  }
}

// One online-softmax step for TR rows of this thread: scores s (base 2, -inf = masked) update the running
// max m and this thread's part of the row sum l, rescale o, and write p to `ps`.
template <int TR, int TC, int TD, int RP, int COLS>
__device__ __forceinline__ void online_softmax_step(float (&s)[TR][TC], float (&m)[TR], float (&l)[TR],
                                                    float2 (&o)[TR][TD], ScoreTile<RP, COLS>& ps, int ty, int tx) {
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    float tile_max = -inf();
#pragma unroll
    for (int j = 0; j < TC; ++j) tile_max = fmaxf(tile_max, s[i][j]);
    const float m_new = fmaxf(m[i], halfwarp_max(tile_max));
    const float m_use = m_new == -inf() ? 0.f : m_new;  // no real key yet: keep everything 0
    const float alpha = exp2f(m[i] - m_use);
    m[i] = m_new;
    l[i] *= alpha;
#pragma unroll
    for (int c = 0; c < TD; ++c) {
      o[i][c].x *= alpha;
      o[i][c].y *= alpha;
    }
#pragma unroll
    for (int j = 0; j < TC; ++j) {
      const float pij = exp2f(s[i][j] - m_use);
      l[i] += pij;
      ps.v[ty * TR + i][tx + 16 * j] = pij;
    }
  }
}

template <int D> struct K3Tiles {
  static constexpr int BL = 32, BK = D == 128 ? 32 : 64;  // landmarks x keys per tile
};

// Grid (splits, ceil(m / BL), B Hq). Keys [split * chunk, min(+chunk, N)), padded keys masked.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_k3_fwd_kernel(const Params p) {
  constexpr int BL = K3Tiles<D>::BL, BK = K3Tiles<D>::BK;
  constexpr int TR = BL / 16, TC = BK / 16, TD = D / 32;
  __shared__ FTile<BL, D> ls;
  __shared__ Tile<BK, D> ks;
  __shared__ Tile<BK, D> vs;
  __shared__ ScoreTile<BL, BK> ps;
  __shared__ float bias[BK];

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int split = blockIdx.x, l0 = blockIdx.y * BL, bh = blockIdx.z;
  const int b = bh / p.hq, h = bh % p.hq, g = h / p.groups;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h;
  const float scale_log2 = p.root * kLog2e;  // landmarks carry √scale, keys not yet

  load_ftile_f32(ls, p.q_land + (long long)bh * p.m * D, l0, p.m);
  float m[TR], l[TR];
  float2 o[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    m[i] = -inf();
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = make_float2(0.f, 0.f);
  }

  const int kbeg = split * p.chunk, kend = min(kbeg + p.chunk, p.n);
  for (int k0 = kbeg; k0 < kend; k0 += BK) {
    __syncthreads();  // the previous tile's readers are done
    load_tile(ks, k, p.sk.n, k0, kend);
    load_tile(vs, v, p.sv.n, k0, kend);
    for (int c = threadIdx.x; c < BK; c += kThreads) {
      const int j = k0 + c;
      const bool ok = j < kend && (p.mask == nullptr || p.mask[b * p.mask_stride + j]);
      bias[c] = ok ? 0.f : -inf();
    }
    __syncthreads();
    float s[TR][TC];
    tile_dot<T>(s, ls, ks, ty, tx);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) s[i][j] = fmaf(s[i][j], scale_log2, bias[tx + 16 * j]);
    online_softmax_step(s, m, l, o, ps, ty, tx);
    __syncthreads();
    tile_accumulate<T>(o, ps, vs, ty, tx);
  }

  const long long rows = (long long)split * gridDim.z + bh;  // (split, b h) slab of m rows
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const float sum = halfwarp_sum(l[i]);
    const int row = l0 + ty * TR + i;
    if (row >= p.m) continue;
    const long long r = rows * p.m + row;
    float2* acc = reinterpret_cast<float2*>(p.part_acc + r * D);
#pragma unroll
    for (int c = 0; c < TD; ++c) acc[tx + 16 * c] = o[i][c];
    if (tx == 0) {
      p.part_max[r] = m[i];
      p.part_sum[r] = sum;
    }
  }
}

template <int D> struct OutTiles {
  static constexpr int BQ = D <= 64 ? 64 : 32, BK = D == 32 ? 64 : 32;
  static constexpr bool kQ32 = D <= 64;  // q tile converted to fp32 once (else 16-bit, <= 48 KB static)
};

// Grid (ceil(N / BQ), Hq, B).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_out_fwd_kernel(const Params p) {
  using Cfg = OutTiles<D>;
  constexpr int BQ = Cfg::BQ, BK = Cfg::BK;
  constexpr int TR = BQ / 16, TC = BK / 16, TD = D / 32;
  __shared__ TileOf<Cfg::kQ32, BQ, D> qs;
  __shared__ FTile<BK, D> ks;
  __shared__ FTile<BK, D> vs;
  __shared__ ScoreTile<BQ, BK> ps;

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = blockIdx.x * BQ, h = blockIdx.y, b = blockIdx.z, g = h / p.groups;
  const long long bh = (long long)b * p.hq + h;
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const float* keys = p.keys + bh * p.slots * D;
  const float* vals = p.vals + bh * p.slots * D;
  const int nvalid = p.nvalid[b];
  const float scale_log2 = p.root * kLog2e;  // keys carry √scale, q not yet

  load_tile(qs, q, p.sq.n, q0, p.n);
  float m[TR], l[TR];
  float2 o[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    m[i] = -inf();
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = make_float2(0.f, 0.f);
  }
  for (int k0 = 0; k0 < nvalid; k0 += BK) {
    __syncthreads();
    load_ftile_f32(ks, keys, k0, nvalid);
    load_ftile_f32(vs, vals, k0, nvalid);
    __syncthreads();
    float s[TR][TC];
    tile_dot<T>(s, qs, ks, ty, tx);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) s[i][j] = k0 + tx + 16 * j < nvalid ? s[i][j] * scale_log2 : -inf();
    online_softmax_step(s, m, l, o, ps, ty, tx);
    __syncthreads();
    tile_accumulate<T>(o, ps, vs, ty, tx);
  }

  const int half = p.ks / 2;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h;
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const float sum = halfwarp_sum(l[i]);
    const int row = q0 + ty * TR + i;
    if (row >= p.n) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    float2 r[TD];
#pragma unroll
    for (int c = 0; c < TD; ++c) r[c] = make_float2(o[i][c].x * inv, o[i][c].y * inv);
    if (p.conv != nullptr) {
      for (int t = 0; t < p.ks; ++t) {
        const int j = row + t - half;
        if (j < 0 || j >= p.n || (p.mask != nullptr && !p.mask[b * p.mask_stride + j])) continue;
        const float w = p.conv[h * p.ks + t];
        const unsigned* vrow = reinterpret_cast<const unsigned*>(v + j * p.sv.n);
#pragma unroll
        for (int c = 0; c < TD; ++c) {
          const float2 x = Pair<T>::to_float2(vrow[tx + 16 * c]);
          r[c].x = fmaf(w, x.x, r[c].x);
          r[c].y = fmaf(w, x.y, r[c].y);
        }
      }
    }
    unsigned* dst = reinterpret_cast<unsigned*>(static_cast<T*>(p.out) + (bh * p.n + row) * D);
#pragma unroll
    for (int c = 0; c < TD; ++c) dst[tx + 16 * c] = Pair<T>::from_float2(r[c]);
  }
}

}  // namespace nystrom
}  // namespace hfab
