// Nyström attention: the kernels over the sequence (N-sized work) and the m x m stage (K2, Newton–Schulz,
// W = Z W0, one block per (batch, head)) on CUDA cores.
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
//                                 split, merged in a fixed order (deterministic) by
//   nystrom_k3_merge_fwd_kernel   one thread per (landmark row, 4 columns): W0 = K3 v and lse3 from the partials
//   nystrom_out_fwd_kernel        one block per (query block, q head, batch): online softmax over the key
//                                 buffer, times the value buffer, plus the conv residual, in q.dtype
//   nystrom_inverse_fwd_kernel    one block per (batch, q head): K2, Newton–Schulz (all iterates in shared
//                                 memory, optionally saved for the backward)
//   nystrom_w_fwd_kernel          one block per (batch, q head): W = Z W0
#pragma once

#include "common/mma.cuh"
#include "common/strides.cuh"
#include "common/tile.cuh"

namespace hfab {
namespace nystrom {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kThreads = 256;

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
  float* out_lse;             // (B Hq, N): the output kernels write row_lse of each row (the backward's lse1); or null
};

// The base-2 log-sum-exp of a row's buffer scores from its running max m and sum Σ 2^(s - m); +inf for a row with no
// valid slot (sum 0), whose probabilities are then all 0.
__device__ __forceinline__ float row_lse(float m, float sum) { return sum > 0.f ? m + __log2f(sum) : inf(); }

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

// Grid (m, Hq + Hkv, B), THREADS threads: blockIdx.y < Hq averages q head y, else k head y - Hq.
template <typename T, int D, int THREADS>
__global__ void __launch_bounds__(THREADS) nystrom_landmark_fwd_kernel(const Params p) {
  constexpr int kChunks = D / 8, kSlots = THREADS / kChunks;  // 16-byte chunks per row; rows in flight
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
  for (int d = threadIdx.x; d < D; d += THREADS) {
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
    load_tiles(ks, k, p.sk.n, vs, v, p.sv.n, k0, kend);
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

// W0 = K3 v from the key splits' partials (nystrom_k3_fwd_kernel's layout), in a fixed split order:
// top = max_s part_max[s] (>= -1e30: -inf where no split saw a real key), w_s = 2^(part_max[s] - top),
// W0 = Σ_s w_s acc_s / max(Σ_s w_s sum_s, 1e-30); with lse3, also top + log2 of that denominator. One thread per
// (row, 4 columns); rows = B Hq m. Grid ceil(rows D / 4 / 256). Static: this header is included by two .cu files.
static __global__ void __launch_bounds__(kThreads) nystrom_k3_merge_fwd_kernel(const float* part_max,
                                                                               const float* part_sum,
                                                                               const float* part_acc, int splits,
                                                                               long long rows, int d, float* w0,
                                                                               float* lse3) {
  const long long quads = (long long)d / 4, i = (long long)blockIdx.x * kThreads + threadIdx.x;
  if (i >= rows * quads) return;
  const long long row = i / quads, c = 4 * (i % quads);
  float top = -1e30f;
  for (int s = 0; s < splits; ++s) top = fmaxf(top, part_max[s * rows + row]);
  float den = 0.f;
  float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < splits; ++s) {
    const float w = exp2f(part_max[s * rows + row] - top);  // 0 for a split without a real key (max -inf)
    den = fmaf(w, part_sum[s * rows + row], den);
    const float4 a = *reinterpret_cast<const float4*>(part_acc + (s * rows + row) * d + c);
    num = make_float4(fmaf(w, a.x, num.x), fmaf(w, a.y, num.y), fmaf(w, a.z, num.z), fmaf(w, a.w, num.w));
  }
  den = fmaxf(den, 1e-30f);
  *reinterpret_cast<float4*>(w0 + row * d + c) = make_float4(num.x / den, num.y / den, num.z / den, num.w / den);
  if (lse3 != nullptr && c == 0) lse3[row] = top + __log2f(den);
}

template <int D> struct OutTiles {
  static constexpr int BQ = D <= 64 ? 64 : 32, BK = D == 32 ? 64 : 32;
  static constexpr bool kQ32 = D <= 64;  // q tile converted to fp32 once (else 16-bit, <= 48 KB static)
};

// Online softmax of the query tile `qs` (already loaded) over the nvalid first rows of the key/value buffer:
// running max m (base 2), this thread's part of the row sum l and the unnormalised o = Σ p values, for rows
// ty·TR + i and value column pairs tx + 16 c. Used by the forward's output kernel and the backward's row stats.
template <typename T, int TR, int TD, typename TQ, int BQ, int BK, int D>
__device__ __forceinline__ void buffer_attend(const TQ& qs, FTile<BK, D>& ks, FTile<BK, D>& vs, ScoreTile<BQ, BK>& ps,
                                              const float* keys, const float* vals, int nvalid, float scale_log2,
                                              float (&m)[TR], float (&l)[TR], float2 (&o)[TR][TD], int ty, int tx) {
  constexpr int TC = BK / 16;
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
}

// Grid (ceil(N / BQ), Hq, B).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_out_fwd_kernel(const Params p) {
  using Cfg = OutTiles<D>;
  constexpr int BQ = Cfg::BQ, BK = Cfg::BK;
  constexpr int TR = BQ / 16, TD = D / 32;
  __shared__ TileOf<Cfg::kQ32, BQ, D> qs;
  __shared__ FTile<BK, D> ks;
  __shared__ FTile<BK, D> vs;
  __shared__ ScoreTile<BQ, BK> ps;

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = blockIdx.x * BQ, h = blockIdx.y, b = blockIdx.z, g = h / p.groups;
  const long long bh = (long long)b * p.hq + h;
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  load_tile(qs, q, p.sq.n, q0, p.n);
  float m[TR], l[TR];
  float2 o[TR][TD];
  buffer_attend<T>(qs, ks, vs, ps, p.keys + bh * p.slots * D, p.vals + bh * p.slots * D, p.nvalid[b],
                   p.root * kLog2e, m, l, o, ty, tx);  // keys carry √scale, q not yet

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
    if (p.out_lse != nullptr && tx == 0) p.out_lse[bh * p.n + row] = row_lse(m[i], sum);
  }
}

