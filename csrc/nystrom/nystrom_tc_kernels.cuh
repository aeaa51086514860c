// Nyström output on tensor cores (mma.sync sm_80+, wgmma sm_90a): out = softmax(q_s keysᵀ) values + conv residual over the
// key/value buffer of nystrom_kernels.cuh (slots <= 128 fp32 rows per (batch, q head); keys carry √scale).
//
// nystrom_out_tc_fwd_kernel: grid (blocks per head, Hq, B), 256 threads = 8 warps, each warp owns 16 rows of a
// 128-row query tile. A block stages its head's buffer once in shared memory and then takes query tiles
// blockIdx.x, blockIdx.x + gridDim.x, ...: each tile loads (cp.async) into one shared tile, from which the warps read
// their A fragments at every chunk (at most 128 registers: two blocks per SM overlap one's loads with the other's
// products). Per 32-row chunk of the buffer, an online softmax step. Built for sm_90a the products run on wgmma
// (each warpgroup of four warps takes 64 rows; tiles in core matrices), else on mma.sync.
// Precision: S = q keysᵀ with q exact in T and keys as a T high part plus a T residual (two mma, ~2^-16 relative
// for bf16); P values with P and the fp32 values each in two fp16 halves (hi hi + hi lo + lo hi, three m16n8k16:
// ~2^-22 relative, about fp32), whatever T is, because W = Z (K3 v) can exceed |out| 50-fold (an ill-conditioned K2).
// fp16's range is kept by powers of two: the block's values times 2^e with max |value| 2^e in [2^14, 2^15), P (<= 1)
// times 2^8 (so that neither residual falls among fp16's subnormals); the sums are scaled back once per tile.
#pragma once

#include <cstdint>

#include "common/mma.cuh"
#include "common/wgmma.cuh"
#include "nystrom/nystrom_kernels.cuh"

namespace hfab {
namespace nystrom {
namespace tc {

constexpr bool kWgmma = wgmma::kEnabled;

constexpr int kWarps = 8, kThreads = 32 * kWarps, kBQ = 16 * kWarps;
constexpr int kChunk = 32;  // buffer rows per online-softmax step (32: the scores take 16 registers, not 32)

// Dynamic shared memory for a buffer of `slots` rows (padded to 16; to kChunk in the wgmma layout):
//   khi, klo [rows][D + 8] T     keys as a 16-bit high part and residual (ldmatrix rows 16-byte aligned)
//   vhi, vlo [rows][D + 8] fp16  values times 2^e (the block's power of two) as high part and residual
//   q        [stages][kBQ][D + 8] T  the query tile (two stages: the next one's copy in flight during this one)
// The wgmma path (sm_90a) holds the same tiles in core matrices (mma::core_at), D elements per row; `bytes` is the
// larger of the two layouts, so that the host needs not know which path the kernel was built with.
template <int D> struct OutSmem {
  static constexpr int kKey = D + 8;
  static __host__ __device__ int rows(int slots) { return (slots + 15) / 16 * 16; }
  static __host__ __device__ int core_rows(int slots) { return (slots + kChunk - 1) / kChunk * kChunk; }
  static __host__ __device__ int bytes(int slots, int stages = 1) {
    const int padded = 4 * rows(slots) * kKey * 2 + stages * kBQ * kKey * 2;
    const int core = 4 * core_rows(slots) * D * 2 + stages * kBQ * D * 2;
    return padded > core ? padded : core;
  }
};

constexpr int kProbExp = 8;  // P (<= 1) enters the P values product times 2^8

// Two fp32 values as packed T high parts and packed T residuals.
template <typename T>
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = Pair<T>::from_float2(make_float2(x0, x1));
  const float2 back = Pair<T>::to_float2(hi);
  lo = Pair<T>::from_float2(make_float2(x0 - back.x, x1 - back.y));
}

// Rows [0, rows) of an fp32 matrix (D floats per row; rows >= count zero) times `scale` (a power of two) into shared
// memory as 16-bit high parts and residuals, rows D + 8 elements apart (CORE: in core matrices, mma::core_at), by a
// block of THREADS threads.
template <typename T, int D, int THREADS, bool CORE = false>
__device__ __forceinline__ void split_rows(const float* src, int count, int rows, uint16_t* hi, uint16_t* lo,
                                           float scale = 1.f) {
  constexpr int kQuads = D / 4;
  for (int c = threadIdx.x; c < rows * kQuads; c += THREADS) {
    const int r = c / kQuads, d = 4 * (c % kQuads);
    const float4 x = r < count ? __ldg(reinterpret_cast<const float4*>(src + r * D + d)) : make_float4(0.f, 0.f, 0.f, 0.f);
    uint2 h, l;
    split_pair<T>(x.x * scale, x.y * scale, h.x, l.x);
    split_pair<T>(x.z * scale, x.w * scale, h.y, l.y);
    const int at = CORE ? mma::core_at<D>(r, d) : r * (D + 8) + d;
    *reinterpret_cast<uint2*>(hi + at) = h;
    *reinterpret_cast<uint2*>(lo + at) = l;
  }
}

// The power of two e with max |x| 2^e in [2^14, 2^15) over rows [0, count) of an fp32 matrix (D floats per row), the
// same in every thread of the block (one barrier; `red`: kThreads / 32 floats of shared memory); e is in [-113, 100]
// (100 for tiny or zero values), so 2^e and 2^-e are normal floats; 0 where the maximum is inf (the product then
// carries inf or NaN into the output, as a NaN among the values does).
template <int D>
__device__ __forceinline__ int fp16_exponent(const float* src, int count, float* red) {
  float mx = 0.f;
  for (int c = threadIdx.x; c < count * (D / 4); c += kThreads) {
    const float4 x = __ldg(reinterpret_cast<const float4*>(src + c * 4));
    mx = fmaxf(mx, fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w))));
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) mx = fmaxf(mx, red[w]);
  if (mx == inf()) return 0;
  int ex;
  frexpf(mx, &ex);  // mx = f 2^ex, f in [0.5, 1)
  return min(15 - ex, 100);
}

