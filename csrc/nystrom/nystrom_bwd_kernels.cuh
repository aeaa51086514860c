// Nyström attention backward: the kernels over the sequence (N-sized work) on CUDA cores. No N x m matrix
// and no fp32 copy of q, k, v or dO is written; softmax matrices are recomputed from their row statistics.
//
// Notation (nystrom_kernels.cuh): keys/vals = the fp32 key/value buffer (slots rows per (b, q head), nvalid
// valid), K1 = softmax(q_s keysᵀ) (N x slots), K3 = softmax(Q̃ k_sᵀ) over the real keys (m x N),
// out_attn = K1 vals, W0 = K3 v, dW0 the gradient of W0 (from the host's m x m VJP). Scores in base 2.
//
// Kernels (256 threads as 16 x 16, fp32 accumulation; every reduction in a fixed order: deterministic; the
// tiled ones after the stats kernel take their tiles from dynamic shared memory, <Tiles>::Smem, so that D 128
// gets 32 x 32 tiles too):
//   nystrom_stats_bwd_kernel  per query block: lse1 = log2 Σ exp2(s) over the valid slots and
//                             Δ1 = dO · out_attn (= rowsum(K1 ∘ dO valsᵀ)), both (B Hq, N)
//   nystrom_k1_bwd_kernel     per (query split, slot tile, b h): partial d vals = K1ᵀ dO and d keys = dS1ᵀ q_s,
//                             dS1 = K1 ∘ (dO valsᵀ − Δ1); (splits, B Hq, slots, D), summed in order by the host
//   nystrom_k3_bwd_kernel     per (key split, landmark tile, b h): partial dQ̃ = dS3 k_s,
//                             dS3 = K3 ∘ (dW0 vᵀ − rowdot), rowdot = rowsum(dW0 ∘ W0); (splits, B Hq, m, D)
//   nystrom_kv_bwd_kernel     per (key block, kv head, b): dk, dv in k.dtype / v.dtype, one writer per row:
//                             landmark sequences K3ᵀ dW0 and dS3ᵀ Q̃ summed over the group's q heads in order,
//                             plus the landmark keys' gradient spread over their segments; exact sequences
//                             the buffer gradient of the token's slot; conv: Σ_h Σ_t w[h, t] dO_h[j − t + c]
//   nystrom_dq_bwd_kernel     per query block: dq = √scale (dS1 keys + [landmark sequence, real token]
//                             dQ̃[l(i)] / |segment l(i)|) in q.dtype
//   nystrom_ns_bwd_kernel     per (b, q head): the Newton–Schulz VJP through every saved iterate (m x m)
//   nystrom_split_sum_bwd_kernel  the split partials of k1 and K3's backward summed in order
//   nystrom_landmark_vjp_bwd_kernel, nystrom_landmark_grads_bwd_kernel: the m x m products before and after it
#pragma once

#include "nystrom/nystrom_kernels.cuh"

namespace hfab {
namespace nystrom {

struct BwdParams {
  Params p;                     // the forward's (q, k, v, mask, landmarks, key/value buffers, conv)
  const void* dout;             // (B, Hq, N, D) contiguous, q.dtype
  const int* cumsum;            // (B, N) inclusive cumsum of the mask (rank + 1 of a real token); nullptr = no mask
  const unsigned char* exact;   // (B,) bool: n <= m (the buffer holds the real tokens)
  bool landmarks;               // N > m: q_land, dw0, lse3, rowdot, dql, dkl are set
  float* lse1;                  // (B Hq, N) base-2 log-sum-exp of the buffer scores (+inf: no valid slot)
  float* delta1;                // (B Hq, N)
  int a_chunk;                  // queries per split of nystrom_k1_bwd_kernel
  float* part_dkeys;            // (splits, B Hq, slots, D)
  float* part_dvals;            // (splits, B Hq, slots, D)
  const float* dw0;             // (B Hq, m, D)
  const float* lse3;            // (B Hq, m) base-2 log-sum-exp of the K3 scores over the real keys
  const float* rowdot;          // (B Hq, m)
  int b_chunk;                  // keys per split of nystrom_k3_bwd_kernel
  float* part_dql;              // (splits, B Hq, m, D): partial dQ̃ (w.r.t. the scaled landmarks)
  const float* dkeys_kv;        // (B, Hkv, slots, D): d keys summed over each kv head's q heads
  const float* dvals_kv;        // (B, Hkv, slots, D)
  const float* dkl;             // (B, Hkv, m, D): d K̃ (scaled landmark keys), summed over the group
  int kv_chunk;                 // keys per split of nystrom_kv_tc_bwd_kernel (a multiple of 64)
  const float* dql;             // (B, Hq, m, D): d Q̃ (scaled landmark queries)
  void* dq;                     // (B, Hq, N, D) contiguous, q.dtype
  void* dk;                     // (B, Hkv, N, D) contiguous
  void* dv;
};

// 1 / |segment| of the landmark of real token `rank` of batch b, and that landmark (segment_bounds' rule).
__device__ __forceinline__ float segment_share(const Params& p, int b, int rank, int& lt) {
  const int n = p.n_real != nullptr ? p.n_real[b] : p.n;
  lt = min(rank / max(n / p.m, 1), p.m - 1);
  return 1.f / fmaxf(p.counts[(long long)b * p.m + lt], 1.f);
}

// Rank of token j among the real tokens of batch b, or -1 when j is padding.
__device__ __forceinline__ int real_rank(const BwdParams& bp, int b, int j) {
  const Params& p = bp.p;
  if (p.mask == nullptr) return j;
  return p.mask[b * p.mask_stride + j] ? bp.cumsum[(long long)b * p.n + j] - 1 : -1;
}

// acc += mul · the column pair c of an fp32 row.
__device__ __forceinline__ void add_row(float2& acc, const float* row, int c, float mul) {
  const float2 x = *reinterpret_cast<const float2*>(row + 2 * c);
  acc.x = fmaf(mul, x.x, acc.x);
  acc.y = fmaf(mul, x.y, acc.y);
}

// dst[b, h, j] += rows[b, h, lt] · share · √scale for every real token j of a landmark sequence (landmark lt, its
// segment's share): a landmark gradient spread over its segment, added to a gradient that its kernel wrote without it
// (dq from k1: d Q̃; dk beside the Newton–Schulz VJP: that VJP's part of d K̃). rows (B, heads, m, D) fp32, dst (B,
// heads, N, D) contiguous in T. Grid (ceil(N / segment_add_rows), heads, B), 256 threads, each on 8 columns of a row.
template <int D>
constexpr int segment_add_rows = kThreads / (D / 8);

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    nystrom_segment_add_bwd_kernel(const BwdParams bp, const float* rows, void* dst_rows) {
  constexpr int kLanes = D / 8, kRows = segment_add_rows<D>;
  const Params& p = bp.p;
  const int j = blockIdx.x * kRows + threadIdx.x / kLanes, c = threadIdx.x % kLanes * 8;
  const int h = blockIdx.y, b = blockIdx.z;
  if (j >= p.n || bp.exact[b]) return;
  const int rank = real_rank(bp, b, j);
  if (rank < 0) return;
  int lt;
  const float mul = segment_share(p, b, rank, lt) * p.root;
  const long long bh = (long long)b * gridDim.y + h;
  const float4* src = reinterpret_cast<const float4*>(rows + (bh * p.m + lt) * D + c);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(dst_rows) + (bh * p.n + j) * D + c);
  const float4 lo = src[0], hi = src[1];
  uint4 w = *dst;
  const float add[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  unsigned* words = reinterpret_cast<unsigned*>(&w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = Pair<T>::to_float2(words[i]);
    words[i] = Pair<T>::from_float2(make_float2(fmaf(mul, add[2 * i], x.x), fmaf(mul, add[2 * i + 1], x.y)));
  }
  *dst = w;
}

// Grid (ceil(N / BQ), Hq, B); the output kernel's tiles.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_stats_bwd_kernel(const BwdParams bp) {
  using Cfg = OutTiles<D>;
  constexpr int BQ = Cfg::BQ, BK = Cfg::BK;
  constexpr int TR = BQ / 16, TD = D / 32;
  __shared__ TileOf<Cfg::kQ32, BQ, D> qs;
  __shared__ FTile<BK, D> ks;
  __shared__ FTile<BK, D> vs;
  __shared__ ScoreTile<BQ, BK> ps;
  const Params& p = bp.p;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = blockIdx.x * BQ, h = blockIdx.y, b = blockIdx.z;
  const long long bh = (long long)b * p.hq + h;
  load_tile(qs, static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h, p.sq.n, q0, p.n);
  float m[TR], l[TR];
  float2 o[TR][TD];
  buffer_attend<T>(qs, ks, vs, ps, p.keys + bh * p.slots * D, p.vals + bh * p.slots * D, p.nvalid[b],
                   p.root * kLog2e, m, l, o, ty, tx);
  const T* dout = static_cast<const T*>(bp.dout) + bh * p.n * D;
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const float sum = halfwarp_sum(l[i]);
    const int row = q0 + ty * TR + i;
    float dot = 0.f;
    if (row < p.n) {
      const unsigned* drow = reinterpret_cast<const unsigned*>(dout + (long long)row * D);
#pragma unroll
      for (int c = 0; c < TD; ++c) {
        const float2 x = Pair<T>::to_float2(drow[tx + 16 * c]);
        dot = fmaf(x.x, o[i][c].x, fmaf(x.y, o[i][c].y, dot));
      }
    }
    dot = halfwarp_sum(dot);
    if (row < p.n && tx == 0) {
      bp.lse1[bh * p.n + row] = row_lse(m[i], sum);
      bp.delta1[bh * p.n + row] = sum > 0.f ? dot / sum : 0.f;
    }
  }
}

