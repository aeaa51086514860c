// Stieltjes attention on tensor cores (mma.sync m16n8k16, fp16/bf16 in, fp32 accumulate; sm_80 and newer).
//
// Math (hf_attention_backends/ops/stieltjes/reference.py): s = scale q k^T over allowed keys (causal bottom-right
// aligned: query i sees key j <= i + Nk - Nq; key padding; GQA query head h reads kv head h / groups),
// x = s - rowmax, lambda solves sum_j (lambda - x_j)^(-order) = 1 (Newton, or clamped Halley at order >= 4, on
// f^(-1/order) - 1 from start_lambda, newton_iter steps, clamp >= 1: the reference's solver step for step; newton_iter
// < 0: -newton_iter steps, then up to kMaxExtraSteps more for the rows whose last step may have left them short of
// the root (needs_another_step), a block sweeping the keys again only when one of its rows needs it),
// P = (lambda - x)^(-order), out = P v / sum P. Backward at the saved lambda (implicit function theorem):
// r = (lambda - x)^(-order-1), delta = sum dP r / sum r = dO . u with u = sum r v / sum r (saved by the training
// forward), dS = order r (dP - delta), dq = scale dS k, dk = scale dS^T q, dv = (P / sum P)^T dO. Rows with no allowed
// key: out 0, rowmax 0, lambda 1, u 0, sum P 0, no gradient.
//
// Kernels (128 threads = 4 warps, each warp owns 16 rows of the block; tiles in dynamic shared memory):
//   stieltjes_fwd_kernel  (query block of 64, q head, batch): Q fragments stay in registers; sweeps over
//                         the key tiles of 64 (computed in sub-tiles of 32 keys): stats (max, count, sum),
//                         newton_iter solver sweeps, output sweep; only sub-tiles with a disallowed pair
//                         (diagonal, padding, ragged ends) do per-element mask work (their raw scores set
//                         to -inf; needs scale > 0). The training variant (STATE) also keeps, per row, sum P
//                         and u = sum r v / sum r (the output sweep's second product), so that
//                         delta = sum dP r / sum r = dO . u needs no sweep in the backward
//   stieltjes_dq_kernel   (query block of 64, q head, batch), key tiles of 128 (64 at D 128): delta = dO . u
//                         (to scratch), one sweep for dq = scale dS K
//   stieltjes_dkv_kernel  (key block of 64, kv head, batch): loops over the group's q heads and the query
//                         tiles (32, or 16 at D 128): dv = (P / sum P)^T dO, dk = scale dS^T Q; no atomics
// Products whose left operand is computed in fp32 (P, dS) are split into a 16-bit high part and a 16-bit
// residual (two mma), so the fp32 value enters the product to ~2^-16 relative instead of 2^-8 (bf16). In fp16 that
// holds only in its normal range: a long flat row's P ~ 1/N falls below it, so the forward's P and R enter times
// 2^15 (kPUnit), as does the dkv kernel's P / sum P (also in [0, 1]), the dq kernel's dS per row times
// lambda^(order+1), the dkv kernel's dS (summed over rows, for dk) times a running power of two per warp
// (to_running_unit; all undone in the result).
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/mma.cuh"
#include "common/strides.cuh"
#include "common/tile.cuh"

namespace hfab {
namespace stieltjes {

constexpr int kThreads = 128;

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  const unsigned char* kpm;  // (B, Nk) bool, element (b, j) at b * kpm_sb + j * kpm_sn; nullptr = none
  long long kpm_sb, kpm_sn;
  float* rowmax;  // (B, Hq, Nq) contiguous: forward writes, backward reads
  float* lam;
  float* delta;   // (B, Hq, Nq) contiguous backward scratch: delta = dO . u
  float* lsum;    // (B, Hq, Nq) contiguous sum_j P_ij: the training forward writes, backward reads
  float* u;       // (B, Hq, Nq, D) contiguous fp32 sum_j r_ij v_j / sum_j r_ij: the training forward writes
  void* o;        // forward: out; backward: dq   (B, Hq, Nq, D) contiguous
  void* dk;       // (B, Hkv, Nk, D) contiguous
  void* dv;
  Strides sq, sk, sv, sdo;
  int hq, groups, nq, nk, newton_iter;  // newton_iter < 0: the adaptive solve (reference.solve_lambda)
  float scale, order;
  int causal;
};

// ROWS x D 16-bit elements, rows padded by 8 elements (16 bytes): fragment loads and ldmatrix rows of
// 8 consecutive rows fall on distinct banks.
template <int ROWS, int D> struct HTile {
  uint16_t h[ROWS][D + 8];
};

// acc += a (b0, b1): one m16n8k16 product on T operands (common/mma.cuh).
template <typename T>
__device__ __forceinline__ void mma16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  mma::m16n8k16(acc, a, b, T());
}

// p = y^(-order), r = y^(-order-1) for y >= 1 (y = +inf gives 0, 0); returns 1/y. IORD: 2 or 4 fast paths (one
// MUFU), 0 = any order (three MUFU).
template <int IORD>
__device__ __forceinline__ float powers(float y, float order, float& p, float& r) {
  const float inv = rcp_approx(y);
  if constexpr (IORD == 4) {
    const float i2 = inv * inv;
    p = i2 * i2;
  } else if constexpr (IORD == 2) {
    p = inv * inv;
  } else {
    p = exp2f(-order * __log2f(y));
  }
  r = p * inv;
  return inv;
}

constexpr float kHalleyMinOrder = 4.f;  // reference.HALLEY_MIN_ORDER: clamped Halley steps from this order, Newton below