// The m x m stage of one (batch, q head) per block: K2 = softmax(Q̃ K̃ᵀ), Z = NS(K2) or NS(K2ᵀK2 + λI) K2ᵀ
// (reference.k2_inverse); then W = Z W0 (nystrom_w_fwd_kernel). Matrices padded to MP = 16 TM rows/cols (padding
// never enters the real block: every product sums over k < m only). 256 threads as 16 x 16, thread (ty, tx) owns
// rows ty + 16 i and columns tx + 16 j (conflict-free shared reads). Buffers M (= A Z), T in dynamic shared memory;
// A and Z too for MP <= 64, in global scratch for MP = 128 (3 x 64 KB would not fit an sm_80 block).
struct InvParams {
  const float* q_land;  // (B, Hq, m, D) fp32 contiguous
  const float* k_land;  // (B, Hkv, m, D)
  const float* w0;      // (B, Hq, m, D): K3 v (nystrom_w_fwd_kernel)
  float* k2;            // (B, Hq, m, m) out (also read back when kappa > 0)
  float* w;             // (B, Hq, m, D) out: Z W0 (nystrom_w_fwd_kernel)
  float* scratch;       // MP = 128: (B Hq, 2, MP, MP) for A and Z; else unused
  float* zs;            // optional (B, Hq, iters + 1, m, m): the iterates Z_0 .. Z_iters of NS
  float* z;             // (B, Hq, m, m) out: the final Z (after the K2ᵀ factor when kappa > 0)
  float* a;             // optional (B, Hq, m, m): the matrix NS inverts
  float* s;             // optional (B Hq): ‖A‖₁‖A‖∞
  int hq, groups, m, iters;
  bool ridge;           // kappa_star > 0
  float kappa;
};

// acc[i][j] = Σ_{k < kdim} lp(ty + 16 i, k) lq(k, tx + 16 j) (kAccumulate: acc[i][j] += the sum), the sums in
// Sum (float, or double: operands converted once per k, the result rounded once to float).
template <bool kAccumulate = false, typename Sum = float, int TM, int TN, typename LP, typename LQ>
__device__ __forceinline__ void inv_product(float (&acc)[TM][TN], int kdim, LP lp, LQ lq, int ty, int tx) {
  Sum sum[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) sum[i][j] = kAccumulate ? acc[i][j] : Sum{0};
  for (int k = 0; k < kdim; ++k) {
    Sum a[TM], b[TN];
#pragma unroll
    for (int i = 0; i < TM; ++i) a[i] = lp(ty + 16 * i, k);
#pragma unroll
    for (int j = 0; j < TN; ++j) b[j] = lq(k, tx + 16 * j);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) sum[i][j] = fma(a[i], b[j], sum[i][j]);
  }
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) acc[i][j] = static_cast<float>(sum[i][j]);
}

