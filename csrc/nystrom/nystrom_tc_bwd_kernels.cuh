// Nyström backward on tensor cores (mma.sync, sm_80+): the row statistics of K1 and the buffer gradients, the two
// query-side kernels of nystrom_bwd_kernels.cuh (same outputs, same layouts; the others stay on CUDA cores).
//
//   nystrom_stats_tc_bwd_kernel  the forward's output kernel (attend_tiles) with another epilogue: lse1 = m + log2 Σp
//                                and Δ1 = dO · out_attn per query row
//   nystrom_k1_tc_bwd_kernel     per (query split, 16 W slots, b h): partial d vals = K1ᵀ dO and d keys = dS1ᵀ q_s with
//                                dS1 = K1 ∘ (dO valsᵀ − Δ1); W = row_warps(slots) warps x 16 slots, the slots' fp32
//                                keys and values in two 16-bit halves as A operands, 64-query (D 128: 32) q and dO
//                                tiles (with lse1, Δ1) double-buffered by cp.async; Kᵀ and dS1ᵀ in two halves against
//                                exact q, dO; FUSED (one slot tile): also Δ1 and dq's buffer part √scale dS1 keys
//   nystrom_k3_tc_bwd_kernel     per (key split, 16 W landmarks, b h): partial dQ̃ = dS3 k_s, dS3 = K3 ∘ (dW0 vᵀ − rowdot);
//                                the landmarks and dW0 (fp32) staged in 16-bit halves, 64-key k and v tiles with their
//                                padding bias double-buffered by cp.async (one buffer at D 128 with four warps); dS3 in
//                                halves against exact k
//   nystrom_kv_tc_bwd_kernel     per (64 keys, kv head, b): dk, dv (one writer per row) as nystrom_kv_bwd_kernel; for
//                                landmark sequences the keys' and values' rows (exact) as A operands against each q
//                                head's landmarks and dW0 (staged in 16-bit halves, 64 at a time): K3ᵀ dW0 and
//                                dS3ᵀ Q̃ with K3, dS3 in halves against the halves (three m16n8k16 each; on sm_90a
//                                wgmma: the block's warpgroup on its 64 keys, m64n{kLand}k16 and m64nDk16)
//   nystrom_dq_tc_bwd_kernel     per (blocks per head, q head, b): the head's keys and values in 16-bit halves staged
//                                once, then every gridDim.x-th 128-query tile: dq = √scale (dS1 keys + the landmark
//                                term), dS1 in two halves against the key halves (three m16n8k16)
#pragma once

#include <cstdint>

#include "common/mma.cuh"
#include "nystrom/nystrom_bwd_kernels.cuh"
#include "nystrom/nystrom_tc_kernels.cuh"

namespace hfab {
namespace nystrom {
namespace tc {

// s (16 x 8 NT) = (a[0] + a[1]) yᵀ and dp = (a[2] + a[3]) zᵀ over D: this warp's 16 rows of the staged 16-bit halves
// a[0..3] ([.][D + 8], A fragments by ldmatrix) against rows [0, 8 NT) of the 16-bit tiles y and z (exact).
template <typename T, int D, int NT>
__device__ __forceinline__ void halves_scores(float (&s)[NT][4], float (&dp)[NT][4], const uint16_t* const (&a)[4],
                                              const uint16_t* y, const uint16_t* z, int warp, int lane) {
  constexpr int kRow = D + 8;
  const int arow = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
  const int brow = (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    uint32_t af[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) mma::ldsm_x4(af[i], a[i] + arow * kRow + 16 * kc + acol);
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
      uint32_t by[4], bz[4];
      mma::ldsm_x4(by, y + (16 * jj + brow) * kRow + 16 * kc + bcol);
      mma::ldsm_x4(bz, z + (16 * jj + brow) * kRow + 16 * kc + bcol);
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        mma::m16n8k16(s[2 * jj], af[part], {by[0], by[1]}, T());
        mma::m16n8k16(s[2 * jj + 1], af[part], {by[2], by[3]}, T());
        mma::m16n8k16(dp[2 * jj], af[2 + part], {bz[0], bz[1]}, T());
        mma::m16n8k16(dp[2 * jj + 1], af[2 + part], {bz[2], bz[3]}, T());
      }
    }
  }
}

// s (16 x 8 NT) = x (b[0] + b[1])ᵀ and dp = w (b[2] + b[3])ᵀ over D: this warp's 16 rows of the 16-bit tiles x and w
// (exact, A by ldmatrix) against rows [0, 8 NT) of the staged 16-bit halves b[0..3] ([.][D + 8]); 16-row n-tile pairs
// at or past row `valid` are skipped (left 0).
template <typename T, int D, int NT>
__device__ __forceinline__ void scores_against_halves(float (&s)[NT][4], float (&dp)[NT][4], const uint16_t* x,
                                                      const uint16_t* w, const uint16_t* const (&b)[4], int valid,
                                                      int warp, int lane) {
  constexpr int kRow = D + 8;
  const int arow = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
  const int brow = (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    uint32_t ax[4], aw[4];
    mma::ldsm_x4(ax, x + arow * kRow + 16 * kc + acol);
    mma::ldsm_x4(aw, w + arow * kRow + 16 * kc + acol);
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
      if (16 * jj >= valid) continue;
      const int off = (16 * jj + brow) * kRow + 16 * kc + bcol;
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        uint32_t bs[4], bd[4];
        mma::ldsm_x4(bs, b[part] + off);
        mma::ldsm_x4(bd, b[2 + part] + off);
        mma::m16n8k16(s[2 * jj], ax, {bs[0], bs[1]}, T());
        mma::m16n8k16(s[2 * jj + 1], ax, {bs[2], bs[3]}, T());
        mma::m16n8k16(dp[2 * jj], aw, {bd[0], bd[1]}, T());
        mma::m16n8k16(dp[2 * jj + 1], aw, {bd[2], bd[3]}, T());
      }
    }
  }
}