template <int D> struct K1Tiles {
  static constexpr int BL = 32, BQ = D == 32 ? 64 : 32;  // slots x queries per tile
  struct Smem {  // dynamic shared memory (up to 60 KB at D 128)
    FTile<BL, D> ks, vs;
    Tile<BQ, D> qs, dos;
    ScoreTile<BL, BQ> ps, dss;
    float lse[BQ], delta[BQ];
  };
};

// Grid (splits, ceil(slots / BL), B Hq). Queries [split * a_chunk, min(+a_chunk, N)).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_k1_bwd_kernel(const BwdParams bp) {
  constexpr int BL = K1Tiles<D>::BL, BQ = K1Tiles<D>::BQ;
  constexpr int TR = BL / 16, TC = BQ / 16, TD = D / 32;
  extern __shared__ float4 bwd_smem[];
  auto& sm = *reinterpret_cast<typename K1Tiles<D>::Smem*>(bwd_smem);
  auto &ks = sm.ks, &vs = sm.vs;
  auto &ps = sm.ps, &dss = sm.dss;
  auto &qs = sm.qs, &dos = sm.dos;
  float* const lse = sm.lse;
  float* const delta = sm.delta;
  const Params& p = bp.p;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int split = blockIdx.x, s0 = blockIdx.y * BL, bh = blockIdx.z;
  const int b = bh / p.hq, h = bh % p.hq;
  const int nvalid = p.nvalid[b];
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* dout = static_cast<const T*>(bp.dout) + (long long)bh * p.n * D;
  const float scale_log2 = p.root * kLog2e;
  load_ftile_f32(ks, p.keys + (long long)bh * p.slots * D, s0, nvalid);
  load_ftile_f32(vs, p.vals + (long long)bh * p.slots * D, s0, nvalid);
  float2 accv[TR][TD], acck[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i)
#pragma unroll
    for (int c = 0; c < TD; ++c) accv[i][c] = acck[i][c] = make_float2(0.f, 0.f);

  const int qbeg = split * bp.a_chunk, qend = s0 < nvalid ? min(qbeg + bp.a_chunk, p.n) : qbeg;
  for (int q0 = qbeg; q0 < qend; q0 += BQ) {
    __syncthreads();  // the previous tile's readers are done
    load_tiles(qs, q, p.sq.n, dos, dout, D, q0, qend);
    for (int c = threadIdx.x; c < BQ; c += kThreads) {
      const bool ok = q0 + c < qend;
      lse[c] = ok ? bp.lse1[(long long)bh * p.n + q0 + c] : 0.f;
      delta[c] = ok ? bp.delta1[(long long)bh * p.n + q0 + c] : 0.f;
    }
    __syncthreads();
    float s[TR][TC], dp[TR][TC];
    tile_dot<T>(s, ks, qs, ty, tx);
    tile_dot<T>(dp, vs, dos, ty, tx);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        const int c = tx + 16 * j;
        const bool ok = s0 + ty * TR + i < nvalid && q0 + c < qend;
        const float pr = ok ? exp2f(fmaf(s[i][j], scale_log2, -lse[c])) : 0.f;
        ps.v[ty * TR + i][c] = pr;
        dss.v[ty * TR + i][c] = pr * (dp[i][j] - delta[c]);
      }
    __syncthreads();
    tile_accumulate<T>(accv, ps, dos, ty, tx);
    tile_accumulate<T>(acck, dss, qs, ty, tx);
  }

  const long long slab = (long long)split * gridDim.z + bh;  // (split, b h) slab of slots rows
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int row = s0 + ty * TR + i;
    if (row >= p.slots) continue;
    float2* dv = reinterpret_cast<float2*>(bp.part_dvals + (slab * p.slots + row) * D);
    float2* dk = reinterpret_cast<float2*>(bp.part_dkeys + (slab * p.slots + row) * D);