// The fp32 m x m products of Newton–Schulz (the inverse kernel's steps; the VJP's, all but its two with A): on tensor
// cores for m <= 64 (TM <= 4), m16n8k8 with both operands in two tf32 halves (hi hi + hi lo + lo hi, fp32
// accumulation: ~2^-20 relative per operand), the 8 warps tiling the MP x MP result in 16 x 8 tiles (kWarpRows x
// kWarpCols warps of kRows x kCols tiles): 5x fewer shared-memory reads per product than the CUDA-core 4 x 4
// register tiles, whose reads bound those kernels (NOTES.md). For m > 64 the CUDA-core products (inv_product;
// thread (ty, tx) owns rows ty + 16 i, columns tx + 16 j).
// Acc: one product's accumulators; zero, add (acc += lp lq over k < kdim) and for_each (f(r, c, value) on this thread's
// entries: together the threads cover the MP x MP block once).
template <int TM, bool kTensorCores = (TM <= 4)>
struct NsProducts {
  using Acc = float[TM][TM];

  __device__ static void zero(Acc& acc) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TM; ++j) acc[i][j] = 0.f;
  }
  template <typename LP, typename LQ>
  __device__ static void add(Acc& acc, int kdim, LP lp, LQ lq) {
    inv_product<true>(acc, kdim, lp, lq, threadIdx.x / 16, threadIdx.x % 16);
  }
  template <typename F>
  __device__ static void for_each(const Acc& acc, F f) {  // f(r, c, value) on this thread's entries
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TM; ++j) f(ty + 16 * i, tx + 16 * j, acc[i][j]);
  }
};

template <int TM>
struct NsProducts<TM, true> {
  static constexpr int MP = 16 * TM;
  static constexpr int kTileRows = MP / 16, kTileCols = MP / 8, kWarps = kThreads / 32;
  static constexpr int kWarpRows = kTileRows < 4 ? kTileRows : 4, kWarpCols = kWarps / kWarpRows;
  static constexpr int kRows = kTileRows / kWarpRows, kCols = kTileCols / kWarpCols;
  static_assert(kWarpRows * kWarpCols == kWarps && kRows * kWarpRows == kTileRows && kCols * kWarpCols == kTileCols,
                "the warps must tile the result");
  using Acc = float[kRows][kCols][4];

  __device__ static int row0() { return (threadIdx.x / 32 / kWarpCols) * kRows * 16; }
  __device__ static int col0() { return (threadIdx.x / 32 % kWarpCols) * kCols * 8; }

  __device__ static void zero(Acc& acc) {
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
  }
  // k runs in steps of 8 up to kdim rounded up: the buffers are zero outside the m x m block.
  template <typename LP, typename LQ>
  __device__ static void add(Acc& acc, int kdim, LP lp, LQ lq) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = row0() + g, c0 = col0() + g;
    for (int k0 = 0; k0 < kdim; k0 += 8) {
      uint32_t ahi[kRows][4], alo[kRows][4], bhi[kCols][2], blo[kCols][2];
#pragma unroll
      for (int i = 0; i < kRows; ++i) {  // A: (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4)
        const int r = r0 + 16 * i;
        mma::tf32_split(lp(r, k0 + t), ahi[i][0], alo[i][0]);
        mma::tf32_split(lp(r + 8, k0 + t), ahi[i][1], alo[i][1]);
        mma::tf32_split(lp(r, k0 + t + 4), ahi[i][2], alo[i][2]);
        mma::tf32_split(lp(r + 8, k0 + t + 4), ahi[i][3], alo[i][3]);
      }
#pragma unroll
      for (int j = 0; j < kCols; ++j) {  // B: (t, g), (t + 4, g)
        const int c = c0 + 8 * j;
        mma::tf32_split(lq(k0 + t, c), bhi[j][0], blo[j][0]);
        mma::tf32_split(lq(k0 + t + 4, c), bhi[j][1], blo[j][1]);
      }
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int j = 0; j < kCols; ++j) mma::mma_tf32x3(acc[i][j], ahi[i], alo[i], bhi[j], blo[j]);
    }
  }
  template <typename F>
  __device__ static void for_each(const Acc& acc, F f) {  // C: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
    const int lane = threadIdx.x % 32, r0 = row0() + lane / 4, c0 = col0() + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kCols; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(r0 + 16 * i + 8 * (e / 2), c0 + 8 * j + e % 2, acc[i][j][e]);
  }
};