// Per-row powers of two for an fp32 tile x (C layout: this lane's rows g, g + 8) that halves_product is about to
// split into 16-bit halves: K3's probabilities are ~1/N, so at long N they (and dS3) fall among fp16's subnormals
// and lose their low bits (dv 4.7 ulp off at N 262,145), and large gradients could pass fp16's range. Each row of x
// is scaled by 2^e[r] so that its largest |x| stays below 2^15; e starts at kRowExpMax and only ever goes down, the
// accumulator's row following it (powers of two: exact); unscale_rows undoes e at the end.
constexpr int kRowExpMax = 64;

__device__ __forceinline__ float pow2(int e) { return __uint_as_float(static_cast<unsigned>(127 + e) << 23); }

template <int NT, int D>
__device__ __forceinline__ void scale_rows(float (&x)[NT][4], float (&acc)[D / 8][4], int (&e)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) m = fmaxf(m, fmaxf(fabsf(x[j][2 * r]), fabsf(x[j][2 * r + 1])));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the row's four lanes
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const int want = min(141 - static_cast<int>(__float_as_uint(m) >> 23), kRowExpMax);  // m < 2^(biased - 126)
    if (want < e[r]) {
      const float down = ldexpf(1.f, want - e[r]);
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        acc[dn][2 * r] *= down;
        acc[dn][2 * r + 1] *= down;
      }
      e[r] = want;
    }
    const float up = pow2(e[r]);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      x[j][2 * r] *= up;
      x[j][2 * r + 1] *= up;
    }
  }
}

template <int D>
__device__ __forceinline__ void unscale_rows(float (&acc)[D / 8][4], const int (&e)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float down = pow2(-e[r]);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      acc[dn][2 * r] *= down;
      acc[dn][2 * r + 1] *= down;
    }
  }
}

// Grid and shared memory as nystrom_out_tc_fwd_kernel. lse1 = +inf and Δ1 = 0 for a row with no valid slot.
template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kThreads, 2) nystrom_stats_tc_bwd_kernel(const BwdParams bp) {
  const Params& p = bp.p;
  const long long bh = (long long)blockIdx.z * p.hq + blockIdx.y;
  const T* dout = static_cast<const T*>(bp.dout) + bh * p.n * D;
  attend_tiles<T, D, STAGES>(p, [&](const float (&o)[D / 8][4], const float (&m)[2], const float (&l)[2], int row0) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = mma::quad_sum(l[r]);
      const int row = row0 + 8 * r;
      float dot = 0.f;
      if (row < p.n) {
        const unsigned* drow = reinterpret_cast<const unsigned*>(dout + (long long)row * D);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          const float2 x = Pair<T>::to_float2(drow[4 * dn + t]);
          dot = fmaf(x.x, o[dn][2 * r], fmaf(x.y, o[dn][2 * r + 1], dot));
        }
      }
      dot = mma::quad_sum(dot);
      if (row < p.n && t == 0) {
        bp.lse1[bh * p.n + row] = row_lse(m[r], sum);
        bp.delta1[bh * p.n + row] = sum > 0.f ? dot / sum : 0.f;
      }
    }
  });
}

// delta[j][k] = Σ over the block's slot rows of p ∘ dp at query column 8 j + 2 t + k (C layout: slot rows of this
// warp, query columns): the sum over this warp's rows by shuffles, then over the W warps through parts [W][NQ] in
// warp order (one barrier; the caller's next barrier protects parts from the next tile's writes).
template <int W, int NQ>
__device__ __forceinline__ void sum_slots(float (&delta)[NQ / 8][2], const float (&p)[NQ / 8][4],
                                          const float (&dp)[NQ / 8][4], float* parts, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float x = fmaf(p[j][k], dp[j][k], p[j][k + 2] * dp[j][k + 2]);  // rows g, g + 8
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (g == 0) parts[warp * NQ + 8 * j + 2 * t + k] = x;
    }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < NQ / 8; ++j)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float x = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) x += parts[w * NQ + 8 * j + 2 * t + k];
      delta[j][k] = x;
    }
}

// dq rows [16 rt, +16) x columns [c0, +32) of a query tile, √scale-free: dS1ᵀ (queries x slots) in 16-bit halves
// staged slot-major ([slot][queries + 8], A fragments by ldmatrix.trans) times the slots' key halves ([slot][D + 8],
// B by ldmatrix.trans), hi hi + hi lo + lo hi; 16-slot k-steps at or past `valid` skipped.
template <typename T, int D, int DS_ROW>
__device__ __forceinline__ void ds_keys(float (&acc)[4][4], const uint16_t* dhi, const uint16_t* dlo,
                                        const uint16_t* khi, const uint16_t* klo, int rt, int c0, int valid,
                                        int lane) {
  constexpr int kRow = D + 8;
  const int srow = (lane & 7) + (lane >> 4) * 8, scol = ((lane >> 3) & 1) * 8;
  const int trow = (lane & 7) + ((lane >> 3) & 1) * 8, tcol = (lane >> 4) * 8;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  for (int kc = 0; 16 * kc < valid; ++kc) {
    uint32_t ahi[4], alo[4];
    const int at = (16 * kc + srow) * DS_ROW + 16 * rt + scol;
    mma::ldsm_x4_trans(ahi, dhi + at);
    mma::ldsm_x4_trans(alo, dlo + at);
#pragma unroll
    for (int dn = 0; dn < 2; ++dn) {
      const int off = (16 * kc + trow) * kRow + c0 + 16 * dn + tcol;
      uint32_t bh[4], bl[4];
      mma::ldsm_x4_trans(bh, khi + off);
      mma::ldsm_x4_trans(bl, klo + off);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        mma::m16n8k16(acc[2 * dn + half], ahi, {bh[2 * half], bh[2 * half + 1]}, T());
        mma::m16n8k16(acc[2 * dn + half], ahi, {bl[2 * half], bl[2 * half + 1]}, T());
        mma::m16n8k16(acc[2 * dn + half], alo, {bh[2 * half], bh[2 * half + 1]}, T());
      }
    }
  }
}