// The first `nvalid` buffer rows into shared memory (keys and values 2^e split), zeros up to `rows`; returns e.
template <typename T, int D, bool CORE = false>
__device__ __forceinline__ int stage_buffer(const float* keys, const float* vals, int nvalid, int rows, uint16_t* khi,
                                            uint16_t* klo, uint16_t* vhi, uint16_t* vlo, float* red) {
  split_rows<T, D, kThreads, CORE>(keys, nvalid, rows, khi, klo);
  const int e = fp16_exponent<D>(vals, nvalid, red);
  split_rows<__half, D, kThreads, CORE>(vals, nvalid, rows, vhi, vlo, ldexpf(1.f, e));
  return e;
}

// s (16 x kChunk, C layout) = this warp's 16 query rows of the staged tile qs ([kBQ][D + 8], A fragments by ldmatrix
// from row `arow`, column `acol`) times keys rows [c0, c0 + kChunk)ᵀ, high part plus residual; 16-row n-tile pairs at
// or past nvalid are skipped (left 0).
template <typename T, int D>
__device__ __forceinline__ void chunk_scores(float (&s)[kChunk / 8][4], const uint16_t* qs, int arow, int acol,
                                             const uint16_t* khi, const uint16_t* klo, int c0, int nvalid, int lane) {
  constexpr int kKey = OutSmem<D>::kKey;
  // matrices: (n-tile 2jj, k 0-7), (2jj, k 8-15), (2jj + 1, k 0-7), (2jj + 1, k 8-15)
  const int brow = (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int j = 0; j < kChunk / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    uint32_t qa[4];
    mma::ldsm_x4(qa, qs + arow * kKey + 16 * kc + acol);
#pragma unroll
    for (int jj = 0; jj < kChunk / 16; ++jj) {
      if (c0 + 16 * jj >= nvalid) continue;
      const int off = (c0 + 16 * jj + brow) * kKey + bcol + 16 * kc;
      uint32_t b[4];
      mma::ldsm_x4(b, khi + off);
      mma::m16n8k16(s[2 * jj], qa, {b[0], b[1]}, T());
      mma::m16n8k16(s[2 * jj + 1], qa, {b[2], b[3]}, T());
      mma::ldsm_x4(b, klo + off);
      mma::m16n8k16(s[2 * jj], qa, {b[0], b[1]}, T());
      mma::m16n8k16(s[2 * jj + 1], qa, {b[2], b[3]}, T());
    }
  }
}