#pragma unroll
    for (int c = 0; c < TD; ++c) {
      dv[tx + 16 * c] = accv[i][c];
      dk[tx + 16 * c] = make_float2(acck[i][c].x * p.root, acck[i][c].y * p.root);  // q_s = q √scale
    }
  }
}

template <int D> struct K3BwdTiles {
  static constexpr int BL = 32, BK = D == 128 ? 32 : 64;  // landmarks x keys per tile
  struct Smem {  // dynamic shared memory (up to 55 KB at D 128)
    FTile<BL, D> ls, dws;
    Tile<BK, D> ks, vs;
    ScoreTile<BL, BK> ps;
    float bias[BK];
  };
};

// Grid (splits, ceil(m / BL), B Hq). Keys [split * b_chunk, min(+b_chunk, N)); exact sequences write zeros.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_k3_bwd_kernel(const BwdParams bp) {
  constexpr int BL = K3BwdTiles<D>::BL, BK = K3BwdTiles<D>::BK;
  constexpr int TR = BL / 16, TC = BK / 16, TD = D / 32;
  extern __shared__ float4 bwd_smem[];
  auto& sm = *reinterpret_cast<typename K3BwdTiles<D>::Smem*>(bwd_smem);
  auto &ls = sm.ls, &dws = sm.dws;
  auto &ks = sm.ks, &vs = sm.vs;
  auto& ps = sm.ps;
  float* const bias = sm.bias;
  const Params& p = bp.p;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int split = blockIdx.x, l0 = blockIdx.y * BL, bh = blockIdx.z;
  const int b = bh / p.hq, h = bh % p.hq, g = h / p.groups;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h;
  const float scale_log2 = p.root * kLog2e;  // landmarks carry √scale, keys not yet
  load_ftile_f32(ls, p.q_land + (long long)bh * p.m * D, l0, p.m);
  load_ftile_f32(dws, bp.dw0 + (long long)bh * p.m * D, l0, p.m);
  float lse[TR], rd[TR];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int row = l0 + ty * TR + i;
    lse[i] = row < p.m ? bp.lse3[(long long)bh * p.m + row] : 0.f;
    rd[i] = row < p.m ? bp.rowdot[(long long)bh * p.m + row] : 0.f;
  }
  float2 o[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i)
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = make_float2(0.f, 0.f);

  const int kbeg = split * bp.b_chunk, kend = bp.exact[b] ? kbeg : min(kbeg + bp.b_chunk, p.n);
  for (int k0 = kbeg; k0 < kend; k0 += BK) {
    __syncthreads();
    load_tiles(ks, k, p.sk.n, vs, v, p.sv.n, k0, kend);
    for (int c = threadIdx.x; c < BK; c += kThreads) {
      const int j = k0 + c;
      const bool ok = j < kend && (p.mask == nullptr || p.mask[b * p.mask_stride + j]);
      bias[c] = ok ? 0.f : -inf();
    }
    __syncthreads();
    float s[TR][TC], dp[TR][TC];
    tile_dot<T>(s, ls, ks, ty, tx);
    tile_dot<T>(dp, dws, vs, ty, tx);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        const float pr = exp2f(fmaf(s[i][j], scale_log2, bias[tx + 16 * j]) - lse[i]);
        ps.v[ty * TR + i][tx + 16 * j] = pr * (dp[i][j] - rd[i]);
      }
    __syncthreads();
    tile_accumulate<T>(o, ps, ks, ty, tx);
  }

  const long long slab = (long long)split * gridDim.z + bh;
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int row = l0 + ty * TR + i;
    if (row >= p.m) continue;
    float2* dst = reinterpret_cast<float2*>(bp.part_dql + (slab * p.m + row) * D);
#pragma unroll
    for (int c = 0; c < TD; ++c) dst[tx + 16 * c] = make_float2(o[i][c].x * p.root, o[i][c].y * p.root);  // k_s
  }
}

// The gradients of key row j (< N) of batch b, kv head kvh, in this thread's column pairs cols[i] (fp32, dk before its
// √scale): on entry gk, gv hold what the landmark path accumulated (dS3ᵀ Q̃ and K3ᵀ dW0; zero for exact sequences);
// adds the landmark keys' gradient spread over their segments, or for exact sequences the gradient of the token's
// buffer slot, and the conv residual's; padding rows get 0.
template <typename T, int D, int NP>
__device__ __forceinline__ void key_row_gradients(const BwdParams& bp, int b, int kvh, int j, bool landmark,
                                                  const int (&cols)[NP], float2 (&gk)[NP], float2 (&gv)[NP]) {
  const Params& p = bp.p;
  const long long bg = (long long)b * p.hkv + kvh;
  const int rank = real_rank(bp, b, j);
  if (rank < 0) {
#pragma unroll
    for (int i = 0; i < NP; ++i) gk[i] = gv[i] = make_float2(0.f, 0.f);
    return;
  }
  if (landmark) {
    int lt;
    const float share = segment_share(p, b, rank, lt);
    const float* dkl = bp.dkl + (bg * p.m + lt) * D;
#pragma unroll
    for (int i = 0; i < NP; ++i) add_row(gk[i], dkl, cols[i], share);
  } else if (rank < p.slots) {
    const float* dkr = bp.dkeys_kv + (bg * p.slots + rank) * D;
    const float* dvr = bp.dvals_kv + (bg * p.slots + rank) * D;
#pragma unroll
    for (int i = 0; i < NP; ++i) {
      add_row(gk[i], dkr, cols[i], 1.f);
      add_row(gv[i], dvr, cols[i], 1.f);
    }
  }
  if (p.conv == nullptr) return;
  const int half = p.ks / 2;
  for (int hi = 0; hi < p.groups; ++hi) {
    const int h = kvh * p.groups + hi;
    const T* dout = static_cast<const T*>(bp.dout) + ((long long)b * p.hq + h) * p.n * D;
    for (int t = 0; t < p.ks; ++t) {
      const int row = j - t + half;
      if (row < 0 || row >= p.n) continue;
      const float w = p.conv[h * p.ks + t];
      const unsigned* drow = reinterpret_cast<const unsigned*>(dout + (long long)row * D);
#pragma unroll
      for (int i = 0; i < NP; ++i) {
        const float2 x = Pair<T>::to_float2(drow[cols[i]]);
        gv[i].x = fmaf(w, x.x, gv[i].x);
        gv[i].y = fmaf(w, x.y, gv[i].y);
      }
    }
  }
}