// Dynamic shared memory: keys hi, lo and vals hi, lo [16 W][D + 8] T (the block's slots); 2 buffers x (q, dO)
// [kQueries][D + 8] T; 2 buffers x (lse1, Δ1) [kQueries] fp32; [W][kQueries] fp32 (each warp's part of Δ1, FUSED);
// FUSED: dS1 in hi, lo halves [16 W][kQueries + 8] T, in the q and dO tiles of the buffer just used where they fit
// (else after the rest: D 32 with four warps). 32 queries per tile at D 128 (registers: the two D-wide accumulators
// take 128).
template <int D, int W> struct K1Smem {
  static constexpr int kQueries = D == 128 ? 32 : 64;
  static constexpr int kRow = D + 8, kSlotTile = 16 * W * kRow, kQueryTile = kQueries * kRow;
  static constexpr int kDsRow = kQueries + 8, kDsTile = 16 * W * kDsRow;
  static constexpr bool kDsInQueryTile = kDsTile <= kQueryTile;
  static constexpr int bytes =
      4 * kSlotTile * 2 + 4 * kQueryTile * 2 + (4 + W) * kQueries * 4 + (kDsInQueryTile ? 0 : 2 * kDsTile * 2);
};

// Grid (splits, ceil(slots / 16 W), B Hq), 32 W threads. Queries [split * a_chunk, min(+a_chunk, N)). FUSED (one slot
// tile: slots <= 16 W, the forward's lse1): Δ1 = Σ_slots K1 ∘ dP per query is summed here, from this tile's own K1 and
// dP, and written to bp.delta1, and dq's buffer part √scale dS1 keys is written to bp.dq (every query row of the
// split, zeros for a sequence without valid slots; nystrom_segment_add_bwd_kernel adds the landmark part); else Δ1 is
// read from bp.delta1 and the dq kernel computes dq.
template <typename T, int D, int W, bool FUSED>
__global__ void __launch_bounds__(32 * W, row_blocks<W>(D == 128 ? 1 : 2))
    nystrom_k1_tc_bwd_kernel(const BwdParams bp) {
  using S = K1Smem<D, W>;
  constexpr int kThreadsW = 32 * W, kSlotsW = 16 * W;
  constexpr int kTile = S::kSlotTile, kQTile = S::kQueryTile, kQueries = S::kQueries;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* khi = reinterpret_cast<uint16_t*>(smem);
  uint16_t* klo = khi + kTile;
  uint16_t* vhi = klo + kTile;
  uint16_t* vlo = vhi + kTile;
  uint16_t* qdo = vlo + kTile;                                 // [buffer][q, dO][kQueries][D + 8]
  float* stats = reinterpret_cast<float*>(qdo + 4 * kQTile);   // [buffer][lse1, Δ1][kQueries]
  float* parts = stats + 4 * kQueries;                          // FUSED: [warp][kQueries]
  uint16_t* ds_apart = reinterpret_cast<uint16_t*>(parts + W * kQueries);  // FUSED, !kDsInQueryTile: dS1 hi, lo
  const Params& p = bp.p;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int split = blockIdx.x, s0 = blockIdx.y * kSlotsW, bh = blockIdx.z;
  const int b = bh / p.hq, h = bh % p.hq;
  const int nvalid = p.nvalid[b];
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* dout = static_cast<const T*>(bp.dout) + (long long)bh * p.n * D;
  const float scale_log2 = p.root * kLog2e;
  const int qbeg = split * bp.a_chunk, qend = FUSED || s0 < nvalid ? min(qbeg + bp.a_chunk, p.n) : qbeg;

  auto load = [&](int q0, int buf) {
    uint16_t* qt = qdo + 2 * buf * kQTile;
    auto ok = [=](int r) { return q0 + r < qend; };
    mma::load_rows_async<kQueries, D, kThreadsW>(qt, q, p.sq.n, q0, ok);
    mma::load_rows_async<kQueries, D, kThreadsW>(qt + kQTile, dout, D, q0, ok);
    float* st = stats + 2 * buf * kQueries;
    for (int c = threadIdx.x; c < kQueries; c += kThreadsW) {
      const bool in = q0 + c < qend;
      st[c] = in ? bp.lse1[(long long)bh * p.n + q0 + c] : 0.f;
      if (!FUSED) st[kQueries + c] = in ? bp.delta1[(long long)bh * p.n + q0 + c] : 0.f;
    }
  };
  if (qbeg < qend) load(qbeg, 0);
  const long long slot0 = (long long)bh * p.slots + s0;
  const int count = max(min(nvalid - s0, kSlotsW), 0);
  split_rows<T, D, kThreadsW>(p.keys + slot0 * D, count, kSlotsW, khi, klo);
  split_rows<T, D, kThreadsW>(p.vals + slot0 * D, count, kSlotsW, vhi, vlo);

  float dvals[D / 8][4], dkeys[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) dvals[dn][e] = dkeys[dn][e] = 0.f;
  const bool slot_ok[2] = {s0 + 16 * warp + g < nvalid, s0 + 16 * warp + g + 8 < nvalid};
  int dkeys_exps[2] = {kRowExpMax, kRowExpMax};
  const bool active = 16 * warp < count;  // else every slot of this warp is past the valid ones: loads and barriers
  int buf = 0;
  for (int q0 = qbeg; q0 < qend; q0 += kQueries, buf ^= 1) {
    mma::cp_async_wait_all();
    __syncthreads();  // this tile (and, at the first, the slots) is in; every warp is done with the other buffer
    if (q0 + kQueries < qend) load(q0 + kQueries, buf ^ 1);
    uint16_t* qt = qdo + 2 * buf * kQTile;
    uint16_t* dt = qt + kQTile;
    const float* lse = stats + 2 * buf * kQueries;

    float dp[kQueries / 8][4];  // dPᵀ = vals dOᵀ (slots x queries), then dS1ᵀ scaled per slot row
    if (active) {
      float s[kQueries / 8][4];  // Sᵀ = keys q_sᵀ, then K1ᵀ
      const uint16_t* const halves[4] = {khi, klo, vhi, vlo};
      halves_scores<T, D>(s, dp, halves, qt, dt, warp, lane);
#pragma unroll
      for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // slot row 16 warp + g + 8 (e / 2), query column 8 j + 2 t + e % 2
          const int c = 8 * j + 2 * t + (e & 1);
          const bool ok = slot_ok[e >> 1] && q0 + c < qend;
          s[j][e] = ok ? exp2f(fmaf(s[j][e], scale_log2, -lse[c])) : 0.f;
        }
      float delta[kQueries / 8][2];  // FUSED: Δ1 of query columns 8 j + 2 t + k
      if (FUSED) {
        sum_slots<W, kQueries>(delta, s, dp, parts, warp, lane);
        if (warp == 0 && g == 0)
#pragma unroll
          for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
            for (int k = 0; k < 2; ++k)
              if (q0 + 8 * j + 2 * t + k < qend) bp.delta1[(long long)bh * p.n + q0 + 8 * j + 2 * t + k] = delta[j][k];
      }
#pragma unroll
      for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          dp[j][e] = s[j][e] * (dp[j][e] - (FUSED ? delta[j][e & 1] : lse[kQueries + 8 * j + 2 * t + (e & 1)]));
      halves_product<T, D, kQueries / 8, false>(dvals, s, dt, nullptr, kQueries, lane);  // K1ᵀ dO
      scale_rows<kQueries / 8, D>(dp, dkeys, dkeys_exps);  // dS1 scales with dO: fp16's subnormals for a tiny dO
      halves_product<T, D, kQueries / 8, false>(dkeys, dp, qt, nullptr, kQueries, lane);  // dS1ᵀ q
    } else if (FUSED) {  // this warp's part of Δ1 is 0; the others wait for it
      for (int c = lane; c < kQueries; c += 32) parts[warp * kQueries + c] = 0.f;
      __syncthreads();
    }
    if (FUSED) {
      uint16_t* dhi = S::kDsInQueryTile ? qt : ds_apart;
      uint16_t* dlo = S::kDsInQueryTile ? dt : ds_apart + S::kDsTile;
      if (S::kDsInQueryTile) __syncthreads();  // every warp is done with this tile's q and dO: dS1 takes their place
      if (active) {
#pragma unroll
        for (int j = 0; j < kQueries / 8; ++j)
#pragma unroll
          for (int r = 0; r < 2; ++r) {  // slot row 16 warp + g + 8 r, unscaled (powers of two: exact)
            const float unscale = pow2(-dkeys_exps[r]);
            uint32_t hi, lo;
            split_pair<T>(dp[j][2 * r] * unscale, dp[j][2 * r + 1] * unscale, hi, lo);
            const int at = (16 * warp + g + 8 * r) * S::kDsRow + 8 * j + 2 * t;
            *reinterpret_cast<uint32_t*>(dhi + at) = hi;
            *reinterpret_cast<uint32_t*>(dlo + at) = lo;
          }
      }
      __syncthreads();  // dS1 of every slot is staged
      constexpr int kChunks = D / 32, kItems = kQueries / 16 * kChunks;
      for (int item = warp; item < kItems; item += W) {
        const int rt = item / kChunks, c0 = 32 * (item % kChunks);
        float acc[4][4];
        ds_keys<T, D, S::kDsRow>(acc, dhi, dlo, khi, klo, rt, c0, count, lane);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = q0 + 16 * rt + g + 8 * r;
          if (row >= qend) continue;
          unsigned* dst = reinterpret_cast<unsigned*>(static_cast<T*>(bp.dq) + ((long long)bh * p.n + row) * D + c0);
#pragma unroll
          for (int j = 0; j < 4; ++j)  // q_s = q √scale
            dst[4 * j + t] = Pair<T>::from_float2(make_float2(acc[j][2 * r] * p.root, acc[j][2 * r + 1] * p.root));
        }
      }
    }
  }
  unscale_rows<D>(dkeys, dkeys_exps);

  const long long slab = (long long)split * gridDim.z + bh;  // (split, b h) slab of slots rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = s0 + 16 * warp + g + 8 * r;
    if (row >= p.slots) continue;
    float2* dv = reinterpret_cast<float2*>(bp.part_dvals + (slab * p.slots + row) * D);
    float2* dk = reinterpret_cast<float2*>(bp.part_dkeys + (slab * p.slots + row) * D);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      dv[4 * dn + t] = make_float2(dvals[dn][2 * r], dvals[dn][2 * r + 1]);
      dk[4 * dn + t] = make_float2(dkeys[dn][2 * r] * p.root, dkeys[dn][2 * r + 1] * p.root);  // q_s = q √scale
    }
  }
}

