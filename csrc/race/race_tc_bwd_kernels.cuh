// RACE backward on tensor cores (mma.sync, sm_80+) for fp16/bf16 inputs and S = L * 2^P <= 64.
//
// dq side:
//
// race_group_dq_bwd_kernel walks the key chunks of one group (causal; non-causal: the query tiles of one
// group) in order, as race_group_out_fwd_kernel does, with the group's prefix state [A, z] (from
// race_group_state_fwd_kernel + the group scan) in shared memory. Per query tile (rows i, dO_i, den_i):
//   den_i       = phi(q_i) . z + sum_j s_ij                (s_ij = phi(q_i) . phi(k_j), j <= i: the chunk's scores)
//   c^_i        = dO_i . num_i / den_i = (phi(q_i) . (A dO_i) + sum_j s_ij (dO_i . v_j)) / den_i
//                                                           (c_i = G_i . O_i = c^_i / den_i, saved with den_i)
//   ds'_ij      = dO_i . v_j - c^_i  over j <= i           (= den_i d a_ij: well scaled for 16-bit operands)
//   dphi(q_i)   = (dO_i A^T - c^_i z + sum_j ds'_ij phi(k_j)) / den_i
//   g = dphi * phi(q) (fp32 phi), w per table and plane, dq = sum_lt 2 beta w (1 - u^2) W_lt, dbeta partial.
// Operand precision: dO_i A^T in tf32 with dO exact (fp16/bf16 are tf32 subsets) and A split in two tf32
// halves; ds' = dO v^T on T operands (exact products, fp32 sums); sum_j ds' phi(k) with ds' scaled per row
// by a power of two (row max in [1, 2): fp16 keeps its bits when dO is tiny) and split in two T halves,
// phi(k) in two T halves (the forward's pkt). c^ z in fp32 on CUDA cores. num is never formed: c^ takes A dO_i from
// dO_i A^T (the product dphi(q) needs anyway) and dO_i . v_j from ds', dotted with fp32 phi(q) and the fp32-accurate
// scores on CUDA cores, so c^ and dphi(q) share their operands (with the forward's fp16 phi and tf32 state, c^ missed
// the exact cancellation sum_j a_ij (G_i . v_j - c_i) = 0 by ~1e-4 relative, and dbeta, both sides, with it).
// No atomics.
//
// Key side (dk, dv, the k-side dbeta; section "Key side" below, reads den and c written by the dq side):
//   race_group_qstate_bwd_kernel  per (group, q head): sum phi(q) / den [dO, c den]^T over the group's query tiles
//   race_scan_fwd_kernel          reverse: slot grp + 1 = the groups after grp (race_kernels.cuh)
//   race_group_dkv_bwd_kernel     per (key-chunk group, kv head): q heads in order, chunks in reverse order: dv,
//                                 dphi(k), dk, dbeta partial; then state += the chunk's query tile
// Where tc_key_side_applies is false (shared memory) the CUDA-core race_dkv_bwd_kernel path takes dk, dv.
#pragma once

#include "race/race_tc_kernels.cuh"

namespace hfab {
namespace race {
namespace tc {

// Row stride (floats) of the g tile, and of warp_chain_factors' da in the same storage: each warp's da rows lie
// within its own g rows, so a warp writes them while another still reads its g rows.
constexpr int kGRow = kS + 1;

// The dq kernel's shared memory: the forward's Tiles, then dO, u, the w table and per-row values; the g
// tile (fp32 [64][65]) reuses phq + phk, the w table reuses the x tile where it fits (D >= 64).
template <typename T, int D>
struct BwdTiles {
  using Fwd = Tiles<T, D>;
  static constexpr int kX = D + 8;
  static constexpr int kG = kGRow;
  static constexpr int table_bytes = kC * kLPMax * 4;
  static constexpr bool w_in_x = Fwd::x_bytes >= table_bytes;
  static constexpr int do_off = Fwd::bytes;                  // T dO [64][D + 8]
  static constexpr int u_off = do_off + kC * kX * 2;         // fp32 u [64][L * P]
  static constexpr int wt_off = u_off + table_bytes;         // fp32 w [64][L * P] (unless in x)
  static constexpr int row_off = wt_off + (w_in_x ? 0 : table_bytes);
  static constexpr int bytes = row_off + 3 * kC * 4;         // c^, 1 / den, dbeta terms per row
  static_assert(Fwd::phq_off + kC * kG * 4 <= Fwd::pkt_off, "the g tile fits phq + phk");
  static_assert(do_off % 16 == 0 && u_off % 16 == 0 && wt_off % 16 == 0, "16-byte aligned tiles");

  T* dO;
  float *u, *w, *g, *chat, *inv, *rowpart;

  __device__ explicit BwdTiles(char* base)
      : dO(reinterpret_cast<T*>(base + do_off)),
        u(reinterpret_cast<float*>(base + u_off)),
        w(reinterpret_cast<float*>(base + (w_in_x ? 0 : wt_off))),
        g(reinterpret_cast<float*>(base + Fwd::phq_off)),
        chat(reinterpret_cast<float*>(base + row_off)),
        inv(chat + kC),
        rowpart(inv + kC) {}
};

// phi_s of row r in fp32 from the sigma tables (as `features`).
__device__ __forceinline__ float phi_at(const Params& p, const float* sp, const float* sm, int r, int s) {
  const int P = p.planes_per_table, l = s >> P, bucket = s & ((1 << P) - 1);
  const float* pos = sp + r * kLPMax + l * P;
  const float* neg = sm + r * kLPMax + l * P;
  float val = 1.f;
  for (int t = 0; t < P; ++t) val *= ((bucket >> (P - 1 - t)) & 1) ? pos[t] : neg[t];
  return val;
}

// tf32 B fragment (two halves) of the fp32 state tile st [feature][D + 8]: k = features 8 kk.., n = columns 8 n..
__device__ __forceinline__ void state_frag(const float* st, int kX, int kk, int n, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const float* col = st + (kk * 8 + t) * kX + n * 8 + g;
  mma::tf32_split(col[0], hi[0], lo[0]);
  mma::tf32_split(col[4 * kX], hi[1], lo[1]);
}

// tf32 A fragment (two halves) of phi(row) * scale[row] (fp32 from the sigma tables) for k-step kk. ROWS_M: m = rows
// m0.., k = features 8 kk..; else m = features m0.., k = rows 8 kk... 0 for features >= S, rows with ok = 0.
template <bool ROWS_M>
__device__ __forceinline__ void phi_frag(const Params& p, const float* sp, const float* sm, const int* ok,
                                         const float* scale, int m0, int kk, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // A register r: m g + 8 (r % 2), k t + 4 (r / 2)
    const int mi = m0 + g + 8 * (r % 2), ki = kk * 8 + t + 4 * (r / 2);
    const int row = ROWS_M ? mi : ki, f = ROWS_M ? ki : mi;
    float val = 0.f;
    if (f < p.features && (ok == nullptr || ok[row]))
      val = phi_at(p, sp, sm, row, f) * (scale == nullptr ? 1.f : scale[row]);
    mma::tf32_split(val, hi[r], lo[r]);
  }
}

// phi_frag read from an fp32 phi tile [64][kS + 1] (`features` wrote it: zeros for features >= S and rows with
// ok = 0) instead of rebuilt from the sigma tables: the same values, bit for bit.
template <bool ROWS_M>
__device__ __forceinline__ void phi_frag_tile(const float* phi32, const float* scale, int m0, int kk,
                                              uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int r = 0; r < 4; ++r) {  // A register r: m g + 8 (r % 2), k t + 4 (r / 2)
    const int mi = m0 + g + 8 * (r % 2), ki = kk * 8 + t + 4 * (r / 2);
    const int row = ROWS_M ? mi : ki, f = ROWS_M ? ki : mi;
    mma::tf32_split(phi32[row * (kS + 1) + f] * (scale == nullptr ? 1.f : scale[row]), hi[r], lo[r]);
  }
}

// acc[n] += rows x st^T over D for the feature n-tiles n < nf: the warp's 16 rows of a T tile [64][D + 8] (exact in
// tf32) times the state tile st [feature][D + 8] in two tf32 halves (dq: dO A^T; key side: v B^T).
template <typename T, int D>
__device__ __forceinline__ void rows_times_state(const T* rows, const float* st, int nf, float (&acc)[kS / 8][4]) {
  constexpr int kX = D + 8;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int kk = 0; kk < D / 8; ++kk) {
    const T* base = rows + (r0 + g) * kX + kk * 8 + t;
    const uint32_t a[4] = {__float_as_uint(to_float(base[0])), __float_as_uint(to_float(base[8 * kX])),
                           __float_as_uint(to_float(base[4])), __float_as_uint(to_float(base[8 * kX + 4]))};
#pragma unroll
    for (int n = 0; n < kS / 8; ++n) {
      if (n >= nf) continue;
      const float* row = st + (n * 8 + g) * kX + kk * 8 + t;
      uint32_t hi[2], lo[2];
      mma::tf32_split(row[0], hi[0], lo[0]);
      mma::tf32_split(row[4], hi[1], lo[1]);
      mma::m16n8k8_tf32(acc[n], a, hi);
      mma::m16n8k8_tf32(acc[n], a, lo);
    }
  }
}