template <int D> struct KvTiles {
  static constexpr int BK = D == 128 ? 32 : 64, BL = 32;  // keys x landmarks per tile
  struct Smem {  // dynamic shared memory (up to 60 KB at D 128)
    Tile<BK, D> ks, vs;
    FTile<BL, D> ls, dws;
    ScoreTile<BK, BL> ps, dss;
    float lse[BL], rd[BL], bias[BK];
  };
};

// Grid (ceil(N / BK), Hkv, B).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_kv_bwd_kernel(const BwdParams bp) {
  constexpr int BK = KvTiles<D>::BK, BL = KvTiles<D>::BL;
  constexpr int TR = BK / 16, TC = BL / 16, TD = D / 32;
  extern __shared__ float4 bwd_smem[];
  auto& sm = *reinterpret_cast<typename KvTiles<D>::Smem*>(bwd_smem);
  auto &ks = sm.ks, &vs = sm.vs;
  auto &ls = sm.ls, &dws = sm.dws;
  auto &ps = sm.ps, &dss = sm.dss;
  float* const lse = sm.lse;
  float* const rd = sm.rd;
  float* const bias = sm.bias;
  const Params& p = bp.p;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int j0 = blockIdx.x * BK, g = blockIdx.y, b = blockIdx.z;
  const long long bg = (long long)b * p.hkv + g;
  const bool landmark = bp.landmarks && !bp.exact[b];
  float2 acck[TR][TD], accv[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i)
#pragma unroll
    for (int c = 0; c < TD; ++c) acck[i][c] = accv[i][c] = make_float2(0.f, 0.f);

  if (landmark) {
    load_tiles(ks, static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h, p.sk.n,
               vs, static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h, p.sv.n, j0, p.n);
    for (int c = threadIdx.x; c < BK; c += kThreads) {
      const int j = j0 + c;
      const bool ok = j < p.n && (p.mask == nullptr || p.mask[b * p.mask_stride + j]);
      bias[c] = ok ? 0.f : -inf();
    }
    const float scale_log2 = p.root * kLog2e;
    for (int hi = 0; hi < p.groups; ++hi) {  // the group's q heads in a fixed order
      const long long bh = (long long)b * p.hq + g * p.groups + hi;
      for (int l0 = 0; l0 < p.m; l0 += BL) {
        __syncthreads();  // the previous tile's readers are done (and ks, vs, bias written)
        load_ftile_f32(ls, p.q_land + bh * p.m * D, l0, p.m);
        load_ftile_f32(dws, bp.dw0 + bh * p.m * D, l0, p.m);
        for (int c = threadIdx.x; c < BL; c += kThreads) {
          const bool ok = l0 + c < p.m;
          lse[c] = ok ? bp.lse3[bh * p.m + l0 + c] : 0.f;
          rd[c] = ok ? bp.rowdot[bh * p.m + l0 + c] : 0.f;
        }
        __syncthreads();
        float s[TR][TC], dp[TR][TC];
        tile_dot<T>(s, ks, ls, ty, tx);
        tile_dot<T>(dp, vs, dws, ty, tx);
#pragma unroll
        for (int i = 0; i < TR; ++i)
#pragma unroll
          for (int j = 0; j < TC; ++j) {
            const int c = tx + 16 * j;
            const float pr =
                l0 + c < p.m ? exp2f(fmaf(s[i][j], scale_log2, bias[ty * TR + i]) - lse[c]) : 0.f;
            ps.v[ty * TR + i][c] = pr;
            dss.v[ty * TR + i][c] = pr * (dp[i][j] - rd[c]);
          }
        __syncthreads();
        tile_accumulate<T>(accv, ps, dws, ty, tx);
        tile_accumulate<T>(acck, dss, ls, ty, tx);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int j = j0 + ty * TR + i;
    if (j >= p.n) continue;
    int cols[TD];
    float2 dk[TD], dv[TD];
#pragma unroll
    for (int c = 0; c < TD; ++c) {
      cols[c] = tx + 16 * c;
      dk[c] = acck[i][c];
      dv[c] = accv[i][c];
    }
    key_row_gradients<T, D>(bp, b, g, j, landmark, cols, dk, dv);
    store_row<T, TD>(static_cast<T*>(bp.dk) + (bg * p.n + j) * D, dk, p.root, tx);  // k_s = k √scale
    store_row<T, TD>(static_cast<T*>(bp.dv) + (bg * p.n + j) * D, dv, 1.f, tx);
  }
}

template <int D> struct DqTiles {
  static constexpr int BQ = D == 128 ? 32 : 64, BK = D == 32 ? 64 : 32;  // queries x slots
  struct Smem {  // dynamic shared memory (up to 55 KB at D 128)
    Tile<BQ, D> qs, dos;
    FTile<BK, D> ks, vs;
    ScoreTile<BQ, BK> ps;
  };
};

// Grid (ceil(N / BQ), Hq, B).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) nystrom_dq_bwd_kernel(const BwdParams bp) {
  constexpr int BQ = DqTiles<D>::BQ, BK = DqTiles<D>::BK;
  constexpr int TR = BQ / 16, TC = BK / 16, TD = D / 32;
  extern __shared__ float4 bwd_smem[];
  auto& sm = *reinterpret_cast<typename DqTiles<D>::Smem*>(bwd_smem);
  auto &qs = sm.qs, &dos = sm.dos;
  auto &ks = sm.ks, &vs = sm.vs;
  auto& ps = sm.ps;
  const Params& p = bp.p;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = blockIdx.x * BQ, h = blockIdx.y, b = blockIdx.z;
  const long long bh = (long long)b * p.hq + h;
  const int nvalid = p.nvalid[b];
  const float scale_log2 = p.root * kLog2e;
  const float* keys = p.keys + bh * p.slots * D;
  const float* vals = p.vals + bh * p.slots * D;
  load_tiles(qs, static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h, p.sq.n,
             dos, static_cast<const T*>(bp.dout) + bh * p.n * D, D, q0, p.n);
  float lse[TR], delta[TR];
  float2 acc[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int row = q0 + ty * TR + i;
    lse[i] = row < p.n ? bp.lse1[bh * p.n + row] : 0.f;
    delta[i] = row < p.n ? bp.delta1[bh * p.n + row] : 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) acc[i][c] = make_float2(0.f, 0.f);
  }
  for (int k0 = 0; k0 < nvalid; k0 += BK) {
    __syncthreads();
    load_ftile_f32(ks, keys, k0, nvalid);
    load_ftile_f32(vs, vals, k0, nvalid);
    __syncthreads();
    float s[TR][TC], dp[TR][TC];
    tile_dot<T>(s, qs, ks, ty, tx);
    tile_dot<T>(dp, dos, vs, ty, tx);
#pragma unroll
    for (int i = 0; i < TR; ++i)
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        const float pr = k0 + tx + 16 * j < nvalid ? exp2f(fmaf(s[i][j], scale_log2, -lse[i])) : 0.f;
        ps.v[ty * TR + i][tx + 16 * j] = pr * (dp[i][j] - delta[i]);
      }
    __syncthreads();
    tile_accumulate<T>(acc, ps, ks, ty, tx);
  }

  const bool landmark = bp.landmarks && !bp.exact[b];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int row = q0 + ty * TR + i;
    if (row >= p.n) continue;
    const int rank = landmark ? real_rank(bp, b, row) : -1;
    if (rank >= 0) {  // a real token of a landmark sequence: its landmark query's gradient
      int lt;
      const float share = segment_share(p, b, rank, lt);
      const float* dql = bp.dql + (bh * p.m + lt) * D;
#pragma unroll
      for (int c = 0; c < TD; ++c) add_row(acc[i][c], dql, tx + 16 * c, share);
    }
    store_row<T, TD>(static_cast<T*>(bp.dq) + (bh * p.n + row) * D, acc[i], p.root, tx);  // q_s = q √scale
  }
}

