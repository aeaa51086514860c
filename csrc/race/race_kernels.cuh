// RACE attention on CUDA cores: chunked linear attention with the soft-LSH feature map fused in.
//
// Math (hf_attention_backends/ops/race/reference.py): u = tanh(W x) with W (L*P, D); for feature
// s = l*R + r (R = 2^P) phi_s(x) = prod_t sigmoid(c_{r,t} * 2 beta u_{l,t}), c_{r,t} = +1 when bit P-1-t
// of r is set (plane 0 = most significant bit). a_ij = <phi(q_i), phi(k_j)> over allowed keys,
// out_i = sum_j a_ij v_j / sum_j a_ij, 0 for rows with no allowed key.
//
// Chunking (csrc/race/NOTES.md): keys are cut into chunks of C = 64 starting at key s0 in (-C, 0]; query
// tile m (queries [64m, 64m + 64)) sees exactly the chunks before chunk kappa0 + m in full and chunk
// kappa0 + m up to the diagonal (causal, bottom-right aligned). Non-causal: s0 = 0 and every query sees
// the total of all chunks. Per-chunk states sum_j phi(k_j) v_j^T (S x D) and sum_j phi(k_j) (S) are fp32
// in global memory, scanned in place (fixed order, no atomics).
//
// Kernels (256 threads; ty = tid / 16, tx = tid % 16; dynamic shared memory, sizes in Layout below):
//   race_state_fwd_kernel<QUERY=false>  per (key chunk, q head, batch): phi(k)^T v and sum phi(k)
//   race_state_fwd_kernel<QUERY=true>   backward, per (query tile, q head, batch): phi(q)^T G and
//                                       sum c_i phi(q_i), G_i = dO_i / den_i, c_i = G_i . O_i
//   race_scan_fwd_kernel                exclusive prefix (forward) or suffix (backward) over the slots
//   race_out_fwd_kernel                 per (query tile, q head, batch): out
//   race_dq_bwd_kernel                  per (query tile, q head, batch): dq, den, c, dbeta partials
//   race_dkv_bwd_kernel                 per (key chunk, kv head, batch), loops over the group's q heads:
//                                       dk, dv (summed over the group in registers), dbeta partials
//   race_dbeta_bwd_kernel               per q head: dbeta = fixed-order sum of the partials
//   race_dbeta_total_kernel             dbeta of a scalar beta: sum over the heads
//
// Pure CUDA (no torch headers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/strides.cuh"