// acc[n] += a b^T over D on T operands (exact products, fp32 sums): the warp's 16 rows of a (T tile [64][D + 8])
// times rows [8n, 8n + 8) of b, a T tile [64][D + 8] or, B_T, its transpose [D][kT] (dq: dO v^T; key side: v dO^T).
template <typename T, int D, bool B_T = false>
__device__ __forceinline__ void rows_dot(const T* a, const T* b, float (&acc)[kC / 8][4]) {
  constexpr int kX = D + 8;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    const T* base = a + (r0 + g) * kX + k0 + 2 * t;
    const uint32_t ar[4] = {mma::ld32(base), mma::ld32(base + 8 * kX), mma::ld32(base + 8), mma::ld32(base + 8 * kX + 8)};
#pragma unroll
    for (int n = 0; n < kC / 8; ++n) {
      uint32_t br[2];
      if (B_T) {  // B register e: k = k0 + 2t + 8e and the next, n = 8n + g
        const T* col = b + (k0 + 2 * t) * kT + n * 8 + g;
        br[0] = mma::pack2<T>(to_float(col[0]), to_float(col[kT]));
        br[1] = mma::pack2<T>(to_float(col[8 * kT]), to_float(col[9 * kT]));
      } else {
        const T* brow = b + (n * 8 + g) * kX + k0 + 2 * t;
        br[0] = mma::ld32(brow);
        br[1] = mma::ld32(brow + 8);
      }
      mma::m16n8k16(acc[n], ar, br, T{});
    }
  }
}

// The powers of two that put the largest |x| of each of a fragment's two rows (g and g + 8: half 0, 1) in [1, 2), and
// their inverses; mx: this lane's part of each row's max (the quad's lanes share a row: their max is taken here).
// Exact scalings, so that a row of tiny values keeps its bits in fp16 halves.
__device__ __forceinline__ void row_pow2_scales(float (&mx)[2], float (&scale)[2], float (&unscale)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
    mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
    const int ex = mx[half] > 0.f ? max(ilogbf(mx[half]), -126) : 0;  // row max * 2^-ex in [1, 2)
    scale[half] = ldexpf(1.f, -ex);
    unscale[half] = ldexpf(1.f, ex);
  }
}

// acc[n] (0 on entry; kAccumulate: a partial sum) += x b for the n-tiles n < ncount. x: the warp's 16 rows x 64
// columns in the C layout, scaled per row by a power of two (row max in [1, 2), exact, undone at the end: a tiny row
// keeps its bits in fp16) and split in two T halves, reused as A registers; b: a 16-bit tile [8 n + .][kT] (k = x's
// columns), either exact in T (b_lo null: hi b + lo b) or itself two halves b + b_lo (hi b + hi b_lo + lo b).
// kAccumulate: acc is scaled by the same power of two first (exact unless a value drops below 2^-126: only where x's
// row is 2^126 times larger), capped so that the scaled partial sum stays below 2^122: a row of x far smaller than its
// partial sum cannot push that sum past fp32's range.
template <typename T, int NN, bool kAccumulate = false>
__device__ __forceinline__ void split_product(const float (&x)[kC / 8][4], const T* b, const T* b_lo, int ncount,
                                              float (&acc)[NN][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float mx[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < kC / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], fabsf(x[n][e]));
  if constexpr (kAccumulate) {
#pragma unroll
    for (int n = 0; n < NN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], fabsf(acc[n][e]) * 0x1p-120f);
  }
  float scale[2], unscale[2];
  row_pow2_scales(mx, scale, unscale);
  if constexpr (kAccumulate) {
#pragma unroll
    for (int n = 0; n < NN; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] *= scale[e / 2];
  }
#pragma unroll
  for (int kk = 0; kk < kC / 16; ++kk) {
    uint32_t hi[4], lo[4];
    split_a<T>(x, kk, scale, hi, lo);
#pragma unroll
    for (int n = 0; n < NN; ++n) {
      if (n >= ncount) continue;
      const T* brow = b + (n * 8 + g) * kT + kk * 16 + 2 * t;
      const uint32_t bhi[2] = {mma::ld32(brow), mma::ld32(brow + 8)};
      mma::m16n8k16(acc[n], hi, bhi, T{});
      if (b_lo != nullptr) {
        const T* lrow = b_lo + (n * 8 + g) * kT + kk * 16 + 2 * t;
        const uint32_t blo[2] = {mma::ld32(lrow), mma::ld32(lrow + 8)};
        mma::m16n8k16(acc[n], hi, blo, T{});
      }
      mma::m16n8k16(acc[n], lo, bhi, T{});
    }
  }
#pragma unroll
  for (int n = 0; n < NN; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] *= unscale[e / 2];
}

// The warp's rows of a tile (rows 16 warp + rr, rr < kWarpRows): the rows of its mma fragments, so that each warp
// takes its own rows from dphi to dq (dk) with no block barrier between (warp_table_w, warp_chain_factors, chain_mma).
constexpr int kWarpRows = kC / (kThreads / 32);