// acc (16 x D) += x (16 x 8 NT, C layout, fp32) times rows [0, 8 NT) of the 16-bit tile b ([.][D + 8], rows as the k
// index, by ldmatrix.trans), x in two halves: x_hi b + x_lo b; with kLo, b is the high part of fp32 values whose
// residual is b_lo, and x_hi b_lo is added. 16-row k-steps at or past row `valid` are skipped.
template <typename T, int D, int NT, bool kLo>
__device__ __forceinline__ void halves_product(float (&acc)[D / 8][4], const float (&x)[NT][4], const uint16_t* b,
                                               const uint16_t* b_lo, int valid, int lane) {
  constexpr int kRow = D + 8;
  const int trow = (lane & 7) + ((lane >> 3) & 1) * 8, tcol = (lane >> 4) * 8;
#pragma unroll
  for (int kc = 0; kc < NT / 2; ++kc) {
    if (16 * kc >= valid) continue;
    uint32_t xhi[4], xlo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // e: (row g, k 0-7), (row g + 8, 0-7), (row g, 8-15), (row g + 8, 8-15)
      const int j = 2 * kc + e / 2, c = 2 * (e % 2);
      split_pair<T>(x[j][c], x[j][c + 1], xhi[e], xlo[e]);
    }
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      const int off = (16 * kc + trow) * kRow + 16 * dn + tcol;
      uint32_t bf[4];  // b's fragments die before b_lo's load (four registers fewer at the peak)
      mma::ldsm_x4_trans(bf, b + off);
      mma::m16n8k16(acc[2 * dn], xhi, {bf[0], bf[1]}, T());
      mma::m16n8k16(acc[2 * dn + 1], xhi, {bf[2], bf[3]}, T());
      mma::m16n8k16(acc[2 * dn], xlo, {bf[0], bf[1]}, T());
      mma::m16n8k16(acc[2 * dn + 1], xlo, {bf[2], bf[3]}, T());
      if constexpr (kLo) {
        mma::ldsm_x4_trans(bf, b_lo + off);
        mma::m16n8k16(acc[2 * dn], xhi, {bf[0], bf[1]}, T());
        mma::m16n8k16(acc[2 * dn + 1], xhi, {bf[2], bf[3]}, T());
      }
    }
  }
}

// The running max of this lane's two rows (g, g + 8) after a tile with column maxima cmax; l and o rescaled to it.
// m_use: what the tile's probabilities subtract (0 while a row has seen no real key, so that everything stays 0).
template <int D>
__device__ __forceinline__ void advance_max(const float (&cmax)[2], float (&m)[2], float (&l)[2], float (&o)[D / 8][4],
                                            float (&m_use)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], mma::quad_max(cmax[r]));
    m_use[r] = m_new == -inf() ? 0.f : m_new;
    const float alpha = exp2f(m[r] - m_use[r]);  // 0 at a row's first real key (m = -inf)
    m[r] = m_new;
    l[r] *= alpha;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      o[dn][2 * r] *= alpha;
      o[dn][2 * r + 1] *= alpha;
    }
  }
}

// One online-softmax step over a chunk: scores (raw q.keys) to base-2 probabilities, columns >= nvalid masked;
// the warp's two rows per lane (g, g + 8) keep running max m and this lane's part of the row sum l; o rescaled.
template <int D>
__device__ __forceinline__ void chunk_softmax(float (&s)[kChunk / 8][4], float (&m)[2], float (&l)[2],
                                              float (&o)[D / 8][4], int c0, int nvalid, float scale_log2, int lane) {
  const int t = lane % 4;
  float cmax[2] = {-inf(), -inf()};
#pragma unroll
  for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = c0 + 8 * j + 2 * t + (e & 1) < nvalid ? s[j][e] * scale_log2 : -inf();
      s[j][e] = x;
      cmax[e >> 1] = fmaxf(cmax[e >> 1], x);
    }
  float m_use[2];  // = m: every chunk has a valid column
  advance_max<D>(cmax, m, l, o, m_use);