// Dynamic shared memory of the k3 kernel: landmarks hi, lo and dW0 hi, lo [16 W][D + 8] T; 2 buffers x (k, v)
// [64][D + 8] T; 2 buffers x the keys' padding bias [64] fp32.
// Dynamic shared memory of K3's backward: landmarks hi, lo and dW0 hi, lo [16 W][D + 8] T; k, v [kStages][64][D + 8]
// T; the key bias [2][64] fp32. Two k/v stages (the next tile's copy in flight during this one) except at D 128 with
// four warps, where the second would take 35 KB and one of the two blocks an SM holds (139 against 104 KB).
template <int D, int W> struct K3BwdSmem {
  static constexpr int kRow = D + 8, kLandTile = 16 * W * kRow, kTile = kK3Keys * kRow;
  static constexpr int kStages = D == 128 && W == 4 ? 1 : 2;
  static constexpr int bytes = 4 * kLandTile * 2 + 2 * kStages * kTile * 2 + 2 * kK3Keys * 4;
};

// Grid (splits, ceil(m / 16 W), B Hq), 32 W threads. Keys [split * b_chunk, min(+b_chunk, N)); exact sequences write
// zeros.
template <typename T, int D, int W>
__global__ void __launch_bounds__(32 * W, row_blocks<W>(D == 128 ? 1 : 2))
    nystrom_k3_tc_bwd_kernel(const BwdParams bp) {
  using S = K3BwdSmem<D, W>;
  constexpr int kTile = S::kTile, kLandTile = S::kLandTile, kThreadsW = 32 * W, kRowsW = 16 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* lhi = reinterpret_cast<uint16_t*>(smem);
  uint16_t* llo = lhi + kLandTile;
  uint16_t* whi = llo + kLandTile;
  uint16_t* wlo = whi + kLandTile;
  uint16_t* tiles = wlo + kLandTile;                                      // [buffer][k, v][64][D + 8]
  float* bias = reinterpret_cast<float*>(tiles + 2 * S::kStages * kTile);  // [buffer][64]
  const Params& p = bp.p;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int split = blockIdx.x, l0 = blockIdx.y * kRowsW, bh = blockIdx.z;
  const int b = bh / p.hq, h = bh % p.hq, kvh = h / p.groups;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + kvh * p.sv.h;
  const float scale_log2 = p.root * kLog2e;  // landmarks carry √scale, keys not yet
  const int kbeg = split * bp.b_chunk, kend = bp.exact[b] ? kbeg : min(kbeg + bp.b_chunk, p.n);

  auto load = [&](int k0, int buf) {
    uint16_t* kt = tiles + 2 * buf * kTile;
    auto ok = [=](int r) { return k0 + r < kend; };
    mma::load_rows_async<kK3Keys, D, kThreadsW>(kt, k, p.sk.n, k0, ok);
    mma::load_rows_async<kK3Keys, D, kThreadsW>(kt + kTile, v, p.sv.n, k0, ok);
    for (int c = threadIdx.x; c < kK3Keys; c += kThreadsW) {
      const int j = k0 + c;
      const bool real = j < kend && (p.mask == nullptr || p.mask[b * p.mask_stride + j]);
      bias[buf * kK3Keys + c] = real ? 0.f : -inf();
    }
  };
  if (kbeg < kend) load(kbeg, 0);
  const long long land0 = (long long)bh * p.m + l0;
  const int count = max(min(p.m - l0, kRowsW), 0);
  split_rows<T, D, kThreadsW>(p.q_land + land0 * D, count, kRowsW, lhi, llo);
  split_rows<T, D, kThreadsW>(bp.dw0 + land0 * D, count, kRowsW, whi, wlo);
  float lse[2], rd[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = l0 + 16 * warp + g + 8 * r;
    lse[r] = row < p.m ? bp.lse3[(long long)bh * p.m + row] : 0.f;
    rd[r] = row < p.m ? bp.rowdot[(long long)bh * p.m + row] : 0.f;
  }
  float acc[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.f;
  int exps[2] = {kRowExpMax, kRowExpMax};
  const bool active = 16 * warp < count;  // else every row of this warp is past m: loads and barriers only
  int buf = 0;
  for (int k0 = kbeg; k0 < kend; k0 += kK3Keys, buf ^= S::kStages - 1) {
    if (S::kStages == 1 && k0 != kbeg) {
      __syncthreads();  // every warp is done with the last tile
      load(k0, 0);
    }
    mma::cp_async_wait_all();
    __syncthreads();  // this tile (and, at the first, the staged rows) is in; every warp is done with the other buffer
    if (S::kStages == 2 && k0 + kK3Keys < kend) load(k0 + kK3Keys, buf ^ 1);
    if (!active) continue;
    const uint16_t* kt = tiles + 2 * buf * kTile;
    const uint16_t* vt = kt + kTile;
    const float* bt = bias + buf * kK3Keys;
    float s[kK3Keys / 8][4], dp[kK3Keys / 8][4];  // S3 = Q̃ kᵀ, dP3 = dW0 vᵀ (landmarks x keys)
    const uint16_t* const halves[4] = {lhi, llo, whi, wlo};
    halves_scores<T, D>(s, dp, halves, kt, vt, warp, lane);
#pragma unroll
    for (int j = 0; j < kK3Keys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // landmark row g + 8 (e / 2), key column 8 j + 2 t + e % 2
        const float pr = exp2f(fmaf(s[j][e], scale_log2, bt[8 * j + 2 * t + (e & 1)]) - lse[e >> 1]);
        dp[j][e] = pr * (dp[j][e] - rd[e >> 1]);
      }
    scale_rows<kK3Keys / 8, D>(dp, acc, exps);
    halves_product<T, D, kK3Keys / 8, false>(acc, dp, kt, nullptr, kK3Keys, lane);  // dS3 k
  }
  unscale_rows<D>(acc, exps);

  const long long slab = (long long)split * gridDim.z + bh;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = l0 + 16 * warp + g + 8 * r;
    if (row >= p.m) continue;
    float2* dst = reinterpret_cast<float2*>(bp.part_dql + (slab * p.m + row) * D);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)  // k_s = k √scale
      dst[4 * dn + t] = make_float2(acc[dn][2 * r] * p.root, acc[dn][2 * r + 1] * p.root);
  }
}