// The per-(row, table, plane) factors of chain_row (race_kernels.cuh), once per row instead of once per lane of
// the row's warp, for the warp's rows: da[r][lt] = 2 beta w (1 - u^2) (rows kGRow floats apart) and the row's dbeta
// term 2 sum_lt u w (lt in order) into rowpart[r] (0 where ok[r] is 0). u, w: [64][L*P]. Ends with __syncwarp.
__device__ __forceinline__ void warp_chain_factors(const Params& p, float beta, const float* u, const float* w,
                                                   const int* ok, float* da, float* rowpart) {
  const int lane = threadIdx.x % 32, r0 = (threadIdx.x / 32) * kWarpRows;
  for (int e = lane; e < kWarpRows * kLPMax; e += 32) {
    const int r = r0 + e / kLPMax, lt = e % kLPMax;
    if (lt >= p.lp) continue;
    const float ut = u[r * p.lp + lt], wt = w[r * p.lp + lt];
    da[r * kGRow + lt] = 2.f * beta * wt * (1.f - ut * ut);
  }
  if (lane < kWarpRows) {
    const int r = r0 + lane;
    float db = 0.f;
    for (int lt = 0; lt < p.lp; ++lt) db = fmaf(2.f * u[r * p.lp + lt], w[r * p.lp + lt], db);
    rowpart[r] = ok[r] ? db : 0.f;
  }
  __syncwarp();
}

// acc[n0 + j] += a b for four n-tiles with a = hi + lo and b = b[0] + b[1] in two T halves each: hi b[0] + lo b[0] +
// hi b[1] (lo b[1] dropped), each product four accumulators after the previous one into the same tile.
template <typename T, int NN>
__device__ __forceinline__ void halves_product4(float (&acc)[NN][4], int n0, const uint32_t (&hi)[4],
                                                const uint32_t (&lo)[4], const uint32_t (&b)[2][4][2]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) mma::m16n8k16(acc[n0 + j], hi, b[0][j], T{});
#pragma unroll
  for (int j = 0; j < 4; ++j) mma::m16n8k16(acc[n0 + j], lo, b[0][j], T{});
#pragma unroll
  for (int j = 0; j < 4; ++j) mma::m16n8k16(acc[n0 + j], hi, b[1][j], T{});
}

// dx (0 on entry) = da W for the warp's 16 rows, on tensor cores: da [row][lt] (warp_chain_factors' rows of the g
// tile, kGRow floats apart; lt < p.lp), each row scaled by a power of two (row max in [1, 2), undone at the end) and
// split in two T halves, times the planes W [lt][d] in two T halves (init_constants' s.w: hi rows 0.., lo rows
// kLPMax..), hi hi + lo hi + hi lo: lt 0..15 in one k16 step, lt 16..23 (p.lp > 16) in a k16 step whose upper half is
// zero, so that no row past the planes' tiles is read. The C layout: dx[n][2 half + e] is row 16w + g + 8 half,
// column 8n + 2t + e. ~2^-16 relative (bf16 halves) before the output's rounding; chain_row (race_kernels.cuh) has
// the fp32 sum.
template <typename T, int D>
__device__ __forceinline__ void chain_mma(const Params& p, const T* planes, const float* da, float (&dx)[D / 8][4]) {
  constexpr int kX = D + 8, kN = D / 8;
  static_assert(kN % 4 == 0, "whole groups of four n-tiles");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * kWarpRows;
  const int steps = p.lp > 16 ? 2 : 1;
  float a[2][4][2];  // k-step st, A register r: row g + 8 (r % 2), lt 16 st + 8 (r / 2) + 2t + e
  float mx[2] = {0.f, 0.f};
#pragma unroll
  for (int st = 0; st < 2; ++st)
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int lt = 16 * st + 8 * (r / 2) + 2 * t + e;
        const bool live = st < steps && (st == 0 || r / 2 == 0) && lt < p.lp;
        a[st][r][e] = live ? da[(r0 + g + 8 * (r % 2)) * kGRow + lt] : 0.f;
        mx[r % 2] = fmaxf(mx[r % 2], fabsf(a[st][r][e]));
      }
  float scale[2], unscale[2];
  row_pow2_scales(mx, scale, unscale);
#pragma unroll
  for (int st = 0; st < 2; ++st) {
    if (st >= steps) continue;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r)
      mma::split2<T>(a[st][r][0] * scale[r % 2], a[st][r][1] * scale[r % 2], hi[r], lo[r]);
#pragma unroll
    for (int n0 = 0; n0 < kN; n0 += 4) {  // four n-tiles at a time: 16 B registers, four accumulators between products
      uint32_t b[2][4][2];                 // [hi, lo][n-tile n0 + j]: W's rows 16 st.. (k), columns 8 (n0 + j).. (n)
#pragma unroll
      for (int part = 0; part < 2; ++part) {
        const T* tile = planes + (part * kLPMax + 16 * st) * kX + 8 * n0;
        if (st == 0) {
          mma::for_each_b_trans<4>(tile, kX, 0, lane, [&](int j, const uint32_t (&bj)[2]) {
            b[part][j][0] = bj[0];
            b[part][j][1] = bj[1];
          });
        } else {  // rows 16..23 only (the step's k rows 24.. are zero in A and B): four n-tiles per ldmatrix.x4.trans
          uint32_t r4[4];
          mma::ldsm_x4_trans(r4, tile + (lane & 7) * kX + 8 * (lane >> 3));
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            b[part][j][0] = r4[j];
            b[part][j][1] = 0u;
          }
        }
      }
      halves_product4<T>(dx, n0, hi, lo, b);
    }
  }
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dx[n][e] *= unscale[e / 2];
}

// table_w for P planes per table and the warp's rows: one pass over each (row, table)'s 2^P values of g sums them
// for all P planes at once (per plane in bucket order, so the same bits as one pass per plane).
template <int P>
__device__ __forceinline__ void warp_table_w_p(const Params& p, const float* g, const float* sp, const float* sm,
                                               float* w) {
  constexpr int R = 1 << P;
  const int lane = threadIdx.x % 32, r0 = (threadIdx.x / 32) * kWarpRows;
  for (int e = lane; e < kWarpRows * (p.lp / P); e += 32) {
    const int r = r0 + e % kWarpRows, l = e / kWarpRows;  // 16 rows x 2 tables: g's odd row stride, all 32 banks
    const float* row = g + r * kGRow + l * R;
    float set[P] = {}, clear[P] = {};
#pragma unroll
    for (int bucket = 0; bucket < R; ++bucket) {
      const float gv = row[bucket];
#pragma unroll
      for (int t = 0; t < P; ++t) {
        if ((bucket >> (P - 1 - t)) & 1)
          set[t] += gv;
        else
          clear[t] += gv;
      }
    }
#pragma unroll
    for (int t = 0; t < P; ++t) {
      const int lt = l * P + t;
      w[r * p.lp + lt] = sm[r * kLPMax + lt] * set[t] - sp[r * kLPMax + lt] * clear[t];
    }
  }
  __syncwarp();
}

// w[r][lt] = sigma- sum_{bit set} g - sigma+ sum_{bit clear} g per (row, table, plane) for the warp's rows; g: fp32
// [64][kGRow]. Ends with __syncwarp.
__device__ __forceinline__ void warp_table_w(const Params& p, const float* g, const float* sp, const float* sm,
                                             float* w) {
  dispatch_planes(p, [&](auto planes) { warp_table_w_p<decltype(planes)::value>(p, g, sp, sm, w); });
}