// The Newton–Schulz VJP of one (batch, q head) per block: from gz = dL/dZ_iters back through every step
// Z ← ¼Z(13I − M(15I − M(7I − M))), M = AZ_i (the saved iterates), as the host's reference formula:
//   t1 = 7I − M, t2 = 15I − M t1, t3 = 13I − M t2, dZ_i = ¼ gz t3ᵀ, dV = −¼ Z_iᵀ gz, dU = −Mᵀ dV,
//   dM = dV t2ᵀ + dU t1ᵀ − Mᵀ dU, da += dM Z_iᵀ, gz ← dZ_i + Aᵀ dM.
// Then dL/dA through Z₀ = Aᵀ / s, s = ‖A‖₁‖A‖∞ (max column |.| sum x max row |.| sum; an amax tie shares its
// gradient evenly, as torch's amax), so the block writes the whole dL/dA. Matrices padded to MP = 16 TM with
// zeros, rows ns_ld<TM>() floats apart, in dynamic
// shared memory for m <= 64 (ns_bwd_smem_bytes) and in the block's own global scratch for m > 64 (9 x 66 KB would
// not fit a block). The two products with A run on CUDA cores (thread (ty, tx) owns rows ty + 16 i, columns
// tx + 16 j), the others through NsProducts (tensor cores for m <= 64); every product sums over k < m only.
// Each product writes buffers that no thread reads in the same phase, then one barrier. The two products with A
// (M = A Z_i, Aᵀ dM) accumulate in double: near convergence Z_i ≈ A⁺, their terms cancel (max |A||Z_i| /
// max |A Z_i| ≈ 2e3 for cond(A) ≈ 1e4 at newton_iter 20, m 8) and float sums left dA with a 2e-3 relative error
// (issue 4).
struct NsBwdParams {
  const float* a;    // (B Hq, m, m) the matrix NS inverted
  const float* s;    // (B Hq) its ‖A‖₁‖A‖∞ (Z₀ = Aᵀ / s)
  const float* zs;   // (B Hq, iters + 1, m, m) the iterates Z_0 .. Z_iters
  const float* gz;   // (B Hq, m, m) dL/dZ_iters
  float* da;         // (B Hq, m, m) out: dL/dA
  float* da_steps;   // (B Hq, MP, MP) scratch: the part of dL/dA through the steps (owner-only, no predicates)
  float* scratch;    // m > 64: (B Hq, kNsBuffers, MP, ns_ld) ; else unused
  int m, iters;
};

constexpr int kNsBuffers = 9;

// Row pitch of the padded buffers: MP + 4 where the tensor-core products read them (bank 4 g + t for the fragment
// element (g, t) of a row-major read: conflict-free; 2-way for a transposed one), MP + 1 for the CUDA-core products
// of m > 64 (their transposed reads conflict-free). The host's m > 64 scratch uses MP + 1.
template <int TM>
constexpr int ns_ld() {
  return TM <= 4 ? 16 * TM + 4 : 16 * TM + 1;
}

template <int TM>
constexpr bool ns_in_shared() {
  return TM <= 4;
}

// Dynamic shared memory of nystrom_ns_bwd_kernel<TM>: 41 KB for m <= 32, 153 KB for m <= 64, none above.
template <int TM>
constexpr int ns_bwd_smem_bytes() {
  return ns_in_shared<TM>() ? kNsBuffers * 16 * TM * ns_ld<TM>() * static_cast<int>(sizeof(float)) : 0;
}

// Block sum in a fixed order (butterfly in each warp, then the warps in turn): deterministic. `red`: kThreads / 32
// floats; ends with a barrier, so `red` may be reused.
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) t += red[w];
  __syncthreads();
  return t;
}