// Dynamic shared memory of the dk/dv kernel: k, v [kStages][64][D + 8] T (the block's key tiles: two stages, the next
// tile's copy in flight during this one, where two blocks still fit an SM; else one, the next tile's copy in flight
// during this one's stores); landmarks hi, lo and dW0 hi, lo [kStage][D + 8] T; lse3, rowdot [kStage] fp32 (the
// wgmma path: the same tiles in core matrices, rows D apart, within the same bytes). RESIDENT: every landmark row of
// the group's q heads, staged once per block (64 rows: resident_kv_fits); else one tile of kLand landmarks at
// a time, restaged per key tile. kLand is what one pass computes (LAND): 32 at D 128, where the two D-wide fp32
// accumulators take 128 registers, else 64 (or 32: resident_kv_land).
template <int D, bool RESIDENT, int LAND = (D == 128 ? 32 : 64)> struct KvSmem {
  static constexpr int kLand = LAND;
  static constexpr int kStage = RESIDENT ? 64 : kLand;
  static constexpr int kStages = D == 128 ? 1 : 2;
  static constexpr int kRow = D + 8, kKeyTile = kK3Keys * kRow;
  static constexpr int bytes = 2 * kStages * kKeyTile * 2 + 4 * kStage * kRow * 2 + 2 * kStage * 4;
};