// Whether chunk_scores takes the scores on T operands (scores_split) instead of tf32 halves: for bf16 inputs, whose
// phi(k) is already two bf16 halves in pkt (16 bits); bf16 keeps fp32's exponent range, where fp16 halves of phi(q)
// (products of up to six sigmoids) would flush a sharp row's small features.
template <typename T>
constexpr bool kSplitScores = std::is_same_v<T, __nv_bfloat16>;

// sc[n] += phi(q) phi(k)^T for the warp's 16 query rows and the chunk's keys 8n.., on T operands: phi(q) in fp32 (the
// phi tile, or rebuilt from the sigma tables: the same values) split in two T halves, phi(k) = pkt's hi and lo halves
// ([feature][key], by ldmatrix.trans); hi hi + lo hi + hi lo per k16 step, four n-tiles at a time.
template <typename T, int D, bool PHI_TILE>
__device__ __forceinline__ void scores_split(const Params& p, const Tiles<T, D>& s, const float* phi32,
                                             float (&sc)[kC / 8][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
  const int steps = (p.features + 15) / 16;  // pkt rows past S are 0 (features), phi(q) there too
#pragma unroll
  for (int kk = 0; kk < kS / 16; ++kk) {
    if (kk >= steps) continue;
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // A register r: row g + 8 (r % 2), features 16 kk + 8 (r / 2) + 2t + {0, 1}
      const int row = r0 + g + 8 * (r % 2), f = kk * 16 + 8 * (r / 2) + 2 * t;
      float x[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if constexpr (PHI_TILE) x[e] = phi32[row * (kS + 1) + f + e];
        else x[e] = f + e < p.features && s.okq[row] ? phi_at(p, s.sp, s.sm, row, f + e) : 0.f;
      }
      mma::split2<T>(x[0], x[1], hi[r], lo[r]);
    }
#pragma unroll
    for (int n0 = 0; n0 < kC / 8; n0 += 4) {
      uint32_t b[2][4][2];  // [hi, lo][n-tile n0 + j]
#pragma unroll
      for (int part = 0; part < 2; ++part)
        mma::for_each_b_trans<4>(s.pkt + part * kS * kT + 8 * n0, kT, kk * 16, lane, [&](int j, const uint32_t (&bj)[2]) {
          b[part][j][0] = bj[0];
          b[part][j][1] = bj[1];
        });
      halves_product4<T>(sc, n0, hi, lo, b);
    }
  }
}

// sc = phi(q) phi(k)^T (unmasked) for the warp's 16 query rows and the chunk's keys 8n.., fp32-accurate: bf16 inputs
// on T halves (scores_split); fp16: phi(q) in fp32 (the phi tile, or rebuilt from the sigma tables) and phi(k) = pkt
// hi + lo, each in two tf32 halves (hi hi + hi lo + lo hi).
template <typename T, int D, bool PHI_TILE = false>
__device__ __forceinline__ void chunk_scores(const Params& p, const Tiles<T, D>& s, const float* phi32,
                                             float (&sc)[kC / 8][4]) {
  if constexpr (kSplitScores<T>) {
    scores_split<T, D, PHI_TILE>(p, s, phi32, sc);
  } else {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
    const int nf = (p.features + 7) / 8;  // feature k-steps that are not all zero
#pragma unroll
    for (int kk = 0; kk < kS / 8; ++kk) {
      if (kk >= nf) continue;
      uint32_t qhi[4], qlo[4];
      if constexpr (PHI_TILE) phi_frag_tile<true>(phi32, nullptr, r0, kk, qhi, qlo);
      else phi_frag<true>(p, s.sp, s.sm, s.okq, nullptr, r0, kk, qhi, qlo);
#pragma unroll
      for (int n = 0; n < kC / 8; ++n) {  // B register e: feature kk * 8 + t + 4 e, key n * 8 + g
        const T* k0 = s.pkt + (kk * 8 + t) * kT + n * 8 + g;
        uint32_t bhi[2], blo[2];
        mma::tf32_split(to_float(k0[0]) + to_float(k0[kS * kT]), bhi[0], blo[0]);
        mma::tf32_split(to_float(k0[4 * kT]) + to_float(k0[(kS + 4) * kT]), bhi[1], blo[1]);
        mma::mma_tf32x3(sc[n], qhi, qlo, bhi, blo);
      }
    }
  }
}

// Whether tile_dq advances the causal state itself (D <= 64; at D = 128 its registers beside the epilogue's would
// spill): one barrier per chunk fewer, and advance_state's products beside the epilogue's scalar work.
template <int D>
constexpr bool kDqAdvanceInTile = D <= 64;

// Whether the causal dq kernel loads the next chunk's k and v rows into registers while tile_dq computes (D <= 64: 32
// registers beside tile_dq's; at D = 128 the 64 would not fit), instead of waiting on them in key_chunk, and the query
// tile's q and dO rows by cp.async while key_chunk maps k (then the kernel waits on no load of its own).
template <int D>
constexpr bool kDqPrefetch = D <= 64;