// One solver step of reference.solve_lambda from a row's sums f = sum y^-order, s1 = sum y^(-order-1) and, for
// HALLEY, s2 = sum y^(-order-2); upper = n^(1/order), above the root. newton: the step's Newton iterate (both
// clamped >= 1, as reference.solver_iterates), for needs_another_step.
template <bool HALLEY>
__device__ __forceinline__ float solver_step(float lam, float f, float s1, float s2, float order, float inv_order,
                                             float upper, float& newton) {
  const float w = exp2f(__log2f(f) * inv_order);
  newton = lam + f * (w - 1.f) / s1;  // never passes the root
  float next = newton;
  if constexpr (HALLEY) {
    const float den = 2.f * s1 * s1 + (w - 1.f) * (order + 1.f) * (s1 * s1 - f * s2);
    if (den > 0.f) {
      const float halley = lam + 2.f * (w - 1.f) * s1 * f / den;
      if (halley > next) next = fmaxf(next, fminf(halley, upper));
    }
  }
  newton = fmaxf(1.f, newton);
  return fmaxf(1.f, next);
}

constexpr int kStartSteps = 6;  // reference.START_STEPS
constexpr float kStepTol = 0.1f;  // reference.STEP_TOL
constexpr float kHalleyTol = 3e-4f;  // reference.HALLEY_TOL
constexpr int kMaxExtraSteps = 2;  // reference.MAX_EXTRA_STEPS

// reference.needs_another_step: whether the step lam -> next (newton: its Newton iterate) may leave the row short of
// the root: a Halley step's error estimate |next - newton| |next - lam| above kHalleyTol next^2, a Newton step's move
// above kStepTol next.
__device__ __forceinline__ bool needs_another_step(float next, float newton, float lam) {
  const float moved = fabsf(next - lam);
  return next != newton ? fabsf(next - newton) * moved > kHalleyTol * next * next : moved > kStepTol * next;
}

// reference.start_lambda from a row's allowed-key count n and mean score below the max mean_x (<= 0), with upper =
// n^(1/order): Jensen's bound max(1, upper + mean_x), then Newton steps on h^(-1/order) - 1 with h = lambda^-order
// + (n - 1) (lambda + dist)^-order (the largest key apart, Jensen on the others), each still a lower bound of the root.
__device__ __forceinline__ float start_lambda(float n, float mean_x, float order, float inv_order, float upper) {
  float lam = fmaxf(1.f, upper + mean_x);
  const float others = n - 1.f, dist = others > 0.f ? -mean_x * n / others : 0.f;
  for (int it = 0; it < kStartSteps; ++it) {
    const float y = lam + dist;
    const float p_top = exp2f(-order * __log2f(lam)), p_rest = others * exp2f(-order * __log2f(y));
    const float h = p_top + p_rest, s1 = p_top / lam + p_rest / y;
    lam += h * (exp2f(__log2f(h) * inv_order) - 1.f) / s1;
  }
  return lam;
}

// Rows [row0, row0 + ROWS) of a matrix with D contiguous elements per row, `stride` elements apart; rows >= n
// are zero. Needs a 16-byte aligned base and stride % 8 == 0 (the host checks).
template <int ROWS, int D, typename T>
__device__ __forceinline__ void load_rows(HTile<ROWS, D>& t, const T* base, long long stride, int row0, int n) {
  mma::load_rows<ROWS, D, kThreads>(t.h, base, stride, row0, [=](int r) { return row0 + r < n; });
}

// The same with cp.async (16 bytes per chunk, rows >= n zero-filled): completes at cp_async_wait.
template <int ROWS, int D, typename T>
__device__ __forceinline__ void load_rows_async(HTile<ROWS, D>& t, const T* base, long long stride, int row0, int n) {
  mma::load_rows_async<ROWS, D, kThreads>(t.h, base, stride, row0, [=](int r) { return row0 + r < n; });
}

// A fragments (16 x D, row-major rows [r0, r0 + 16) of t), one per 16-column chunk.
template <int ROWS, int D>
__device__ __forceinline__ void a_frags(uint32_t (&a)[D / 16][4], const HTile<ROWS, D>& t, int r0, int lane) {
  const int g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    a[kc][0] = mma::ld32(&t.h[r0 + g][16 * kc + c]);
    a[kc][1] = mma::ld32(&t.h[r0 + g + 8][16 * kc + c]);
    a[kc][2] = mma::ld32(&t.h[r0 + g][16 * kc + c + 8]);
    a[kc][3] = mma::ld32(&t.h[r0 + g + 8][16 * kc + c + 8]);
  }
}

// acc (16 x 8*NT) = A (16 x D, fragments) . B^T with B rows t_row0 + [0, 8*NT) of t (row-major, D columns); the B
// fragments of two 8-row n-tiles come from one ldmatrix.x4.
template <int NT, int ROWS, int D, typename T>
__device__ __forceinline__ void mma_abt(float (&acc)[NT][4], const uint32_t (&a)[D / 16][4], const HTile<ROWS, D>& t,
                                        int lane, int t_row0 = 0) {
  static_assert(NT % 2 == 0 && 8 * NT <= ROWS, "tile shapes");
  // matrices: (n-tile 2jj, k 0-7), (2jj, k 8-15), (2jj + 1, k 0-7), (2jj + 1, k 8-15)
  const int brow = (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc)
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
      uint32_t b[4];
      mma::ldsm_x4(b, &t.h[t_row0 + 16 * jj + brow][16 * kc + bcol]);
      mma16816<T>(acc[2 * jj], a[kc], b[0], b[1]);
      mma16816<T>(acc[2 * jj + 1], a[kc], b[2], b[3]);
    }
}