// kLand of the resident dk/dv kernel for m landmarks: 32 where m <= 32 at D <= 64 (the scores of a pass take half
// the registers: three blocks per SM instead of two), else KvSmem's.
template <int D> constexpr int resident_kv_land(int m) { return D < 128 && m <= 32 ? 32 : KvSmem<D, true>::kLand; }

// Whether the group's landmarks stay resident in the dk/dv kernel: each q head takes m rows rounded up to whole passes
// (resident_kv_land), so that every pass reads rows [at, at + kLand) within the stage, zero past m, and the wgmma
// products run whole passes without a branch (a branch between them makes ptxas serialise every wgmma).
template <int D> constexpr bool resident_kv_fits(int groups, int m) {
  const int land = resident_kv_land<D>(m);
  return groups * ((m + land - 1) / land * land) <= KvSmem<D, true>::kStage;
}

// Landmark rows [l0, l0 + count) of head bh (Q̃ and dW0 split into 16-bit halves, lse3, rowdot) into stage rows
// [at, at + rows), rows >= count zero; CORE: the halves in core matrices (mma::core_at; at a multiple of 8).
template <typename T, int D, bool CORE>
__device__ __forceinline__ void stage_landmarks(const BwdParams& bp, long long bh, int l0, int count, int rows, int at,
                                                uint16_t* const (&halves)[4], float* lse, float* rd) {
  const Params& p = bp.p;
  const int off = at * (CORE ? D : D + 8);
  split_rows<T, D, kK3Threads, CORE>(p.q_land + (bh * p.m + l0) * D, count, rows, halves[0] + off, halves[1] + off);
  split_rows<T, D, kK3Threads, CORE>(bp.dw0 + (bh * p.m + l0) * D, count, rows, halves[2] + off, halves[3] + off);
  for (int c = threadIdx.x; c < rows; c += kK3Threads) {
    lse[at + c] = c < count ? bp.lse3[bh * p.m + l0 + c] : 0.f;
    rd[at + c] = c < count ? bp.rowdot[bh * p.m + l0 + c] : 0.f;
  }
}

// s = k (Q̃ hi + lo)ᵀ and dp = v (dW0 hi + lo)ᵀ by wgmma: the block's 64 key rows (kt, vt: core matrices) against
// the stage's landmark rows [0, N) (tile: Q̃ hi, lo, dW0 hi, lo in core matrices).
template <typename T, int D, int N>
__device__ __forceinline__ void landmark_scores_wg(float (&s)[N / 8][4], float (&dp)[N / 8][4], const uint16_t* kt,
                                                   const uint16_t* vt, const uint16_t* const (&tile)[4]) {
  zero(s);
  zero(dp);
  wgmma::fence();
  issue_times_halves<T, D, N>(s, kt, tile[0], tile[1]);
  issue_times_halves<T, D, N>(dp, vt, tile[2], tile[3]);
  wgmma::commit_group();
  wgmma::wait_group<0>();
}

// Key rows j, j + 8 (< N) of this lane's C-layout accumulators dk, dv (columns 8 dn + 2 t, + 1): the rest of their
// gradients added (key_row_gradients), then dk √scale and dv stored.
template <typename T, int D>
__device__ __forceinline__ void store_key_rows(const BwdParams& bp, int b, int kvh, int j, bool landmark,
                                               const float (&dk)[D / 8][4], const float (&dv)[D / 8][4], int t) {
  const Params& p = bp.p;
  const long long bg = (long long)b * p.hkv + kvh;
#pragma unroll
  for (int r = 0; r < 2; ++r, j += 8) {
    if (j >= p.n) continue;
    int cols[D / 8];
    float2 gk[D / 8], gv[D / 8];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      cols[dn] = 4 * dn + t;
      gk[dn] = make_float2(dk[dn][2 * r], dk[dn][2 * r + 1]);
      gv[dn] = make_float2(dv[dn][2 * r], dv[dn][2 * r + 1]);
    }
    key_row_gradients<T, D>(bp, b, kvh, j, landmark, cols, gk, gv);
    unsigned* dkrow = reinterpret_cast<unsigned*>(static_cast<T*>(bp.dk) + (bg * p.n + j) * D);
    unsigned* dvrow = reinterpret_cast<unsigned*>(static_cast<T*>(bp.dv) + (bg * p.n + j) * D);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {  // k_s = k √scale
      dkrow[4 * dn + t] = Pair<T>::from_float2(make_float2(gk[dn].x * p.root, gk[dn].y * p.root));
      dvrow[4 * dn + t] = Pair<T>::from_float2(gv[dn]);
    }
  }
}