// dq rows, den, c and the dbeta partial of query tile m. Expects: sp / sm, u, dO of the tile; the state
// before the tile's chunk in st; when `intra`, the chunk's pkt, vt, okk and v row-major in x. PHI_TILE: also
// phi(q) in fp32 in the g tile's storage (query_tile's phi32), read where the default rebuilds it from sp / sm.
// advance (kDqAdvanceInTile<D>): the state in st then takes the chunk's phi(k)^T [v, 1] (advance_state's products and
// sums), issued once every warp is done reading st and added after the epilogue's scalar work, which reads z from
// registers.
template <typename T, int D, bool PHI_TILE = false>
__device__ void tile_dq(const Params& p, const Heads<T>& hd, int m, bool intra, Tiles<T, D>& s, BwdTiles<T, D>& bt,
                        bool advance = false) {
  constexpr int kX = D + 8;
  constexpr int kG = BwdTiles<T, D>::kG;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, warp = threadIdx.x / 32, r0 = warp * 16;
  const int nf = (p.features + 7) / 8;  // feature n-tiles that are not all zero
  float z[kS / 8][2];  // z of the lane's features 8n + 2t + e (st changes only after the tile's barrier below)
#pragma unroll
  for (int n = 0; n < kS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) z[n][e] = s.st[(n * 8 + 2 * t + e) * kX + D];
  const auto phi_q = [&](int r, int f) {  // fp32 phi(q)[r][f]: 0 past S and for rows with ok = 0 (as the phi tile)
    if constexpr (PHI_TILE) return bt.g[r * kG + f];
    else return f < p.features && s.okq[r] ? phi_at(p, s.sp, s.sm, r, f) : 0.f;
  };
  float dphi[kS / 8][4] = {};
  rows_times_state<T, D>(bt.dO, s.st, nf, dphi);  // dO A^T: dO exact in tf32, A in two tf32 halves
  // den = phi(q) . z + sum_j s_ij and c^ den = dO . num = phi(q) . (A dO) + sum_j s_ij (dO . v_j), over j <= i:
  // this lane's part of each of its two rows (half), then the quad's sum
  float den[2] = {0.f, 0.f}, dot[2] = {0.f, 0.f};
  float ds[kC / 8][4] = {};  // intra: dO v^T, the warp's rows x the chunk's 64 keys
  if (intra) {
    float sc[kC / 8][4] = {};
    chunk_scores<T, D, PHI_TILE>(p, s, bt.g, sc);
    rows_dot<T, D>(bt.dO, s.x, ds);
#pragma unroll
    for (int n = 0; n < kC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e / 2, i = r0 + g + 8 * half, j = n * 8 + 2 * t + (e & 1);
        if (j <= i && s.okk[j]) {  // tile m and chunk kappa0 + m share the diagonal
          den[half] += sc[n][e];
          dot[half] = fmaf(sc[n][e], ds[n][e], dot[half]);
        }
      }
  }
#pragma unroll
  for (int n = 0; n < kS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int half = e / 2, f = n * 8 + 2 * t + (e & 1);
      const float phi = phi_q(r0 + g + 8 * half, f);
      den[half] = fmaf(phi, z[n][e & 1], den[half]);
      dot[half] = fmaf(phi, dphi[n][e], dot[half]);
    }
  float chat[2], inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    den[half] = mma::quad_sum(den[half]);  // the quad's lanes hold the row's other columns
    dot[half] = mma::quad_sum(dot[half]);
    const int r = r0 + g + 8 * half, i = m * kC + r;
    const bool live = s.okq[r] && den[half] > 0.f;
    inv[half] = live ? 1.f / den[half] : 0.f;
    chat[half] = live ? dot[half] * inv[half] : 0.f;
    if (t == 0 && i < p.nq) {
      p.den[hd.bh * p.nq + i] = live ? den[half] : 0.f;
      p.cq[hd.bh * p.nq + i] = chat[half] * inv[half];
    }
  }
  if (intra) {
#pragma unroll
    for (int n = 0; n < kC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e / 2, i = r0 + g + 8 * half, j = n * 8 + 2 * t + (e & 1);
        ds[n][e] = j <= i && s.okk[j] ? ds[n][e] - chat[half] : 0.f;
      }
    split_product<T, kS / 8, true>(ds, s.pkt, s.pkt + kS * kT, nf, dphi);  // += ds' phi(k), phi(k) in T halves
  }
  __syncthreads();  // every warp is done with phq, phk (the g tile's storage) and with reading the state
  const bool advancing = kDqAdvanceInTile<D> && advance;
  float delta[D / 8 + 1][4] = {};  // advance_state's products, issued here and added to st after the scalar work
  if (advancing) state_delta<T, D / 8 + 1>(s.pkt, s.vt, 0, D / 8 + 1, delta);
#pragma unroll
  for (int n = 0; n < kS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int half = e / 2, r = r0 + g + 8 * half, f = n * 8 + 2 * t + (e & 1);
      float val = 0.f;
      if (f < p.features && inv[half] > 0.f) {  // PHI_TILE: this thread alone reads phi(q)[r][f], then writes g
        val = (dphi[n][e] - chat[half] * z[n][e & 1]) * inv[half] * phi_q(r, f);
      }
      bt.g[r * kG + f] = val;
    }
  __syncwarp();  // from here on each warp reads and writes only its own rows
  warp_table_w(p, bt.g, s.sp, s.sm, bt.w);
  warp_chain_factors(p, hd.beta, bt.u, bt.w, s.okq, bt.g, bt.rowpart);  // da into the warp's g rows (read above)
  if (advancing) add_state_rows<D>(s.st, 0, delta);
  T* dq = static_cast<T*>(p.out) + hd.bh * p.nq * D;
  float dx[D / 8][4] = {};
  chain_mma<T, D>(p, s.w, bt.g, dx);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int i = m * kC + r0 + g + 8 * half;
    if (i < p.nq) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<uint32_t*>(dq + (long long)i * D + n * 8 + 2 * t) =
            mma::pack2<T>(dx[n][2 * half], dx[n][2 * half + 1]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) p.dbeta_q[hd.bh * p.nqt + m] = ordered_sum64(bt.rowpart);
}

// dq, den, c and the query-side dbeta partials. Causal: block = (group of kGroup key chunks, q head, batch),
// walking the chunks in order with the running state (slot grp of the group prefix, then += each chunk);
// non-causal: block = (group of kGroup query tiles, q head, batch) with the total state (slot ngk).
// Query tiles before the first key chunk (causal, Nq - Nk >= 64) are never visited: the host zero-fills
// their dq, den, c and dbeta partials.
template <typename T, int D, bool PHI_TILE = false>
__global__ void __launch_bounds__(kThreads, 1) race_group_dq_bwd_kernel(const Params p) {
  extern __shared__ __align__(16) char smem_raw[];
  Tiles<T, D> s(smem_raw);
  BwdTiles<T, D> bt(smem_raw);
  const int grp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Heads<T> hd(p, h, b);
  const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h;
  const int first = grp * kGroup;
  const int end = min(p.causal ? p.nkc : p.nqt, first + kGroup);
  if (p.causal && end - 1 < p.kappa0) return;  // only keys before the first query: no tile here
  init_constants<T, D>(p, s);
  load_state<T, D>(p, hd.bh, p.causal ? grp : p.ngk, s);
  float* phi32 = PHI_TILE ? bt.g : nullptr;  // fp32 phi(q) of the tile instead of the (here unused) fp16 phq
  if (!p.causal) {
    for (int m = first; m < end; ++m) {
      query_tile<T, D>(p, hd, m, s, dout, bt.dO, bt.u, phi32);
      tile_dq<T, D, PHI_TILE>(p, hd, m, false, s, bt);
    }
    return;
  }
  KeyRowsInFlight<T, D> next;  // the next chunk's rows, loaded while tile_dq computes (kDqPrefetch<D>)
  bool fetched = false;
  for (int kappa = first; kappa < end; ++kappa) {
    const int m = kappa - p.kappa0;  // the query tile whose diagonal is in this chunk
    VtInFlight<T, D> v_rows;  // the chunk's v rows as key_chunk loaded them (D <= 64: 16 registers)
    const int async_m = kDqPrefetch<D> ? m : -1;  // q and dO rows by cp.async while key_chunk maps k
    key_chunk<T, D>(p, hd, b, kappa, s, !PHI_TILE && m >= 0, -1, -1, &v_rows, fetched, next, async_m, dout, bt.dO);
    fetched = false;
    if (m >= 0) {
      query_tile<T, D>(p, hd, m, s, dout, bt.dO, bt.u, phi32, -1, async_m >= 0);  // sp, sm: q's tables
      v_rows.store_rows(s.x);  // v row-major (x is free again), without loading it twice
      if (kDqPrefetch<D> && kappa + 1 < end) {
        next.fetch(p, hd, b, kappa + 1);
        fetched = true;
      }
      __syncthreads();
      tile_dq<T, D, PHI_TILE>(p, hd, m, true, s, bt, kappa + 1 < end);
    }
    if (kappa + 1 == end) break;
    if (m >= 0 && kDqAdvanceInTile<D>) continue;  // tile_dq advanced the state
    __syncthreads();  // every warp has read the state
    advance_state<T, D>(s);
  }
}