#pragma unroll
  for (int j = 0; j < kChunk / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pe = exp2f(s[j][e] - m_use[e >> 1]);
      l[e >> 1] += pe;
      s[j][e] = pe * (1 << kProbExp);
    }
}

// Rows row0 and row0 + 8 of the output (lane's columns 8 dn + 2t, + 1): o / Σp plus the conv residual, in T; and,
// where p.out_lse is set, their row_lse.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const Params& p, const float (&o)[D / 8][4], const float (&m)[2],
                                           const float (&l)[2], int row0, int b, int h, const T* v, int lane) {
  const int t = lane % 4, half = p.ks / 2;
  const long long bh = (long long)b * p.hq + h;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = mma::quad_sum(l[r]);  // every lane: a shuffle
    const int row = row0 + 8 * r;
    if (row >= p.n) continue;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    float2 res[D / 8];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) res[dn] = make_float2(o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv);
    if (p.conv != nullptr) {
      for (int tap = 0; tap < p.ks; ++tap) {
        const int j = row + tap - half;
        if (j < 0 || j >= p.n || (p.mask != nullptr && !p.mask[b * p.mask_stride + j])) continue;
        const float w = p.conv[h * p.ks + tap];
        const unsigned* vrow = reinterpret_cast<const unsigned*>(v + j * p.sv.n);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
          const float2 x = Pair<T>::to_float2(vrow[4 * dn + t]);
          res[dn].x = fmaf(w, x.x, res[dn].x);
          res[dn].y = fmaf(w, x.y, res[dn].y);
        }
      }
    }
    unsigned* dst = reinterpret_cast<unsigned*>(static_cast<T*>(p.out) + (bh * p.n + row) * D);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) dst[4 * dn + t] = Pair<T>::from_float2(res[dn]);
    if (p.out_lse != nullptr && t == 0) p.out_lse[bh * p.n + row] = row_lse(m[r], sum);
  }
}

// acc (64 x N per warpgroup; this warp's 16 rows in the C layout) += a (the warpgroup's 64 rows, core matrices, D
// wide) times (b_hi + b_lo)ᵀ (rows [0, N) of two core-matrix tiles, D wide), both K-major, by wgmma: issued only (the
// caller fences before, commits and waits after).
template <typename T, int D, int N>
__device__ __forceinline__ void issue_times_halves(float (&acc)[N / 8][4], const uint16_t* a, const uint16_t* b_hi,
                                                   const uint16_t* b_lo) {
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {  // K-major operands: core matrices 128 bytes apart in k, 16 D in rows
    const uint64_t ad = wgmma::descriptor(a + 128 * kc, 128, 16 * D);
    wgmma::mma<N, T, false>(acc, ad, wgmma::descriptor(b_hi + 128 * kc, 128, 16 * D), true);
    wgmma::mma<N, T, false>(acc, ad, wgmma::descriptor(b_lo + 128 * kc, 128, 16 * D), true);
  }
}

template <int NT>
__device__ __forceinline__ void zero(float (&x)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) x[j][0] = x[j][1] = x[j][2] = x[j][3] = 0.f;
}

// s (64 x kChunk per warpgroup, C layout) = the warpgroup's 64 query rows (qw, core matrices) times the chunk's key
// rows (khi, klo at the chunk's first row)ᵀ, high part plus residual, by wgmma.
template <typename T, int D>
__device__ __forceinline__ void chunk_scores_wg(float (&s)[kChunk / 8][4], const uint16_t* qw, const uint16_t* khi,
                                                const uint16_t* klo) {
  zero(s);
  wgmma::fence();
  issue_times_halves<T, D, kChunk>(s, qw, khi, klo);
  wgmma::commit_group();
  wgmma::wait_group<0>();
}

