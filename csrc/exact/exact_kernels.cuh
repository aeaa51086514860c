// Exact softmax attention on CUDA cores: FlashAttention-2 forward and backward (sm_60 and newer).
//
// Math (hf_attention_backends/ops/exact/reference.py): s = scale q k^T over allowed keys (causal
// bottom-right aligned: query i sees key j <= i + Nk - Nq; key padding mask; GQA query head h reads
// kv head h / groups), out = softmax(s) v, lse = logsumexp(s) (fp32, -inf and out = 0 for rows with
// no allowed key). Softmax and every accumulation in fp32; scores in base 2 (exp2, scale * log2 e).
//
// Kernels (256 threads as a 16 x 16 grid, tiles in static shared memory, fp32 accumulators in registers):
//   exact_attn_fwd_kernel   one block per (query block, q head, batch), streams key/value tiles,
//                           online softmax; causal blocks stop at the diagonal (upper triangle skipped)
//   exact_delta_bwd_kernel  delta = rowsum(dO * O), one warp per row
//   exact_dq_bwd_kernel     one block per (query block, q head, batch): dQ = scale dS K
//   exact_dkv_bwd_kernel    one block per (key block, kv head, batch), loops over the group's q heads
//                           and query blocks: dV = P^T dO, dK = scale dS^T Q (no atomics, no repeats)
// with P = exp2(s log2e - lse log2e) recomputed from lse and dS = P (dP - delta) in fp32.
//
// Pure CUDA: NVRTC compiles this header for sm_60/sm_70 (scripts/nvrtc_check.py).
#pragma once

#include "common/tile.cuh"

namespace hfab {
namespace exact {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Strides {
  long long b, h, n;  // in elements; the head dim is contiguous
};

// Everything a launch needs; pointers to 16-byte aligned data (the host makes sure).
struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* out;   // forward output (backward input)
  const void* dout;
  const unsigned char* key_padding_mask;  // (B, Nk) bool, rows kpm_stride apart; nullptr = none
  const float* lse;  // (B, Hq, Nq) contiguous
  float* delta;      // (B, Hq, Nq) contiguous, backward scratch
  void* o;           // forward: out; backward: dq        (B, Hq, Nq, D) contiguous
  void* dk;          // (B, Hkv, Nk, D) contiguous
  void* dv;
  float* lse_out;    // forward: lse
  Strides sq, sk, sv, so, sdo;
  long long kpm_stride;
  int hq, groups, nq, nk;  // groups = Hq / Hkv
  float scale;             // softmax scale
  float scale_log2;        // scale * log2(e)
  int causal;
};

// Tile shapes per head dim, and which tiles are staged in fp32 (FTile: no conversion per use, twice the
// bytes), chosen so each kernel's static shared memory stays <= 48 KB (scripts/nvrtc_check.py checks).
template <int D> struct FwdTiles {
  static constexpr int BQ = D <= 64 ? 64 : 32, BK = D == 32 ? 64 : 32;
  static constexpr bool kQ32 = true, kK32 = true, kV32 = D <= 64;
};
template <int D> struct DqTiles {
  static constexpr int BQ = D == 32 ? 64 : 32, BK = 32;
  static constexpr bool kQ32 = D <= 64, kK32 = true, kV32 = D <= 64;  // kQ32: q and dO
};
template <int D> struct DkvTiles {
  static constexpr int BK = D == 32 ? 64 : 32, BQ = 32;
  static constexpr bool kK32 = D <= 64, kQ32 = D <= 64, kDo32 = D <= 64;  // kK32: k and v
};

// Last key (exclusive) that any query in [q0, q0 + rows) may see.
__device__ __forceinline__ int key_end(const Params& p, int q0, int rows) {
  if (!p.causal) return p.nk;
  const int last_q = min(q0 + rows, p.nq) - 1;
  return max(0, min(p.nk, last_q + (p.nk - p.nq) + 1));
}

// Fill bias[c] for keys k0 + c: 0 if the key exists and is not padding, else -inf.
template <int BK>
__device__ __forceinline__ void key_bias(float (&bias)[BK], const Params& p, int b, int k0) {
  for (int c = threadIdx.x; c < BK; c += kTileThreads) {
    const int j = k0 + c;
    const bool ok = j < p.nk && (p.key_padding_mask == nullptr || p.key_padding_mask[b * p.kpm_stride + j]);
    bias[c] = ok ? 0.f : -inf();
  }
}

template <typename T, int D, int BQ, int BK>
__global__ void __launch_bounds__(kTileThreads, 2) exact_attn_fwd_kernel(const Params p) {
  using Cfg = FwdTiles<D>;
  constexpr int TR = BQ / 16, TC = BK / 16, TD = D / 32;
  __shared__ TileOf<Cfg::kQ32, BQ, D> qs;
  __shared__ TileOf<Cfg::kK32, BK, D> ks;
  __shared__ TileOf<Cfg::kV32, BK, D> vs;
  __shared__ ScoreTile<BQ, BK> ps;
  __shared__ float bias[BK];

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // longest causal blocks first
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.groups;
  const int offset = p.nk - p.nq;
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h;

  load_tile(qs, q, p.sq.n, q0, p.nq);
  float m[TR], l[TR];  // running max (base-2 scaled scores) and this thread's part of the row sum
  float2 o[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    m[i] = -inf();
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = make_float2(0.f, 0.f);
  }

  const int kend = key_end(p, q0, BQ);
  for (int k0 = 0; k0 < kend; k0 += BK) {
    __syncthreads();  // the previous tile's readers are done
    load_tile(ks, k, p.sk.n, k0, p.nk);
    load_tile(vs, v, p.sv.n, k0, p.nk);
    key_bias(bias, p, b, k0);
    __syncthreads();

    float s[TR][TC];
    tile_dot<T>(s, qs, ks, ty, tx);
#pragma unroll
    for (int i = 0; i < TR; ++i) {
      const int row = q0 + ty * TR + i;
      float tile_max = -inf();
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        const int col = k0 + tx + 16 * j;
        float x = fmaf(s[i][j], p.scale_log2, bias[tx + 16 * j]);
        if (p.causal && col > row + offset) x = -inf();
        s[i][j] = x;
        tile_max = fmaxf(tile_max, x);
      }
      const float m_new = fmaxf(m[i], halfwarp_max(tile_max));
      const float m_use = m_new == -inf() ? 0.f : m_new;  // no allowed key yet: keep everything 0
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
    __syncthreads();
    tile_accumulate<T>(o, ps, vs, ty, tx);
  }

  const long long row_base = ((long long)b * p.hq + h) * p.nq;
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const float sum = halfwarp_sum(l[i]);
    const int row = q0 + ty * TR + i;
    if (row >= p.nq) continue;
    store_row<T>(static_cast<T*>(p.o) + (row_base + row) * D, o[i], sum > 0.f ? 1.f / sum : 0.f, tx);
    if (tx == 0) p.lse_out[row_base + row] = sum > 0.f ? (m[i] + log2f(sum)) * kLn2 : -inf();
  }
}