// ---- Key side (dk, dv, the k-side dbeta): race_group_qstate_bwd_kernel, the reverse group scan, race_group_dkv_bwd_kernel.
// Query-tile groups follow the key-chunk groups (causal: tile m = kappa - kappa0 of the group's chunks; non-causal:
// kGroup tiles), so the dkv block of key-chunk group grp starts from the suffix slot grp + 1 (non-causal: 0, the total).
// State [B, y] = sum_i phi~(q_i) [dO_i, c^_i]^T with phi~ = phi(q) / den, c^ = c den (= c_i phi(q_i) in column D).

// The key-side kernels' shared memory: the forward's Tiles (s.sp / s.sm: the query tile's sigma tables, s.vt: its
// dO^T, s.pkt: its phi(q) in T halves, s.x: the keys' v), then the keys' u and sigma tables, w (in x where it fits,
// D >= 64), 1/den, c^ and dbeta terms per row; the g tile (fp32 [64][65]) reuses phq + phk. dO is read from s.vt
// only: 97.6 / 111.1 / 150.1 KB at D = 32 / 64 / 128, two blocks per SM on sm_90 up to D = 64.
template <typename T, int D>
struct DkvTiles {
  using Fwd = Tiles<T, D>;
  static constexpr int kG = kGRow;
  static constexpr int table_bytes = kC * kLPMax * 4;
  static constexpr bool w_in_x = Fwd::x_bytes >= table_bytes;
  static constexpr int u_off = Fwd::bytes;                   // fp32 u [64][L * P] of the keys
  static constexpr int spk_off = u_off + table_bytes;        // fp32 sigma+, sigma- [64][kLPMax] of the keys
  static constexpr int wt_off = spk_off + 2 * table_bytes;   // fp32 w [64][L * P] (unless in x)
  static constexpr int row_off = wt_off + (w_in_x ? 0 : table_bytes);
  static constexpr int bytes = row_off + 3 * kC * 4;         // c^, 1 / den, dbeta terms per row
  static_assert(Fwd::phq_off + kC * kG * 4 <= Fwd::pkt_off, "the g tile fits phq + phk");
  static_assert(u_off % 16 == 0 && spk_off % 16 == 0 && wt_off % 16 == 0, "16-byte aligned tables");

  float *u, *spk, *smk, *w, *g, *chat, *inv, *rowpart;

  // query_state: the query-state kernel's packed layout (Tiles' kQueryState: g and the per-row values only; u, the
  // key sigma tables and w null).
  __device__ explicit DkvTiles(char* base, bool query_state = false)
      : u(query_state ? nullptr : reinterpret_cast<float*>(base + u_off)),
        spk(query_state ? nullptr : reinterpret_cast<float*>(base + spk_off)),
        smk(query_state ? nullptr : spk + kC * kLPMax),
        w(query_state ? nullptr : reinterpret_cast<float*>(base + (w_in_x ? 0 : wt_off))),
        g(reinterpret_cast<float*>(base + Fwd::phq_off)),
        chat(reinterpret_cast<float*>(base + (query_state ? Fwd::qs_rows_off : row_off))),
        inv(chat + kC),
        rowpart(inv + kC) {}
};

// den and c of query tile m's row threadIdx.x (threads < kC; 0 past Nq), as the dq kernel saved them.
struct QueryRow {
  float den = 0.f, c = 0.f;
  __device__ void fetch(const Params& p, long long bh, int m) {
    const int i = m * kC + threadIdx.x;
    if (threadIdx.x >= kC || i >= p.nq) return;
    den = p.den[bh * p.nq + i];
    c = p.cq[bh * p.nq + i];
  }
};

// 1/den (0 for rows past Nq or without a key) and c^ = c den of a query tile's rows into kt.inv, kt.chat.
template <typename T, int D>
__device__ __forceinline__ void query_rows(const QueryRow& row, DkvTiles<T, D>& kt) {
  if (threadIdx.x >= kC) return;
  kt.inv[threadIdx.x] = row.den > 0.f ? 1.f / row.den : 0.f;
  kt.chat[threadIdx.x] = row.den > 0.f ? row.c * row.den : 0.f;
}

