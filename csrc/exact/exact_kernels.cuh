// Exact softmax attention on CUDA cores: FlashAttention-2 forward and backward (sm_60 and newer).
//
// Math (hf_attention_backends/ops/exact/reference.py): s = scale q k^T over allowed keys (causal
// bottom-right aligned: query i sees key j <= i + Nk - Nq; key padding mask; GQA query head h reads
// kv head h / groups), out = softmax(s) v, lse = logsumexp(s) (fp32, -inf and out = 0 for rows with
// no allowed key). Softmax and every accumulation in fp32; scores in base 2 (exp2, scale * log2 e).
//
// Kernels (256 threads, tiles in static shared memory <= 48 KB, fp32 accumulators in registers; each warp owns
// 8 rows of the block and lanes split D, then a reduce-scatter: version 3, csrc/exact/NOTES.md):
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

#include "common/strides.cuh"
#include "common/tile.cuh"

namespace hfab {
namespace exact {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

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

// Tile shapes per head dim (8 stationary rows per warp), chosen with the tiles' element type (Elem) so that each
// kernel's static shared memory stays <= 48 KB (scripts/nvrtc_check.py checks).
template <int D> struct FwdTiles {
  static constexpr int BQ = 64, BK = D == 32 ? 64 : D == 64 ? 32 : 16;
};
template <int D> struct DqTiles {
  static constexpr int BQ = 64, BK = D == 32 ? 32 : 16;
};
template <int D> struct DkvTiles {
  static constexpr int BK = 64, BQ = D == 32 ? 32 : 16;
};

// Last key (exclusive) that any query in [q0, q0 + rows) may see.
__device__ __forceinline__ int key_end(const Params& p, int q0, int rows) {
  if (!p.causal) return p.nk;
  const int last_q = min(q0 + rows, p.nq) - 1;
  return max(0, min(p.nk, last_q + (p.nk - p.nq) + 1));
}

// Version 3 building blocks: a warp owns 8 rows of a block; see the kernels below.

// Element type of a version-3 tile: fp32 (converted once when staged) for D <= 64; for D = 128, where fp32 tiles
// would pass 48 KB, the 16-bit elements as loaded, converted per use.
template <int D> using Elem = typename Select<(D <= 64), float, unsigned short>::type;

// Four consecutive elements of a tile as fp32 (16-byte aligned for fp32, 8-byte for 16-bit).
template <typename T> __device__ __forceinline__ float4 ld4(const float* x) { return *reinterpret_cast<const float4*>(x); }
template <typename T> __device__ __forceinline__ float4 ld4(const unsigned short* x) {
  const uint2 w = *reinterpret_cast<const uint2*>(x);
  const float2 a = Pair<T>::to_float2(w.x), b = Pair<T>::to_float2(w.y);
  return make_float4(a.x, a.y, b.x, b.y);
}

// The two 16-bit elements of word w (the lower first) into two tile entries.
template <typename T> __device__ __forceinline__ void put_pair(float& lo, float& hi, unsigned w) {
  const float2 e = Pair<T>::to_float2(w);
  lo = e.x;
  hi = e.y;
}
template <typename T> __device__ __forceinline__ void put_pair(unsigned short& lo, unsigned short& hi, unsigned w) {
  lo = static_cast<unsigned short>(w & 0xffffu);
  hi = static_cast<unsigned short>(w >> 16);
}

// Elements [4c, 4c + 4) of row `row` (zero for row >= n) of a matrix with rows `stride` elements apart.
template <typename T>
__device__ __forceinline__ uint2 load_quad(const T* base, long long stride, int row, int c, int n) {
  if (row >= n) return make_uint2(0u, 0u);
  return __ldg(reinterpret_cast<const uint2*>(base + (long long)row * stride) + c);
}

// Column of stationary row r (block-relative) at dim d in a d-major copy: inside its group of 8 rows,
// the rows are XOR-swizzled by the D split that reads dim d (lane group ds reads the float4 dim groups
// ds + NDS u), so that in reduce_scatter_rows the rows a lane keeps are its registers 0..hh-1 and the
// rows it sends are hh..2hh-1, in every lane.
template <int NDS, int RL>
__device__ __forceinline__ int row_col(int r, int d) { return (r & ~7) | ((r & 7) ^ (RL * (d / 4 % NDS))); }

// Rows [row0, row0 + BR) of a (rows, D) matrix into t (row pitch BRP >= BR), d-major and swizzled by row_col;
// rows >= n are 0.
template <int NDS, int RL, int BR, int D, int BRP, typename E, typename T>
__device__ __forceinline__ void stage_stationary(E (&t)[D][BRP], const T* base, long long stride, int row0, int n) {
  for (int c = threadIdx.x; c < BR * D / 8; c += kTileThreads) {  // a warp: 32 rows, one chunk
    const int r = c % BR, d0 = c / BR * 8;
    const uint4 x = load_chunk(base, stride, row0 + r, c / BR, n);
    const int c0 = row_col<NDS, RL>(r, d0), c1 = row_col<NDS, RL>(r, d0 + 4);
    put_pair<T>(t[d0][c0], t[d0 + 1][c0], x.x);
    put_pair<T>(t[d0 + 2][c0], t[d0 + 3][c0], x.y);
    put_pair<T>(t[d0 + 4][c1], t[d0 + 5][c1], x.z);
    put_pair<T>(t[d0 + 6][c1], t[d0 + 7][c1], x.w);
  }
}

// Sum the D-split partials: afterwards s[i] (i < RL) is row ds RL + i, complete. The swizzle makes the
// rows a lane keeps registers 0..hh-1 and the rows it sends hh..2hh-1 in every lane.
template <int NCG, int RL>
__device__ __forceinline__ void reduce_scatter_rows(float (&s)[8][4]) {
#pragma unroll
  for (int hh = 4; hh >= RL; hh /= 2)
#pragma unroll
    for (int i = 0; i < hh; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] += __shfl_xor_sync(0xffffffffu, s[i + hh][j], NCG * (hh / RL));
}

// The streamed tile held in registers (chunk c of thread t: c = t + i 256; row c / (D/4), quad c % (D/4)).
template <int QUADS, int D, typename T>
__device__ __forceinline__ void fetch_quads(uint2 (&reg)[QUADS], const T* base, long long stride, int row0, int n) {
#pragma unroll
  for (int i = 0; i < QUADS; ++i) {
    const int c = threadIdx.x + i * kTileThreads;  // a warp: consecutive quads of a row
    reg[i] = load_quad(base, stride, row0 + c / (D / 4), c % (D / 4), n);
  }
}

template <typename T, int QUADS, int D, int ROWS, int LB>
__device__ __forceinline__ void store_quads(float (&t)[ROWS][LB], const uint2 (&reg)[QUADS]) {
#pragma unroll
  for (int i = 0; i < QUADS; ++i) {
    const int c = threadIdx.x + i * kTileThreads;
    const float2 a = Pair<T>::to_float2(reg[i].x), b = Pair<T>::to_float2(reg[i].y);
    *reinterpret_cast<float4*>(&t[c / (D / 4)][c % (D / 4) * 4]) = make_float4(a.x, a.y, b.x, b.y);
  }
}

template <typename T, int QUADS, int D, int ROWS, int LB>
__device__ __forceinline__ void store_quads(unsigned short (&t)[ROWS][LB], const uint2 (&reg)[QUADS]) {
#pragma unroll
  for (int i = 0; i < QUADS; ++i) {
    const int c = threadIdx.x + i * kTileThreads;
    *reinterpret_cast<uint2*>(&t[c / (D / 4)][c % (D / 4) * 4]) = reg[i];
  }
}

// The forward's K^T (d-major) and V tiles (Elem: 16-bit for D = 128, where fp32 Q alone takes 32 KB).
template <typename T, int D, int BK> struct FwdKV {
  using E = Elem<D>;
  static constexpr int kPitch = D <= 64 ? BK : BK + 4;  // 16-bit K^T rows 4 apart (the next lane group) 8 banks apart
  E kt[D][kPitch];
  E vs[BK][D];
  __device__ __forceinline__ void put_k(int key, int d0, uint4 x) {  // elements d0 .. d0 + 7 of a key
    put_pair<T>(kt[d0][key], kt[d0 + 1][key], x.x);
    put_pair<T>(kt[d0 + 2][key], kt[d0 + 3][key], x.y);
    put_pair<T>(kt[d0 + 4][key], kt[d0 + 5][key], x.z);
    put_pair<T>(kt[d0 + 6][key], kt[d0 + 7][key], x.w);
  }
  template <int QUADS> __device__ __forceinline__ void put_v(const uint2 (&reg)[QUADS]) {
    store_quads<T, QUADS, D>(vs, reg);
  }
  __device__ __forceinline__ float4 k4(int d, int c) const { return ld4<T>(&kt[d][c]); }
  __device__ __forceinline__ float4 v4(int r, int c) const { return ld4<T>(&vs[r][c]); }
};

// Forward, version 3 (every D; NOTES.md "Version 3"): warp w owns query rows [8w, 8w + 8) of the
// block, so a row's softmax state, its probabilities and its output never leave the warp.
//   S = Q K^T: lane (cg, ds) = (lane % NCG, lane / NCG) computes rows 0..7 x keys [4cg, 4cg + 4) over
//     the float4 dim groups ds + NDS u from d-major copies of Q (fp32, swizzled, row_col) and K (FwdKV); a
//     reduce-scatter over ds leaves it RL = 8 / NDS whole rows (ds RL .. ds RL + RL - 1) of those keys.
//   O += P V: lane (dg, kh) = (lane % NDG, lane / NDG) accumulates rows 0..7 x columns [4dg, 4dg + 4)
//     over keys [kh KPH, kh KPH + KPH) of each tile; the kh partial sums are added once at the end.
template <int D, int BK> struct FwdWarpShape {
  static constexpr int kRows = 8;                           // query rows per warp
  static constexpr int BQ = kRows * (kTileThreads / 32);  // 64
  static constexpr int NCG = BK / 4, NDS = 32 / NCG, RL = kRows / NDS;
  static constexpr int NDG = D / 4, NKH = 32 / NDG, KPH = BK / NKH;
  static constexpr int KCH = BK * D / 8 / kTileThreads;   // 16-byte K chunks per thread and tile
  static constexpr int VCH = BK * D / 4 / kTileThreads;   // 8-byte V chunks per thread and tile
  static_assert(NCG * NDS == 32 && NDG * NKH == 32 && NDS <= kRows && D % (4 * NDS) == 0, "lane layout");
  static_assert(KCH * 8 * kTileThreads == BK * D && VCH * 4 * kTileThreads == BK * D && KPH % 4 == 0, "tiles");
};


template <typename T, int D, int BQ, int BK>
__device__ __forceinline__ void attn_fwd_warp_rows(const Params& p) {
  using W = FwdWarpShape<D, BK>;
  static_assert(W::BQ == BQ, "FwdTiles<D>::BQ must be 8 rows per warp");
  constexpr int NCG = W::NCG, NDS = W::NDS, RL = W::RL, NDG = W::NDG, NKH = W::NKH, KPH = W::KPH;
  __shared__ __align__(16) float qt[D][BQ];  // Q^T, rows swizzled by row_col
  __shared__ __align__(16) FwdKV<T, D, BK> kv;  // K^T, V
  __shared__ __align__(16) float ps[BQ][BK];  // probabilities; rows 8w..8w+7 belong to warp w
  __shared__ __align__(16) float bias[BK];

  const int lane = threadIdx.x % 32, r0 = threadIdx.x / 32 * W::kRows;
  const int cg = lane % NCG, ds = lane / NCG;  // score layout
  const int dg = lane % NDG, kh = lane / NDG;  // output layout
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // longest causal blocks first
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.groups;
  const int offset = p.nk - p.nq;
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h;

  stage_stationary<NDS, RL, BQ>(qt, q, p.sq.n, q0, p.nq);

  float m[RL], l[RL];  // running max (base-2 scaled scores) and this lane's part of the row sum
  float o[8][4];
#pragma unroll
  for (int i = 0; i < RL; ++i) {
    m[i] = -inf();
    l[i] = 0.f;
  }
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[r][c] = 0.f;

  uint4 kreg[W::KCH];  // the next K / V tile and key-padding flag, in flight during the products
  uint2 vreg[W::VCH];
  int key_ok = 0;
  const int kend = key_end(p, q0, BQ);
  auto fetch = [&](int k0) {
#pragma unroll
    for (int i = 0; i < W::KCH; ++i) {
      const int c = threadIdx.x + i * kTileThreads;  // a warp: 32 keys, one chunk
      kreg[i] = load_chunk(k, p.sk.n, k0 + c % BK, c / BK, p.nk);
    }
    fetch_quads<W::VCH, D>(vreg, v, p.sv.n, k0, p.nk);
    const int j = k0 + threadIdx.x;  // threads < BK: the flag of key j
    if (threadIdx.x < BK) key_ok = j < p.nk && (p.key_padding_mask == nullptr || p.key_padding_mask[b * p.kpm_stride + j]);
  };
  if (kend > 0) fetch(0);

  for (int k0 = 0; k0 < kend; k0 += BK) {
    __syncthreads();  // every warp is done with the previous K, V tile
#pragma unroll
    for (int i = 0; i < W::KCH; ++i) {
      const int c = threadIdx.x + i * kTileThreads;
      kv.put_k(c % BK, c / BK * 8, kreg[i]);
    }
    kv.put_v(vreg);
    if (threadIdx.x < BK) bias[threadIdx.x] = key_ok ? 0.f : -inf();
    __syncthreads();

    // S: rows 0..7 (in row_col order) x keys 4cg..4cg+3, partial over this lane's dim groups ds + NDS u
    float s[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
#pragma unroll 8
    for (int dd = 0; dd < D / NDS; ++dd) {
      const int d = 4 * (ds + NDS * (dd / 4)) + dd % 4;
      const float4 qa = *reinterpret_cast<const float4*>(&qt[d][r0]);
      const float4 qb = *reinterpret_cast<const float4*>(&qt[d][r0 + 4]);
      const float4 kd = kv.k4(d, 4 * cg);
      const float qr[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
      const float kc[4] = {kd.x, kd.y, kd.z, kd.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i][j] = fmaf(qr[i], kc[j], s[i][j]);
    }
    reduce_scatter_rows<NCG, RL>(s);

    // online softmax on rows r0 + ds RL + i (i < RL), keys k0 + 4cg + j
    const float4 bv = *reinterpret_cast<const float4*>(&bias[4 * cg]);
    const float kb[4] = {bv.x, bv.y, bv.z, bv.w};
    float alpha[RL];
#pragma unroll
    for (int i = 0; i < RL; ++i) {
      const int row = q0 + r0 + ds * RL + i;
      float tile_max = -inf();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float x = fmaf(s[i][j], p.scale_log2, kb[j]);
        if (p.causal && k0 + 4 * cg + j > row + offset) x = -inf();
        s[i][j] = x;
        tile_max = fmaxf(tile_max, x);
      }
#pragma unroll
      for (int off = 1; off < NCG; off *= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float m_new = fmaxf(m[i], tile_max);
      const float m_use = m_new == -inf() ? 0.f : m_new;  // no allowed key yet: keep everything 0
      alpha[i] = exp2f(m[i] - m_use);
      m[i] = m_new;
      l[i] *= alpha[i];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[i][j] = exp2f(s[i][j] - m_use);
        l[i] += s[i][j];
      }
      *reinterpret_cast<float4*>(&ps[r0 + ds * RL + i][4 * cg]) = make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
    }
    __syncwarp();
    if (k0 + BK < kend) fetch(k0 + BK);  // in flight during P V (fewer live registers than during S)

    // O = alpha O + P V on rows 0..7, columns 4dg..4dg+3, keys kh KPH .. kh KPH + KPH - 1
    bool same_max = true;
#pragma unroll
    for (int i = 0; i < RL; ++i) same_max = same_max && alpha[i] == 1.f;
    if (!__all_sync(0xffffffffu, same_max)) {  // else every alpha is 1: skip the exact no-op
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const float a = __shfl_sync(0xffffffffu, alpha[r % RL], r / RL * NCG);
#pragma unroll
        for (int c = 0; c < 4; ++c) o[r][c] *= a;
      }
    }
#pragma unroll 2
    for (int kq = kh * KPH; kq < kh * KPH + KPH; kq += 4) {
      float4 pr[8];
#pragma unroll
      for (int r = 0; r < 8; ++r) pr[r] = *reinterpret_cast<const float4*>(&ps[r0 + r][kq]);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const float4 vv = kv.v4(kq + kk, 4 * dg);
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const float pk = kk == 0 ? pr[r].x : kk == 1 ? pr[r].y : kk == 2 ? pr[r].z : pr[r].w;
          o[r][0] = fmaf(pk, vv.x, o[r][0]);
          o[r][1] = fmaf(pk, vv.y, o[r][1]);
          o[r][2] = fmaf(pk, vv.z, o[r][2]);
          o[r][3] = fmaf(pk, vv.w, o[r][3]);
        }
      }
    }
    // the next write of ps follows two __syncthreads
  }

#pragma unroll
  for (int i = 0; i < RL; ++i)
#pragma unroll
    for (int off = 1; off < NCG; off *= 2) l[i] += __shfl_xor_sync(0xffffffffu, l[i], off);
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int off = NDG; off < 32; off *= 2) o[r][c] += __shfl_xor_sync(0xffffffffu, o[r][c], off);

  const long long row_base = ((long long)b * p.hq + h) * p.nq;
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    const float sum = __shfl_sync(0xffffffffu, l[r % RL], r / RL * NCG);
    const int row = q0 + r0 + r;
    if (row >= p.nq || r % NKH != kh) continue;
    const float mul = sum > 0.f ? 1.f / sum : 0.f;
    unsigned* w = reinterpret_cast<unsigned*>(static_cast<T*>(p.o) + (row_base + row) * D + 4 * dg);
    *reinterpret_cast<uint2*>(w) = make_uint2(Pair<T>::from_float2(make_float2(o[r][0] * mul, o[r][1] * mul)),
                                              Pair<T>::from_float2(make_float2(o[r][2] * mul, o[r][3] * mul)));
  }
  if (cg == 0) {
#pragma unroll
    for (int i = 0; i < RL; ++i) {
      const int row = q0 + r0 + ds * RL + i;
      if (row < p.nq) p.lse_out[row_base + row] = l[i] > 0.f ? (m[i] + log2f(l[i])) * kLn2 : -inf();
    }
  }
}