// acc (64 x D per warpgroup, C layout) += x (64 x 8 NT fp32, C layout) times rows [0, 8 NT) of b (core matrices, D
// wide, MN-major), x in two T halves from registers: hi b + lo b, and with kLo + hi b_lo (b_lo: b's residual), as
// halves_product. Every k-step runs: b's rows past the valid ones must be finite (zeros), as x's columns there are 0
// (a skip is a branch between the products, and ptxas then serialises every wgmma of the kernel).
template <typename T, int D, int NT, bool kLo>
__device__ __forceinline__ void halves_product_wg(float (&acc)[D / 8][4], const float (&x)[NT][4], const uint16_t* b,
                                                  const uint16_t* b_lo) {
  uint32_t xhi[NT / 2][4], xlo[NT / 2][4];
#pragma unroll
  for (int kc = 0; kc < NT / 2; ++kc)
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // e: (row g, k 0-7), (row g + 8, 0-7), (row g, 8-15), (row g + 8, 8-15)
      const int j = 2 * kc + e / 2, c = 2 * (e % 2);
      split_pair<T>(x[j][c], x[j][c + 1], xhi[kc][e], xlo[kc][e]);
    }
  wgmma::fence();
#pragma unroll
  for (int kc = 0; kc < NT / 2; ++kc) {  // MN-major: core matrices 16 D bytes apart in k, 128 in n
    const uint64_t hi = wgmma::descriptor(b + 16 * kc * D, 16 * D, 128);
    wgmma::mma_regs<D, T, true>(acc, xhi[kc], hi, true);
    wgmma::mma_regs<D, T, true>(acc, xlo[kc], hi, true);
    if constexpr (kLo)
      wgmma::mma_regs<D, T, true>(acc, xhi[kc], wgmma::descriptor(b_lo + 16 * kc * D, 16 * D, 128), true);
  }
  wgmma::commit_group();
  wgmma::wait_group<0>();
}