// acc[n] += sum_i phi~(q_i) [dO_i, c^_i]^T over one query tile, for the warp's 16 features (rows of acc) and the
// n-tiles of columns [0, D + 8): phi~ from the sigma tables in fp32 (PHI_TILE: from the fp32 phi(q) tile in
// kt.g), times 1/den, in two tf32 halves; dO (from dO^T in s.vt) exact in tf32; c^ in two tf32 halves in
// columns D (hi) and D + 1 (lo): y's term is their sum.
template <typename T, int D, bool PHI_TILE = false>
__device__ __forceinline__ void query_state_delta(const Params& p, const Tiles<T, D>& s, const DkvTiles<T, D>& kt,
                                                  float (&acc)[D / 8 + 1][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, f0 = (threadIdx.x / 32) * 16;
  if (f0 >= p.features) return;
#pragma unroll
  for (int kk = 0; kk < kC / 8; ++kk) {
    uint32_t ahi[4], alo[4];
    if constexpr (PHI_TILE) phi_frag_tile<false>(kt.g, kt.inv, f0, kk, ahi, alo);
    else phi_frag<false>(p, s.sp, s.sm, nullptr, kt.inv, f0, kk, ahi, alo);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {  // B register e: query kk * 8 + t + 4 e, column n * 8 + g
      const T* row = s.vt + (n * 8 + g) * kT + kk * 8 + t;
      const uint32_t b[2] = {__float_as_uint(to_float(row[0])), __float_as_uint(to_float(row[4]))};
      mma::m16n8k8_tf32(acc[n], ahi, b);
      mma::m16n8k8_tf32(acc[n], alo, b);
    }
    uint32_t chi[2], clo[2];
    mma::tf32_split(kt.chat[kk * 8 + t], chi[0], clo[0]);
    mma::tf32_split(kt.chat[kk * 8 + t + 4], chi[1], clo[1]);
    const uint32_t b[2] = {g == 0 ? chi[0] : g == 1 ? clo[0] : 0u, g == 0 ? chi[1] : g == 1 ? clo[1] : 0u};
    mma::m16n8k8_tf32(acc[D / 8], ahi, b);
    mma::m16n8k8_tf32(acc[D / 8], alo, b);
  }
}

// Query tile m for the key side: the forward's query_tile (flags, q's sigma tables in s.sp / s.sm, fp16 phi(q)
// into phq, or fp32 into phi32 instead when that is not null), 1/den and c^, dO^T into s.vt; with `intra` also
// phi(q) in T halves into pkt. Ends with a barrier.
template <typename T, int D>
__device__ __forceinline__ void key_side_query_tile(const Params& p, const Heads<T>& hd, const T* dout, int m,
                                                    bool intra, Tiles<T, D>& s, DkvTiles<T, D>& kt,
                                                    float* phi32 = nullptr) {
  VtInFlight<T, D> grads;  // dO's loads in flight while query_tile loads and maps q
  grads.fetch(dout, p.sdo.n, m * kC, [&](int j) { return m * kC + j < p.nq; });
  QueryRow row;  // den and c in flight while query_tile loads and maps q
  row.fetch(p, hd.bh, m);
  query_tile<T, D>(p, hd, m, s, nullptr, nullptr, nullptr, phi32);
  query_rows<T, D>(row, kt);
  grads.store(s.vt);
  if (intra) features<T>(p, s.okq, s.sp, s.sm, nullptr, s.pkt);
  __syncthreads();
}

// Key chunk kappa for the key side: flags, k's sigma tables and u (kt.spk, kt.smk, kt.u), then v row-major into
// s.x and, with `intra`, fp16 phi(k) into phk. Ends with a barrier.
template <typename T, int D>
__device__ __forceinline__ void key_side_chunk(const Params& p, const Heads<T>& hd, int b, int kappa, bool intra,
                                               Tiles<T, D>& s, DkvTiles<T, D>& kt) {
  const int key0 = p.s0 + kappa * kC;
  const auto ok = [&](int r) { return key_ok(p, b, key0 + r); };
  mma::RowsInFlight<kC, D, kThreads> keys, values;  // both copies' loads in flight together (D <= 64: 32 registers)
  keys.fetch(hd.k, p.sk.n, key0, ok);
  if constexpr (D <= 64) values.fetch(hd.v, p.sv.n, key0, ok);
  __syncthreads();
  if (threadIdx.x < kC) s.okk[threadIdx.x] = ok(threadIdx.x);
  keys.store(s.x);
  __syncthreads();
  project<T, D>(p, s.x, s.w, hd.beta, kt.spk, kt.smk, kt.u);
  if constexpr (D > 64) values.fetch(hd.v, p.sv.n, key0, ok);
  __syncthreads();
  values.store(s.x);
  if (intra) features<T>(p, s.okk, kt.spk, kt.smk, s.phk, nullptr);
  __syncthreads();
}

// Head g's term x of element idx of dk or dv: summed over the GQA group's q heads in order in an fp32 scratch that
// only this block touches, rounded to T after the last head (a group of one head writes T directly).
template <typename T>
__device__ __forceinline__ void add_head(const Params& p, int g, float* scratch, T* out, long long idx, float x) {
  if (g > 0) x += scratch[idx];
  if (g + 1 == p.groups) out[idx] = from_float<T>(x);
  else scratch[idx] = x;
}

// add_head for the warp's 16 key rows of a [key][D] gradient (dk, dv) held in the C layout (acc[n][2 half + e]: key
// key0 + 16w + g + 8 half, column 8n + 2t + e); rows outside [0, Nk) are skipped. row0: the (b, kv head) offset
// (even, as every idx: 4-byte pairs).
template <typename T, int D>
__device__ __forceinline__ void store_key_rows(const Params& p, int g_head, float* scratch, T* out, long long row0,
                                               int key0, const float (&acc)[D / 8][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = key0 + r0 + g + 8 * half;
    if (j < 0 || j >= p.nk) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const long long idx = row0 + (long long)j * D + n * 8 + 2 * t;
      if (p.groups == 1) {  // no head to add: the pair rounded and stored at once (the same bits as add_head's)
        *reinterpret_cast<uint32_t*>(out + idx) = mma::pack2<T>(acc[n][2 * half], acc[n][2 * half + 1]);
        continue;
      }
      add_head<T>(p, g_head, scratch, out, idx, acc[n][2 * half]);
      add_head<T>(p, g_head, scratch, out, idx + 1, acc[n][2 * half + 1]);
    }
  }
}

// dv, dk and the dbeta partial of key chunk kappa for q head g of the group (with `intra`, chunk kappa holds the
// diagonal of query tile m = kappa - kappa0, loaded by key_side_query_tile). st holds [B, y] of the query tiles
// after m (non-causal: all). With j the chunk's keys, i the tile's queries (j <= i: the shared diagonal):
//   dv_j      = phi(k_j) B + sum_i (a_ji / den_i) dO_i
//   dphi(k_j) = v_j B^T - y + sum_i ((v_j . dO_i - c^_i) / den_i) phi(q_i)
//   g = dphi * phi(k) (fp32 phi), w per table and plane, dk = sum_lt 2 beta w (1 - u^2) W_lt, dbeta partial.
// Operand precision: phi(k) B with both in two tf32 halves; the scores a = phi(k) phi(q)^T with the forward's fp16
// features (they feed dv only), a / den in T halves (row-scaled) times dO exact; v B^T with v exact and B in two
// tf32 halves; y in fp32 on CUDA cores; v dO^T exact in T; (v . dO - c^) / den in T halves (row-scaled) times phi(q)
// in T halves: every product that feeds dphi(k), hence dbeta, is fp32-accurate.
// PHI_TILE: phi(k) in fp32 is built once per chunk into the g tile's storage (after the intra scores have read phq,
// phk there) and read where the per-use path rebuilds each value from the sigma tables (phi_at): the same values.
template <typename T, int D, bool PHI_TILE = false>
__device__ void chunk_dkv(const Params& p, const Heads<T>& hd, int kappa, int g_head, bool intra,
                          Tiles<T, D>& s, DkvTiles<T, D>& kt) {
  constexpr int kX = D + 8;
  constexpr int kG = DkvTiles<T, D>::kG;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, warp = threadIdx.x / 32, r0 = warp * 16;
  const int nf = (p.features + 7) / 8;  // feature tiles that are not all zero
  const int key0 = p.s0 + kappa * kC;
  const long long row0 = hd.bh / p.groups * p.nk * D;  // (b, kv head) of dk, dv: (b Hq + h) / groups
  // D <= 64: dv is stored after the dphi(k) products are issued, so that its roundings and stores do not wait on
  // its last products (at D = 128 its 64 accumulators would not stay live beside them)
  constexpr bool kDeferDv = D <= 64;
  float dv[D / 8][4] = {};
  {
    if (intra) {
      float sc[kC / 8][4] = {};  // a_ji: the warp's keys x the tile's queries
      scores(s.phk, s.phq, sc);
#pragma unroll
      for (int n = 0; n < kC / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = r0 + g + 8 * (e / 2), i = n * 8 + 2 * t + (e & 1);
          sc[n][e] = j <= i ? sc[n][e] * kt.inv[i] : 0.f;
        }
      split_product<T, D / 8>(sc, s.vt, static_cast<const T*>(nullptr), D / 8, dv);
    }
    if constexpr (PHI_TILE) {
      __syncthreads();  // every warp is done with phq, phk (the fp32 phi(k) tile's storage)
      features<T>(p, s.okk, kt.spk, kt.smk, nullptr, nullptr, kt.g);
      __syncthreads();
    }
#pragma unroll
    for (int kk = 0; kk < kS / 8; ++kk) {
      if (kk >= nf) continue;
      uint32_t khi[4], klo[4];
      if constexpr (PHI_TILE) phi_frag_tile<true>(kt.g, nullptr, r0, kk, khi, klo);
      else phi_frag<true>(p, kt.spk, kt.smk, s.okk, nullptr, r0, kk, khi, klo);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t bhi[2], blo[2];
        state_frag(s.st, kX, kk, n, bhi, blo);
        mma::mma_tf32x3(dv[n], khi, klo, bhi, blo);
      }
    }
    if constexpr (!kDeferDv) store_key_rows<T, D>(p, g_head, p.dv_scratch, static_cast<T*>(p.dv), row0, key0, dv);
  }
  float dphi[kS / 8][4] = {};
  if (intra) {
    float ds[kC / 8][4] = {};  // v dO^T: the warp's keys x the tile's queries
    rows_dot<T, D, true>(s.x, s.vt, ds);
#pragma unroll
    for (int n = 0; n < kC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = r0 + g + 8 * (e / 2), i = n * 8 + 2 * t + (e & 1);
        ds[n][e] = j <= i ? (ds[n][e] - kt.chat[i]) * kt.inv[i] : 0.f;
      }
    split_product<T, kS / 8>(ds, s.pkt, s.pkt + kS * kT, nf, dphi);
  }
  rows_times_state<T, D>(s.x, s.st, nf, dphi);
  if constexpr (kDeferDv) store_key_rows<T, D>(p, g_head, p.dv_scratch, static_cast<T*>(p.dv), row0, key0, dv);
  __syncthreads();  // every warp is done with the g tile's storage (phq, phk or phi(k)) and with v in x (w's storage)