// delta[row] = sum_d dO[row, d] * O[row, d] in fp32. Grid (ceil(Hq Nq / 8), B): one warp per (head, row).
template <typename T, int D>
__global__ void __launch_bounds__(kTileThreads) exact_delta_bwd_kernel(const Params p) {
  const int r = blockIdx.x * (kTileThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32, b = blockIdx.y;
  if (r >= p.hq * p.nq) return;
  const int h = r / p.nq, i = r % p.nq;
  const unsigned* o = reinterpret_cast<const unsigned*>(
      static_cast<const T*>(p.out) + b * p.so.b + h * p.so.h + i * p.so.n);
  const unsigned* d = reinterpret_cast<const unsigned*>(
      static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h + i * p.sdo.n);
  float acc = 0.f;
  for (int c = lane; c < D / 2; c += 32) {
    const float2 x = Pair<T>::to_float2(o[c]), y = Pair<T>::to_float2(d[c]);
    acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) p.delta[(long long)b * p.hq * p.nq + r] = acc;
}

// Base-2 log-sum-exp to subtract for a query row; +inf (so P = 0) for rows past Nq or with no key.
__device__ __forceinline__ float lse2_of(const Params& p, long long row_base, int row) {
  if (row >= p.nq) return inf();
  const float lse = p.lse[row_base + row];
  return lse == -inf() ? inf() : lse * kLog2e;
}

template <typename T, int D, int BQ, int BK>
__global__ void __launch_bounds__(kTileThreads, 2) exact_dq_bwd_kernel(const Params p) {
  using Cfg = DqTiles<D>;
  constexpr int TR = BQ / 16, TC = BK / 16, TD = D / 32;
  __shared__ TileOf<Cfg::kQ32, BQ, D> qs, dos;
  __shared__ TileOf<Cfg::kK32, BK, D> ks;
  __shared__ TileOf<Cfg::kV32, BK, D> vs;
  __shared__ ScoreTile<BQ, BK> dss;
  __shared__ float bias[BK];

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.groups;
  const int offset = p.nk - p.nq;
  const long long row_base = ((long long)b * p.hq + h) * p.nq;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h;

  load_tile(qs, static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h, p.sq.n, q0, p.nq);
  load_tile(dos, static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h, p.sdo.n, q0, p.nq);
  float lse2[TR], dl[TR];
  float2 acc[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int row = q0 + ty * TR + i;
    lse2[i] = lse2_of(p, row_base, row);
    dl[i] = row < p.nq ? p.delta[row_base + row] : 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) acc[i][c] = make_float2(0.f, 0.f);
  }

  const int kend = key_end(p, q0, BQ);
  for (int k0 = 0; k0 < kend; k0 += BK) {
    __syncthreads();
    load_tile(ks, k, p.sk.n, k0, p.nk);
    load_tile(vs, v, p.sv.n, k0, p.nk);
    key_bias(bias, p, b, k0);
    __syncthreads();

    float s[TR][TC], dp[TR][TC];
    tile_dot<T>(s, qs, ks, ty, tx);
    tile_dot<T>(dp, dos, vs, ty, tx);
#pragma unroll
    for (int i = 0; i < TR; ++i) {
      const int row = q0 + ty * TR + i;
#pragma unroll
      for (int j = 0; j < TC; ++j) {
        const int col = k0 + tx + 16 * j;
        float x = fmaf(s[i][j], p.scale_log2, bias[tx + 16 * j]);
        if (p.causal && col > row + offset) x = -inf();
        const float pij = exp2f(x - lse2[i]);
        dss.v[ty * TR + i][tx + 16 * j] = pij * (dp[i][j] - dl[i]);  // fp32: dP - delta cancels
      }
    }
    __syncthreads();
    tile_accumulate<T>(acc, dss, ks, ty, tx);
  }

#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int row = q0 + ty * TR + i;
    if (row < p.nq) store_row<T>(static_cast<T*>(p.o) + (row_base + row) * D, acc[i], p.scale, tx);
  }
}