template <typename T, int D, int BQ, int BK>
__global__ void __launch_bounds__(kTileThreads, 2) exact_attn_fwd_kernel(const Params p) {
  attn_fwd_warp_rows<T, D, BQ, BK>(p);
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

// Backward lane layout (NOTES.md "Version 3"): warp w owns rows [8w, 8w + 8) of the stationary operands
// (staged d-major and XOR-swizzled as in the forward); the streamed operands are row-major, LB floats
// per row. A product over D: lane (cg, ds) = (lane % NCG, lane / NCG) computes rows 0..7 x columns
// {cg, cg + NCG, cg + 2 NCG, cg + 3 NCG} over the float4 dim groups f = ds + NDS u, then a reduce-scatter
// over ds leaves it rows ds RL .. ds RL + RL - 1. A product over the columns (the score tile, stored per
// warp with column cg + NCG j at position 4 cg + j): lane (dg, kh) accumulates rows 0..7 x D-columns
// [4dg, 4dg + 4) over positions [kh KPH, kh KPH + KPH).
template <int D, int BN> struct BwdWarpShape {
  static constexpr int kRows = 8, BR = kRows * (kTileThreads / 32);  // 64 stationary rows per block
  static constexpr int NCG = BN / 4, NDS = 32 / NCG, NF = D / 4 / NDS, RL = kRows / NDS;
  static constexpr int NDG = D / 4, NKH = 32 / NDG, KPH = BN / NKH;
  // float4 reads of rows c + NCG j by 8 lanes are conflict-free when LB / 4 is odd (NCG >= 8), or
  // == 2 mod 8 (NCG == 4: a phase holds 4 values of cg and 2 of ds, whose dim groups are adjacent)
  // 16-bit rows (D = 128, NCG == 4): 8-byte reads by 16 lanes (4 cg x 4 ds) conflict-free when LB / 2 == 8 mod 32
  static constexpr int LB = D <= 64 ? D + (NCG == 4 ? 8 : 4) : D + 16;
  // d-major stationary rows: 16-bit ones padded so that the dims 4 apart (lane groups ds, ds + 1) sit 8 banks apart
  static constexpr int BRP = D <= 64 ? BR : BR + 4;
  using E = Elem<D>;
  static constexpr int QUADS = BN * D / 4 / kTileThreads;  // 8-byte chunks per thread of one streamed tile
  static_assert(NCG * NDS == 32 && NDS <= kRows && NF >= 1 && NDG * NKH == 32 && KPH % 4 == 0, "lane layout");
  static_assert(QUADS * 4 * kTileThreads == BN * D, "streamed tile");
};

// s[i][j] = sum over this lane's dims of A[r0 + (i ^ RL ds)][d] * B[cg + NCG j][d]   (A: stationary, B: streamed)
template <typename T, int NCG, int NDS, int NF, int D, int BRP, int BN, int LB, typename EA, typename EB>
__device__ __forceinline__ void warp_rows_dot(float (&s)[8][4], const EA (&at)[D][BRP], const EB (&b)[BN][LB],
                                              int r0, int cg, int ds) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
  constexpr int kUnroll = NF > 2 ? 2 : NF;  // fully unrolled, dq at D = 128 spills on sm_70 (NVRTC check)
#else
  constexpr int kUnroll = NF;
#endif
#pragma unroll(kUnroll)
  for (int u = 0; u < NF; ++u) {
    const int f = ds + NDS * u;
    float bc[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 x = ld4<T>(&b[cg + NCG * j][4 * f]);
      bc[0][j] = x.x;
      bc[1][j] = x.y;
      bc[2][j] = x.z;
      bc[3][j] = x.w;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float4 qa = ld4<T>(&at[4 * f + e][r0]);
      const float4 qb = ld4<T>(&at[4 * f + e][r0 + 4]);
      const float ar[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i][j] = fmaf(ar[i], bc[e][j], s[i][j]);
    }
  }
}

