// RACE backward on tensor cores (mma.sync, sm_80+) for fp16/bf16 inputs and S = L * 2^P <= 64: the dq side.
//
// race_group_dq_bwd_kernel walks the key chunks of one group (causal; non-causal: the query tiles of one
// group) in order, as race_group_out_fwd_kernel does, with the group's prefix state [A, z] (from
// race_group_state_fwd_kernel + the group scan) in shared memory. Per query tile (rows i, dO_i, den_i):
//   [num, den]  = tile_num_fp32 (the forward's products with fp32-accurate operands)
//   c^_i        = dO_i . num_i / den_i                     (c_i = G_i . O_i = c^_i / den_i, saved with den_i)
//   ds'_ij      = dO_i . v_j - c^_i  over j <= i           (= den_i d a_ij: well scaled for 16-bit operands)
//   dphi(q_i)   = (dO_i A^T - c^_i z + sum_j ds'_ij phi(k_j)) / den_i
//   g = dphi * phi(q) (fp32 phi), w per table and plane, dq = sum_lt 2 beta w (1 - u^2) W_lt, dbeta partial.
// Operand precision: dO_i A^T in tf32 with dO exact (fp16/bf16 are tf32 subsets) and A split in two tf32
// halves; ds' = dO v^T on T operands (exact products, fp32 sums); sum_j ds' phi(k) with ds' scaled per row
// by a power of two (row max in [1, 2): fp16 keeps its bits when dO is tiny) and split in two T halves,
// phi(k) in two T halves (the forward's pkt). c^ z in fp32 on CUDA cores. num and den (so c^, den, c) from
// fp32 phi(q), the state and phi(k) in two tf32 halves: with the forward's fp16 phi and tf32 state, c^ missed the
// exact cancellation sum_j a_ij (G_i . v_j - c_i) = 0 by ~1e-4 relative, and dbeta (both sides) with it. No atomics.
// The key side (dk, dv) stays on the CUDA-core race_dkv_bwd_kernel (race_kernels.cuh), which reads the
// den and c written here.
#pragma once

#include "race/race_tc_kernels.cuh"