// Column t's and row t's sums of |X| over the m x m block of X (rows LD floats apart), by threads t < m, each in row
// order: the forward's ‖A‖₁‖A‖∞ and its backward's amax-tie test read the same sums.
template <int LD>
__device__ __forceinline__ void abs_line_sums(const float* x, int m, float* col_sums, float* row_sums) {
  const int t = threadIdx.x;
  if (t >= m) return;
  float cs = 0.f, rs = 0.f;
  for (int r = 0; r < m; ++r) {
    cs += fabsf(x[r * LD + t]);
    rs += fabsf(x[t * LD + r]);
  }
  col_sums[t] = cs;
  row_sums[t] = rs;
}

// ‖X‖₁‖X‖∞ of the m x m block of X (rows LD floats apart), fixed order; every thread gets the value.
template <int MP, int LD>
__device__ __forceinline__ float inv_norm_product(const float* x, int m, float* red) {
  __syncthreads();  // red's previous readers are done
  const int t = threadIdx.x;
  abs_line_sums<LD>(x, m, red, red + MP);
  __syncthreads();
  if (t == 0) {
    float cm = 0.f, rm = 0.f;
    for (int r = 0; r < m; ++r) {
      cm = fmaxf(cm, red[r]);
      rm = fmaxf(rm, red[MP + r]);
    }
    red[2 * MP] = cm * rm;
  }
  __syncthreads();
  return red[2 * MP];
}

// Row pitch of the inverse kernel's m x m buffers: MP + 4 where the Newton–Schulz products run on tensor cores
// (m <= 64: fragment reads conflict-free), MP for m > 64 (A and Z in the host's (B Hq, 2, 128, 128) scratch).
template <int TM>
constexpr int inv_ld() {
  return TM == 8 ? 16 * TM : 16 * TM + 4;
}

// Grid (B Hq), 256 threads, dynamic shared memory inv_smem_bytes<TM>().
template <int TM>
constexpr int inv_smem_bytes() {
  return (TM == 8 ? 2 : 4) * (16 * TM) * inv_ld<TM>() * static_cast<int>(sizeof(float));
}

// Two blocks per SM (128 registers) where B Hq exceeds the SMs, except m > 64 (its 8 x 8 tiles need ~190).
template <int TM, int D>
__global__ void __launch_bounds__(kThreads, TM == 8 ? 1 : 2) nystrom_inverse_fwd_kernel(const InvParams p) {
  constexpr int MP = 16 * TM, LD = inv_ld<TM>(), MM = MP * LD;
  constexpr bool kGlobalAZ = TM == 8;
  extern __shared__ float4 inv_smem[];
  __shared__ float red[2 * MP + 1];
  float* const mz = reinterpret_cast<float*>(inv_smem);
  float* const tt = mz + MM;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int bh = blockIdx.x, b = bh / p.hq, h = bh % p.hq, g = h / p.groups, m = p.m;
  float* a;
  float* z;
  if constexpr (kGlobalAZ) {
    a = p.scratch + (long long)bh * 2 * MM;
    z = a + MM;
  } else {
    a = mz + 2 * MM;
    z = mz + 3 * MM;
  }
  const float* ql = p.q_land + (long long)bh * m * D;
  const float* kl = p.k_land + ((long long)b * (p.hq / p.groups) + g) * m * D;
  float* k2g = p.k2 + (long long)bh * m * m;
  const long long mm2 = (long long)m * m;
  auto at = [](const float* x) { return [x](int r, int c) { return x[r * LD + c]; }; };
  auto eye = [m](int r, int c, float v) { return r == c && r < m ? v : 0.f; };
  float acc[TM][TM];

  // K2 = row softmax of Q̃ K̃ᵀ (landmarks carry √scale each), KC columns of D at a time through shared memory
  // (mz: Q̃ rows, tt: K̃ transposed with its columns XOR-swizzled by the row, so that both the transposing
  // stores and the products' reads are conflict-free; both free until Newton–Schulz): one global latency per
  // chunk instead of one per k
  constexpr int KC = MP < D ? MP : D;
  auto swizzled = [](int d, int c) { return d * MP + (c ^ (d & 31)); };
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TM; ++j) acc[i][j] = 0.f;
  for (int d0 = 0; d0 < D; d0 += KC) {
    for (int e = threadIdx.x; e < MP * KC; e += kThreads) {
      const int r = e / KC, d = e % KC;
      mz[e] = r < m ? __ldg(ql + r * D + d0 + d) : 0.f;
      tt[swizzled(d, r)] = r < m ? __ldg(kl + r * D + d0 + d) : 0.f;
    }
    __syncthreads();
    inv_product<true>(acc, KC, [&](int r, int d) { return mz[r * KC + d]; },
                      [&](int d, int c) { return tt[swizzled(d, c)]; }, ty, tx);
    __syncthreads();
  }
  float* const k2s = p.ridge ? mz : a;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int r = ty + 16 * i;
    float mx = -inf();