// The softmax attention of query tiles over the head's buffer: grid (blocks per head, Hq, B), 256 threads, dynamic
// shared memory OutSmem<D>::bytes(p.slots, STAGES). Per tile, each warp calls epilogue(o, m, l, row0) with its
// unnormalised o = Σ p vals (scaled back from the product's powers of two), the running max m (base 2) and this
// lane's part of the row sums l of rows row0 and row0 + 8. STAGES 2: the block's next tile is copied during this one;
// 1 (where a second tile would cost a resident block, e.g. m 64 at D 128: 104 KB per block): the next tile loads after
// this one. Built for sm_90a (HFAB_HAS_WGMMA) the products run on wgmma, each warpgroup taking 64 rows of the tile
// from tiles in core matrices; else on mma.sync, the query fragments read from the staged tile at each chunk, not
// held (at most 128 registers: two blocks per SM).
template <typename T, int D, int STAGES, typename Epilogue>
__device__ __forceinline__ void attend_tiles(const Params& p, Epilogue&& epilogue) {
  static_assert(STAGES == 1 || STAGES == 2, "one or two query tiles");
  using S = OutSmem<D>;
  constexpr int kRow = kWgmma ? D : S::kKey;  // elements per tile row (core matrices: no padding)
  extern __shared__ __align__(16) unsigned char smem[];
  const int tiles = (p.n + kBQ - 1) / kBQ;
  int tile = blockIdx.x;
  if (tile >= tiles) return;
  const int h = blockIdx.y, b = blockIdx.z;
  const long long bh = (long long)b * p.hq + h;
  const int nvalid = p.nvalid[b], rows = kWgmma ? S::core_rows(p.slots) : S::rows(p.slots);
  uint16_t* khi = reinterpret_cast<uint16_t*>(smem);
  uint16_t* klo = khi + rows * kRow;
  uint16_t* vhi = klo + rows * kRow;
  uint16_t* vlo = vhi + rows * kRow;
  uint16_t* qs = vlo + rows * kRow;
  __shared__ float red[kWarps], unscale_s;  // read back after each tile's products: one register fewer in them
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = p.n;
  const auto load = [&](int at, int buf) {  // the head's q formed per tile from the parameters: no register held
    const T* q = static_cast<const T*>(p.q) + blockIdx.z * p.sq.b + blockIdx.y * p.sq.h;
    mma::load_rows_async<kBQ, D, kThreads, false, kWgmma>(qs + buf * kBQ * kRow, q, p.sq.n, at * kBQ,
                                                        [=](int r) { return at * kBQ + r < n; });
  };
  if (STAGES == 2) load(tile, 0);
  const int e = stage_buffer<T, D, kWgmma>(p.keys + bh * p.slots * D, p.vals + bh * p.slots * D, nvalid, rows, khi, klo,
                                        vhi, vlo, red);
  if (threadIdx.x == 0) unscale_s = ldexpf(1.f, -e - kProbExp);  // read after the loop's first barrier
  const float scale_log2 = p.root * kLog2e;  // keys carry √scale, q not yet
  // mma.sync A fragments: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
  const int arow = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
  for (int buf = 0; tile < tiles; tile += gridDim.x, buf ^= STAGES - 1) {
    if (STAGES == 1) {
      __syncthreads();  // the previous tile's readers of qs are done (wgmma: waited for)
      load(tile, 0);
    }
    mma::cp_async_wait_all();
    if constexpr (kWgmma) wgmma::fence_shared_for_async();  // this thread's copies and stores, for the products' reads
    __syncthreads();  // the tile (at the first, the buffer) is in; every warp is done with the other stage
    if (STAGES == 2 && tile + static_cast<int>(gridDim.x) < tiles) load(tile + gridDim.x, buf ^ 1);
    const uint16_t* qt = qs + buf * kBQ * kRow;

    float m[2] = {-inf(), -inf()}, l[2] = {0.f, 0.f};
    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    for (int c0 = 0; c0 < nvalid; c0 += kChunk) {
      float s[kChunk / 8][4];
      if constexpr (kWgmma) chunk_scores_wg<T, D>(s, qt + 64 * (warp / 4) * D, khi + c0 * D, klo + c0 * D);
      else chunk_scores<T, D>(s, qt, arow, acol, khi, klo, c0, nvalid, lane);
      chunk_softmax<D>(s, m, l, o, c0, nvalid, scale_log2, lane);
      const uint16_t *vh = vhi + c0 * kRow, *vl = vlo + c0 * kRow;
      if constexpr (kWgmma) halves_product_wg<__half, D, kChunk / 8, true>(o, s, vh, vl);  // rows padded with zeros
      else halves_product<__half, D, kChunk / 8, true>(o, s, vh, vl, nvalid - c0, lane);
    }
    const float unscale = unscale_s;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[dn][i] *= unscale;
    epilogue(o, m, l, tile * kBQ + 16 * warp + lane / 4);
  }
}

// out = softmax(q_s keysᵀ) vals + conv residual, in T.
template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(kThreads, 2) nystrom_out_tc_fwd_kernel(const Params p) {
  attend_tiles<T, D, STAGES>(p, [&](const float (&o)[D / 8][4], const float (&m)[2], const float (&l)[2], int row0) {
    const int h = blockIdx.y, b = blockIdx.z;  // formed per tile: nothing held across the products
    const T* v = static_cast<const T*>(p.v) + b * p.sv.b + (h / p.groups) * p.sv.h;
    store_rows<T, D>(p, o, m, l, row0, b, h, v, threadIdx.x % 32);
  });
}

// The K3 stage on tensor cores: for 16 W landmarks (W warps x 16 rows; fp32 Q̃ carrying √scale, as A fragments in a
// 16-bit high part and residual) against the real keys of one key split, the online softmax of the scores and the
// unnormalised sum of p v, written as the split's partial (max, sum, acc) exactly as nystrom_k3_fwd_kernel does.
// Key and value tiles of 64 rows double-buffered by cp.async (one barrier per tile). Precision: S = Q̃ kᵀ with k exact
// and Q̃ in two halves (two m16n8k16); P v with v exact and P in two halves (two m16n8k16): ~2^-16 relative (bf16).
constexpr int kK3Threads = 128, kK3Keys = 64;  // the dk/dv kernel's block; K3's key tiles