// The end of nystrom_ns_bwd_kernel (after a barrier): dA = da_steps + gzᵀ / s + sign(A) (dcol[c] + drow[r]), with
// ds = −Σ gz ∘ Z₀ / s, dcol = ds · row on the tied largest column sums, drow = ds · col on the tied largest row
// sums. a, gz: padded buffers (rows ns_ld apart); red: a free buffer (>= 3 MP + 8 floats).
// Its row loops are not unrolled: unrolled, ptxas spilled the m > 64 kernel (255 registers).
template <int TM>
__device__ __forceinline__ void ns_normalisation_backward(const NsBwdParams& p, const float* a, const float* gz,
                                                          const float* da_steps, float* red) {
  constexpr int MP = 16 * TM, LD = ns_ld<TM>();
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, m = p.m, t = threadIdx.x;
  const long long bh = blockIdx.x, mm2 = (long long)m * m;
  const float s = p.s[bh];
  const float* z0 = p.zs + bh * (p.iters + 1) * mm2;
  float dot = 0.f;
#pragma unroll 1
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TM; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      if (r < m && c < m) dot = fmaf(gz[r * LD + c], z0[r * m + c], dot);
    }
  const float ds = -block_sum(dot, red) / s;
  float* const col_sums = red;
  float* const row_sums = red + MP;
  float* const tied = red + 2 * MP;  // max column sum, max row sum, their tie counts
  abs_line_sums<LD>(a, m, col_sums, row_sums);  // the forward's order: the same maxima as its s
  __syncthreads();
  if (t == 0) {
    float cm = 0.f, rm = 0.f;
    for (int k = 0; k < m; ++k) {
      cm = fmaxf(cm, col_sums[k]);
      rm = fmaxf(rm, row_sums[k]);
    }
    int nc = 0, nr = 0;
    for (int k = 0; k < m; ++k) {
      nc += col_sums[k] == cm;
      nr += row_sums[k] == rm;
    }
    tied[0] = cm;
    tied[1] = rm;
    tied[2] = ds * rm / static_cast<float>(nc);  // each tied column's share of ds · row
    tied[3] = ds * cm / static_cast<float>(nr);
  }
  __syncthreads();
#pragma unroll 1
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TM; ++j) {
      const int r = ty + 16 * i, c = tx + 16 * j;
      if (r >= m || c >= m) continue;
      const float x = a[r * LD + c];
      const float sign = static_cast<float>((x > 0.f) - (x < 0.f));
      const float dnorm = (col_sums[c] == tied[0] ? tied[2] : 0.f) + (row_sums[r] == tied[1] ? tied[3] : 0.f);
      p.da[bh * mm2 + r * m + c] = da_steps[r * MP + c] + gz[c * LD + r] / s + sign * dnorm;
    }
}

template <int TM>
__global__ void __launch_bounds__(kThreads, 1) nystrom_ns_bwd_kernel(const NsBwdParams p) {
  constexpr int MP = 16 * TM, LD = ns_ld<TM>(), MM = MP * LD;
  extern __shared__ float4 ns_smem[];
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, m = p.m;
  const long long bh = blockIdx.x, mm2 = (long long)m * m;
  float* const a = ns_in_shared<TM>() ? reinterpret_cast<float*>(ns_smem) : p.scratch + bh * kNsBuffers * MM;
  float* const zb = a + MM;
  float* const mz = a + 2 * MM;
  float* const t1 = a + 3 * MM;
  float* const t2 = a + 4 * MM;
  float* const t3 = a + 5 * MM;  // t3, then dM (t3 is dead once dZ_i is formed)
  float* const dm = t3;
  float* const gz = a + 6 * MM;  // gz, then dZ_i, then the next gz
  float* const dv = a + 7 * MM;
  float* const du = a + 8 * MM;
  float* const da = p.da_steps + bh * MP * MP;
  // m x m row-major global matrix -> padded buffer (zeros outside the m x m block)
  auto load_padded = [m](float* dst, const float* src) {
    for (int e = threadIdx.x; e < MM; e += kThreads) {
      const int r = e / LD, c = e % LD;
      dst[e] = r < m && c < m ? src[r * m + c] : 0.f;
    }
  };
  load_padded(a, p.a + bh * mm2);
  load_padded(gz, p.gz + bh * mm2);
  auto at = [](const float* x) { return [x](int r, int c) { return x[r * LD + c]; }; };
  auto tr = [](const float* x) { return [x](int r, int c) { return x[c * LD + r]; }; };
  auto neg_tr = [](const float* x) { return [x](int r, int c) { return -x[c * LD + r]; }; };
  auto eye = [m](int r, int c, float v) { return r == c && r < m ? v : 0.f; };
  for (int e = threadIdx.x; e < MP * MP; e += kThreads) da[e] = 0.f;
  float f64acc[TM][TM];  // the two products with A, on CUDA cores in double
  // f64acc → out[r][c] = f(r, c, x) on this thread's entries (CUDA-core layout)
  auto store_f64 = [&](float* out, auto f) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TM; ++j) {
        const int r = ty + 16 * i, c = tx + 16 * j;
        out[r * LD + c] = f(r, c, f64acc[i][j]);
      }
  };
  using P = NsProducts<TM>;
  typename P::Acc x, y;
  auto store = [](float* out, const typename P::Acc& acc, auto f) {
    P::for_each(acc, [&](int r, int c, float v) { out[r * LD + c] = f(r, c, v); });
  };
  auto copy = [](int, int, float v) { return v; };

  for (int it = p.iters - 1; it >= 0; --it) {
    load_padded(zb, p.zs + (bh * (p.iters + 1) + it) * mm2);  // Z_i; the previous readers passed a barrier
    __syncthreads();
    inv_product<false, double>(f64acc, m, at(a), at(zb), ty, tx);  // M = A Z_i
    store_f64(mz, copy);
    store_f64(t1, [&](int r, int c, float v) { return eye(r, c, 7.f) - v; });
    __syncthreads();
    P::zero(x);
    P::add(x, m, at(mz), at(t1));
    store(t2, x, [&](int r, int c, float v) { return eye(r, c, 15.f) - v; });
    __syncthreads();
    P::zero(x);
    P::add(x, m, at(mz), at(t2));
    store(t3, x, [&](int r, int c, float v) { return eye(r, c, 13.f) - v; });
    __syncthreads();
    P::zero(x);
    P::add(x, m, at(gz), tr(t3));  // 4 dZ_i
    P::zero(y);
    P::add(y, m, tr(zb), at(gz));  // -4 dV
    __syncthreads();               // every read of gz is done
    store(gz, x, [](int, int, float v) { return 0.25f * v; });
    store(dv, y, [](int, int, float v) { return -0.25f * v; });
    __syncthreads();
    P::zero(x);
    P::add(x, m, tr(mz), at(dv));
    store(du, x, [](int, int, float v) { return -v; });
    __syncthreads();
    P::zero(x);  // dM = dV t2ᵀ + dU t1ᵀ - Mᵀ dU
    P::add(x, m, at(dv), tr(t2));
    P::add(x, m, at(du), tr(t1));
    P::add(x, m, neg_tr(mz), at(du));
    store(dm, x, copy);
    __syncthreads();
    P::zero(x);
    P::add(x, m, at(dm), tr(zb));
    P::for_each(x, [&](int r, int c, float v) { da[r * MP + c] += v; });
    inv_product<false, double>(f64acc, m, tr(a), at(dm), ty, tx);
    store_f64(gz, [&](int r, int c, float v) { return gz[r * LD + c] + v; });
    __syncthreads();
  }
  __syncthreads();  // newton_iter 0: the loads above
  ns_normalisation_backward<TM>(p, a, gz, da, zb);
}