namespace hfab {
namespace race {
namespace tc {

// The dq kernel's shared memory: the forward's Tiles, then dO, u, the w table and per-row values; the g
// tile (fp32 [64][65]) reuses phq + phk, the w table reuses the x tile where it fits (D >= 64).
template <typename T, int D>
struct BwdTiles {
  using Fwd = Tiles<T, D>;
  static constexpr int kX = D + 8;
  static constexpr int kG = kS + 1;  // row stride (floats) of the g tile
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

// x in two tf32 halves: hi + lo keeps about 22 of its 24 significand bits.
__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = mma::to_tf32(x);
  lo = mma::to_tf32(x - __uint_as_float(hi));
}

// [num, den] of one query tile as tile_num computes them, with fp32-accurate products: phi(q) in fp32 from the
// sigma tables, the state and (when `intra`) phi(k) = pkt hi + lo, each in two tf32 halves (hi hi + hi lo +
// lo hi), then the masked scores in two T halves times [v, 1] as in tile_num. c^ = dO . num / den must match
// the fp32 phi(q), phi(k) and state that dphi(q) and the key side (race_dkv_bwd_kernel, fp32) use: the
// forward's fp16 phi(q) and tf32 state leave c^ ~1e-4 relative off, far above the dbeta tolerance.
template <typename T, int D>
__device__ __forceinline__ void tile_num_fp32(const Params& p, const Tiles<T, D>& s, bool intra,
                                              float (&acc)[D / 8 + 1][4]) {
  constexpr int kX = D + 8;
  constexpr int kN = D / 8 + 1;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
  const int nf = (p.features + 7) / 8;  // feature k-steps that are not all zero
  float sc[kC / 8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kS / 8; ++kk) {
    if (kk >= nf) continue;
    uint32_t qhi[4], qlo[4];  // A register r: row g + 8 (r % 2), feature kk * 8 + t + 4 (r / 2)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = r0 + g + 8 * (r % 2), f = kk * 8 + t + 4 * (r / 2);
      tf32_split(f < p.features && s.okq[row] ? phi_at(p, s.sp, s.sm, row, f) : 0.f, qhi[r], qlo[r]);
    }
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float* col = s.st + (kk * 8 + t) * kX + n * 8 + g;
      uint32_t bhi[2], blo[2];
      tf32_split(col[0], bhi[0], blo[0]);
      tf32_split(col[4 * kX], bhi[1], blo[1]);
      mma::m16n8k8_tf32(acc[n], qhi, bhi);
      mma::m16n8k8_tf32(acc[n], qhi, blo);
      mma::m16n8k8_tf32(acc[n], qlo, bhi);
    }
    if (!intra) continue;
#pragma unroll
    for (int n = 0; n < kC / 8; ++n) {  // B register e: feature kk * 8 + t + 4 e, key n * 8 + g
      const T* k0 = s.pkt + (kk * 8 + t) * kT + n * 8 + g;
      uint32_t bhi[2], blo[2];
      tf32_split(to_float(k0[0]) + to_float(k0[kS * kT]), bhi[0], blo[0]);
      tf32_split(to_float(k0[4 * kT]) + to_float(k0[(kS + 4) * kT]), bhi[1], blo[1]);
      mma::m16n8k8_tf32(sc[n], qhi, bhi);
      mma::m16n8k8_tf32(sc[n], qhi, blo);
      mma::m16n8k8_tf32(sc[n], qlo, bhi);
    }
  }
  if (!intra) return;
#pragma unroll
  for (int n = 0; n < kC / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = r0 + g + (e >= 2 ? 8 : 0), j = n * 8 + 2 * t + (e & 1);
      if (j > i) sc[n][e] = 0.f;  // tile m and chunk kappa0 + m share their diagonal
    }
#pragma unroll
  for (int kk = 0; kk < kC / 16; ++kk) {
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // A register r: scores of n-tile 2kk + r / 2, elements 2 (r % 2) + {0, 1}
      const float x0 = sc[2 * kk + r / 2][2 * (r % 2)], x1 = sc[2 * kk + r / 2][2 * (r % 2) + 1];
      T h0, l0, h1, l1;
      mma::split<T>(x0, h0, l0);
      mma::split<T>(x1, h1, l1);
      hi[r] = mma::pack2<T>(to_float(h0), to_float(h1));
      lo[r] = mma::pack2<T>(to_float(l0), to_float(l1));
    }
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const T* vrow = s.vt + (n * 8 + g) * kT + kk * 16 + 2 * t;
      const uint32_t b[2] = {mma::ld32(vrow), mma::ld32(vrow + 8)};
      mma::m16n8k16(acc[n], hi, b, T{});
      mma::m16n8k16(acc[n], lo, b, T{});
    }
  }
}