// Warps per block (16 landmark or buffer-slot rows each) of K3's kernels and k1: two where every row fits in 32, so
// that at m <= 32 no warp of a block idles and twice the blocks share an SM; else four.
inline constexpr int row_warps(long long rows) { return rows <= 32 ? 2 : 4; }

// Blocks per SM that the row-tiled kernels of W warps ask registers for: twice as many two-warp blocks.
template <int W> constexpr int row_blocks(int four_warp_blocks) { return four_warp_blocks * 4 / W; }

template <int D> struct K3Smem {
  static constexpr int kRow = D + 8;
  static constexpr int kTile = kK3Keys * kRow;  // elements of one k or v tile
  static constexpr int bytes = 2 * 2 * kTile * 2 + 2 * kK3Keys * 4;  // (k, v) x 2 buffers + 2 bias rows
};

// A fragments of this warp's 16 landmark rows (fp32, D per row, rows >= m zero) in two 16-bit halves.
template <typename T, int D>
__device__ __forceinline__ void landmark_frags(uint32_t (&hi)[D / 16][4], uint32_t (&lo)[D / 16][4], const float* land,
                                               int row0, int m, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc)
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // e: (row g, k 2t..), (row g + 8, 2t..), (row g, 2t + 8..), (row g + 8, 2t + 8..)
      const int row = row0 + g + 8 * (e & 1), col = 16 * kc + 2 * t + 8 * (e >> 1);
      const float2 x = row < m ? *reinterpret_cast<const float2*>(land + row * D + col) : make_float2(0.f, 0.f);
      split_pair<T>(x.x, x.y, hi[kc][e], lo[kc][e]);
    }
}

// Grid (splits, ceil(m / 16 W), B Hq), 32 W threads; keys [split * chunk, min(+chunk, N)), padded keys masked.
template <typename T, int D, int W>
__global__ void __launch_bounds__(32 * W, row_blocks<W>(2)) nystrom_k3_tc_fwd_kernel(const Params p) {
  using S = K3Smem<D>;
  constexpr int kThreadsW = 32 * W;
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);  // [buffer][k, v][kK3Keys][D + 8]
  float* bias = reinterpret_cast<float*>(tiles + 4 * S::kTile);  // [buffer][kK3Keys]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int split = blockIdx.x, l0 = blockIdx.y * 16 * W, bh = blockIdx.z;
  const int b = bh / p.hq, h = bh % p.hq, g = h / p.groups;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + g * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + g * p.sv.h;
  const float scale_log2 = p.root * kLog2e;  // landmarks carry √scale, keys not yet
  const int kbeg = split * p.chunk, kend = min(kbeg + p.chunk, p.n);

  auto load = [&](int k0, int buf) {
    uint16_t* kt = tiles + 2 * buf * S::kTile;
    auto ok = [=](int r) { return k0 + r < kend; };
    mma::load_rows_async<kK3Keys, D, kThreadsW>(kt, k, p.sk.n, k0, ok);
    mma::load_rows_async<kK3Keys, D, kThreadsW>(kt + S::kTile, v, p.sv.n, k0, ok);
    for (int c = threadIdx.x; c < kK3Keys; c += kThreadsW) {
      const int j = k0 + c;
      const bool real = j < kend && (p.mask == nullptr || p.mask[b * p.mask_stride + j]);
      bias[buf * kK3Keys + c] = real ? 0.f : -inf();
    }
  };
  load(kbeg, 0);
  uint32_t ahi[D / 16][4], alo[D / 16][4];
  landmark_frags<T, D>(ahi, alo, p.q_land + (long long)bh * p.m * D, l0 + 16 * warp, p.m, lane);

  float m[2] = {-inf(), -inf()}, l[2] = {0.f, 0.f};
  float o[D / 8][4];