#pragma unroll
    for (int j = 0; j < TM; ++j) mx = fmaxf(mx, tx + 16 * j < m ? acc[i][j] : -inf());
    mx = halfwarp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < TM; ++j) {
      acc[i][j] = tx + 16 * j < m ? __expf(acc[i][j] - mx) : 0.f;
      sum += acc[i][j];
    }
    sum = halfwarp_sum(sum);
#pragma unroll
    for (int j = 0; j < TM; ++j) {
      const int c = tx + 16 * j;
      const float v = r < m ? acc[i][j] / sum : 0.f;
      k2s[r * LD + c] = v;
      if (r < m && c < m) k2g[r * m + c] = v;
    }
  }
  __syncthreads();
  if (p.ridge) {  // A = K2ᵀK2 + λI, λ = ‖K2‖₁‖K2‖∞ / kappa
    const float lam = inv_norm_product<MP, LD>(mz, m, red) / p.kappa;
    inv_product(acc, m, [&](int r, int k) { return mz[k * LD + r]; }, at(mz), ty, tx);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TM; ++j) {
        const int r = ty + 16 * i, c = tx + 16 * j;
        a[r * LD + c] = acc[i][j] + eye(r, c, lam);
      }
    __syncthreads();
  }
  const float s = inv_norm_product<MP, LD>(a, m, red);
  if (p.s != nullptr && threadIdx.x == 0) p.s[bh] = s;
  for (int e = threadIdx.x; e < MP * MP; e += kThreads) {  // Z₀ = Aᵀ / s
    const int r = e / MP, c = e % MP;
    const float v = a[c * LD + r] / s;
    z[r * LD + c] = v;
    if (r < m && c < m) {
      if (p.a != nullptr) p.a[bh * mm2 + c * m + r] = a[c * LD + r];
      if (p.zs != nullptr) p.zs[(long long)bh * (p.iters + 1) * mm2 + r * m + c] = v;
    }
  }
  __syncthreads();

  using P = NsProducts<TM>;
  typename P::Acc x;
  for (int it = 0; it < p.iters; ++it) {  // Z ← ¼Z(13I − M(15I − M(7I − M))), M = AZ
    P::zero(x);
    P::add(x, m, at(a), at(z));
    __syncthreads();
    P::for_each(x, [&](int r, int c, float v) {
      mz[r * LD + c] = v;
      tt[r * LD + c] = eye(r, c, 7.f) - v;
    });
    __syncthreads();
#pragma unroll 1
    for (int step = 0; step < 2; ++step) {  // T ← 15I − M T, then T ← 13I − M T
      P::zero(x);
      P::add(x, m, at(mz), at(tt));
      __syncthreads();
      const float c0 = step == 0 ? 15.f : 13.f;
      P::for_each(x, [&](int r, int c, float v) { tt[r * LD + c] = eye(r, c, c0) - v; });
      __syncthreads();
    }
    P::zero(x);
    P::add(x, m, [&](int r, int k) { return 0.25f * z[r * LD + k]; }, at(tt));
    __syncthreads();
    float* zs = p.zs != nullptr ? p.zs + ((long long)bh * (p.iters + 1) + it + 1) * mm2 : nullptr;
    P::for_each(x, [&](int r, int c, float v) {
      z[r * LD + c] = v;
      if (zs != nullptr && r < m && c < m) zs[r * m + c] = v;
    });
    __syncthreads();
  }

  if (p.ridge) {  // Z ← Z K2ᵀ (K2 read back from global: written by this block before a barrier)
    inv_product(acc, m, at(z), [&](int k, int c) { return c < m ? k2g[c * m + k] : 0.f; }, ty, tx);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TM; ++j) z[(ty + 16 * i) * LD + tx + 16 * j] = acc[i][j];
    __syncthreads();
  }
  for (int e = threadIdx.x; e < m * m; e += kThreads) p.z[bh * mm2 + e] = z[(e / m) * LD + e % m];
}