// dq rows, den, c and the dbeta partial of query tile m. Expects: sp / sm, u, dO of the tile; the state
// before the tile's chunk in st; when `intra`, the chunk's pkt, vt, okk and v row-major in x.
template <typename T, int D>
__device__ void tile_dq(const Params& p, const Heads<T>& hd, int m, bool intra, Tiles<T, D>& s, BwdTiles<T, D>& bt) {
  constexpr int kX = D + 8;
  constexpr int kN = D / 8 + 1;
  constexpr int kG = BwdTiles<T, D>::kG;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, warp = threadIdx.x / 32, r0 = warp * 16;
  const int nf = (p.features + 7) / 8;  // feature n-tiles that are not all zero
  float chat[2], inv[2];
  {
    float acc[kN][4] = {};
    tile_num_fp32<T, D>(p, s, intra, acc);
    const int quad = lane & ~3;  // den = column D, held by the quad's t = 0 lane
    const float dens[2] = {__shfl_sync(0xffffffffu, acc[kN - 1][0], quad),
                           __shfl_sync(0xffffffffu, acc[kN - 1][2], quad)};
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r0 + g + 8 * half, i = m * kC + r;
      const bool live = s.okq[r] && dens[half] > 0.f;
      float part = 0.f;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const T* o = bt.dO + r * kX + n * 8 + 2 * t;
        part = fmaf(to_float(o[0]), acc[n][2 * half], part);
        part = fmaf(to_float(o[1]), acc[n][2 * half + 1], part);
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);  // every lane of the quad gets the same sum
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      inv[half] = live ? 1.f / dens[half] : 0.f;
      chat[half] = live ? part * inv[half] : 0.f;
      if (t == 0 && i < p.nq) {
        p.den[hd.bh * p.nq + i] = live ? dens[half] : 0.f;
        p.cq[hd.bh * p.nq + i] = chat[half] * inv[half];
      }
    }
  }
  float dphi[kS / 8][4] = {};
  if (intra) {
    float ds[kC / 8][4] = {};  // dO v^T: rows of the warp x the chunk's 64 keys
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
      const T* base = bt.dO + (r0 + g) * kX + k0 + 2 * t;
      const uint32_t a[4] = {mma::ld32(base), mma::ld32(base + 8 * kX), mma::ld32(base + 8), mma::ld32(base + 8 * kX + 8)};
#pragma unroll
      for (int n = 0; n < kC / 8; ++n) {
        const T* vrow = s.x + (n * 8 + g) * kX + k0 + 2 * t;
        const uint32_t b[2] = {mma::ld32(vrow), mma::ld32(vrow + 8)};
        mma::m16n8k16(ds[n], a, b, T{});
      }
    }
    float mx[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < kC / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e / 2, i = r0 + g + 8 * half, j = n * 8 + 2 * t + (e & 1);
        ds[n][e] = j <= i && s.okk[j] ? ds[n][e] - chat[half] : 0.f;  // tile m and chunk kappa0 + m share the diagonal
        mx[half] = fmaxf(mx[half], fabsf(ds[n][e]));
      }
    float scale[2], unscale[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
      mx[half] = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 2));
      const int ex = mx[half] > 0.f ? max(ilogbf(mx[half]), -126) : 0;  // row max * 2^-ex in [1, 2)
      scale[half] = ldexpf(1.f, -ex);
      unscale[half] = ldexpf(1.f, ex);
    }
#pragma unroll
    for (int kk = 0; kk < kC / 16; ++kk) {
      uint32_t hi[4], lo[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // A register r: n-tile 2kk + r / 2, elements 2 (r % 2) + {0, 1} (row half r % 2)
        const float x0 = ds[2 * kk + r / 2][2 * (r % 2)] * scale[r % 2];
        const float x1 = ds[2 * kk + r / 2][2 * (r % 2) + 1] * scale[r % 2];
        T h0, l0, h1, l1;
        mma::split<T>(x0, h0, l0);
        mma::split<T>(x1, h1, l1);
        hi[r] = mma::pack2<T>(to_float(h0), to_float(h1));
        lo[r] = mma::pack2<T>(to_float(l0), to_float(l1));
      }
#pragma unroll
      for (int n = 0; n < kS / 8; ++n) {
        if (n >= nf) continue;
        const T* khi = s.pkt + (n * 8 + g) * kT + kk * 16 + 2 * t;
        const T* klo = khi + kS * kT;
        const uint32_t bhi[2] = {mma::ld32(khi), mma::ld32(khi + 8)};
        const uint32_t blo[2] = {mma::ld32(klo), mma::ld32(klo + 8)};
        mma::m16n8k16(dphi[n], hi, bhi, T{});
        mma::m16n8k16(dphi[n], hi, blo, T{});
        mma::m16n8k16(dphi[n], lo, bhi, T{});
      }
    }
#pragma unroll
    for (int n = 0; n < kS / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dphi[n][e] *= unscale[e / 2];
  }
#pragma unroll
  for (int kk = 0; kk < D / 8; ++kk) {  // dO A^T: dO exact in tf32, A in two tf32 halves
    const T* base = bt.dO + (r0 + g) * kX + kk * 8 + t;
    const uint32_t a[4] = {__float_as_uint(to_float(base[0])), __float_as_uint(to_float(base[8 * kX])),
                           __float_as_uint(to_float(base[4])), __float_as_uint(to_float(base[8 * kX + 4]))};
#pragma unroll
    for (int n = 0; n < kS / 8; ++n) {
      if (n >= nf) continue;
      const float* row = s.st + (n * 8 + g) * kX + kk * 8 + t;
      const uint32_t hi[2] = {mma::to_tf32(row[0]), mma::to_tf32(row[4])};
      const uint32_t lo[2] = {mma::to_tf32(row[0] - __uint_as_float(hi[0])),
                              mma::to_tf32(row[4] - __uint_as_float(hi[1]))};
      mma::m16n8k8_tf32(dphi[n], a, hi);
      mma::m16n8k8_tf32(dphi[n], a, lo);
    }
  }
  __syncthreads();  // every warp is done with phq, phk (the g tile's storage)