// The same with A rows [r0, r0 + 16) of a shared tile (fragments by ldmatrix.x4 per 16-column chunk).
template <int NT, int RA, int ROWS, int D, typename T>
__device__ __forceinline__ void mma_abt_smem(float (&acc)[NT][4], const HTile<RA, D>& ta, int r0,
                                             const HTile<ROWS, D>& t, int lane, int t_row0 = 0) {
  static_assert(NT % 2 == 0 && 8 * NT <= ROWS, "tile shapes");
  // A matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
  const int arow = r0 + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
  const int brow = (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    uint32_t a[4];
    mma::ldsm_x4(a, &ta.h[arow][16 * kc + acol]);
#pragma unroll
    for (int jj = 0; jj < NT / 2; ++jj) {
      uint32_t bf[4];
      mma::ldsm_x4(bf, &t.h[t_row0 + 16 * jj + brow][16 * kc + bcol]);
      mma16816<T>(acc[2 * jj], a, bf[0], bf[1]);
      mma16816<T>(acc[2 * jj + 1], a, bf[2], bf[3]);
    }
  }
}

// acc (16 x D) += X (16 x 8*NT, fp32 accumulator layout) . B with B = t rows t_row0 + [0, 8*NT) (row-major, D
// columns).
// X enters as a 16-bit high part plus a 16-bit residual.
template <int NT, int ROWS, int D, typename T>
__device__ __forceinline__ void mma_xb(float (&acc)[D / 8][4], const float (&x)[NT][4], const HTile<ROWS, D>& t,
                                      int lane, int t_row0 = 0) {
  static_assert(NT % 2 == 0 && 8 * NT <= ROWS, "tile shapes");
  const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lcol = (lane >> 4) * 8;
#pragma unroll
  for (int kc = 0; kc < NT / 2; ++kc) {
    uint32_t hi[4], lo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // e: (row g, keys 0-7), (row g+8, 0-7), (row g, 8-15), (row g+8, 8-15)
      const float x0 = x[2 * kc + e / 2][2 * (e % 2)], x1 = x[2 * kc + e / 2][2 * (e % 2) + 1];
      hi[e] = Pair<T>::from_float2(make_float2(x0, x1));
      const float2 back = Pair<T>::to_float2(hi[e]);
      lo[e] = Pair<T>::from_float2(make_float2(x0 - back.x, x1 - back.y));
    }
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t b[4];
      mma::ldsm_x4_trans(b, &t.h[t_row0 + 16 * kc + lrow][16 * dn + lcol]);
      mma16816<T>(acc[2 * dn], hi, b[0], b[1]);
      mma16816<T>(acc[2 * dn + 1], hi, b[2], b[3]);
      mma16816<T>(acc[2 * dn], lo, b[0], b[1]);
      mma16816<T>(acc[2 * dn + 1], lo, b[2], b[3]);
    }
  }
}

// P = y^-order and R = y^(-order-1) lie in [0, 1] (y >= lam >= 1), as does P / sum P; the forward's P V and R V
// products and the dkv kernel's dv product take them times 2^15 (exact; undone in the result): a long flat row's
// P ~ 1/N (R ~ 1/(N lam)) would sit below fp16's normal range, where their 16-bit parts keep a few bits (out 1e-3 off
// at N 65,536); scaled, every value above 2^-29 is normal, and none exceeds fp16's max.
constexpr float kPUnit = 32768.f;

// fp16 only (bf16 has fp32's range): x, a left operand of mma_xb summed over many products into acc, enters times a
// warp-wide power of two 2^e that puts the largest |x| so far in [2^14, 2^15), so that a small x (dS ~ 1 / N at a
// long flat row, or beside a small dO) keeps its bits in fp16; a larger x lowers e and rescales acc (exact). e
// starts at kMaxUnitExp; the result is acc 2^-e. All 32 lanes call it (shuffles).
constexpr int kMaxUnitExp = 64, kMinUnitExp = -100;
template <typename T, int NT, int NA>
__device__ __forceinline__ void to_running_unit(float (&x)[NT][4], float (&acc)[NA][4], int& e) {
  if constexpr (std::is_same_v<T, __half>) {
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) mx = fmaxf(mx, fabsf(x[j][k]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    // mx 2^want in [2^14, 2^15): 14 minus mx's unbiased exponent
    const int want = max(kMinUnitExp, 14 - (static_cast<int>(__float_as_uint(mx) >> 23) - 127));
    if (want < e) {  // warp-uniform
      const float f = ldexpf(1.f, want - e);
#pragma unroll
      for (int t = 0; t < NA; ++t)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[t][k] *= f;
      e = want;
    }
    const float unit = __uint_as_float(static_cast<unsigned>(e + 127) << 23);
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) x[j][k] *= unit;
  }
}

__device__ __forceinline__ bool key_ok(const Params& p, int b, int j) {
  return j < p.nk && (p.kpm == nullptr || p.kpm[b * p.kpm_sb + j * p.kpm_sn]);
}

// Last key (exclusive) that any query in [q0, q0 + rows) may see.
__device__ __forceinline__ int key_end(const Params& p, int q0, int rows) {
  if (!p.causal) return p.nk;
  const int last_q = min(q0 + rows, p.nq) - 1;
  return max(0, min(p.nk, last_q + (p.nk - p.nq) + 1));
}

// True when every (query, key) pair of queries [q0, q0 + rows) x keys [k0, k0 + cols) exists and is allowed.
__device__ __forceinline__ bool all_allowed(const Params& p, int q0, int rows, int k0, int cols) {
  return p.kpm == nullptr && q0 + rows <= p.nq && k0 + cols <= p.nk &&
         (!p.causal || k0 + cols - 1 <= q0 + p.nk - p.nq);
}