#pragma unroll
  for (int n = 0; n < kS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = r0 + g + 8 * (e / 2), f = n * 8 + 2 * t + (e & 1);
      float val = 0.f;
      if (f < p.features && s.okk[j]) {  // PHI_TILE: this thread alone reads phi(k)[j][f], then writes g
        const float phi = PHI_TILE ? kt.g[j * kG + f] : phi_at(p, kt.spk, kt.smk, j, f);
        val = (dphi[n][e] - s.st[f * kX + D]) * phi;
      }
      kt.g[j * kG + f] = val;
    }
  __syncwarp();  // from here on each warp reads and writes only its own rows
  warp_table_w(p, kt.g, kt.spk, kt.smk, kt.w);
  warp_chain_factors(p, hd.beta, kt.u, kt.w, s.okk, kt.g, kt.rowpart);  // da into the warp's g rows (read above)
  float dx[D / 8][4] = {};
  chain_mma<T, D>(p, s.w, kt.g, dx);
  store_key_rows<T, D>(p, g_head, p.dk_scratch, static_cast<T*>(p.dk), row0, key0, dx);
  __syncthreads();
  if (threadIdx.x == 0) p.dbeta_k[hd.bh * p.nkc + kappa] = ordered_sum64(kt.rowpart);
}

// Step (2): per (group, q head, batch), sum_i phi~(q_i) [dO_i, c^_i]^T over the group's query tiles (causal: tiles
// kappa - kappa0 of key chunks [16 grp, 16 grp + 16); non-causal: tiles [16 grp, 16 grp + 16)) into slot grp of
// p.qstate / p.qz (groups + 1 slots; race_scan_fwd_kernel with reverse = 1 then makes them suffix sums). Shared
// memory: Tiles' kQueryState layout (query_state_bytes). (128, 1): with 128 alone ptxas capped sm_80 fp16 D = 32 at
// 72 registers and spilled 12 bytes.
template <typename T, int D, bool PHI_TILE = false>
__global__ void __launch_bounds__(kThreads, 1) race_group_qstate_bwd_kernel(const Params p) {
  extern __shared__ __align__(16) char smem_raw[];
  Tiles<T, D> s(smem_raw, Tiles<T, D>::Use::kQueryState);
  DkvTiles<T, D> kt(smem_raw, true);
  const int grp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Heads<T> hd(p, h, b);
  const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h;
  init_constants<T, D>(p, s);
  float acc[D / 8 + 1][4] = {};
  const int first = grp * kGroup, end = min(p.causal ? p.nkc : p.nqt, first + kGroup);
  for (int it = first; it < end; ++it) {
    const int m = p.causal ? it - p.kappa0 : it;
    if (m < 0) continue;
    key_side_query_tile<T, D>(p, hd, dout, m, false, s, kt, PHI_TILE ? kt.g : nullptr);  // phq is not read here
    query_state_delta<T, D, PHI_TILE>(p, s, kt, acc);
  }
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, f0 = (threadIdx.x / 32) * 16;
  const int slots = (p.causal ? p.ngk : p.ngq) + 1;
  float* B = p.qstate + (hd.bh * slots + grp) * p.features * D;
  float* y = p.qz + (hd.bh * slots + grp) * p.features;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int f = f0 + g + 8 * half;
    if (f >= p.features) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(B + (long long)f * D + n * 8 + 2 * t) = make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
    if (t == 0) y[f] = acc[D / 8][2 * half] + acc[D / 8][2 * half + 1];
  }
}

// Step (3): dk, dv and the k-side dbeta partials of the key chunks of group blockIdx.x, kv head blockIdx.y, batch
// blockIdx.z. The GQA group's q heads in order, outermost (one suffix state in st at a time); per head the group's
// chunks in reverse order from slot grp + 1 (non-causal: the total), causal: then st += the chunk's query tile.
// dk, dv summed over the heads in fixed order (add_head), no atomics.
template <typename T, int D, bool PHI_TILE = false>
__global__ void __launch_bounds__(kThreads, 1) race_group_dkv_bwd_kernel(const Params p) {
  extern __shared__ __align__(16) char smem_raw[];
  Tiles<T, D> s(smem_raw);
  DkvTiles<T, D> kt(smem_raw);
  const int grp = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int first = grp * kGroup, end = min(p.nkc, first + kGroup);
  const int slots = (p.causal ? p.ngk : p.ngq) + 1;
  init_constants<T, D>(p, s);
  for (int gh = 0; gh < p.groups; ++gh) {
    const int h = hk * p.groups + gh;
    const Heads<T> hd(p, h, b);
    const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h;
    const long long slot = hd.bh * slots + (p.causal ? grp + 1 : 0);
    __syncthreads();  // the previous head's readers of st are done
    load_state<T, D>(p, p.qstate + slot * p.features * D, p.qz + slot * p.features, s);
    for (int kappa = end - 1; kappa >= first; --kappa) {
      const int m = p.causal ? kappa - p.kappa0 : -1;  // the query tile whose diagonal is in this chunk
      if (m >= 0) key_side_query_tile<T, D>(p, hd, dout, m, true, s, kt);
      key_side_chunk<T, D>(p, hd, b, kappa, m >= 0, s, kt);
      chunk_dkv<T, D, PHI_TILE>(p, hd, kappa, gh, m >= 0, s, kt);
      if (m < 0 || kappa == first) continue;
      if constexpr (PHI_TILE) {  // tile m's fp32 phi(q) into the g storage (read last by chain_mma, before a barrier)
        features<T>(p, s.okq, s.sp, s.sm, nullptr, nullptr, kt.g);
        __syncthreads();
      }
      float delta[D / 8 + 1][4] = {};  // st += tile m: the state of the tiles after m - 1
      query_state_delta<T, D, PHI_TILE>(p, s, kt, delta);
      const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, f0 = (threadIdx.x / 32) * 16;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float* row = s.st + (f0 + g + 8 * half) * (D + 8);
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          row[n * 8 + 2 * t] += delta[n][2 * half];
          row[n * 8 + 2 * t + 1] += delta[n][2 * half + 1];
        }
        if (t == 0) row[D] += delta[D / 8][2 * half] + delta[D / 8][2 * half + 1];
      }
    }
  }
}

}  // namespace tc
}  // namespace race
}  // namespace hfab