// acc[r][c] += sum over positions q in [kh KPH, kh KPH + KPH) of a[r0 + r][q] * b[q / 4 + NCG (q % 4)][4 dg + c]
template <typename T, int NCG, int KPH, int BR, int BN, int ROWS, int LB, typename EB>
__device__ __forceinline__ void warp_rows_accumulate(float (&acc)[8][4], const float (&a)[BR][BN],
                                                     const EB (&b)[ROWS][LB], int r0, int dg, int kh) {
#pragma unroll 2
  for (int g = kh * KPH / 4; g < (kh + 1) * KPH / 4; ++g) {
    float4 pr[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) pr[r] = *reinterpret_cast<const float4*>(&a[r0 + r][4 * g]);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const float4 bv = ld4<T>(&b[g + NCG * jj][4 * dg]);
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const float pk = jj == 0 ? pr[r].x : jj == 1 ? pr[r].y : jj == 2 ? pr[r].z : pr[r].w;
        acc[r][0] = fmaf(pk, bv.x, acc[r][0]);
        acc[r][1] = fmaf(pk, bv.y, acc[r][1]);
        acc[r][2] = fmaf(pk, bv.z, acc[r][2]);
        acc[r][3] = fmaf(pk, bv.w, acc[r][3]);
      }
    }
  }
}