namespace hfab {
namespace race {

constexpr int kThreads = 256;
constexpr int kRows = 64;          // rows of a tile = chunk size C (queries or keys)
constexpr int kFeat = 64;          // features per S-tile (2^P <= 64 divides it: tiles hold whole tables)
constexpr int kPad = kFeat + 1;    // row stride of 64-column fp32 tiles (conflict-free column reads)
constexpr int kMaxPlanes = 6;
constexpr int kMaxTables = 8;

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  Strides sq, sk, sv, sdo;
  const unsigned char* kpm;  // (B, Nk) bool, rows kpm_stride apart; nullptr = no padding
  long long kpm_stride;
  const float* planes;  // (L*P, D) fp32 contiguous
  const float* beta;    // (Hq,) fp32
  int hq, groups, nq, nk;
  int planes_per_table, tables, lp, features, stiles;  // P, L, L*P, S = L*2^P, ceil(S / 64)
  int causal;
  int s0;      // first key of chunk 0, in (-64, 0]
  int kappa0;  // chunk of query tile 0 (causal), may be negative
  int nkc;     // key chunks
  int nqt;     // query tiles
  int ngk;     // tensor-core forward (race_tc_kernels.cuh): groups of gchunks key chunks
  int gchunks;  // key chunks per group of the group states: tc::forward_group_chunks (forward), tc::kGroup (backward)
  int ngq;     // groups of tc::kGroup query tiles (non-causal)
  float* kstate;  // (B, Hq, nkc + 1, S, D) chunk states, then their exclusive prefix sums (slot nkc: total)
  float* kz;      // (B, Hq, nkc + 1, S)
  float* qstate;  // backward: (B, Hq, nqt + 1, S, D), then suffix sums (slot m + 1: tiles after m); tensor-core
                  // key side: (B, Hq, groups + 1, S, D) per group of query tiles (race_tc_bwd_kernels.cuh)
  float* qz;      // (B, Hq, nqt + 1, S) or (B, Hq, groups + 1, S)
  float* den;     // backward: (B, Hq, Nq) row denominators
  float* cq;      // backward: (B, Hq, Nq) c_i = G_i . O_i
  void* out;      // forward: out; backward: dq      (B, Hq, Nq, D) contiguous
  void* dk;       // (B, Hkv, Nk, D) contiguous
  void* dv;
  float* dbeta_q;  // (B, Hq, nqt) per-tile partials
  float* dbeta_k;  // (B, Hq, nkc)
  float* dk_scratch;  // tensor-core key side with GQA: (B, Hkv, Nk, D) fp32 sums over the group's q heads
  float* dv_scratch;
};

// Shared-memory carve-up (in floats) of each kernel, used by the host for the launch size too.
struct Layout {
  static __host__ __device__ int table(int lp) { return kRows * lp; }
  static __host__ __device__ int tile() { return kRows * kPad; }
  static __host__ __device__ int grads(int d) { return kRows * (d + 1); }
  static __host__ __device__ int state(int lp) { return 2 * table(lp) + tile() + 3 * kRows; }
  static __host__ __device__ int out(int lp) { return 4 * table(lp) + 2 * tile() + 2 * kRows; }
  static __host__ __device__ int dq(int lp, int d) { return 6 * table(lp) + 4 * tile() + grads(d) + 4 * kRows; }
  static __host__ __device__ int dkv(int lp, int d) { return 6 * table(lp) + 4 * tile() + grads(d) + 4 * kRows; }
};

__device__ __forceinline__ long long bh_index(const Params& p, int b, int h) { return (long long)b * p.hq + h; }

__device__ __forceinline__ bool key_ok(const Params& p, int b, int j) {
  return j >= 0 && j < p.nk && (p.kpm == nullptr || p.kpm[b * p.kpm_stride + j] != 0);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ float warp_fmax(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// 2^e as a float, exactly, for -126 <= e <= 127 (normal fp32: no flush to zero).
__device__ __forceinline__ float pow2f(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

__device__ __forceinline__ float halfwarp_sum(float x) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// sigmoid(z) and sigmoid(-z) from one exponential: e = exp(-|z|) in [0, 1] cannot overflow, sigmoid(|z|) = 1 / (1 + e)
// and sigmoid(-|z|) = e sigmoid(|z|) keeps its relative precision however small.
__device__ __forceinline__ void sigmoid_pair(float z, float& pos, float& neg) {
  const float e = __expf(-fabsf(z)), big = 1.f / (1.f + e), small = e * big;
  pos = z >= 0.f ? big : small;
  neg = z >= 0.f ? small : big;
}

// Soft signs of the 64 rows [row0, row0 + 64) of x (one warp per row): for lt < L*P,
// sp = sigmoid(2 beta u), sm = sigmoid(-2 beta u), u = tanh(W_lt . x) (stored when `u` is not null).
// ok[r] = 1 when row r takes part (rows with ok = 0 get phi = 0 in build_phi).
template <typename T, int D>
__device__ void project_rows(const Params& p, const T* x, long long stride, int row0, const int* ok, float beta,
                             float* sp, float* sm, float* u) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int r = warp; r < kRows; r += kThreads / 32) {
    float xr[D / 32];
#pragma unroll
    for (int c = 0; c < D / 32; ++c)
      xr[c] = ok[r] ? to_float(x[(long long)(row0 + r) * stride + lane + 32 * c]) : 0.f;
    for (int lt = 0; lt < p.lp; ++lt) {
      float part = 0.f;
#pragma unroll
      for (int c = 0; c < D / 32; ++c) part = fmaf(__ldg(p.planes + lt * D + lane + 32 * c), xr[c], part);
      const float ut = tanhf(warp_sum(part));
      if (lane == 0) {
        sigmoid_pair(2.f * beta * ut, sp[r * p.lp + lt], sm[r * p.lp + lt]);
        if (u != nullptr) u[r * p.lp + lt] = ut;
      }
    }
  }
}

// phi[r][f] = phi_s(row r), s = 64 * st + f; 0 for s >= S and rows with ok = 0.
__device__ inline void build_phi(const Params& p, int st, const int* ok, const float* sp, const float* sm, float* phi) {
  const int P = p.planes_per_table;
  for (int e = threadIdx.x; e < kRows * kFeat; e += kThreads) {
    const int r = e / kFeat, f = e % kFeat, s = st * kFeat + f;
    float val = 0.f;
    if (s < p.features && ok[r]) {
      const int l = s >> P, bucket = s & ((1 << P) - 1);
      const float* pos = sp + r * p.lp + l * P;
      const float* neg = sm + r * p.lp + l * P;
      val = 1.f;
      for (int t = 0; t < P; ++t) val *= ((bucket >> (P - 1 - t)) & 1) ? pos[t] : neg[t];
    }
    phi[r * kPad + f] = val;
  }
}

// acc[i][j] += sum_f a[ty*4 + i][f] * b[tx + 16 j][f]
__device__ __forceinline__ void tile_dot(float (&acc)[4][4], const float* a, const float* b, int ty, int tx) {
#pragma unroll 4
  for (int f = 0; f < kFeat; ++f) {
    float av[4], bv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) av[i] = a[(ty * 4 + i) * kPad + f];
#pragma unroll
    for (int j = 0; j < 4; ++j) bv[j] = b[(tx + 16 * j) * kPad + f];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
  }
}

// num[i][c] += sum_f phi[ty*4 + i][f] * A[s][tx + 16 c], den[i] += sum_f phi[..][f] * z[s], s = 64 st + f < S.
// A (S, D) and z (S) are one fp32 state slot.
template <int D>
__device__ __forceinline__ void state_apply(float (&num)[4][D / 16], float (&den)[4], const float* phi,
                                            const float* A, const float* z, int st, int features, int ty, int tx) {
  const int fend = min(kFeat, features - st * kFeat);
  for (int f = 0; f < fend; ++f) {
    const int s = st * kFeat + f;
    const float zs = __ldg(z + s);
    float a[D / 16];
#pragma unroll
    for (int c = 0; c < D / 16; ++c) a[c] = __ldg(A + (long long)s * D + tx + 16 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float ph = phi[(ty * 4 + i) * kPad + f];
      den[i] = fmaf(ph, zs, den[i]);
#pragma unroll
      for (int c = 0; c < D / 16; ++c) num[i][c] = fmaf(ph, a[c], num[i][c]);
    }
  }
}

// w[r][l*P + t] for the tables inside S-tile st, from g = dphi * phi (tile layout):
// w = sm * sum_{bit t of r set} g - sp * sum_{bit clear} g   (d u_{l,t} = 2 beta w, d beta += 2 u w)
__device__ inline void table_grads(const Params& p, int st, const float* g, const float* sp, const float* sm, float* w) {
  const int P = p.planes_per_table, R = 1 << P;
  const int l0 = st * kFeat / R, l1 = min(p.tables, (st + 1) * kFeat / R), per_row = (l1 - l0) * P;
  for (int e = threadIdx.x; e < kRows * per_row; e += kThreads) {
    const int r = e / per_row, l = l0 + (e % per_row) / P, t = (e % per_row) % P;
    float set = 0.f, clear = 0.f;
    for (int b = 0; b < R; ++b) {
      const float gv = g[r * kPad + l * R + b - st * kFeat];
      if ((b >> (P - 1 - t)) & 1) set += gv;
      else clear += gv;
    }
    const int idx = r * p.lp + l * P + t;
    w[idx] = sm[idx] * set - sp[idx] * clear;
  }
}

// One warp per row: dx[c] (lane's columns lane + 32 c) += sum_lt 2 beta w (1 - u^2) W[lt][.],
// and the row's dbeta term 2 sum_lt u w (returned on every lane).
template <int D>
__device__ __forceinline__ float chain_row(const Params& p, int r, float beta, const float* u, const float* w,
                                           float (&dx)[D / 32]) {
  const int lane = threadIdx.x % 32;
  float db = 0.f;
  for (int lt = 0; lt < p.lp; ++lt) {
    const float ut = u[r * p.lp + lt], wt = w[r * p.lp + lt];
    const float da = 2.f * beta * wt * (1.f - ut * ut);
    db = fmaf(2.f * ut, wt, db);
#pragma unroll
    for (int c = 0; c < D / 32; ++c) dx[c] = fmaf(da, __ldg(p.planes + lt * D + lane + 32 * c), dx[c]);
  }
  return db;
}

// Sum of vals[0..64) in index order by thread 0 (a deterministic block reduction).
__device__ __forceinline__ float ordered_sum64(const float* vals) {
  float s = 0.f;
  for (int r = 0; r < kRows; ++r) s += vals[r];
  return s;
}

// Chunk states. QUERY = false: rows are the keys of chunk blockIdx.x, value v_j, weight 1.
// QUERY = true (backward): rows are the queries of tile blockIdx.x, value dO_i / den_i, weight c_i.
// Writes slot blockIdx.x of (kstate, kz) or (qstate, qz).
template <typename T, int D, bool QUERY>
__global__ void __launch_bounds__(kThreads, 1) race_state_fwd_kernel(const Params p) {
  extern __shared__ float smem[];
  float* sp = smem;
  float* sm = sp + Layout::table(p.lp);
  float* phi = sm + Layout::table(p.lp);
  int* ok = reinterpret_cast<int*>(phi + Layout::tile());
  float* scale = phi + Layout::tile() + kRows;
  float* weight = scale + kRows;

  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / p.groups;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const float beta = p.beta[h];
  const int row0 = QUERY ? tile * kRows : p.s0 + tile * kRows;
  const T* x = QUERY ? static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h
                     : static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h;
  const T* val = QUERY ? static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h
                       : static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h;
  const long long xstride = QUERY ? p.sq.n : p.sk.n, vstride = QUERY ? p.sdo.n : p.sv.n;
  const long long bh = bh_index(p, b, h);
  for (int r = threadIdx.x; r < kRows; r += kThreads) {
    const int i = row0 + r;
    if (QUERY) {
      const float dn = i < p.nq ? p.den[bh * p.nq + i] : 0.f;
      ok[r] = dn > 0.f;
      scale[r] = dn > 0.f ? 1.f / dn : 0.f;
      weight[r] = dn > 0.f ? p.cq[bh * p.nq + i] : 0.f;
    } else {
      ok[r] = key_ok(p, b, i);
      scale[r] = 1.f;
      weight[r] = 1.f;
    }
  }
  __syncthreads();
  project_rows<T, D>(p, x, xstride, row0, ok, beta, sp, sm, nullptr);

  const int nslots = QUERY ? p.nqt + 1 : p.nkc + 1;
  float* A = (QUERY ? p.qstate : p.kstate) + (bh * nslots + tile) * p.features * D;
  float* z = (QUERY ? p.qz : p.kz) + (bh * nslots + tile) * p.features;
  for (int st = 0; st < p.stiles; ++st) {
    __syncthreads();
    build_phi(p, st, ok, sp, sm, phi);
    __syncthreads();
    float acc[4][D / 16] = {}, zacc[4] = {};
    for (int r = 0; r < kRows; ++r) {
      if (!ok[r]) continue;  // block-uniform
      float vr[D / 16];
#pragma unroll
      for (int c = 0; c < D / 16; ++c) vr[c] = to_float(val[(long long)(row0 + r) * vstride + tx + 16 * c]) * scale[r];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float ph = phi[r * kPad + ty * 4 + i];
        zacc[i] = fmaf(ph, weight[r], zacc[i]);
#pragma unroll
        for (int c = 0; c < D / 16; ++c) acc[i][c] = fmaf(ph, vr[c], acc[i][c]);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int s = st * kFeat + ty * 4 + i;
      if (s >= p.features) continue;
#pragma unroll
      for (int c = 0; c < D / 16; ++c) A[(long long)s * D + tx + 16 * c] = acc[i][c];
      if (tx == 0) z[s] = zacc[i];
    }
  }
}

// Over slots [0, n] of every (b, h) (elements: S*D of `state`, then S of `z`), in place, by `mode`:
// kPrefix: slot k <- sum of input slots < k (slot n: the total); kSuffix: slot m + 1 <- sum of input slots > m for
// m = -1 .. n - 1 (slot 0: the total); kTotal: slot n <- the sum of input slots < n, the others unchanged (the
// non-causal forward reads the total only). The same order of additions in every mode.
enum ScanMode : int { kPrefix = 0, kSuffix = 1, kTotal = 2 };
static __global__ void __launch_bounds__(kThreads) race_scan_fwd_kernel(float* state, float* z, int n, int sd, int features,
                                                                 int hq, int mode) {
  const int e = blockIdx.x * kThreads + threadIdx.x;
  if (e >= sd + features) return;
  const long long bh = (long long)blockIdx.z * hq + blockIdx.y;
  const bool is_state = e < sd;
  float* base = is_state ? state + bh * (n + 1) * sd + e : z + bh * (n + 1) * features + (e - sd);
  const long long step = is_state ? sd : features;
  constexpr int kBatch = 32;  // slots are read 32 at a time before any of them is written: the loads overlap
  float run = 0.f;
  if (mode == kTotal) {  // no stores between the loads: 2 kBatch in flight
    for (int k0 = 0; k0 < n; k0 += 2 * kBatch) {
      float x[2 * kBatch];
#pragma unroll
      for (int u = 0; u < 2 * kBatch; ++u) x[u] = k0 + u < n ? base[(k0 + u) * step] : 0.f;
#pragma unroll
      for (int u = 0; u < 2 * kBatch; ++u)
        if (k0 + u < n) run += x[u];
    }
    base[n * step] = run;
  } else if (mode == kPrefix) {
    for (int k0 = 0; k0 <= n; k0 += kBatch) {
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) x[u] = k0 + u < n ? base[(k0 + u) * step] : 0.f;
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (k0 + u <= n) {
          base[(k0 + u) * step] = run;
          run += x[u];
        }
    }
  } else {
    for (int top = n - 1; top >= -1; top -= kBatch) {  // m = top - u: slot m + 1 <- run, then run += input m
      float x[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) x[u] = top - u >= 0 ? base[(top - u) * step] : 0.f;
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        if (top - u >= -1) {
          base[(top - u + 1) * step] = run;
          run += x[u];
        }
    }
  }
}