// Raw scores (q.k, unscaled) of rows r0 + g, r0 + g + 8 x keys k0 + [0, 8 NT) in the mma accumulator layout:
// -inf where the pair is not allowed (kbias: the key tile's 0 / -inf bias, or nullptr where every key of the tile is
// real: tile_needs_bias). With scale > 0, scale s - rowmax stays -inf there, so lambda - x is +inf and y^(-order) is
// 0: no other per-element mask work.
template <int NT>
__device__ __forceinline__ void mask_raw(float (&s)[NT][4], const Params& p, const float* kbias, int r0, int k0,
                                         int lane) {
  const int g = lane / 4, c = 2 * (lane % 4), off = p.nk - p.nq;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = r0 + g + 8 * (e / 2), col = 8 * j + c + (e % 2);
      const bool ok = i < p.nq && (!p.causal || k0 + col <= i + off);
      s[j][e] = ok ? s[j][e] + (kbias != nullptr ? kbias[col] : 0.f) : -inf();
    }
}

// Whether key tile [k0, k0 + BK) holds a padding key or one past the keys, i.e. needs its load_bias (elsewhere every
// bias is 0: the tile's is neither stored nor read).
template <int BK> __device__ __forceinline__ bool tile_needs_bias(const Params& p, int k0) {
  return p.kpm != nullptr || k0 + BK > p.nk;
}

// The key sub-tiles [k0, k0 + cols) with k0 + cols <= interior_end(p, r0, rows) are interior for rows
// [r0, r0 + rows): all_allowed(p, r0, rows, k0, cols) for every k0 >= 0, in one compare per sub-tile.
__device__ __forceinline__ int interior_end(const Params& p, int r0, int rows) {
  if (p.kpm != nullptr || r0 + rows > p.nq) return 0;
  return p.causal ? min(p.nk, r0 + p.nk - p.nq + 1) : p.nk;
}

template <int BK>
__device__ __forceinline__ void load_bias(float* kbias, const Params& p, int b, int k0) {
  for (int c = threadIdx.x; c < BK; c += kThreads) kbias[c] = key_ok(p, b, k0 + c) ? 0.f : -inf();
}

template <int D> struct FwdCfg {
  static constexpr int BQ = 64, BK = 64, KS = 32;  // key tiles of BK, computed in sub-tiles of KS keys
  // blocks per SM the registers must allow: caps registers at 128 (D <= 64: 4 blocks), 255 (D 128: 2 blocks by
  // its ~190 registers); lower caps (96, 80) spill. The training variant's u accumulators (D / 2 registers) need
  // 168 at D <= 64 (3 blocks); at D 128 it sweeps once more instead
  static constexpr int min_blocks(bool state) { return D <= 64 ? (state ? 3 : 4) : 2; }
  struct Smem {  // key tiles double-buffered (cp.async prefetch of the next tile)
    HTile<BK, D> k[2];
    union {
      HTile<BQ, D> q;  // read into registers before the first key tile
      HTile<BK, D> v[2];
    } u;
    float kbias[2][BK];
  };
};