// Grid (splits, Hkv, B), 128 threads: block x takes the keys [x · kv_chunk, (x + 1) · kv_chunk) in tiles of 64;
// RESIDENT only where resident_kv_fits(groups, m). Built for sm_90a (HFAB_HAS_WGMMA) the block is one warpgroup and the
// products run on wgmma (the 64 key rows as M, scores N = kLand, products N = D) from tiles in core matrices; the
// accumulators keep mma.sync's layout per warp, so everything between the products is shared.
template <typename T, int D, bool RESIDENT, int LAND = KvSmem<D, RESIDENT>::kLand>
__global__ void __launch_bounds__(kK3Threads, D == 128 ? 1 : LAND == 32 ? 3 : 2) nystrom_kv_tc_bwd_kernel(const BwdParams bp) {
  using S = KvSmem<D, RESIDENT, LAND>;
  constexpr int kLand = S::kLand, kStages = S::kStages, STAGE = S::kStage;
  constexpr int kRow = kWgmma ? D : S::kRow, kKeyTile = kK3Keys * kRow;  // elements per tile row (core: no padding)
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* const kv = reinterpret_cast<uint16_t*>(smem);  // stage s: k at 2 s kKeyTile, v at (2 s + 1) kKeyTile
  uint16_t* const lhi = kv + 2 * kStages * kKeyTile;
  uint16_t* const halves[4] = {lhi, lhi + STAGE * kRow, lhi + 2 * STAGE * kRow, lhi + 3 * STAGE * kRow};
  float* const lse = reinterpret_cast<float*>(lhi + 4 * STAGE * kRow);
  float* const rd = lse + STAGE;
  const Params& p = bp.p;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int kvh = blockIdx.y, b = blockIdx.z, n = p.n;
  const int first = blockIdx.x * bp.kv_chunk, last = min(n, first + bp.kv_chunk);
  const bool landmark = bp.landmarks && !bp.exact[b];
  const int per_head = (p.m + kLand - 1) / kLand * kLand;  // resident rows per q head: whole passes
  const float scale_log2 = p.root * kLog2e;
  const auto load_keys = [&](int j0, int stage) {
    const auto ok = [=](int r) { return j0 + r < n; };
    uint16_t* kt = kv + 2 * stage * kKeyTile;
    mma::load_rows_async<kK3Keys, D, kK3Threads, false, kWgmma>(
        kt, static_cast<const T*>(p.k) + b * p.sk.b + kvh * p.sk.h, p.sk.n, j0, ok);
    mma::load_rows_async<kK3Keys, D, kK3Threads, false, kWgmma>(
        kt + kKeyTile, static_cast<const T*>(p.v) + b * p.sv.b + kvh * p.sv.h, p.sv.n, j0, ok);
  };
  if (landmark && first < last) load_keys(first, 0);  // in flight while the landmarks are staged
  if (landmark && RESIDENT) {
    for (int hi = 0; hi < p.groups; ++hi)
      stage_landmarks<T, D, kWgmma>(bp, (long long)b * p.hq + kvh * p.groups + hi, 0, p.m, per_head, hi * per_head,
                                 halves, lse, rd);
  }

#pragma unroll 1
  for (int j0 = first, it = 0; j0 < last; j0 += kK3Keys, ++it) {
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[dn][e] = dv[dn][e] = 0.f;
    if (landmark) {
      const int stage = kStages == 2 ? it & 1 : 0;
      const bool ahead = kStages == 2 && j0 + kK3Keys < last;
      if (kStages == 2) {
        __syncthreads();  // the readers of the stage loaded next are done
        if (ahead) load_keys(j0 + kK3Keys, stage ^ 1);
      }
      const auto wait_for_tile = [ahead] {  // this tile's k and v, not the next one's
        if (ahead) mma::cp_async_wait_prior<2>();
        else mma::cp_async_wait_all();
        if constexpr (kWgmma) wgmma::fence_shared_for_async();  // this thread's copies and stores, for the products
      };
      if (RESIDENT) {
        wait_for_tile();
        __syncthreads();
      }
      const uint16_t* kt = kv + 2 * stage * kKeyTile;
      const uint16_t* vt = kt + kKeyTile;
      float bias[2];  // 0 / -inf for this lane's key rows g, g + 8
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = j0 + 16 * warp + g + 8 * r;
        bias[r] = j < n && (p.mask == nullptr || p.mask[b * p.mask_stride + j]) ? 0.f : -inf();
      }
      int dk_exps[2] = {kRowExpMax, kRowExpMax}, dv_exps[2] = {kRowExpMax, kRowExpMax};
      for (int hi = 0; hi < p.groups; ++hi) {  // the group's q heads in a fixed order
        const long long bh = (long long)b * p.hq + kvh * p.groups + hi;
        for (int l0 = 0; l0 < p.m; l0 += kLand) {
          const int count = min(p.m - l0, kLand);
          if (!RESIDENT) {
            __syncthreads();  // the previous tile's readers are done
            stage_landmarks<T, D, kWgmma>(bp, bh, l0, count, kLand, 0, halves, lse, rd);
            wait_for_tile();
            __syncthreads();
          }
          const int at = RESIDENT ? hi * per_head + l0 : 0;
          const uint16_t* const tile[4] = {halves[0] + at * kRow, halves[1] + at * kRow, halves[2] + at * kRow,
                                           halves[3] + at * kRow};
          float s[kLand / 8][4], dp[kLand / 8][4];  // S3ᵀ = k Q̃ᵀ, dP3ᵀ = v dW0ᵀ (keys x landmarks)
          if constexpr (kWgmma) {
            landmark_scores_wg<T, D, kLand>(s, dp, kt, vt, tile);
          } else {
            scores_against_halves<T, D>(s, dp, kt, vt, tile, count, warp, lane);
          }
#pragma unroll
          for (int c = 0; c < kLand / 8; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // key row g + 8 (e / 2), landmark column 8 c + 2 t + e % 2
              const int col = 8 * c + 2 * t + (e & 1);
              const bool in = col < count;  // past it the stage rows belong to the next head, or to nothing
              const float pr = in ? exp2f(fmaf(s[c][e], scale_log2, bias[e >> 1]) - lse[at + col]) : 0.f;
              s[c][e] = pr;
              dp[c][e] = in ? pr * (dp[c][e] - rd[at + col]) : 0.f;
            }
          scale_rows<kLand / 8, D>(s, dv, dv_exps);
          scale_rows<kLand / 8, D>(dp, dk, dk_exps);
          if constexpr (kWgmma) {
            halves_product_wg<T, D, kLand / 8, true>(dv, s, tile[2], tile[3]);  // K3ᵀ dW0
            halves_product_wg<T, D, kLand / 8, true>(dk, dp, tile[0], tile[1]);  // dS3ᵀ Q̃
          } else {
            halves_product<T, D, kLand / 8, true>(dv, s, tile[2], tile[3], count, lane);
            halves_product<T, D, kLand / 8, true>(dk, dp, tile[0], tile[1], count, lane);
          }
        }
      }
      unscale_rows<D>(dv, dv_exps);
      unscale_rows<D>(dk, dk_exps);
      if (kStages == 1 && j0 + kK3Keys < last) {  // the next tile loads during this one's stores
        __syncthreads();
        load_keys(j0 + kK3Keys, 0);
      }
    }
    store_key_rows<T, D>(bp, b, kvh, j0 + 16 * warp + g, landmark, dk, dv, t);
  }
}