#pragma unroll
  for (int n = 0; n < kS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int half = e / 2, r = r0 + g + 8 * half, f = n * 8 + 2 * t + (e & 1);
      float val = 0.f;
      if (f < p.features && inv[half] > 0.f)
        val = (dphi[n][e] - chat[half] * s.st[f * kX + D]) * inv[half] * phi_at(p, s.sp, s.sm, r, f);
      bt.g[r * kG + f] = val;
    }
  __syncthreads();
  {  // w = sigma- sum_{bit set} g - sigma+ sum_{bit clear} g per (row, table, plane)
    const int P = p.planes_per_table, R = 1 << P;
    for (int e = threadIdx.x; e < kC * p.lp; e += kThreads) {
      const int r = e / p.lp, lt = e % p.lp, l = lt / P, tt = lt % P;
      float set = 0.f, clear = 0.f;
      for (int bucket = 0; bucket < R; ++bucket) {
        const float gv = bt.g[r * kG + l * R + bucket];
        if ((bucket >> (P - 1 - tt)) & 1) set += gv;
        else clear += gv;
      }
      bt.w[r * p.lp + lt] = s.sm[r * kLPMax + lt] * set - s.sp[r * kLPMax + lt] * clear;
    }
  }
  __syncthreads();
  T* dq = static_cast<T*>(p.out) + hd.bh * p.nq * D;
  for (int r = warp; r < kC; r += kThreads / 32) {
    const int i = m * kC + r;
    float dx[D / 32] = {};
    const float db = chain_row<D>(p, r, hd.beta, bt.u, bt.w, dx);
    if (i < p.nq) {
#pragma unroll
      for (int c = 0; c < D / 32; ++c) dq[(long long)i * D + lane + 32 * c] = from_float<T>(dx[c]);
    }
    if (lane == 0) bt.rowpart[r] = i < p.nq ? db : 0.f;
  }
  __syncthreads();
  if (threadIdx.x == 0) p.dbeta_q[hd.bh * p.nqt + m] = ordered_sum64(bt.rowpart);
}

// dq, den, c and the query-side dbeta partials. Causal: block = (group of kGroup key chunks, q head, batch),
// walking the chunks in order with the running state (slot grp of the group prefix, then += each chunk);
// non-causal: block = (group of kGroup query tiles, q head, batch) with the total state (slot ngk).
// Query tiles before the first key chunk (causal, Nq - Nk >= 64) are never visited: the host zero-fills
// their dq, den, c and dbeta partials.
template <typename T, int D>
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
  if (!p.causal) {
    for (int m = first; m < end; ++m) {
      query_tile<T, D>(p, hd, m, s, dout, bt.dO, bt.u);
      tile_dq<T, D>(p, hd, m, false, s, bt);
    }
    return;
  }
  for (int kappa = first; kappa < end; ++kappa) {
    const int m = kappa - p.kappa0;  // the query tile whose diagonal is in this chunk
    key_chunk<T, D>(p, hd, b, kappa, s, m >= 0);
    if (m >= 0) {
      query_tile<T, D>(p, hd, m, s, dout, bt.dO, bt.u);  // after key_chunk: sp, sm keep q's tables
      load_rows<T, D>(hd.v, p.sv.n, p.s0 + kappa * kC, s.okk, s.x);  // v row-major (x is free again)
      __syncthreads();
      tile_dq<T, D>(p, hd, m, true, s, bt);
    }
    if (kappa + 1 == end) break;
    __syncthreads();  // every warp has read the state
    advance_state<T, D>(s);
  }
}

}  // namespace tc
}  // namespace race
}  // namespace hfab