template <typename T, int D, int IORD, bool STATE>
__global__ void __launch_bounds__(kThreads, FwdCfg<D>::min_blocks(STATE)) stieltjes_fwd_kernel(const Params p) {
  using Cfg = FwdCfg<D>;
  constexpr int BQ = Cfg::BQ, BK = Cfg::BK, KS = Cfg::KS, NT = KS / 8;
  using Sub = std::integral_constant<int, KS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = 2 * (lane % 4);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;  // longest causal blocks first
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.groups;
  const int r0 = q0 + 16 * warp;
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + kvh * p.sv.h;
  const float order = p.order, inv_order = 1.f / p.order, scale = p.scale;

  load_rows(sm.u.q, q, p.sq.n, q0, p.nq);
  __syncthreads();
  uint32_t qf[D / 16][4];
  a_frags(qf, sm.u.q, 16 * warp, lane);

  const int tiles = (key_end(p, q0, BQ) + BK - 1) / BK, warp_keys = key_end(p, r0, 16);
  const int warp_interior = interior_end(p, r0, 16);
  auto issue = [&](bool with_v, int tile) {
    const int buf = tile & 1, k0 = tile * BK;
    load_rows_async(sm.k[buf], k, p.sk.n, k0, p.nk);
    if (with_v) load_rows_async(sm.u.v[buf], v, p.sv.n, k0, p.nk);
    if (tile_needs_bias<BK>(p, k0)) load_bias<BK>(sm.kbias[buf], p, b, k0);
  };
  // body(s, buf, koff, all): s = raw q.k of this warp's 16 rows x keys koff + [0, KS) of the tile in buffer buf,
  // -inf where not allowed; all: every pair of the warp's sub-tile is allowed. The body is inlined on each path (the
  // interior one without a join that would copy the masked path's scores into the same registers). Sub-tiles past
  // the warp's last visible key (causal) are skipped: all their pairs are masked.
  // sub: std::integral_constant<int, sub-tile width> (KS, or 16 where the body keeps more registers live)
  auto sweep = [&](bool with_v, auto&& body, auto sub) {
    constexpr int W = decltype(sub)::value, NW = W / 8;
    if (tiles == 0) return;
    __syncthreads();  // readers of the previous sweep's buffers (and of q, aliased with v) are done
    issue(with_v, 0);
    for (int tile = 0; tile < tiles; ++tile) {
      const int buf = tile & 1;
      mma::cp_async_wait_all();
      __syncthreads();  // tile `tile` has landed for every thread; tile - 1's readers are done
      if (tile + 1 < tiles) issue(with_v, tile + 1);  // overwrites the buffer tile - 1 used
#pragma unroll
      for (int koff = 0; koff < BK; koff += W) {
        const int k0 = tile * BK + koff;
        if (k0 >= warp_keys) break;  // warp-uniform
        float s[NW][4];
        mma_abt<NW, BK, D, T>(s, qf, sm.k[buf], lane, koff);
        if (k0 + W <= warp_interior) {  // warp-uniform: interior sub-tiles skip the mask
          body(s, buf, koff, true);
        } else {
          mask_raw(s, p, tile_needs_bias<BK>(p, tile * BK) ? sm.kbias[buf] + koff : nullptr, r0, k0, lane);
          body(s, buf, koff, false);
        }
      }
    }
  };

  // rows r0 + g (index 0) and r0 + g + 8 (index 1) of this thread; max and sum of the raw scores, scaled after
  // the sweep (scale > 0: the max of the scaled scores is the scaled max, to the bit)
  float m[2] = {-inf(), -inf()}, cnt[2] = {0.f, 0.f}, sum[2] = {0.f, 0.f};
  sweep(false, [&](float (&s)[NT][4], int, int, bool all) {
    if (all) {
      cnt[0] += 2.f * NT;
      cnt[1] += 2.f * NT;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          m[e / 2] = fmaxf(m[e / 2], s[j][e]);
          sum[e / 2] += s[j][e];
        }
      return;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (s[j][e] != -inf()) {
          m[e / 2] = fmaxf(m[e / 2], s[j][e]);
          cnt[e / 2] += 1.f;
          sum[e / 2] += s[j][e];
        }
  }, Sub{});
  float lam[2], neg_m[2], upper[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = mma::quad_max(m[r]) * scale;
    cnt[r] = mma::quad_sum(cnt[r]);
    sum[r] = mma::quad_sum(sum[r]) * scale;
    if (cnt[r] == 0.f) m[r] = 0.f;  // empty row: every pair is masked, every y is +inf
    neg_m[r] = -m[r];
    upper[r] = exp2f(__log2f(cnt[r]) * inv_order);
    lam[r] = cnt[r] > 0.f ? start_lambda(cnt[r], sum[r] / cnt[r] - m[r], order, inv_order, upper[r]) : 1.f;
  }

  // y = lam - (s scale - m) = (lam + m) - s scale: one FFMA per score; rounding lam + m moves y by <= 6e-8 (lam + |m|)
  const float neg_scale = -scale;
  float lam_m[2];
  auto shift_by_max = [&] {
    lam_m[0] = lam[0] - neg_m[0];
    lam_m[1] = lam[1] - neg_m[1];
  };
  // upper[r] (n^(1/order) > 0) carries in its sign whether the row takes the next step: negative before each of the
  // newton_iter steps, then after a step whether the row needs another (needs_another_step), so an extra step takes
  // only those rows, as reference.solve_lambda's adaptive steps. (No register of its own
  // across the sweeps: the D 64 kernels sit at their 128-register cap.)
  // one solver sweep: the row sums at lam, then solver_step (s2 only for Halley)
  auto solve = [&](auto halley) {
    constexpr bool kHalley = decltype(halley)::value;
    float f[2] = {0.f, 0.f}, s1[2] = {0.f, 0.f}, s2[2] = {0.f, 0.f};
    shift_by_max();
    sweep(false, [&](float (&s)[NT][4], int, int, bool) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pp, rr;
          const float inv = powers<IORD>(fmaf(s[j][e], neg_scale, lam_m[e / 2]), order, pp, rr);
          f[e / 2] += pp;
          s1[e / 2] = fmaf(pp, inv, s1[e / 2]);  // y^(-order-1) = p / y, fused (rr unused)
          if constexpr (kHalley) s2[e / 2] = fmaf(pp, inv * inv, s2[e / 2]);
        }
    }, Sub{});
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      f[r] = mma::quad_sum(f[r]);
      s1[r] = mma::quad_sum(s1[r]);
      if constexpr (kHalley) s2[r] = mma::quad_sum(s2[r]);
      if (cnt[r] > 0.f && upper[r] < 0.f) {
        const float up = fabsf(upper[r]);
        float newton;
        const float next = solver_step<kHalley>(lam[r], f[r], s1[r], s2[r], order, inv_order, up, newton);
        upper[r] = needs_another_step(next, newton, lam[r]) ? -up : up;
        lam[r] = next;
      }
    }
  };
  const auto steps = [&](auto halley) {
    const int fixed = abs(p.newton_iter), total = fixed + (p.newton_iter < 0 ? kMaxExtraSteps : 0);
    for (int it = 0; it < total; ++it) {
      if (it < fixed) {  // every row steps
        upper[0] = -fabsf(upper[0]);
        upper[1] = -fabsf(upper[1]);
      } else if (!__syncthreads_or(upper[0] < 0.f || upper[1] < 0.f)) {
        break;  // block-uniform: an extra sweep only where a row needs it
      }
      solve(halley);
    }
  };
  if constexpr (IORD == 4) steps(std::true_type{});
  else if constexpr (IORD == 2) steps(std::false_type{});
  else if (order >= kHalleyMinOrder) steps(std::true_type{});
  else steps(std::false_type{});

  // The output sweep: o = P V, l = sum P and, for STATE, ru = R V, lr = sum R (R = y^(-order-1)): one sweep for
  // both at D <= 64; D 128 has no registers for both accumulators at once (255 and spills), so its training forward
  // sweeps again for ru, in o's registers (its backward saves the same sweep). P and R enter times kPUnit.
  float o[D / 8][4], l[2] = {0.f, 0.f}, lr[2] = {0.f, 0.f};
  auto output_sweep = [&](auto want_p, auto want_r, float (&po)[D / 8][4], float (&ro)[D / 8][4]) {
    constexpr bool kP = decltype(want_p)::value, kR = decltype(want_r)::value;
#pragma unroll
    for (int t = 0; t < D / 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kP) po[t][e] = 0.f;
        if constexpr (kR) ro[t][e] = 0.f;
      }
    shift_by_max();
    sweep(true, [&](auto& s, int buf, int koff, bool) {
      constexpr int NW = std::extent_v<std::remove_reference_t<decltype(s)>>;
      float rs[NW][4];
#pragma unroll
      for (int j = 0; j < NW; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pp;
          powers<IORD>(fmaf(s[j][e], neg_scale, lam_m[e / 2]), order, pp, rs[j][e]);
          pp *= kPUnit;
          s[j][e] = pp;
          if constexpr (kP) l[e / 2] += pp;
          if constexpr (kR) {
            rs[j][e] *= kPUnit;
            lr[e / 2] += rs[j][e];
          }
        }
      if constexpr (kP) mma_xb<NW, BK, D, T>(po, s, sm.u.v[buf], lane, koff);
      if constexpr (kR) mma_xb<NW, BK, D, T>(ro, rs, sm.u.v[buf], lane, koff);
    }, std::integral_constant<int, kP && kR ? 16 : KS>{});  // both products: sub-tiles of 16 keys, fewer registers
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (kP) l[r] = mma::quad_sum(l[r]);
      if constexpr (kR) lr[r] = mma::quad_sum(lr[r]);
    }
  };
  // each row's values, columns 8 dt + c, c + 1 of acc divided by the row's sum, stored by store(row, dt, x0, x1)
  auto store_rows = [&](const float (&acc)[D / 8][4], const float (&sum)[2], auto&& store) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = r0 + g + 8 * r;
      if (i >= p.nq) continue;
      const long long row = (long long)(b * p.hq + h) * p.nq + i;
      const float inv = sum[r] > 0.f ? 1.f / sum[r] : 0.f;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) store(row, dt, acc[dt][2 * r] * inv, acc[dt][2 * r + 1] * inv);
    }
  };
  auto store_u = [&](const float (&ru)[D / 8][4]) {
    store_rows(ru, lr, [&](long long row, int dt, float x0, float x1) {
      *reinterpret_cast<float2*>(p.u + row * D + 8 * dt + c) = make_float2(x0, x1);
    });
  };
  if constexpr (STATE && D <= 64) {
    float ru[D / 8][4];
    output_sweep(std::true_type{}, std::true_type{}, o, ru);
    store_u(ru);
  } else {
    output_sweep(std::true_type{}, std::false_type{}, o, o);
  }
  store_rows(o, l, [&](long long row, int dt, float x0, float x1) {
    *reinterpret_cast<unsigned*>(static_cast<T*>(p.o) + row * D + 8 * dt + c) =
        Pair<T>::from_float2(make_float2(x0, x1));
  });
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = r0 + g + 8 * r;
    if (i >= p.nq || lane % 4 != 0) continue;
    const long long row = (long long)(b * p.hq + h) * p.nq + i;
    p.rowmax[row] = m[r];
    p.lam[row] = lam[r];
    if constexpr (STATE) p.lsum[row] = l[r] * (1.f / kPUnit);
  }
  if constexpr (STATE && D > 64) {
    output_sweep(std::false_type{}, std::true_type{}, o, o);
    store_u(o);
  }
}