// W = Z W0 (m x D) of head bh, KC = min(MP, D) output columns at a time with W0's columns staged in `stage` (MP x KC
// floats); zat(r, k) reads Z[r][k] (0 for padding rows r >= m). Starts with a barrier.
template <int TM, int D, typename ZAt>
__device__ __forceinline__ void z_times_w0(const InvParams& p, ZAt zat, float* stage, int bh) {
  constexpr int MP = 16 * TM, KC = MP < D ? MP : D;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, m = p.m;
  const float* w0 = p.w0 + (long long)bh * m * D;
  float* w = p.w + (long long)bh * m * D;
  for (int c0 = 0; c0 < D; c0 += KC) {
    __syncthreads();  // the previous chunk's readers of `stage` are done (first chunk: the caller's writes)
    for (int e = threadIdx.x; e < MP * KC; e += kThreads) {
      const int r = e / KC, c = e % KC;
      stage[e] = r < m ? __ldg(w0 + r * D + c0 + c) : 0.f;
    }
    __syncthreads();
    float accw[TM][KC / 16];
    inv_product(accw, m, zat, [&](int k, int c) { return stage[k * KC + c]; }, ty, tx);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int r = ty + 16 * i;
      if (r >= m) continue;
#pragma unroll
      for (int j = 0; j < KC / 16; ++j) w[r * D + c0 + tx + 16 * j] = accw[i][j];
    }
  }
}

// Dynamic shared memory of nystrom_w_fwd_kernel<TM, D>: W0's column chunk, and Z for m <= 64.
template <int TM, int D>
constexpr int w_smem_bytes() {
  constexpr int MP = 16 * TM, KC = MP < D ? MP : D;
  return (MP * KC + (TM == 8 ? 0 : MP * inv_ld<TM>())) * static_cast<int>(sizeof(float));
}

// Grid (B Hq), 256 threads, w_smem_bytes<TM, D>(): W = Z W0 from nystrom_inverse_fwd_kernel's Z (p.z) and K3's W0
// (p.w0), a launch of its own so that the inverse kernel, which needs only the landmarks, runs beside K3's kernels.
// Z staged in shared memory for m <= 64, read through L1 for m > 64.
template <int TM, int D>
__global__ void __launch_bounds__(kThreads) nystrom_w_fwd_kernel(const InvParams p) {
  constexpr int MP = 16 * TM, LD = inv_ld<TM>(), KC = MP < D ? MP : D;
  extern __shared__ float4 w_smem[];
  float* const stage = reinterpret_cast<float*>(w_smem);
  const int bh = blockIdx.x, m = p.m;
  const float* zg = p.z + (long long)bh * m * m;
  if constexpr (TM == 8) {
    z_times_w0<TM, D>(p, [zg, m](int r, int k) { return r < m ? __ldg(zg + r * m + k) : 0.f; }, stage, bh);
  } else {
    float* const z = stage + MP * KC;
    for (int e = threadIdx.x; e < MP * LD; e += kThreads) {
      const int r = e / LD, c = e % LD;
      z[e] = r < m && c < m ? __ldg(zg + r * m + c) : 0.f;
    }
    z_times_w0<TM, D>(p, [z](int r, int k) { return z[r * LD + k]; }, stage, bh);
  }
}

}  // namespace nystrom
}  // namespace hfab