// k1's and K3's backward write split partials; nystrom_split_sum_bwd_kernel sums them into the first split in order
// (part: (splits, count) fp32, count % 4 == 0, one or two arrays of that shape: gridDim.y), a float4 per thread.
struct SplitSums {
  float* part[2];
  long long count;
  int splits;
};

__global__ void __launch_bounds__(kThreads) nystrom_split_sum_bwd_kernel(const SplitSums s) {
  const long long e = (long long)blockIdx.x * kThreads + threadIdx.x, stride = s.count / 4;
  if (e >= stride) return;
  float4* const part = reinterpret_cast<float4*>(blockIdx.y == 0 ? s.part[0] : s.part[1]) + e;
  float4 acc = part[0];
#pragma unroll 4
  for (int i = 1; i < s.splits; ++i) {
    const float4 x = part[i * stride];
    acc.x += x.x;
    acc.y += x.y;
    acc.z += x.z;
    acc.w += x.w;
  }
  part[0] = acc;
}

// The m x m products of the backward around the Newton–Schulz VJP, in two kernels (fp32 on CUDA cores, sums in a
// fixed order), so that the host enqueues two launches instead of ~20 ATen ops. Grid (row blocks of
// kLandmarkRows, heads, B), a warp per row:
//   nystrom_landmark_vjp_bwd_kernel    per q head: (the group's first q head) d keys and d vals summed over the group
//                                      (where groups > 1) and d K̃'s buffer part; landmark sequences: dW = d vals,
//                                      dZ = dW W0ᵀ, dW0 = Zᵀ dW, rowdot = rowsum(dW0 ∘ W0)
//   nystrom_landmark_grads_bwd_kernel  per kv head, after the VJP's dK2ᵢ (gradient of K2's softmax output): dS2 =
//                                      K2 ∘ (dK2ᵢ − rowsum(K2 ∘ dK2ᵢ)); per q head of the group dQ̃ = K3's part + dS2 K̃
//                                      (in place); d K̃'s VJP part Σ_group dS2ᵀ Q̃ (written, or added to dkl)
// Sequences with n <= m real tokens (exact, only with a mask) take no landmark path: their dW rows and d K̃'s buffer
// part are 0.
constexpr int kLandmarkRows = 16;
constexpr int kMaxLandmarkTiles = 4;  // m <= 128: 32-landmark slices per warp

struct LandmarkParams {
  int hq, groups, m, slots;
  bool landmarks;               // N > m
  bool add_vjp_to_dkl;          // grads kernel: dkl += the VJP part (else dkl_vjp = it)
  const unsigned char* exact;   // (B,)
  const float* dkeys;           // (B Hq, slots, D): the buffer gradients (k1's split sums)
  const float* dvals;
  float* dkeys_kv;              // (B, Hkv, slots, D): summed over each kv head's q heads (written where groups > 1)
  float* dvals_kv;
  const float* w0;              // (B Hq, m, D)
  const float* z;               // (B Hq, m, m)
  float* dz;                    // (B Hq, m, m)
  float* dw0;                   // (B Hq, m, D)
  float* rowdot;                // (B Hq, m)
  float* dkl;                   // (B, Hkv, m, D): d K̃
  const float* k2;              // (B Hq, m, m)
  const float* dk2;             // (B Hq, m, m): the gradient of K2's softmax output
  const float* q_land;          // (B Hq, m, D)
  const float* k_land;          // (B, Hkv, m, D)
  float* dql;                   // (B Hq, m, D): K3's part of dQ̃ in, dQ̃ out
  float* dkl_vjp;               // (B, Hkv, m, D), unless add_vjp_to_dkl
};

// Dynamic shared memory of the two kernels: dW [m][D] and W0 [m][D + 1]; dS2 [m][m + 1] (padded to 16 bytes) and
// kLandmarkChunk rows of K̃ and of Q̃.
constexpr int kLandmarkChunk = 32;
template <int D>
int landmark_vjp_smem_bytes(int m) { return m * (2 * D + 1) * 4; }
template <int D>
int landmark_grads_smem_bytes(int m) { return ((m * (m + 1) + 3) / 4 * 4 + 2 * kLandmarkChunk * D) * 4; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) nystrom_landmark_vjp_bwd_kernel(const LandmarkParams p) {
  extern __shared__ float4 landmark_smem[];
  const int h = blockIdx.y, b = blockIdx.z, m = p.m, r0 = blockIdx.x * kLandmarkRows;
  const int r1 = min(r0 + kLandmarkRows, p.slots);
  const long long bh = (long long)b * p.hq + h, rows = (long long)p.slots * D;
  const bool exact = p.exact[b];
  if (h % p.groups == 0) {  // the kv head's sums over its q heads, in order
    const long long bk = bh / p.groups;
    for (int e = r0 * D + threadIdx.x; e < r1 * D; e += kThreads) {
      float dkeys = 0.f, dvals = 0.f;
      for (int g = 0; g < p.groups; ++g) {
        dkeys += p.dkeys[(bh + g) * rows + e];
        dvals += p.dvals[(bh + g) * rows + e];
      }
      if (p.groups > 1) {
        p.dkeys_kv[bk * rows + e] = dkeys;
        p.dvals_kv[bk * rows + e] = dvals;
      }
      if (p.landmarks) p.dkl[bk * rows + e] = exact ? 0.f : dkeys;
    }
  }
  if (!p.landmarks) return;
  float* const dw = reinterpret_cast<float*>(landmark_smem);  // [m][D]
  float* const w0 = dw + m * D;                                // [m][D + 1]
  const float4* w0g = reinterpret_cast<const float4*>(p.w0 + bh * rows);
  const float4* dvg = reinterpret_cast<const float4*>(p.dvals + bh * rows);
#pragma unroll 4
  for (int e = threadIdx.x; e < rows / 4; e += kThreads) {  // float4s, several loads in flight
    const float4 x = exact ? make_float4(0.f, 0.f, 0.f, 0.f) : dvg[e], y = w0g[e];
    reinterpret_cast<float4*>(dw)[e] = x;
    float* const row = w0 + (4 * e) / D * (D + 1) + (4 * e) % D;
    row[0] = y.x;
    row[1] = y.y;
    row[2] = y.z;
    row[3] = y.w;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* z = p.z + bh * m * m;
  for (int i = r0 + warp; i < r1; i += kThreads / 32) {
    float zcol[kMaxLandmarkTiles];  // Z[lane + 32 k, i]: the column the dW0 row needs, one load per lane and k
#pragma unroll
    for (int k = 0; k < kMaxLandmarkTiles; ++k) zcol[k] = lane + 32 * k < m ? __ldg(z + (lane + 32 * k) * m + i) : 0.f;
    for (int j = lane; j < m; j += 32) {  // dZ[i, j] = dW[i] · W0[j]
      float s = 0.f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) s = fmaf(dw[i * D + d], w0[j * (D + 1) + d], s);
      p.dz[bh * m * m + i * m + j] = s;
    }
    float acc[D / 32] = {};  // dW0[i, lane + 32 c] = Σ_l Z[l, i] dW[l, lane + 32 c]
#pragma unroll
    for (int k = 0; k < kMaxLandmarkTiles; ++k) {
      for (int l = 32 * k; l < min(m, 32 * k + 32); ++l) {
        const float zli = __shfl_sync(0xffffffffu, zcol[k], l % 32);
#pragma unroll
        for (int c = 0; c < D / 32; ++c) acc[c] = fmaf(zli, dw[l * D + lane + 32 * c], acc[c]);
      }
    }
    float dot = 0.f;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      p.dw0[bh * rows + i * D + lane + 32 * c] = acc[c];
      dot = fmaf(acc[c], w0[i * (D + 1) + lane + 32 * c], dot);
    }
    dot = warp_sum(dot);
    if (lane == 0) p.rowdot[bh * m + i] = dot;
  }
}