// This lane's part of dO_i . u_i (delta = sum_j dP_ij r_ij / sum_j r_ij, with dP = dO v^T): columns 8 t + c, c + 1;
// the quad's four lanes together cover the row (mma::quad_sum).
template <typename T, int D>
__device__ __forceinline__ float row_delta(const uint16_t (&dout_row)[D + 8], const float* u_row, int c) {
  float acc = 0.f;
#pragma unroll
  for (int t = 0; t < D / 8; ++t) {
    const float2 d = Pair<T>::to_float2(mma::ld32(&dout_row[8 * t + c]));
    const float2 u = *reinterpret_cast<const float2*>(u_row + 8 * t + c);
    acc = fmaf(d.x, u.x, fmaf(d.y, u.y, acc));
  }
  return acc;
}

template <int D> struct DqCfg {
  // key tiles of BK (one barrier each; D 128 keeps 64: 70 KB, within the 99 KB per block of sm_86 / sm_89), in
  // sub-tiles of KS keys
  static constexpr int BQ = 64, BK = D == 128 ? 64 : 128, KS = 32;
  static constexpr int kMinBlocks = D == 128 ? 1 : 3;  // caps registers at 168 for D <= 64 (3 blocks per SM)
  struct Smem {
    union {
      struct {
        HTile<BQ, D> q, dout;  // read into registers before the first key tile
      } qd;
      struct {
        HTile<BK, D> k, v;
      } kv[2];  // double-buffered (cp.async prefetch of the next tile)
    } u;
    float kbias[2][BK];
  };
};