// Dynamic shared memory of the dq kernel for `slots` buffer rows (padded to 16): keys hi, lo and vals hi, lo
// [rows][D + 8] T, then the q and dO tiles [kBQ][D + 8] T.
template <int D> struct DqSmem {
  static constexpr int kRow = D + 8;
  static __host__ __device__ int rows(int slots) { return (slots + 15) / 16 * 16; }
  static __host__ __device__ int bytes(int slots, int stages = 1) {
    return 4 * rows(slots) * kRow * 2 + 2 * stages * kBQ * kRow * 2;
  }
};

// Grid (blocks per head, Hq, B) as the output kernel, 256 threads; STAGES as attend_tiles (q and dO tiles).
template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kThreads, D == 32 ? 2 : 1) nystrom_dq_tc_bwd_kernel(const BwdParams bp) {
  using S = DqSmem<D>;
  constexpr int kRow = S::kRow;
  extern __shared__ __align__(16) unsigned char smem[];
  const Params& p = bp.p;
  const int tiles = (p.n + kBQ - 1) / kBQ;
  if (static_cast<int>(blockIdx.x) >= tiles) return;
  const int h = blockIdx.y, b = blockIdx.z;
  const long long bh = (long long)b * p.hq + h;
  const int nvalid = p.nvalid[b], rows = S::rows(p.slots);
  uint16_t* khi = reinterpret_cast<uint16_t*>(smem);
  uint16_t* klo = khi + rows * kRow;
  uint16_t* vhi = klo + rows * kRow;
  uint16_t* vlo = vhi + rows * kRow;
  uint16_t* qdo = vlo + rows * kRow;  // [stage][q, dO][kBQ][D + 8]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* dout = static_cast<const T*>(bp.dout) + bh * p.n * D;
  const float scale_log2 = p.root * kLog2e;
  const int n = p.n;
  const auto load = [&](int at, int buf) {
    const int r0 = at * kBQ;
    uint16_t* qt = qdo + 2 * buf * kBQ * kRow;
    mma::load_rows_async<kBQ, D, kThreads>(qt, q, p.sq.n, r0, [=](int r) { return r0 + r < n; });
    mma::load_rows_async<kBQ, D, kThreads>(qt + kBQ * kRow, dout, D, r0, [=](int r) { return r0 + r < n; });
  };
  if (STAGES == 2) load(blockIdx.x, 0);
  split_rows<T, D, kThreads>(p.keys + bh * p.slots * D, nvalid, rows, khi, klo);
  split_rows<T, D, kThreads>(p.vals + bh * p.slots * D, nvalid, rows, vhi, vlo);
  const bool landmark = bp.landmarks && !bp.exact[b];
  for (int tile = blockIdx.x, buf = 0; tile < tiles; tile += gridDim.x, buf ^= STAGES - 1) {
    const int q0 = tile * kBQ;
    if (STAGES == 1) {
      __syncthreads();  // the previous tile's readers are done (at the first: the staged buffer is written)
      load(tile, 0);
    }
    float lse[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q0 + 16 * warp + g + 8 * r;
      lse[r] = row < n ? bp.lse1[bh * n + row] : 0.f;
      delta[r] = row < n ? bp.delta1[bh * n + row] : 0.f;
    }
    mma::cp_async_wait_all();
    __syncthreads();  // this tile is in; STAGES 2: every warp is done with the other stage (and the buffer written)
    if (STAGES == 2 && tile + static_cast<int>(gridDim.x) < tiles) load(tile + gridDim.x, buf ^ 1);
    const uint16_t* qs = qdo + 2 * buf * kBQ * kRow;
    const uint16_t* dos = qs + kBQ * kRow;

    float acc[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) acc[dn][0] = acc[dn][1] = acc[dn][2] = acc[dn][3] = 0.f;
    for (int c0 = 0; c0 < nvalid; c0 += kChunk) {
      float s[kChunk / 8][4], dp[kChunk / 8][4];  // S = q keysᵀ, dP = dO valsᵀ (queries x slots)
      const uint16_t* const halves[4] = {khi + c0 * kRow, klo + c0 * kRow, vhi + c0 * kRow, vlo + c0 * kRow};
      scores_against_halves<T, D>(s, dp, qs, dos, halves, nvalid - c0, warp, lane);
#pragma unroll
      for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // row g + 8 (e / 2), slot c0 + 8 j + 2 t + e % 2
          const bool ok = c0 + 8 * j + 2 * t + (e & 1) < nvalid;
          const float pr = ok ? exp2f(fmaf(s[j][e], scale_log2, -lse[e >> 1])) : 0.f;
          dp[j][e] = pr * (dp[j][e] - delta[e >> 1]);
        }
      halves_product<T, D, kChunk / 8, true>(acc, dp, khi + c0 * kRow, klo + c0 * kRow, nvalid - c0,
                                             lane);  // dS1 keys
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = q0 + 16 * warp + g + 8 * r;
      if (row >= n) continue;
      float2 res[D / 8];
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) res[dn] = make_float2(acc[dn][2 * r], acc[dn][2 * r + 1]);
      const int rank = landmark ? real_rank(bp, b, row) : -1;
      if (rank >= 0) {  // a real token of a landmark sequence: its landmark query's gradient
        int lt;
        const float share = segment_share(p, b, rank, lt);
        const float* dql = bp.dql + (bh * p.m + lt) * D;
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) add_row(res[dn], dql, 4 * dn + t, share);
      }
      unsigned* dst = reinterpret_cast<unsigned*>(static_cast<T*>(bp.dq) + (bh * n + row) * D);
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn)  // q_s = q √scale
        dst[4 * dn + t] = Pair<T>::from_float2(make_float2(res[dn].x * p.root, res[dn].y * p.root));
    }
  }
}

}  // namespace tc
}  // namespace nystrom
}  // namespace hfab