// Sum acc over the kh lanes and write rows r (r % NKH == kh) scaled by `mul` to out rows row0 + r < n.
template <typename T, int D, int NDG, int NKH>
__device__ __forceinline__ void store_warp_rows(float (&acc)[8][4], T* out, int row0, int n, float mul, int dg, int kh) {
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int off = NDG; off < 32; off *= 2) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], off);
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    if (row0 + r >= n || r % NKH != kh) continue;
    unsigned* w = reinterpret_cast<unsigned*>(out + (long long)(row0 + r) * D + 4 * dg);
    *reinterpret_cast<uint2*>(w) = make_uint2(Pair<T>::from_float2(make_float2(acc[r][0] * mul, acc[r][1] * mul)),
                                              Pair<T>::from_float2(make_float2(acc[r][2] * mul, acc[r][3] * mul)));
  }
}

// dQ, version 3: warp w owns query rows [8w, 8w + 8); S = Q K^T and dP = dO V^T in the
// BwdWarpShape layout, dS = P (dP - delta) per lane, dQ += dS K through a per-warp dS tile.
template <typename T, int D, int BQ, int BK>
__device__ __forceinline__ void dq_warp_rows(const Params& p) {
  using W = BwdWarpShape<D, BK>;
  static_assert(W::BR == BQ, "DqTiles<D>::BQ must be 8 rows per warp");
  constexpr int NCG = W::NCG, NDS = W::NDS, RL = W::RL, LB = W::LB;
  using E = typename W::E;
  __shared__ __align__(16) E qt[D][W::BRP];  // Q^T and dO^T, swizzled by row_col
  __shared__ __align__(16) E dot[D][W::BRP];
  __shared__ __align__(16) E ks[BK][LB];
  __shared__ __align__(16) E vs[BK][LB];
  __shared__ __align__(16) float dss[BQ][BK];  // dS; rows 8w..8w+7 belong to warp w
  __shared__ float bias[BK], lse2s[BQ], dls[BQ];  // per-row constants in shared memory: registers are full

  const int lane = threadIdx.x % 32, r0 = threadIdx.x / 32 * W::kRows;
  const int cg = lane % NCG, ds = lane / NCG, dg = lane % W::NDG, kh = lane / W::NDG;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int h = blockIdx.y, b = blockIdx.z, g = h / p.groups;
  const int offset = p.nk - p.nq;
  const long long row_base = ((long long)b * p.hq + h) * p.nq;

  stage_stationary<NDS, RL, BQ>(qt, static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h, p.sq.n, q0, p.nq);
  stage_stationary<NDS, RL, BQ>(dot, static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h, p.sdo.n, q0, p.nq);
  for (int r = threadIdx.x; r < BQ; r += kTileThreads) {
    lse2s[r] = lse2_of(p, row_base, q0 + r);
    dls[r] = q0 + r < p.nq ? p.delta[row_base + q0 + r] : 0.f;
  }
  float acc[8][4];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[r][c] = 0.f;

  uint2 kreg[W::QUADS], vreg[W::QUADS];  // the next K / V tile and key flag, in flight during dQ += dS K
  int key_ok = 0;
  auto fetch = [&](int k0) {  // pointers rebuilt from the constant bank: registers are full
    fetch_quads<W::QUADS, D>(kreg, static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h, p.sk.n, k0, p.nk);
    fetch_quads<W::QUADS, D>(vreg, static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h, p.sv.n, k0, p.nk);
    const int j = k0 + threadIdx.x;
    if (threadIdx.x < BK) key_ok = j < p.nk && (p.key_padding_mask == nullptr || p.key_padding_mask[b * p.kpm_stride + j]);
  };
  const int kend = key_end(p, q0, BQ);
  if (kend > 0) fetch(0);
  for (int k0 = 0; k0 < kend; k0 += BK) {
    __syncthreads();  // every warp is done with the previous K, V tile
    store_quads<T, W::QUADS, D>(ks, kreg);
    store_quads<T, W::QUADS, D>(vs, vreg);
    if (threadIdx.x < BK) bias[threadIdx.x] = key_ok ? 0.f : -inf();
    __syncthreads();

    float s[8][4], dp[8][4];
    warp_rows_dot<T, NCG, NDS, W::NF>(s, qt, ks, r0, cg, ds);
    reduce_scatter_rows<NCG, RL>(s);
    asm volatile("" ::: "memory");  // keeps the dP loads after S: 32 accumulators live, not 64
    warp_rows_dot<T, NCG, NDS, W::NF>(dp, dot, vs, r0, cg, ds);
    reduce_scatter_rows<NCG, RL>(dp);
    float kb[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) kb[j] = bias[cg + NCG * j];
#pragma unroll
    for (int i = 0; i < RL; ++i) {
      const int row = q0 + r0 + ds * RL + i;
      const float lse2 = lse2s[r0 + ds * RL + i], dl = dls[r0 + ds * RL + i];
      float dsv[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float x = fmaf(s[i][j], p.scale_log2, kb[j]);
        if (p.causal && k0 + cg + NCG * j > row + offset) x = -inf();
        dsv[j] = exp2f(x - lse2) * (dp[i][j] - dl);  // fp32: dP - delta cancels
      }
      *reinterpret_cast<float4*>(&dss[r0 + ds * RL + i][4 * cg]) = make_float4(dsv[0], dsv[1], dsv[2], dsv[3]);
    }
    __syncwarp();
    if (k0 + BK < kend) fetch(k0 + BK);
    warp_rows_accumulate<T, NCG, W::KPH>(acc, dss, ks, r0, dg, kh);
    // the next write of dss follows two __syncthreads
  }
  store_warp_rows<T, D, W::NDG, W::NKH>(acc, static_cast<T*>(p.o) + row_base * D, q0 + r0, p.nq, p.scale, dg, kh);
}