// out for query tile blockIdx.x of (q head blockIdx.y, batch blockIdx.z).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) race_out_fwd_kernel(const Params p) {
  extern __shared__ float smem[];
  float* spq = smem;
  float* smq = spq + Layout::table(p.lp);
  float* spk = smq + Layout::table(p.lp);
  float* smk = spk + Layout::table(p.lp);
  float* phq = smk + Layout::table(p.lp);
  float* phk = phq + Layout::tile();
  int* okq = reinterpret_cast<int*>(phk + Layout::tile());
  int* okk = okq + kRows;

  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / p.groups;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const float beta = p.beta[h];
  const int row0 = m * kRows;
  const int kappa = p.causal ? p.kappa0 + m : p.nkc;  // slot: keys of earlier chunks (or all keys)
  const bool any = kappa >= 0;                       // causal tiles before the first key chunk see nothing
  const bool intra = p.causal && any;
  const int key0 = p.s0 + kappa * kRows;
  const long long bh = bh_index(p, b, h);

  for (int r = threadIdx.x; r < kRows; r += kThreads) {
    okq[r] = any && row0 + r < p.nq;
    okk[r] = intra && key_ok(p, b, key0 + r);
  }
  __syncthreads();
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h;
  project_rows<T, D>(p, q, p.sq.n, row0, okq, beta, spq, smq, nullptr);
  if (intra) project_rows<T, D>(p, k, p.sk.n, key0, okk, beta, spk, smk, nullptr);

  float num[4][D / 16] = {}, den[4] = {}, sc[4][4] = {};
  if (any) {
    const float* A = p.kstate + (bh * (p.nkc + 1) + kappa) * p.features * D;
    const float* z = p.kz + (bh * (p.nkc + 1) + kappa) * p.features;
    for (int st = 0; st < p.stiles; ++st) {
      __syncthreads();
      build_phi(p, st, okq, spq, smq, phq);
      if (intra) build_phi(p, st, okk, spk, smk, phk);
      __syncthreads();
      if (intra) tile_dot(sc, phq, phk, ty, tx);
      state_apply<D>(num, den, phq, A, z, st, p.features, ty, tx);
    }
  }
  if (intra) {
    __syncthreads();
    float* ps = phk;  // masked scores a_ij
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int qi = row0 + ty * 4 + i, kj = key0 + tx + 16 * j;
        ps[(ty * 4 + i) * kPad + tx + 16 * j] = kj <= qi + (p.nk - p.nq) ? sc[i][j] : 0.f;
      }
    __syncthreads();
    for (int j = 0; j < kRows; ++j) {
      if (!okk[j]) continue;  // block-uniform
      float vr[D / 16];
#pragma unroll
      for (int c = 0; c < D / 16; ++c) vr[c] = to_float(v[(long long)(key0 + j) * p.sv.n + tx + 16 * c]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float a = ps[(ty * 4 + i) * kPad + j];
        den[i] += a;
#pragma unroll
        for (int c = 0; c < D / 16; ++c) num[i][c] = fmaf(a, vr[c], num[i][c]);
      }
    }
  }
  T* out = static_cast<T*>(p.out) + bh * p.nq * D;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int qi = row0 + ty * 4 + i;
    if (qi >= p.nq) continue;
    const float inv = den[i] > 0.f ? 1.f / den[i] : 0.f;