#pragma unroll
  for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
  const int brow = (lane & 7) + (lane >> 4) * 8, bcol = ((lane >> 3) & 1) * 8;    // ldmatrix: k rows as n
  const int vrow = (lane & 7) + ((lane >> 3) & 1) * 8, vcol = (lane >> 4) * 8;    // ldmatrix.trans: v rows as k
  const bool active = l0 + 16 * warp < p.m;  // else every row of this warp is past m: loads and barriers only
  int buf = 0;
  for (int k0 = kbeg; k0 < kend; k0 += kK3Keys, buf ^= 1) {
    mma::cp_async_wait_all();
    __syncthreads();  // this tile is in; every warp is done with the other buffer
    if (k0 + kK3Keys < kend) load(k0 + kK3Keys, buf ^ 1);
    if (!active) continue;
    const uint16_t* kt = tiles + 2 * buf * S::kTile;
    const uint16_t* vt = kt + S::kTile;
    const float* bt = bias + buf * kK3Keys;
    float s[kK3Keys / 8][4];
#pragma unroll
    for (int j = 0; j < kK3Keys / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int jj = 0; jj < kK3Keys / 16; ++jj)
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) {
        uint32_t bf[4];
        mma::ldsm_x4(bf, kt + (16 * jj + brow) * S::kRow + 16 * kc + bcol);
        mma::m16n8k16(s[2 * jj], ahi[kc], {bf[0], bf[1]}, T());
        mma::m16n8k16(s[2 * jj + 1], ahi[kc], {bf[2], bf[3]}, T());
        mma::m16n8k16(s[2 * jj], alo[kc], {bf[0], bf[1]}, T());
        mma::m16n8k16(s[2 * jj + 1], alo[kc], {bf[2], bf[3]}, T());
      }
    float cmax[2] = {-inf(), -inf()};
#pragma unroll
    for (int j = 0; j < kK3Keys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = fmaf(s[j][e], scale_log2, bt[8 * j + 2 * t + (e & 1)]);
        s[j][e] = x;
        cmax[e >> 1] = fmaxf(cmax[e >> 1], x);
      }
    float m_use[2];
    advance_max<D>(cmax, m, l, o, m_use);
#pragma unroll
    for (int kc = 0; kc < kK3Keys / 16; ++kc) {
      uint32_t phi[4], plo[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {  // e: (row g, keys 0-7), (row g + 8, 0-7), (row g, 8-15), (row g + 8, 8-15)
        float* x = s[2 * kc + e / 2];
        const int r = e % 2;
        const float p0 = exp2f(x[2 * r] - m_use[r]), p1 = exp2f(x[2 * r + 1] - m_use[r]);
        l[r] += p0 + p1;
        split_pair<T>(p0, p1, phi[e], plo[e]);
      }
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bv[4];
        mma::ldsm_x4_trans(bv, vt + (16 * kc + vrow) * S::kRow + 16 * dn + vcol);
        mma::m16n8k16(o[2 * dn], phi, {bv[0], bv[1]}, T());
        mma::m16n8k16(o[2 * dn + 1], phi, {bv[2], bv[3]}, T());
        mma::m16n8k16(o[2 * dn], plo, {bv[0], bv[1]}, T());
        mma::m16n8k16(o[2 * dn + 1], plo, {bv[2], bv[3]}, T());
      }
    }
  }

  const long long slab = (long long)split * gridDim.z + bh;  // (split, b h) slab of m rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = mma::quad_sum(l[r]);
    const int row = l0 + 16 * warp + lane / 4 + 8 * r;
    if (row >= p.m) continue;
    const long long idx = slab * p.m + row;
    float2* acc = reinterpret_cast<float2*>(p.part_acc + idx * D);
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) acc[4 * dn + t] = make_float2(o[dn][2 * r], o[dn][2 * r + 1]);
    if (t == 0) {
      p.part_max[idx] = m[r];
      p.part_sum[idx] = sum;
    }
  }
}

}  // namespace tc
}  // namespace nystrom
}  // namespace hfab