template <typename T, int D, int BQ, int BK>
__global__ void __launch_bounds__(kTileThreads, 2) exact_dq_bwd_kernel(const Params p) {
  dq_warp_rows<T, D, BQ, BK>(p);
}

// dK, dV, version 3: warp w owns key rows [8w, 8w + 8) of the block; S^T = K Q^T and
// dP^T = V dO^T in the BwdWarpShape layout (keys stationary, queries streamed), then dV += P^T dO and
// dK += dS^T Q through one per-warp score tile (P^T first, dS^T after). 64 accumulators per lane: one
// block per SM (launch bounds), 8 warps.
template <typename T, int D, int BK, int BQ>
__device__ __forceinline__ void dkv_warp_rows(const Params& p) {
  using W = BwdWarpShape<D, BQ>;
  static_assert(W::BR == BK, "DkvTiles<D>::BK must be 8 rows per warp");
  constexpr int NCG = W::NCG, NDS = W::NDS, RL = W::RL, LB = W::LB;
  using E = typename W::E;
  __shared__ __align__(16) E kt[D][W::BRP];  // K^T and V^T, swizzled by row_col
  __shared__ __align__(16) E vt[D][W::BRP];
  __shared__ __align__(16) E qs[BQ][LB];
  __shared__ __align__(16) E dos[BQ][LB];
  __shared__ __align__(16) float sts[BK][BQ];  // P^T, then dS^T; rows 8w..8w+7 belong to warp w
  __shared__ float lse2s[BQ], dls[BQ];

  const int lane = threadIdx.x % 32, r0 = threadIdx.x / 32 * W::kRows;
  const int cg = lane % NCG, ds = lane / NCG, dg = lane % W::NDG, kh = lane / W::NDG;
  const int k0 = blockIdx.x * BK;
  const int g = blockIdx.y, b = blockIdx.z;
  const int offset = p.nk - p.nq;

  stage_stationary<NDS, RL, BK>(kt, static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h, p.sk.n, k0, p.nk);
  stage_stationary<NDS, RL, BK>(vt, static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h, p.sv.n, k0, p.nk);
  float kb[RL];  // keys k0 + r0 + ds RL + i
#pragma unroll
  for (int i = 0; i < RL; ++i) {
    const int key = k0 + r0 + ds * RL + i;
    const bool ok = key < p.nk && (p.key_padding_mask == nullptr || p.key_padding_mask[b * p.kpm_stride + key]);
    kb[i] = ok ? 0.f : -inf();
  }
  float dk[8][4], dv[8][4];
#pragma unroll
  for (int r = 0; r < 8; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk[r][c] = dv[r][c] = 0.f;

  // (q head of the group, query tile) pairs in one flat sequence, so the prefetch crosses heads;
  // causal: query i sees key j iff i >= j - offset: start at the tile holding the first such i
  const int q_first = p.causal ? max(0, k0 - offset) / BQ * BQ : 0;
  const int tiles = q_first < p.nq ? (p.nq - q_first + BQ - 1) / BQ : 0;
  const int total = tiles * p.groups;
  uint2 qreg[W::QUADS], doreg[W::QUADS];  // the next Q / dO tile and row constants, in flight
  float lse2_next = 0.f, dl_next = 0.f;
  auto fetch = [&](int t) {
    const int h = g * p.groups + t / tiles, q0 = q_first + t % tiles * BQ;
    fetch_quads<W::QUADS, D>(qreg, static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h, p.sq.n, q0, p.nq);
    fetch_quads<W::QUADS, D>(doreg, static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h, p.sdo.n, q0, p.nq);
    if (threadIdx.x < BQ) {
      const long long row_base = ((long long)b * p.hq + h) * p.nq;
      const int row = q0 + threadIdx.x;
      lse2_next = lse2_of(p, row_base, row);
      dl_next = row < p.nq ? p.delta[row_base + row] : 0.f;
    }
  };
  if (total > 0) fetch(0);
  for (int t = 0; t < total; ++t) {
    const int q0 = q_first + t % tiles * BQ;
    __syncthreads();  // every warp is done with the previous Q, dO tile
    store_quads<T, W::QUADS, D>(qs, qreg);
    store_quads<T, W::QUADS, D>(dos, doreg);
    if (threadIdx.x < BQ) {
      lse2s[threadIdx.x] = lse2_next;
      dls[threadIdx.x] = dl_next;
    }
    __syncthreads();

    float st[8][4], dpt[8][4];
    warp_rows_dot<T, NCG, NDS, W::NF>(st, kt, qs, r0, cg, ds);
    reduce_scatter_rows<NCG, RL>(st);
    asm volatile("" ::: "memory");  // keeps the dP^T loads after S^T: 32 accumulators live, not 64
    warp_rows_dot<T, NCG, NDS, W::NF>(dpt, vt, dos, r0, cg, ds);
    reduce_scatter_rows<NCG, RL>(dpt);
    // lane: keys k0 + r0 + ds RL + i, queries q0 + cg + NCG j
    float lse2[4], dl[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      lse2[j] = lse2s[cg + NCG * j];
      dl[j] = dls[cg + NCG * j];
    }
#pragma unroll
    for (int i = 0; i < RL; ++i) {
      const int key = k0 + r0 + ds * RL + i;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float x = fmaf(st[i][j], p.scale_log2, kb[i]);
        if (p.causal && key > q0 + cg + NCG * j + offset) x = -inf();
        st[i][j] = exp2f(x - lse2[j]);
        dpt[i][j] = st[i][j] * (dpt[i][j] - dl[j]);  // dS^T in fp32: dP - delta cancels
      }
      *reinterpret_cast<float4*>(&sts[r0 + ds * RL + i][4 * cg]) = make_float4(st[i][0], st[i][1], st[i][2], st[i][3]);
    }
    __syncwarp();
    if (t + 1 < total) fetch(t + 1);
    warp_rows_accumulate<T, NCG, W::KPH>(dv, sts, dos, r0, dg, kh);
    __syncwarp();  // the warp is done reading P^T
#pragma unroll
    for (int i = 0; i < RL; ++i)
      *reinterpret_cast<float4*>(&sts[r0 + ds * RL + i][4 * cg]) =
          make_float4(dpt[i][0], dpt[i][1], dpt[i][2], dpt[i][3]);
    __syncwarp();
    warp_rows_accumulate<T, NCG, W::KPH>(dk, sts, qs, r0, dg, kh);
    // the next write of sts follows two __syncthreads
  }

  const long long row_base = ((long long)b * (p.hq / p.groups) + g) * p.nk;
  store_warp_rows<T, D, W::NDG, W::NKH>(dk, static_cast<T*>(p.dk) + row_base * D, k0 + r0, p.nk, p.scale, dg, kh);
  store_warp_rows<T, D, W::NDG, W::NKH>(dv, static_cast<T*>(p.dv) + row_base * D, k0 + r0, p.nk, 1.f, dg, kh);
}

template <typename T, int D, int BK, int BQ>
__global__ void __launch_bounds__(kTileThreads, 1) exact_dkv_bwd_kernel(const Params p) {
  dkv_warp_rows<T, D, BK, BQ>(p);
}

}  // namespace exact
}  // namespace hfab