#pragma unroll
    for (int c = 0; c < D / 16; ++c) out[(long long)qi * D + tx + 16 * c] = from_float<T>(num[i][c] * inv);
  }
}

// dq, den, c and the query side of dbeta for query tile blockIdx.x of (q head blockIdx.y, batch blockIdx.z).
// d a_ij = G_i . v_j - c_i;  dphi(q_i) = A G_i - c_i z + sum_j (G_i . v_j - c_i) phi(k_j).
// The end of pass 2 for this thread's rows ty * 4 + i and features tx + 16 f of S-tile st (dq and dk/dv kernels): g
// holds (dO A^T or v B^T) there; dphi = g - c(r) lin_s + (ds phi_other)_rf (the intra term where ds is not null),
// g = dphi phi (phi: this side's tile, overwritten with g), then the table gradients into w.
template <typename C>
__device__ __forceinline__ void table_grads_from_dphi(const Params& p, int st, float (&g)[4][4], C c, const float* lin,
                                                      const float* ds, const float* phi_other, float* phi,
                                                      const float* sp, const float* sm, float* w) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      const int r = ty * 4 + i, fl = tx + 16 * f, s = st * kFeat + fl;
      float dphi = g[i][f];
      if (s < p.features) dphi -= c(r) * __ldg(lin + s);
      if (ds != nullptr)
        for (int j = 0; j < kRows; ++j) dphi = fmaf(ds[r * kPad + j], phi_other[j * kPad + fl], dphi);
      g[i][f] = dphi * phi[r * kPad + fl];
    }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int f = 0; f < 4; ++f) phi[(ty * 4 + i) * kPad + tx + 16 * f] = g[i][f];
  __syncthreads();
  table_grads(p, st, phi, sp, sm, w);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) race_dq_bwd_kernel(const Params p) {
  extern __shared__ float smem[];
  float* spq = smem;
  float* smq = spq + Layout::table(p.lp);
  float* uq = smq + Layout::table(p.lp);
  float* wq = uq + Layout::table(p.lp);
  float* spk = wq + Layout::table(p.lp);
  float* smk = spk + Layout::table(p.lp);
  float* phq = smk + Layout::table(p.lp);
  float* phk = phq + Layout::tile();
  float* ds = phk + Layout::tile();
  float* stage = ds + Layout::tile();  // 64 columns of v (ds) or of the state A (pass 2), row stride kPad
  float* G = stage + Layout::tile();   // (64, D + 1): dO_i / den_i
  int* okq = reinterpret_cast<int*>(G + Layout::grads(D));
  int* okk = okq + kRows;
  float* crow = reinterpret_cast<float*>(okk + kRows);
  float* rowpart = crow + kRows;

  const int m = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / p.groups;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float beta = p.beta[h];
  const int row0 = m * kRows;
  const int kappa = p.causal ? p.kappa0 + m : p.nkc;
  const bool any = kappa >= 0;
  const bool intra = p.causal && any;
  const int key0 = p.s0 + kappa * kRows;
  const long long bh = bh_index(p, b, h);

  for (int r = threadIdx.x; r < kRows; r += kThreads) {
    okq[r] = any && row0 + r < p.nq;
    okk[r] = intra && key_ok(p, b, key0 + r);
    rowpart[r] = 0.f;
  }
  for (int e = threadIdx.x; e < Layout::table(p.lp); e += kThreads) wq[e] = 0.f;
  __syncthreads();
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h;
  const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h;
  project_rows<T, D>(p, q, p.sq.n, row0, okq, beta, spq, smq, uq);
  if (intra) project_rows<T, D>(p, k, p.sk.n, key0, okk, beta, spk, smk, nullptr);

  const float* A = p.kstate + (bh * (p.nkc + 1) + (any ? kappa : 0)) * p.features * D;
  const float* z = p.kz + (bh * (p.nkc + 1) + (any ? kappa : 0)) * p.features;
  // pass 1: num, den (as the forward), scores
  float num[4][D / 16] = {}, den[4] = {}, sc[4][4] = {};
  if (any) {
    for (int st = 0; st < p.stiles; ++st) {
      __syncthreads();
      build_phi(p, st, okq, spq, smq, phq);
      if (intra) build_phi(p, st, okk, spk, smk, phk);
      __syncthreads();
      if (intra) tile_dot(sc, phq, phk, ty, tx);
      state_apply<D>(num, den, phq, A, z, st, p.features, ty, tx);
    }
  }
  __syncthreads();
  if (intra) {
    for (int j = 0; j < kRows; ++j) {
      if (!okk[j]) continue;  // block-uniform
      float vr[D / 16];
#pragma unroll
      for (int c = 0; c < D / 16; ++c) vr[c] = to_float(v[(long long)(key0 + j) * p.sv.n + tx + 16 * c]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qi = row0 + ty * 4 + i;
        // the score of (i, j) lives in thread (ty, j % 16), register j / 16: broadcast it over the half-warp
        float a = 0.f;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const float x = __shfl_sync(0xffffffffu, sc[i][jj], (lane & 16) | (j % 16));
          if (jj == j / 16) a = x;
        }
        a = key0 + j <= qi + (p.nk - p.nq) ? a : 0.f;
        den[i] += a;
#pragma unroll
        for (int c = 0; c < D / 16; ++c) num[i][c] = fmaf(a, vr[c], num[i][c]);
      }
    }
  }
  // G_i = dO_i / den_i, c_i = G_i . O_i (0 for rows with no key)
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty * 4 + i, qi = row0 + r;
    const bool live = okq[r] && den[i] > 0.f;
    const float inv = live ? 1.f / den[i] : 0.f;
    float c_part = 0.f;
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
      const int d = tx + 16 * c;
      const float g = live ? to_float(dout[(long long)qi * p.sdo.n + d]) * inv : 0.f;
      G[r * (D + 1) + d] = g;
      c_part = fmaf(g, num[i][c] * inv, c_part);
    }
    const float ci = halfwarp_sum(c_part);
    if (tx == 0) {
      crow[r] = ci;
      if (qi < p.nq) {
        p.den[bh * p.nq + qi] = live ? den[i] : 0.f;
        p.cq[bh * p.nq + qi] = ci;
      }
    }
  }
  __syncthreads();
  if (intra) {  // ds[i][j] = G_i . v_j - c_i over allowed pairs; v staged 64 columns at a time
    float dot[4][4] = {};  // [j][i]
    for (int d0 = 0; d0 < D; d0 += kFeat) {
      const int dn = min(kFeat, D - d0);
      __syncthreads();
      for (int e = threadIdx.x; e < kRows * dn; e += kThreads) {
        const int r = e / dn, d = e % dn;
        stage[r * kPad + d] = okk[r] ? to_float(v[(long long)(key0 + r) * p.sv.n + d0 + d]) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int jl = tx + 16 * j;
        if (!okk[jl]) continue;
        for (int d = 0; d < dn; ++d) {
          const float vd = stage[jl * kPad + d];
#pragma unroll
          for (int i = 0; i < 4; ++i) dot[j][i] = fmaf(G[(ty * 4 + i) * (D + 1) + d0 + d], vd, dot[j][i]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int jl = tx + 16 * j, kj = key0 + jl;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ty * 4 + i;
        const bool allowed = okk[jl] && kj <= row0 + r + (p.nk - p.nq);
        ds[r * kPad + jl] = allowed ? dot[j][i] - crow[r] : 0.f;
      }
    }
  }
  // pass 2: dphi(q) per S-tile, then the table gradients w
  if (any) {
    for (int st = 0; st < p.stiles; ++st) {
      __syncthreads();
      build_phi(p, st, okq, spq, smq, phq);
      if (intra) build_phi(p, st, okk, spk, smk, phk);
      __syncthreads();
      float g[4][4] = {};  // dphi, then dphi * phi
      for (int d0 = 0; d0 < D; d0 += kFeat) {  // A's rows of this S-tile, 64 columns at a time
        const int dn = min(kFeat, D - d0);
        __syncthreads();
        for (int e = threadIdx.x; e < kRows * dn; e += kThreads) {
          const int f = e / dn, d = e % dn, s = st * kFeat + f;
          stage[f * kPad + d] = s < p.features ? __ldg(A + (long long)s * D + d0 + d) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int f = 0; f < 4; ++f) {
            const int r = ty * 4 + i, fl = tx + 16 * f;
            if (st * kFeat + fl >= p.features) continue;
            for (int d = 0; d < dn; ++d) g[i][f] = fmaf(stage[fl * kPad + d], G[r * (D + 1) + d0 + d], g[i][f]);
          }
      }
      table_grads_from_dphi(p, st, g, [&](int r) { return crow[r]; }, z, intra ? ds : nullptr, phk, phq, spq, smq, wq);
    }
  }
  __syncthreads();
  T* dq = static_cast<T*>(p.out) + bh * p.nq * D;
  for (int r = warp; r < kRows; r += kThreads / 32) {
    if (row0 + r >= p.nq) continue;  // warp-uniform
    float dx[D / 32] = {};
    const float db = chain_row<D>(p, r, beta, uq, wq, dx);
#pragma unroll
    for (int c = 0; c < D / 32; ++c) dq[(long long)(row0 + r) * D + lane + 32 * c] = from_float<T>(dx[c]);
    if (lane == 0) rowpart[r] = db;
  }
  __syncthreads();
  if (threadIdx.x == 0) p.dbeta_q[bh * p.nqt + m] = ordered_sum64(rowpart);
}

// dk, dv and the key side of dbeta for key chunk blockIdx.x of (kv head blockIdx.y, batch blockIdx.z),
// summed over the group's query heads. With B, y the suffix state of the queries after this chunk's tile:
// dphi(k_j) = B v_j - y + sum_i ds_ij phi(q_i);  dv_j = B^T phi(k_j) + sum_i a_ij G_i.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) race_dkv_bwd_kernel(const Params p) {
  extern __shared__ float smem[];
  float* spk = smem;
  float* smk = spk + Layout::table(p.lp);
  float* uk = smk + Layout::table(p.lp);
  float* wk = uk + Layout::table(p.lp);
  float* spq = wk + Layout::table(p.lp);
  float* smq = spq + Layout::table(p.lp);
  float* phk = smq + Layout::table(p.lp);
  float* phq = phk + Layout::tile();
  float* as = phq + Layout::tile();  // masked a_ji (key rows, query columns)
  float* ds = as + Layout::tile();
  float* G = ds + Layout::tile();  // (64 queries, D + 1)
  int* okk = reinterpret_cast<int*>(G + Layout::grads(D));
  int* okq = okk + kRows;
  float* crow = reinterpret_cast<float*>(okq + kRows);
  float* rowpart = crow + kRows;

  const int kappa = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int key0 = p.s0 + kappa * kRows;
  const int m = p.causal ? kappa - p.kappa0 : -1;  // the query tile whose diagonal crosses this chunk
  const bool intra = p.causal && m >= 0 && m < p.nqt;
  const int slot = p.causal ? min(max(m + 1, 0), p.nqt) : 0;  // queries after tile m (slot 0: all)
  const int row0q = m * kRows;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h;

  float dv[4][D / 16] = {};
  float dk[kRows / (kThreads / 32)][D / 32] = {};
  for (int g = 0; g < p.groups; ++g) {
    const int h = hk * p.groups + g;
    const float beta = p.beta[h];
    const long long bh = bh_index(p, b, h);
    const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
    const T* dout = static_cast<const T*>(p.dout) + b * p.sdo.b + h * p.sdo.h;
    __syncthreads();  // shared memory of the previous head is free
    for (int r = threadIdx.x; r < kRows; r += kThreads) {
      okk[r] = key_ok(p, b, key0 + r);
      const int qi = row0q + r;
      const float dn = intra && qi < p.nq ? p.den[bh * p.nq + qi] : 0.f;
      okq[r] = dn > 0.f;
      crow[r] = dn > 0.f ? p.cq[bh * p.nq + qi] : 0.f;
      rowpart[r] = 0.f;
    }
    for (int e = threadIdx.x; e < Layout::table(p.lp); e += kThreads) wk[e] = 0.f;
    __syncthreads();
    project_rows<T, D>(p, k, p.sk.n, key0, okk, beta, spk, smk, uk);
    if (intra) {
      project_rows<T, D>(p, q, p.sq.n, row0q, okq, beta, spq, smq, nullptr);
      for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
        const int r = e / D, d = e % D, qi = row0q + r;
        G[r * (D + 1) + d] = okq[r] ? to_float(dout[(long long)qi * p.sdo.n + d]) / p.den[bh * p.nq + qi] : 0.f;
      }
    }
    const float* Bs = p.qstate + (bh * (p.nqt + 1) + slot) * p.features * D;
    const float* y = p.qz + (bh * (p.nqt + 1) + slot) * p.features;

    // pass 1: a_ji, and dv += B^T phi(k)
    float sc[4][4] = {}, unused[4] = {};
    for (int st = 0; st < p.stiles; ++st) {
      __syncthreads();
      build_phi(p, st, okk, spk, smk, phk);
      if (intra) build_phi(p, st, okq, spq, smq, phq);
      __syncthreads();
      if (intra) tile_dot(sc, phk, phq, ty, tx);
      state_apply<D>(dv, unused, phk, Bs, y, st, p.features, ty, tx);
    }
    if (intra) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = ty * 4 + i, kj = key0 + r;
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int cl = tx + 16 * jj, qi = row0q + cl;
          const bool allowed = okk[r] && okq[cl] && kj <= qi + (p.nk - p.nq);
          float dot = 0.f;
          if (allowed)
            for (int d = 0; d < D; ++d) dot = fmaf(G[cl * (D + 1) + d], to_float(v[(long long)kj * p.sv.n + d]), dot);
          as[r * kPad + cl] = allowed ? sc[i][jj] : 0.f;
          ds[r * kPad + cl] = allowed ? dot - crow[cl] : 0.f;
        }
      }
      __syncthreads();
      for (int cl = 0; cl < kRows; ++cl) {  // dv += a G
        float gr[D / 16];
#pragma unroll
        for (int c = 0; c < D / 16; ++c) gr[c] = G[cl * (D + 1) + tx + 16 * c];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float a = as[(ty * 4 + i) * kPad + cl];
#pragma unroll
          for (int c = 0; c < D / 16; ++c) dv[i][c] = fmaf(a, gr[c], dv[i][c]);
        }
      }
    }
    // pass 2: dphi(k) per S-tile, then the table gradients w
    for (int st = 0; st < p.stiles; ++st) {
      __syncthreads();
      build_phi(p, st, okk, spk, smk, phk);
      if (intra) build_phi(p, st, okq, spq, smq, phq);
      __syncthreads();
      float gk[4][4] = {};  // dphi, then dphi * phi
      for (int d0 = 0; d0 < D; d0 += kFeat) {  // 64 columns at a time: Bs rows into `as`, v rows into G
        const int dn = min(kFeat, D - d0);       // (both free in pass 2)
        __syncthreads();
        for (int e = threadIdx.x; e < kRows * dn; e += kThreads) {
          const int f = e / dn, d = e % dn, s = st * kFeat + f;
          as[f * kPad + d] = s < p.features ? __ldg(Bs + (long long)s * D + d0 + d) : 0.f;
          G[f * (D + 1) + d] = okk[f] ? to_float(v[(long long)(key0 + f) * p.sv.n + d0 + d]) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int f = 0; f < 4; ++f) {
            const int r = ty * 4 + i, fl = tx + 16 * f;
            if (!okk[r] || st * kFeat + fl >= p.features) continue;
            for (int d = 0; d < dn; ++d) gk[i][f] = fmaf(as[fl * kPad + d], G[r * (D + 1) + d], gk[i][f]);
          }
      }
      table_grads_from_dphi(p, st, gk, [&](int r) { return okk[r] ? 1.f : 0.f; }, y, intra ? ds : nullptr, phq, phk, spk,
                            smk, wk);
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRows / (kThreads / 32); ++rr) {
      const int r = warp + rr * (kThreads / 32);
      const float db = chain_row<D>(p, r, beta, uk, wk, dk[rr]);
      if (lane == 0) rowpart[r] = okk[r] ? db : 0.f;
    }
    __syncthreads();
    if (threadIdx.x == 0) p.dbeta_k[bh * p.nkc + kappa] = ordered_sum64(rowpart);
  }
  const long long bhk = (long long)b * (p.hq / p.groups) + hk;
  T* dkp = static_cast<T*>(p.dk) + bhk * p.nk * D;
  T* dvp = static_cast<T*>(p.dv) + bhk * p.nk * D;