template <typename T, int D, int BK, int BQ>
__global__ void __launch_bounds__(kTileThreads, 2) exact_dkv_bwd_kernel(const Params p) {
  using Cfg = DkvTiles<D>;
  constexpr int TR = BK / 16, TC = BQ / 16, TD = D / 32;
  __shared__ TileOf<Cfg::kK32, BK, D> ks, vs;
  __shared__ TileOf<Cfg::kQ32, BQ, D> qs;
  __shared__ TileOf<Cfg::kDo32, BQ, D> dos;
  __shared__ ScoreTile<BK, BQ> pts, dsts;  // P^T and dS^T: rows are keys
  __shared__ float lse2s[BQ], dls[BQ];

  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int k0 = blockIdx.x * BK;
  const int g = blockIdx.y, b = blockIdx.z;
  const int offset = p.nk - p.nq;

  load_tile(ks, static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h, p.sk.n, k0, p.nk);
  load_tile(vs, static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h, p.sv.n, k0, p.nk);
  float kb[TR];
  float2 dk[TR][TD], dv[TR][TD];
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int key = k0 + ty * TR + i;
    const bool ok = key < p.nk && (p.key_padding_mask == nullptr || p.key_padding_mask[b * p.kpm_stride + key]);
    kb[i] = ok ? 0.f : -inf();
#pragma unroll
    for (int c = 0; c < TD; ++c) dk[i][c] = dv[i][c] = make_float2(0.f, 0.f);
  }

  // causal: query i sees key j iff i >= j - offset; start at the query block holding the first such i
  const int q_first = p.causal ? max(0, k0 - offset) / BQ * BQ : 0;
  for (int hh = 0; hh < p.groups; ++hh) {
    const int h = g * p.groups + hh;
    const long long row_base = ((long long)b * p.hq + h) * p.nq;
    const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
    const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h;
    for (int q0 = q_first; q0 < p.nq; q0 += BQ) {
      __syncthreads();
      load_tile(qs, q, p.sq.n, q0, p.nq);
      load_tile(dos, dout, p.sdo.n, q0, p.nq);
      for (int c = threadIdx.x; c < BQ; c += kTileThreads) {
        lse2s[c] = lse2_of(p, row_base, q0 + c);
        dls[c] = q0 + c < p.nq ? p.delta[row_base + q0 + c] : 0.f;
      }
      __syncthreads();

      float st[TR][TC], dpt[TR][TC];
      tile_dot<T>(st, ks, qs, ty, tx);
      tile_dot<T>(dpt, vs, dos, ty, tx);
#pragma unroll
      for (int i = 0; i < TR; ++i) {
        const int key = k0 + ty * TR + i;
#pragma unroll
        for (int j = 0; j < TC; ++j) {
          const int c = tx + 16 * j;
          float x = fmaf(st[i][j], p.scale_log2, kb[i]);
          if (p.causal && key > q0 + c + offset) x = -inf();
          const float pij = exp2f(x - lse2s[c]);
          pts.v[ty * TR + i][c] = pij;
          dsts.v[ty * TR + i][c] = pij * (dpt[i][j] - dls[c]);  // fp32: dP - delta cancels
        }
      }
      __syncthreads();
      tile_accumulate<T>(dv, pts, dos, ty, tx);
      tile_accumulate<T>(dk, dsts, qs, ty, tx);
    }
  }

  const long long row_base = ((long long)b * (p.hq / p.groups) + g) * p.nk;
#pragma unroll
  for (int i = 0; i < TR; ++i) {
    const int key = k0 + ty * TR + i;
    if (key >= p.nk) continue;
    store_row<T>(static_cast<T*>(p.dk) + (row_base + key) * D, dk[i], p.scale, tx);
    store_row<T>(static_cast<T*>(p.dv) + (row_base + key) * D, dv[i], 1.f, tx);
  }
}

}  // namespace exact
}  // namespace hfab