template <typename T, int D, int IORD>
__global__ void __launch_bounds__(kThreads, DqCfg<D>::kMinBlocks) stieltjes_dq_kernel(const Params p) {
  using Cfg = DqCfg<D>;
  constexpr int BQ = Cfg::BQ, BK = Cfg::BK, KS = Cfg::KS, NT = KS / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = 2 * (lane % 4);
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int h = blockIdx.y, b = blockIdx.z, kvh = h / p.groups;
  const int r0 = q0 + 16 * warp;
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + kvh * p.sv.h;
  const float order = p.order;
  const long long row_base = (long long)(b * p.hq + h) * p.nq;

  load_rows(sm.u.qd.q, q, p.sq.n, q0, p.nq);
  load_rows(sm.u.qd.dout, dout, p.sdo.n, q0, p.nq);
  __syncthreads();
  uint32_t qf[D / 16][4], df[D / 16][4];
  a_frags(qf, sm.u.qd.q, 16 * warp, lane);
  a_frags(df, sm.u.qd.dout, 16 * warp, lane);
  // lam + m: y = (lam + m) - s scale, the forward's y to the bit. ds_unit: order lam^(order+1), so dS enters the
  // product as order (lam / y)^(order+1) (dP - delta), out of fp16's subnormals for a long flat row and no larger
  // than at a row's max key; undone per row at the store
  float lam_m[2], delta[2], ds_unit[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = r0 + g + 8 * r;
    const float m = i < p.nq ? p.rowmax[row_base + i] : 0.f, lam = i < p.nq ? p.lam[row_base + i] : 1.f;
    lam_m[r] = lam - (-m);
    float lam_p, lam_r;
    powers<IORD>(lam, order, lam_p, lam_r);
    ds_unit[r] = order / lam_r;
    delta[r] = i < p.nq ? row_delta<T, D>(sm.u.qd.dout.h[16 * warp + g + 8 * r], p.u + (row_base + i) * D, c) : 0.f;
    delta[r] = mma::quad_sum(delta[r]);
    if (i < p.nq && lane % 4 == 0) p.delta[row_base + i] = delta[r];
  }
  const float neg_scale = -p.scale;

  const int tiles = (key_end(p, q0, BQ) + BK - 1) / BK, warp_keys = key_end(p, r0, 16);
  const int warp_interior = interior_end(p, r0, 16);
  auto issue = [&](int tile) {
    const int buf = tile & 1, k0 = tile * BK;
    load_rows_async(sm.u.kv[buf].k, k, p.sk.n, k0, p.nk);
    load_rows_async(sm.u.kv[buf].v, v, p.sv.n, k0, p.nk);
    if (tile_needs_bias<BK>(p, k0)) load_bias<BK>(sm.kbias[buf], p, b, k0);
  };
  auto sweep = [&](auto&& body) {
    if (tiles == 0) return;
    __syncthreads();  // readers of the previous sweep's buffers (and of q, dout, aliased) are done
    issue(0);
    for (int tile = 0; tile < tiles; ++tile) {
      const int buf = tile & 1;
      mma::cp_async_wait_all();
      __syncthreads();  // tile `tile` has landed for every thread; tile - 1's readers are done
      if (tile + 1 < tiles) issue(tile + 1);
#pragma unroll
      for (int koff = 0; koff < BK; koff += KS) {
        const int k0 = tile * BK + koff;
        if (k0 >= warp_keys) break;  // warp-uniform: past the warp's last visible key (causal), every pair is masked
        float s[NT][4], dp[NT][4];
        mma_abt<NT, BK, D, T>(s, qf, sm.u.kv[buf].k, lane, koff);
        mma_abt<NT, BK, D, T>(dp, df, sm.u.kv[buf].v, lane, koff);
        if (k0 + KS <= warp_interior) {  // warp-uniform: interior sub-tiles skip the mask (body for each path)
          body(s, dp, buf, koff);
        } else {
          mask_raw(s, p, tile_needs_bias<BK>(p, tile * BK) ? sm.kbias[buf] + koff : nullptr, r0, k0, lane);
          body(s, dp, buf, koff);
        }
      }
    }
  };

  float dq[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) dq[t][0] = dq[t][1] = dq[t][2] = dq[t][3] = 0.f;
  sweep([&](float (&s)[NT][4], float (&dp)[NT][4], int buf, int koff) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pp, rr;
        powers<IORD>(fmaf(s[j][e], neg_scale, lam_m[e / 2]), order, pp, rr);
        s[j][e] = ds_unit[e / 2] * rr * (dp[j][e] - delta[e / 2]);
      }
    mma_xb<NT, BK, D, T>(dq, s, sm.u.kv[buf].k, lane, koff);
  });

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = r0 + g + 8 * r;
    if (i >= p.nq) continue;
    T* out = static_cast<T*>(p.o) + (row_base + i) * D;
    const float f = p.scale * order / ds_unit[r];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<unsigned*>(out + 8 * dt + c) =
          Pair<T>::from_float2(make_float2(dq[dt][2 * r] * f, dq[dt][2 * r + 1] * f));
  }
}

template <int D> struct DkvCfg {
  // query tiles of BQ (one barrier each), computed in sub-tiles of QS queries
  static constexpr int BK = 64, BQ = D == 128 ? 16 : 64, QS = D == 128 ? 16 : 32;
  static constexpr int kMinBlocks = D == 128 ? 1 : 3;  // caps registers at 168 for D <= 64 (3 blocks per SM)
  struct Smem {  // query tiles and their row state double-buffered (cp.async prefetch of the next tile)
    HTile<BK, D> k, v;
    HTile<BQ, D> q[2], dout[2];
    float4 rows[2][BQ];  // per query row: lam + m (the forward's y = (lam + m) - s scale), 1 / sum P, delta, 0
  };
};