#pragma unroll
  for (int rr = 0; rr < kRows / (kThreads / 32); ++rr) {
    const int j = key0 + warp + rr * (kThreads / 32);
    if (j < 0 || j >= p.nk) continue;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) dkp[(long long)j * D + lane + 32 * c] = from_float<T>(dk[rr][c]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int j = key0 + ty * 4 + i;
    if (j < 0 || j >= p.nk) continue;
#pragma unroll
    for (int c = 0; c < D / 16; ++c) dvp[(long long)j * D + tx + 16 * c] = from_float<T>(dv[i][c]);
  }
}

static_assert((kThreads & (kThreads - 1)) == 0, "the dbeta tree halves kThreads");

// dbeta[blockIdx.x] = the head's partials over b, query tiles and key chunks: thread i sums the fixed slice
// i, i + kThreads, ... of each row, then a fixed tree over the block (deterministic; one block per head).
static __global__ void __launch_bounds__(kThreads) race_dbeta_bwd_kernel(const float* part_q, const float* part_k, int batch,
                                                                  int hq, int nqt, int nkc, float* dbeta_h) {
  __shared__ float red[kThreads];
  const int h = blockIdx.x;
  float s = 0.f;
  for (int b = 0; b < batch; ++b) {
    const long long bh = (long long)b * hq + h;
    for (int m = threadIdx.x; m < nqt; m += kThreads) s += part_q[bh * nqt + m];
    for (int c = threadIdx.x; c < nkc; c += kThreads) s += part_k[bh * nkc + c];
  }
  red[threadIdx.x] = s;
  __syncthreads();
#pragma unroll
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] += red[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) dbeta_h[h] = red[0];
}

// dbeta of a scalar beta: the heads' dbeta in order (one thread; hq is small).
static __global__ void race_dbeta_total_kernel(const float* dbeta_h, int hq, float* dbeta_total) {
  float s = 0.f;
  for (int h = 0; h < hq; ++h) s += dbeta_h[h];
  *dbeta_total = s;
}

}  // namespace race
}  // namespace hfab