// fn(t, i) for the rows i = r0 + warp + 8 t < m of a kLandmarkRows block that this warp owns.
constexpr int kLandmarkRowsPerWarp = kLandmarkRows / (kThreads / 32);
template <typename Fn>
__device__ __forceinline__ void for_warp_rows(int r0, int m, Fn fn) {
#pragma unroll
  for (int t = 0; t < kLandmarkRowsPerWarp; ++t) {
    const int i = r0 + threadIdx.x / 32 + (kThreads / 32) * t;
    if (i < m) fn(t, i);
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads, 1) nystrom_landmark_grads_bwd_kernel(const LandmarkParams p) {
  constexpr int kPerWarp = kLandmarkRowsPerWarp;
  extern __shared__ float4 landmark_smem[];
  const int hk = blockIdx.y, b = blockIdx.z, m = p.m, ld = m + 1, r0 = blockIdx.x * kLandmarkRows;
  const long long bk = (long long)b * gridDim.y + hk, rows = (long long)m * D;
  float* const ds = reinterpret_cast<float*>(landmark_smem);  // [m][m + 1]
  float* const klc = ds + m * ld + (4 - m * ld % 4) % 4;       // [kLandmarkChunk][D], 16-byte aligned
  float* const qlc = klc + kLandmarkChunk * D;                 // [kLandmarkChunk][D]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* kl = p.k_land + bk * rows;
  float dkl[kPerWarp][D / 32] = {};  // rows r0 + warp + 8 t of d K̃'s VJP part
  for (int g = 0; g < p.groups; ++g) {
    const long long bh = (long long)b * p.hq + hk * p.groups + g;
    const float* k2 = p.k2 + bh * m * m;
    const float* dk2 = p.dk2 + bh * m * m;
    for (int i = warp; i < m; i += kThreads / 32) {  // softmax VJP of every row, a warp per row
      float pk[kMaxLandmarkTiles], gk[kMaxLandmarkTiles], t = 0.f;
#pragma unroll
      for (int k = 0; k < kMaxLandmarkTiles; ++k) {
        const int j = lane + 32 * k;
        pk[k] = j < m ? k2[i * m + j] : 0.f;
        gk[k] = j < m ? dk2[i * m + j] : 0.f;
      }
#pragma unroll
      for (int k = 0; k < kMaxLandmarkTiles; ++k) t = fmaf(pk[k], gk[k], t);
      t = warp_sum(t);
#pragma unroll
      for (int k = 0; k < kMaxLandmarkTiles; ++k)
        if (lane + 32 * k < m) ds[i * ld + lane + 32 * k] = pk[k] * (gk[k] - t);
    }
    __syncthreads();
    const float* ql = p.q_land + bh * rows;
    float dq[kPerWarp][D / 32] = {};  // rows r0 + warp + 8 t of dQ̃: K3's part, then + Σ_j dS2[i, j] K̃[j]
    for_warp_rows(r0, m, [&](int t, int i) {
#pragma unroll
      for (int c = 0; c < D / 32; ++c) dq[t][c] = p.dql[bh * rows + i * D + lane + 32 * c];
    });
    for (int j0 = 0; j0 < m; j0 += kLandmarkChunk) {  // K̃ and Q̃ rows [j0, j0 + chunk) through shared memory
      const int count = min(kLandmarkChunk, m - j0);
      for (int e = threadIdx.x; e < count * D / 4; e += kThreads) {
        reinterpret_cast<float4*>(klc)[e] = __ldg(reinterpret_cast<const float4*>(kl + j0 * D) + e);
        reinterpret_cast<float4*>(qlc)[e] = __ldg(reinterpret_cast<const float4*>(ql + j0 * D) + e);
      }
      __syncthreads();
      for_warp_rows(r0, m, [&](int t, int i) {
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
          const int d = lane + 32 * c;
#pragma unroll 8
          for (int j = 0; j < count; ++j) {
            dq[t][c] = fmaf(ds[i * ld + j0 + j], klc[j * D + d], dq[t][c]);
            dkl[t][c] = fmaf(ds[(j0 + j) * ld + i], qlc[j * D + d], dkl[t][c]);
          }
        }
      });
      __syncthreads();
    }
    for_warp_rows(r0, m, [&](int t, int i) {
#pragma unroll
      for (int c = 0; c < D / 32; ++c) p.dql[bh * rows + i * D + lane + 32 * c] = dq[t][c];
    });
  }
  for_warp_rows(r0, m, [&](int t, int i) {
#pragma unroll
    for (int c = 0; c < D / 32; ++c) {
      const long long at = bk * rows + i * D + lane + 32 * c;
      if (p.add_vjp_to_dkl) p.dkl[at] += dkl[t][c];
      else p.dkl_vjp[at] = dkl[t][c];
    }
  });
}

}  // namespace nystrom
}  // namespace hfab