template <typename T, int D, int IORD>
__global__ void __launch_bounds__(kThreads, DkvCfg<D>::kMinBlocks) stieltjes_dkv_kernel(const Params p) {
  using Cfg = DkvCfg<D>;
  constexpr int BK = Cfg::BK, BQ = Cfg::BQ, QS = Cfg::QS, NT = QS / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<typename Cfg::Smem*>(smem_raw);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, c = 2 * (lane % 4);
  const int k0 = blockIdx.x * BK;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int kr0 = 16 * warp;  // this warp's keys k0 + kr0 + [0, 16)
  const int off = p.nk - p.nq;
  const float order = p.order;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + kvh * p.sv.h;

  load_rows(sm.k, k, p.sk.n, k0, p.nk);
  load_rows(sm.v, v, p.sv.n, k0, p.nk);
  const int key[2] = {k0 + kr0 + g, k0 + kr0 + g + 8};
  const float kbias[2] = {key_ok(p, b, key[0]) ? 0.f : -inf(), key_ok(p, b, key[1]) ? 0.f : -inf()};

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[t][e] = dv[t][e] = 0.f;
  int dk_exp = std::is_same_v<T, __half> ? kMaxUnitExp : 0;  // dk holds dk 2^dk_exp (to_running_unit)

  // query tiles (q head of the group, query block), causal: from the first block that sees key k0
  const int first = p.causal ? max(0, k0 - off) / BQ * BQ : 0;
  const int per_head = p.nq > first ? (p.nq - first + BQ - 1) / BQ : 0, tiles = p.groups * per_head;
  auto issue = [&](int tile) {
    const int buf = tile & 1, h = kvh * p.groups + tile / per_head, q0 = first + (tile % per_head) * BQ;
    load_rows_async(sm.q[buf], static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h, p.sq.n, q0, p.nq);
    load_rows_async(sm.dout[buf], static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h, p.sdo.n, q0, p.nq);
    const long long row_base = (long long)(b * p.hq + h) * p.nq;
    for (int cq = threadIdx.x; cq < BQ; cq += kThreads) {
      const int i = q0 + cq;
      const bool in = i < p.nq;
      const float m = in ? p.rowmax[row_base + i] : 0.f, lam = in ? p.lam[row_base + i] : 1.f;
      const float l = in ? p.lsum[row_base + i] : 0.f;
      sm.rows[buf][cq] = make_float4(lam - (-m), l > 0.f ? kPUnit / l : 0.f, in ? p.delta[row_base + i] : 0.f, 0.f);
    }
  };
  if (tiles > 0) issue(0);
  for (int tile = 0; tile < tiles; ++tile) {
    const int buf = tile & 1, q0 = first + (tile % per_head) * BQ;
    mma::cp_async_wait_all();
    __syncthreads();  // tile `tile` (and k, v) visible to every thread; tile - 1's readers are done
    if (tile + 1 < tiles) issue(tile + 1);  // overwrites the buffers tile - 1 used
#pragma unroll
    for (int qoff = 0; qoff < BQ; qoff += QS) {
      const int qs0 = q0 + qoff;
      if (qs0 >= p.nq) break;  // warp-uniform: past the queries
      if (p.causal && qs0 + QS - 1 + off < k0 + kr0) continue;  // warp-uniform: no query of the sub-tile sees a key
      float s[NT][4], dp[NT][4];  // rows: keys; columns: queries qs0 + [0, QS)
      mma_abt_smem<NT, BK, BQ, D, T>(s, sm.k, kr0, sm.q[buf], lane, qoff);
      mma_abt_smem<NT, BK, BQ, D, T>(dp, sm.v, kr0, sm.dout[buf], lane, qoff);
      // P / l and dS for the warp's 16 keys x the sub-tile's queries; y(j, e) = (lam + m) - s scale as in the
      // forward, +inf where the pair is masked (P = r = 0)
      const auto grads = [&](auto y_of) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float4 row = sm.rows[buf][qoff + 8 * j + c + h];  // query qs0 + 8 j + c + h: elements h, h + 2
#pragma unroll
            for (int e = h; e < 4; e += 2) {
              float pp, rr;
              powers<IORD>(y_of(j, e, row.x), order, pp, rr);
              s[j][e] = pp * row.y;
              dp[j][e] = order * rr * (dp[j][e] - row.z);
            }
          }
      };
      if (all_allowed(p, qs0, QS, k0 + kr0, 16))  // warp-uniform: no mask, no key bias (interior sub-tiles)
        grads([&](int j, int e, float lam_m) { return fmaf(s[j][e], -p.scale, lam_m); });
      else
        grads([&](int j, int e, float lam_m) {
          const int i = qs0 + 8 * j + c + (e % 2);
          const bool ok = i < p.nq && (!p.causal || key[e / 2] <= i + off);
          return ok ? fmaf(s[j][e], -p.scale, lam_m) - kbias[e / 2] : inf();
        });
      mma_xb<NT, BQ, D, T>(dv, s, sm.dout[buf], lane, qoff);
      to_running_unit<T>(dp, dk, dk_exp);
      mma_xb<NT, BQ, D, T>(dk, dp, sm.q[buf], lane, qoff);
    }
  }

  const float dk_f = ldexpf(p.scale, -dk_exp);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= p.nk) continue;
    const long long row = ((long long)b * (p.hq / p.groups) + kvh) * p.nk + key[r];
    T* dkr = static_cast<T*>(p.dk) + row * D;
    T* dvr = static_cast<T*>(p.dv) + row * D;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<unsigned*>(dkr + 8 * dt + c) =
          Pair<T>::from_float2(make_float2(dk[dt][2 * r] * dk_f, dk[dt][2 * r + 1] * dk_f));
      *reinterpret_cast<unsigned*>(dvr + 8 * dt + c) =
          Pair<T>::from_float2(make_float2(dv[dt][2 * r] * (1.f / kPUnit), dv[dt][2 * r + 1] * (1.f / kPUnit)));
    }
  }
}

}  // namespace stieltjes
}  // namespace hfab
