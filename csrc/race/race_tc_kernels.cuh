// RACE forward on tensor cores (mma.sync, sm_80+) for fp16/bf16 inputs and S = L * 2^P <= 64.
//
// Two levels (csrc/race/NOTES.md, "Tensor-core forward"): key chunks of 64 are taken p.gchunks (16 or 32) at a time.
//   race_group_state_fwd_kernel  per (key-chunk group, q head, batch): the group's sum_j phi(k_j) [v_j, 1]^T
//                                (S x (D + 1), fp32), written to slot g of p.kstate / p.kz
//   race_scan_fwd_kernel         exclusive prefix over the groups (race_kernels.cuh; slot ngk = total)
//   race_causal_out_fwd_kernel   causal: per key-chunk group, each warp on its own rows, the running state in
//                                registers (fp32; features 16w.. per warp): out of the chunk's query tile, then
//                                state += phi(k)^T [v, 1]
//   race_group_out_fwd_kernel    the same block-wide, the running state in shared memory (GPUs with less shared
//                                memory per block; HFAB_RACE_WARP_CAUSAL=0)
//   race_query_out_fwd_kernel    non-causal: per group of query tiles, out from the total state
// 128 threads (4 warps); warp w owns rows [16w, 16w + 16) of a 64-row tile (queries or features).
// Operand precision (measured in a float64 simulation, NOTES.md): projections x W^T with W split in
// two T halves (hi + lo); scores phi(q) phi(k)^T with fp16 features; a v and the causal out kernel's phi(k)^T v with
// the non-v operand split in two T halves, v in T (the block-wide causal out kernel); the group states phi(k)^T v with
// fp16 phi(k) and v in fp16 times a power of two per warp's 16 rows (bf16 v; warp_rows_to_half), fp32 sums, in the
// forward for bf16 inputs (fp16 inputs and the backward: phi(k) in two halves); the per-warp causal kernel's chunk
// products likewise, its scores in fp16 times a power of two per row (two fp16 parts for fp16 inputs); the state apply
// phi(q) [A, z] in tf32 in the block-wide causal kernel, else in fp16 times powers of two (per warp's 16 features where
// the state grows, one per block where it is fixed; two fp16 parts for fp16 inputs in the non-causal kernel). The
// denominators ride along as one more column: v gets a row of ones (intra-chunk sums of a), the state keeps z in
// column D, so num and den see the same rounded a.
// No atomics: every sum has a fixed order. Pure CUDA.
#pragma once

#include "common/mma.cuh"
#include "race/race_kernels.cuh"

namespace hfab {
namespace race {
namespace tc {

constexpr int kThreads = 128;
constexpr int kC = 64;       // rows per chunk / query tile
constexpr int kS = 64;       // features, zero-padded (fast path: S <= 64)
constexpr int kLPMax = 24;   // L * P when L * 2^P <= 64 and L <= 8
constexpr int kGroup = 16;   // chunks per group
constexpr int kT = kC + 8;   // row stride (elements) of 64-column 16-bit tiles: fragment loads hit 32 banks

// Key chunks per group of the forward's group states (Params::gchunks) for nkc key chunks and `heads` (batch x q
// heads): kWideGroup where that still makes enough blocks, else kGroup. Wide groups halve the state slots that the
// group scan walks and that the causal out kernel's blocks start from (measured: causal B1 H8 2M 6.47 -> 6.30 ms,
// non-causal B4 H16 65K 0.754 -> 0.741). Enough: 4,096 causal (the out kernel runs a block per group, three per SM at
// D = 64: ten waves on 132 SMs), 2,048 non-causal (only the group-state kernel does, four per SM). The backward's
// kernels take kGroup.
constexpr int kWideGroup = 32;
__host__ __device__ inline int forward_group_chunks(int nkc, long long heads, bool causal) {
  const long long blocks = static_cast<long long>((nkc + kWideGroup - 1) / kWideGroup) * heads;
  return blocks >= (causal ? 4096 : 2048) ? kWideGroup : kGroup;
}

// Shared-memory carve-up (bytes), for the kernels and the host's launch size.
template <typename T, int D>
struct Tiles {
  static constexpr int kX = D + 8;  // row stride of x tiles, planes and the state
  static constexpr int x_bytes = kC * kX * 2;
  static constexpr int w_off = x_bytes;                             // x of the rows being projected
  static constexpr int sp_off = w_off + 2 * kLPMax * kX * 2;        // planes hi, lo (T)
  static constexpr int table_bytes = kC * kLPMax * 4;
  static constexpr int phq_off = sp_off + 2 * table_bytes;          // sigma+, sigma- of those rows
  static constexpr int phk_off = phq_off + kC * kT * 2;             // fp16 phi(q) [query][feature]
  static constexpr int pkt_off = phk_off + kC * kT * 2;             // fp16 phi(k) [key][feature]
  static constexpr int vt_off = pkt_off + 2 * kS * kT * 2;          // T phi(k) hi, lo [feature][key]
  static constexpr int ok_off = vt_off + kX * kT * 2;               // T v^T [d][key], row D = 1
  static constexpr int st_off = ok_off + 2 * kC * 4;                // flags of query rows, key rows
  static constexpr int bytes = st_off + kS * kX * 4;                // fp32 state [feature][d], column D = z
  // Kernels that use part of the tiles pack them below the ones they skip (fewer bytes: more blocks per SM):
  // kKeyStates (race_group_state_fwd_kernel): x, w, then two phi(k) tiles (phk: [key][feature], the second kC kT after
  // the first; fp16, or hi and lo in T), two v tiles xv (row-major; fp16 once a warp has converted its rows, column
  // D = 1: the z column), the two tiles' exponents ve (int [2][4]: one per warp's 16 rows) and last the sigma tables,
  // left out of the launch size where P = 4 (key_states_bytes_for).
  // kQueryOut (race_query_out_fwd_kernel): x, w, the sigma tables, phq, then the state in fp16 (sth: [feature][d],
  // z in column D; for fp16 inputs its lo part after it, kSplitState) at phk_off and the output rows (ot: [64][D + 8],
  // T) after those.
  // kCausalOut (the causal race_group_out_fwd_kernel): every tile, a second x tile (xk, at `bytes`) for the key
  // rows, so that the next chunk's query and key rows both load (cp.async) while this chunk computes, and where
  // sm_80 has room (D <= 64) a tile xv for the next chunk's v rows (row-major; key_chunk transposes it into vt).
  // kKeyStates has xv too. Every layout but kAll (the backward kernels, and the causal out kernel on GPUs with
  // less shared memory per block than causal_out_bytes) and kQueryState prefetches its next rows: `prefetch`.
  // kCausalWarp (race_causal_out_fwd_kernel): x (query rows), w, then xk (key rows), phq, cw_bufs phk tiles, two xv
  // tiles, cw_bufs staged states sth ([feature][d] fp16, z in column D), ot (in phq's rows where they fit:
  // cw_ot_in_phq), the exponents (ints: ve [2][4], then se [2][4][2]: the staged states' num and den exponents per
  // warp) and last the sigma tables, left out where P = 4 (71.5 KB at D = 64: three blocks per SM).
  // kQueryState (the backward's race_group_qstate_bwd_kernel): x, w, the sigma tables, phq or in its place the fp32
  // phi(q) tile (DkvTiles' g, kC x (kS + 1) floats), then vt, the flags and DkvTiles' per-row values (55.4 KB at D =
  // 64: four blocks per SM where the dk/dv kernel's 113.8 KB layout left two).
  enum class Use { kAll, kKeyStates, kQueryOut, kCausalOut, kCausalWarp, kQueryState };
  static constexpr bool causal_stages_v = D <= 64;
  static constexpr int causal_out_bytes = bytes + (causal_stages_v ? 2 : 1) * x_bytes;
  static constexpr int ks_phk_off = sp_off;
  static constexpr int ks_xv_off = ks_phk_off + 2 * kC * kT * 2;
  static constexpr int ks_ve_off = ks_xv_off + 2 * x_bytes;
  static constexpr int ks_sp_off = ks_ve_off + 2 * kThreads / 32 * 4;
  static constexpr int key_states_bytes = ks_sp_off + 2 * table_bytes;
  // kKeyStates' launch size: without the sigma tables where P = 4 (project_features_p4 maps from registers)
  static __host__ __device__ int key_states_bytes_for(int planes_per_table) {
    return planes_per_table == 4 ? ks_sp_off : key_states_bytes;
  }
  static constexpr bool cw_ot_in_phq = kX == kT;  // D = 64: a warp's output rows fit its phq rows
  // phk and sth copies (by chunk parity): one at D = 64, where it buys a third block per SM at the cost of a second
  // barrier per chunk; two at D = 32 (three blocks either way: registers) and D = 128 (one block either way)
  static constexpr int cw_bufs = D == 64 ? 1 : 2;
  static constexpr int cw_xk_off = sp_off;
  static constexpr int cw_phq_off = cw_xk_off + x_bytes;
  static constexpr int cw_phk_off = cw_phq_off + kC * kT * 2;
  static constexpr int cw_xv_off = cw_phk_off + cw_bufs * kC * kT * 2;
  static constexpr int cw_sth_off = cw_xv_off + 2 * x_bytes;
  static constexpr int cw_ot_off = cw_sth_off + cw_bufs * kS * kX * 2;
  static constexpr int cw_ve_off = cw_ot_off + (cw_ot_in_phq ? 0 : x_bytes);
  static constexpr int cw_sp_off = cw_ve_off + 6 * kThreads / 32 * 4;
  static constexpr int causal_warp_bytes = cw_sp_off + 2 * table_bytes;
  // kCausalWarp's launch size: without the sigma tables where P = 4
  static __host__ __device__ int causal_warp_bytes_for(int planes_per_table) {
    return planes_per_table == 4 ? cw_sp_off : causal_warp_bytes;
  }
  // kQueryOut's staged state in two fp16 parts (hi, then lo kS kX after it) for fp16 inputs: their outputs' rounding
  // leaves too little room for an 11-bit state (S = 2, N = 1,100: 2.06x the reference's error, the tests' bound 2x);
  // the same for the causal per-warp kernel's chunk scores (race_causal_out_fwd_kernel: 2.07x)
  static constexpr bool kSplitState = std::is_same_v<T, __half>;
  static constexpr int qo_ot_off = phk_off + (kSplitState ? 2 : 1) * kS * kX * 2;
  static constexpr int query_out_bytes = qo_ot_off + x_bytes;
  static constexpr int qs_vt_off = phq_off + kC * (kS + 1) * 4;
  static constexpr int qs_ok_off = qs_vt_off + kX * kT * 2;
  static constexpr int qs_rows_off = qs_ok_off + 2 * kC * 4;
  static constexpr int query_state_bytes = qs_rows_off + 3 * kC * 4;
  static_assert(qs_vt_off % 16 == 0 && query_state_bytes <= bytes, "kQueryState: aligned, packed");
  static_assert(cw_phq_off % 16 == 0 && cw_xv_off % 16 == 0 && cw_sth_off % 16 == 0 && cw_ot_off % 16 == 0 &&
                cw_sp_off % 16 == 0, "16-byte aligned tiles");
  static_assert(ks_xv_off % 16 == 0 && ks_sp_off % 16 == 0 && qo_ot_off % 16 == 0 && st_off % 16 == 0 &&
                bytes % 16 == 0 && x_bytes % 16 == 0, "16-byte aligned tiles");
  static_assert(w_off % 16 == 0 && phq_off % 16 == 0 && phk_off % 16 == 0 && pkt_off % 16 == 0 && vt_off % 16 == 0 &&
                kX % 8 == 0 && kT % 8 == 0, "ldmatrix: every row of the 16-bit tiles 16-byte aligned");
  static_assert(key_states_bytes <= st_off && query_out_bytes <= bytes, "packed layouts are smaller");

  T *x, *xk, *w, *pkt = nullptr, *vt = nullptr;  // xk: x of key rows (x itself but in kCausalOut)
  T* xv = nullptr;                                // v rows, row-major, when staged (else load_vt reads global)
  T* ot = nullptr;
  float *sp, *sm, *st = nullptr;
  __half *phq = nullptr, *phk = nullptr, *sth = nullptr;
  int *okq = nullptr, *okk = nullptr, *ve = nullptr, *se = nullptr;
  bool prefetch;

  __device__ explicit Tiles(char* base, Use use = Use::kAll)
      : x(reinterpret_cast<T*>(base)),
        xk(use == Use::kCausalOut ? reinterpret_cast<T*>(base + bytes)
                                  : (use == Use::kCausalWarp ? reinterpret_cast<T*>(base + cw_xk_off) : x)),
        w(reinterpret_cast<T*>(base + w_off)),
        sp(reinterpret_cast<float*>(
            base + (use == Use::kKeyStates ? ks_sp_off : (use == Use::kCausalWarp ? cw_sp_off : sp_off)))),
        sm(sp + kC * kLPMax),
        prefetch(use != Use::kAll && use != Use::kQueryState) {
    if (use == Use::kCausalWarp) {
      phq = reinterpret_cast<__half*>(base + cw_phq_off);
      phk = reinterpret_cast<__half*>(base + cw_phk_off);
      xv = reinterpret_cast<T*>(base + cw_xv_off);
      sth = reinterpret_cast<__half*>(base + cw_sth_off);
      ot = reinterpret_cast<T*>(base + (cw_ot_in_phq ? cw_phq_off : cw_ot_off));
      ve = reinterpret_cast<int*>(base + cw_ve_off);
      se = ve + 2 * kThreads / 32;
    } else if (use == Use::kKeyStates) {
      phk = reinterpret_cast<__half*>(base + ks_phk_off);
      xv = reinterpret_cast<T*>(base + ks_xv_off);
      ve = reinterpret_cast<int*>(base + ks_ve_off);
    } else if (use == Use::kQueryState) {
      phq = reinterpret_cast<__half*>(base + phq_off);
      vt = reinterpret_cast<T*>(base + qs_vt_off);
      okq = reinterpret_cast<int*>(base + qs_ok_off);
      okk = okq + kC;
    } else if (use == Use::kQueryOut) {
      phq = reinterpret_cast<__half*>(base + phq_off);
      sth = reinterpret_cast<__half*>(base + phk_off);
      ot = reinterpret_cast<T*>(base + qo_ot_off);
    } else {
      pkt = reinterpret_cast<T*>(base + pkt_off);
      vt = reinterpret_cast<T*>(base + vt_off);
      phq = reinterpret_cast<__half*>(base + phq_off);
      phk = reinterpret_cast<__half*>(base + phk_off);
      okq = reinterpret_cast<int*>(base + ok_off);
      okk = okq + kC;
      st = reinterpret_cast<float*>(base + st_off);
      if (use == Use::kCausalOut && causal_stages_v) xv = reinterpret_cast<T*>(base + bytes + x_bytes);
    }
  }
};

// Planes split into T halves (rows >= L*P are 0); rows D.. of v^T: a row of ones, then zeros; in kKeyStates' two
// row-major v tiles, columns D.. of every row: a one of type V (the product's operand type), then zeros (the copies
// of v rows write columns < D only).
template <typename T, int D, typename V = T>
__device__ void init_constants(const Params& p, Tiles<T, D>& s) {
  constexpr int kX = Tiles<T, D>::kX;
  for (int e = threadIdx.x; e < kLPMax * D; e += kThreads) {
    const int lt = e / D, d = e % D;
    T hi, lo;
    mma::split<T>(lt < p.lp ? p.planes[lt * D + d] : 0.f, hi, lo);
    s.w[lt * kX + d] = hi;
    s.w[(kLPMax + lt) * kX + d] = lo;
  }
  if (s.ve != nullptr) {
    for (int e = threadIdx.x; e < 2 * kC * 8; e += kThreads)
      reinterpret_cast<V*>(s.xv)[(e / 8) * kX + D + e % 8] = from_float<V>(e % 8 == 0 ? 1.f : 0.f);
    return;
  }
  if (s.vt == nullptr) return;  // kQueryOut: no v^T tile
  for (int e = threadIdx.x; e < 8 * kC; e += kThreads) {
    const int r = e / kC, j = e % kC;
    s.vt[(D + r) * kT + j] = from_float<T>(r == 0 ? 1.f : 0.f);
  }
}

// Rows [row0, row0 + 64) of x (16-byte vectors; rows with ok = 0 are 0) into a [64][D + 8] tile.
template <typename T, int D>
__device__ __forceinline__ void load_rows(const T* x, long long stride, int row0, const int* ok, T* tile) {
  mma::load_rows<kC, D, kThreads>(tile, x, stride, row0, [ok](int r) { return ok[r] != 0; });
}

// load_rows by cp.async (no registers, no wait; one thread's copies complete at its cp_async_wait_all): rows with
// ok(r) false are 0.
template <typename T, int D, typename Ok>
__device__ __forceinline__ void load_rows_async(const T* x, long long stride, int row0, Ok ok, T* tile) {
  mma::load_rows_async<kC, D, kThreads>(tile, x, stride, row0, ok);
}

// load_vt's thread layout: row j = thread % 64, 16-byte chunks c0 + kPass i (c0 = thread / 64) of it.
template <int D> struct VtChunks {
  static constexpr int kPass = kThreads / kC, kIters = D / 8 / kPass, kBatch = kIters < 4 ? kIters : 4;
  static_assert(kThreads % kC == 0 && (D / 8) % kPass == 0 && kIters % kBatch == 0, "tile shapes");
  static __device__ __forceinline__ int row() { return threadIdx.x % kC; }
  // chunks i0 .. i0 + N - 1 of row j (src: its first chunk) into val, zeros where the row is not ok
  template <typename T, int N>
  static __device__ __forceinline__ void fetch(uint4 (&val)[N], const T* src, bool row_ok, int i0) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      val[i] = row_ok ? *reinterpret_cast<const uint4*>(src + 8 * kPass * (i0 + i)) : make_uint4(0, 0, 0, 0);
  }
  // their stores into vt[d][j]: element e of a chunk is 16-bit half e % 2 of word e / 2 (no local copy)
  template <typename T, int N>
  static __device__ __forceinline__ void store(const uint4 (&val)[N], T* vt, int i0) {
    const int j = row(), c0 = threadIdx.x / kC;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint32_t words[4] = {val[i].x, val[i].y, val[i].z, val[i].w};
      uint16_t* col = reinterpret_cast<uint16_t*>(vt) + 8 * (c0 + kPass * (i0 + i)) * kT + j;
#pragma unroll
      for (int e = 0; e < 8; ++e) col[e * kT] = static_cast<uint16_t>(e % 2 ? words[e / 2] >> 16 : words[e / 2]);
    }
  }
  // the same chunks row-major into x[j][d] ([64][D + 8], as load_rows writes it)
  template <typename T, int N>
  static __device__ __forceinline__ void store_rows(const uint4 (&val)[N], T* x, int i0) {
    const int j = row(), c0 = threadIdx.x / kC;
#pragma unroll
    for (int i = 0; i < N; ++i) *reinterpret_cast<uint4*>(x + j * (D + 8) + 8 * (c0 + kPass * (i0 + i))) = val[i];
  }
};

// v rows [row0, row0 + 64) (global or shared memory) transposed into vt[d][j] (rows with ok = 0 are 0). Thread: row j,
// chunks c0 + kPass i; up to four loads in flight before their stores.
template <typename T, int D>
__device__ __forceinline__ void load_vt(const T* v, long long stride, int row0, const int* ok, T* vt) {
  using C = VtChunks<D>;
  const int j = C::row();
  const T* src = v + (long long)(row0 + j) * stride + 8 * (threadIdx.x / kC);
#pragma unroll
  for (int i0 = 0; i0 < C::kIters; i0 += C::kBatch) {
    uint4 val[C::kBatch];
    C::fetch(val, src, ok[j] != 0, i0);
    C::store(val, vt, i0);
  }
}

// A whole load_vt held in registers between its loads (fetch; row_ok(j) for row row0 + j) and its transposed stores
// (store), so that other work overlaps the loads' latency: kIters 16-byte words per thread.
template <typename T, int D> struct VtInFlight {
  using C = VtChunks<D>;
  uint4 val[C::kIters];
  template <typename Ok> __device__ __forceinline__ void fetch(const T* v, long long stride, int row0, Ok row_ok) {
    const int j = C::row();
    C::fetch(val, v + (long long)(row0 + j) * stride + 8 * (threadIdx.x / kC), row_ok(j), 0);
  }
  __device__ __forceinline__ void store(T* vt) const { C::store(val, vt, 0); }
  __device__ __forceinline__ void store_rows(T* x) const { C::store_rows(val, x, 0); }  // row-major, untransposed
};

// W x for the warp's 16 rows 16w.. of `tile` on tensor cores, in the C layout: acc[nt] holds planes 8 nt..8 nt + 7
// (n-tiles past L*P are 0).
template <typename T, int D>
__device__ __forceinline__ void project_acc(const Params& p, const T* tile, const T* w, float (&acc)[3][4]) {
  constexpr int kX = D + 8;
  const int lane = threadIdx.x % 32, r0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t a[4];
    mma::load_a(a, tile, kX, r0, k0, lane);
#pragma unroll
    for (int nt = 0; nt < 3; ++nt) {
      if (nt * 8 >= p.lp) continue;
      uint32_t b[2][2];  // planes hi, lo
      mma::load_b2(b, w, kX, nt * 8, kLPMax + nt * 8, k0, lane);
      mma::m16n8k16(acc[nt], a, b[0], T{});
      mma::m16n8k16(acc[nt], a, b[1], T{});
    }
  }
}

// sigma(+-2 beta u) for u = tanh(W x) of the 64 rows in `tile` (warp w: rows 16w..16w+15), on tensor cores;
// u itself into u[row * L*P + lt] when u is not null (the backward's chain rule).
template <typename T, int D>
__device__ __forceinline__ void project(const Params& p, const T* tile, const T* w, float beta, float* sp, float* sm,
                                        float* u = nullptr) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
  float acc[3][4] = {};
  project_acc<T, D>(p, tile, w, acc);
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = r0 + g + (e >= 2 ? 8 : 0), lt = nt * 8 + 2 * t + (e & 1);
      if (lt >= p.lp) continue;
      const float ut = tanhf(acc[nt][e]);
      sigmoid_pair(2.f * beta * ut, sp[row * kLPMax + lt], sm[row * kLPMax + lt]);
      if (u != nullptr) u[row * p.lp + lt] = ut;
    }
}

// Features bucket0 .. bucket0 + 2^Q - 1 of one table and row, whose first P - Q planes are fixed (their product
// is `start`): val[i] = start * prod_t (bit Q-1-t of i ? sp[t] : sm[t]), built plane by plane (t = 0 is the top
// bit). Each product has the same factors in the same order as the plain loop over all P planes from 1, so
// the values are identical to it, bit for bit.
template <int Q>
__device__ __forceinline__ void table_features(const float* sp, const float* sm, float start, float (&val)[1 << Q]) {
  val[0] = start;
#pragma unroll
  for (int t = 0; t < Q; ++t) {
#pragma unroll
    for (int i = (1 << Q) / 2 - 1; i >= 0; --i) {  // descending: val[i] is read before 2i, 2i + 1 are written
      if (i >= (1 << t)) continue;  // a constant trip count, so both loops unroll and val stays in registers
      val[2 * i + 1] = val[i] * sp[t];
      val[2 * i] = val[i] * sm[t];
    }
  }
}

// An item of the feature map for P planes per table: 2^Q consecutive features (Q = min(P, 4): at most 16 values in
// registers) of one row. The features of `item` (features [item R, item R + R)) of row r from its sigma tables: the
// product of its first P - Q planes, then table_features; zeros past the tables and for rows with ok = false.
template <int P> struct Items {
  static constexpr int Q = P < 4 ? P : 4, R = 1 << Q, kPerRow = kS / R;
  static __device__ __forceinline__ void values(const Params& p, const float* sp, const float* sm, int r, int item,
                                                bool ok, float (&val)[R]) {
    const int l = item >> (P - Q), top = item & ((1 << (P - Q)) - 1);
    if (l < p.tables && ok) {
      const float* pos = sp + r * kLPMax + l * P;
      const float* neg = sm + r * kLPMax + l * P;
      float start = 1.f;
#pragma unroll
      for (int t = 0; t < P - Q; ++t) start *= ((top >> (P - Q - 1 - t)) & 1) ? pos[t] : neg[t];
      table_features<Q>(pos + P - Q, neg + P - Q, start, val);
    } else {
#pragma unroll
      for (int i = 0; i < R; ++i) val[i] = 0.f;
    }
  }
};

// R 16-bit values packed in R / 2 words at dst (an item of a row of a [..][kT] tile): 16-byte stores where R >= 8, so
// that 8 rows per phase hit 32 distinct banks (row stride kT).
template <int R>
__device__ __forceinline__ void store_words(void* dst, const uint32_t* w) {
  if constexpr (R >= 8) {
#pragma unroll
    for (int i = 0; i < R / 2; i += 4) static_cast<uint4*>(dst)[i / 4] = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
  } else if constexpr (R == 4) {
    *static_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *static_cast<uint32_t*>(dst) = w[0];
  }
}

// val in fp16 at dst (store_words).
template <int R>
__device__ __forceinline__ void store_halves(__half* dst, const float (&val)[R]) {
  uint32_t w[R / 2];
#pragma unroll
  for (int j = 0; j < R / 2; ++j) w[j] = mma::pack2<__half>(val[2 * j], val[2 * j + 1]);
  store_words<R>(dst, w);
}

// fn(i, r, item) for the warp's share of the feature map of its 16 rows r0..: Items<P>::kPerRow / 2 (row, item) pairs
// i, lanes 0..15 on rows r0.. of one item and lanes 16..31 on the next (lane l always on row r0 + l % 16).
template <int P, typename Fn>
__device__ __forceinline__ void warp_pairs(int r0, Fn&& fn) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < Items<P>::kPerRow / 2; ++i) fn(i, r0 + lane % 16, lane / 16 + 2 * i);
}

// fn(i, r, item) for the two (row, table) pairs i = 0, 1 of this lane in project_features_p4.
template <typename Fn>
__device__ __forceinline__ void warp_pairs_p4(Fn&& fn) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int r = (threadIdx.x / 32) * 16 + lane / 4 + 8 * (t & 1);
#pragma unroll
  for (int i = 0; i < 2; ++i) fn(i, r, 2 * i + t / 2);
}

// P = 4 without the sigma tables: the warp's 16 rows r0.. projected (project_acc; then `after_reads`, the warp's reads
// of `tile` done) and mapped to features in registers. Lane (g, t) holds planes 8 nt + 2t, 2t + 1 of rows g and g + 8
// (the C layout), so lanes t and t ^ 1 hold the four planes of table 2 nt + t / 2 between them: after one exchange
// lane t maps row g (t even) or g + 8 (t odd) of that table, for nt = 0, 1: fn(i = nt, r, item = table, val) with
// val as Items<4>::values gives it (the same sigma values and products, so the same bits; zeros for tables >= L and
// rows with ok(r) false).
template <typename T, int D, typename After, typename Ok, typename Fn>
__device__ __forceinline__ void project_features_p4(const Params& p, const T* tile, const T* w, float beta,
                                                    After&& after_reads, Ok&& ok, Fn&& fn) {
  const int odd = threadIdx.x % 2;
  float acc[3][4] = {};
  project_acc<T, D>(p, tile, w, acc);
  __syncwarp();
  after_reads();
  warp_pairs_p4([&](int nt, int r, int table) {
    float pos[4], neg[4];  // e = 0, 1: row g; e = 2, 3: row g + 8 (planes 2t, 2t + 1)
#pragma unroll
    for (int e = 0; e < 4; ++e) sigmoid_pair(2.f * beta * tanhf(acc[nt][e]), pos[e], neg[e]);
    float sp[4], sm[4];  // the table's planes 0..3 for the lane's row: two its own, two from lane t ^ 1
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float send_p = odd ? pos[j] : pos[2 + j], send_m = odd ? neg[j] : neg[2 + j];  // the partner's row
      const float got_p = __shfl_xor_sync(0xffffffffu, send_p, 1), got_m = __shfl_xor_sync(0xffffffffu, send_m, 1);
      sp[j] = odd ? got_p : pos[j];
      sm[j] = odd ? got_m : neg[j];
      sp[2 + j] = odd ? pos[2 + j] : got_p;
      sm[2 + j] = odd ? neg[2 + j] : got_m;
    }
    float val[16];
    if (table < p.tables && ok(r)) {
      table_features<4>(sp, sm, 1.f, val);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) val[i] = 0.f;
    }
    fn(nt, r, table, val);
  });
}

// features() for P planes per table. A warp takes 32 consecutive rows of one item, so the transposed pkt stores of
// a feature are 64 contiguous bytes.
template <typename T, int P>
__device__ __forceinline__ void features_p(const Params& p, const int* ok, const float* sp, const float* sm,
                                           __half* phi, T* pkt, float* phi32) {
  constexpr int R = Items<P>::R;
  for (int e = threadIdx.x; e < kC * Items<P>::kPerRow; e += kThreads) {
    const int r = e % kC, item = e / kC;  // features [item R, item R + R)
    float val[R];
    Items<P>::values(p, sp, sm, r, item, ok[r] != 0, val);
    if (phi != nullptr) store_halves<R>(phi + r * kT + item * R, val);
    if (pkt != nullptr) {
#pragma unroll
      for (int i = 0; i < R; ++i) {
        T hi, lo;
        mma::split<T>(val[i], hi, lo);
        pkt[(item * R + i) * kT + r] = hi;
        pkt[(kS + item * R + i) * kT + r] = lo;
      }
    }
    if (phi32 != nullptr) {  // row stride kS + 1: a warp's 32 rows hit 32 banks
#pragma unroll
      for (int i = 0; i < R; ++i) phi32[r * (kS + 1) + item * R + i] = val[i];
    }
  }
}

// fn(Planes<P>{}) for P = p.planes_per_table: the feature-map code with P a compile-time constant (the host admits
// 1 <= P <= 6 on this path: S = L 2^P <= 64).
template <int P> struct Planes { static constexpr int value = P; };
template <typename Fn>
__device__ __forceinline__ void dispatch_planes(const Params& p, Fn&& fn) {
  switch (p.planes_per_table) {
    case 1: fn(Planes<1>{}); break;
    case 2: fn(Planes<2>{}); break;
    case 3: fn(Planes<3>{}); break;
    case 4: fn(Planes<4>{}); break;
    case 5: fn(Planes<5>{}); break;
    default: fn(Planes<6>{}); break;
  }
}

// Each non-null target: phi[r][s] (fp16, row-major), phi in T halves transposed (pkt[s][r] hi, then lo), phi32[r][s]
// (fp32, row stride kS + 1). 0 for s >= S and rows with ok = 0.
template <typename T>
__device__ __forceinline__ void features(const Params& p, const int* ok, const float* sp, const float* sm,
                                         __half* phi, T* pkt, float* phi32 = nullptr) {
  dispatch_planes(p, [&](auto planes) { features_p<T, decltype(planes)::value>(p, ok, sp, sm, phi, pkt, phi32); });
}

// acc[n] += phi(k)^T [v, 1] for the warp's 16 features (rows 16w.. of pkt) and the 8 columns of n-tile
// n0 + n < ncount (rows 8 (n0 + n).. of v^T).
template <typename T, int NN>
__device__ __forceinline__ void state_delta(const T* pkt, const T* vt, int n0, int ncount, float (&acc)[NN][4]) {
  const int lane = threadIdx.x % 32, f0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int kk = 0; kk < kC / 16; ++kk) {
    uint32_t hi[4], lo[4];  // phi(k) in T halves
    mma::load_a(hi, pkt, kT, f0, kk * 16, lane);
    mma::load_a(lo, pkt, kT, kS + f0, kk * 16, lane);
    mma::for_each_b<NN>(vt + n0 * 8 * kT, kT, kk * 16, ncount - n0, lane, [&](int n, const uint32_t (&b)[2]) {
      mma::m16n8k16(acc[n], hi, b, T{});
      mma::m16n8k16(acc[n], lo, b, T{});
    });
  }
}

// Per-block setup shared by both kernels: the (b, h) pointers.
template <typename T>
struct Heads {
  const T *q, *k, *v;
  long long bh;
  float beta;
  __device__ Heads(const Params& p, int h, int b) {
    const int hk = h / p.groups;
    q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
    k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h;
    v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h;
    bh = bh_index(p, b, h);
    beta = p.beta[h];
  }
};

// Starts loading (cp.async) the rows that key_chunk reads from s.xk (and s.xv, when staged) when s.prefetch: those
// of key chunk kappa.
template <typename T, int D>
__device__ __forceinline__ void prefetch_keys(const Params& p, const Heads<T>& hd, int b, int kappa, Tiles<T, D>& s) {
  const int key0 = p.s0 + kappa * kC;
  const auto ok = [&p, b, key0](int r) { return key_ok(p, b, key0 + r); };
  load_rows_async<T, D>(hd.k, p.sk.n, key0, ok, s.xk);
  if (s.xv != nullptr) load_rows_async<T, D>(hd.v, p.sv.n, key0, ok, s.xv);
}

// Starts loading (cp.async) the x rows that query_tile reads from s.x when s.prefetch: those of query tile m.
template <typename T, int D>
__device__ __forceinline__ void prefetch_queries(const Params& p, const Heads<T>& hd, int m, Tiles<T, D>& s) {
  load_rows_async<T, D>(hd.q, p.sq.n, m * kC, [row0 = m * kC, nq = p.nq](int r) { return row0 + r < nq; }, s.x);
}

// Key chunk kappa's k rows and v rows held in registers between their loads (fetch) and their stores (k into x, v^T
// into vt), rows with key_ok false as zeros: 16 + 16 registers per thread at D = 64.
template <typename T, int D>
struct KeyRowsInFlight {
  mma::RowsInFlight<kC, D, kThreads> keys;
  VtInFlight<T, D> values;
  __device__ __forceinline__ void fetch(const Params& p, const Heads<T>& hd, int b, int kappa) {
    const int key0 = p.s0 + kappa * kC;
    const auto ok = [&](int r) { return key_ok(p, b, key0 + r); };
    keys.fetch(hd.k, p.sk.n, key0, ok);
    values.fetch(hd.v, p.sv.n, key0, ok);
  }
  __device__ __forceinline__ void store(Tiles<T, D>& s) const {
    keys.store(s.x);
    values.store(s.vt);
  }
};

// Loads key chunk kappa (x of its keys, v^T, flags) and builds phi(k): fp16 row-major into phk when
// `scores`, T halves transposed into pkt. Ends with a barrier. s.prefetch: the x rows are already on their way
// (prefetch_keys), and once projected, the rows of key chunk next_kappa and query tile next_m (each when >= 0)
// start loading. Without s.prefetch and s.xv: keep (not null) also takes the v rows' registers, for a row-major copy
// later; fetched: the chunk's rows are already in `rows` (KeyRowsInFlight::fetch), with no wait on global memory here;
// tile_m >= 0: once k is projected, query tile tile_m's q rows (into x) and dout rows (into dtile) start loading by
// cp.async, for query_tile(..., rows_async = true).
template <typename T, int D>
__device__ __forceinline__ void key_chunk(const Params& p, const Heads<T>& hd, int b, int kappa, Tiles<T, D>& s,
                                          bool scores, int next_kappa = -1, int next_m = -1,
                                          VtInFlight<T, D>* keep = nullptr, bool fetched = false,
                                          const KeyRowsInFlight<T, D>& rows = {}, int tile_m = -1,
                                          const T* dout = nullptr, T* dtile = nullptr) {
  const int key0 = p.s0 + kappa * kC;
  __syncthreads();  // the previous chunk's readers are done
  if (threadIdx.x < kC) s.okk[threadIdx.x] = key_ok(p, b, key0 + threadIdx.x);
  __syncthreads();
  if (s.prefetch) {
    mma::cp_async_wait_all();  // this thread's copies; the barrier below publishes every thread's
    if (s.xv == nullptr) load_vt<T, D>(hd.v, p.sv.n, key0, s.okk, s.vt);
  } else if (s.xv == nullptr && fetched) {
    rows.store(s);
    if (keep != nullptr) *keep = rows.values;
  } else if (s.xv == nullptr) {  // k's and v's loads in flight together
    KeyRowsInFlight<T, D> here;
    here.fetch(p, hd, b, kappa);
    here.store(s);
    if (keep != nullptr) *keep = here.values;
  } else {
    load_rows<T, D>(hd.k, p.sk.n, key0, s.okk, s.x);
  }
  __syncthreads();
  if (s.xv != nullptr) load_vt<T, D>(s.xv, D + 8, 0, s.okk, s.vt);  // the staged rows, transposed
  project<T, D>(p, s.xk, s.w, hd.beta, s.sp, s.sm);
  __syncthreads();
  if (s.prefetch && next_kappa >= 0) prefetch_keys<T, D>(p, hd, b, next_kappa, s);
  if (s.prefetch && next_m >= 0) prefetch_queries<T, D>(p, hd, next_m, s);
  if (tile_m >= 0) {
    prefetch_queries<T, D>(p, hd, tile_m, s);
    load_rows_async<T, D>(dout, p.sdo.n, tile_m * kC, [row0 = tile_m * kC, nq = p.nq](int r) { return row0 + r < nq; },
                          dtile);
  }
  features<T>(p, s.okk, s.sp, s.sm, scores ? s.phk : nullptr, s.pkt);
  __syncthreads();
}

// The warp's 16 rows 16w.. of the [64][D + 8] tile x projected and mapped to features: fn(i, r, item, val) for each
// of the warp's (row, item) pairs i, val the item's Items<P>::R features (project_features_p4 where P = 4; else project
// into the sigma tables and warp_pairs); after_reads() once the warp's reads of x are done; rows with ok(r) false give
// zeros.
template <typename T, int D, typename After, typename Ok, typename Fn>
__device__ __forceinline__ void warp_features(const Params& p, Tiles<T, D>& s, const T* x, float beta,
                                              After&& after_reads, Ok&& ok, Fn&& fn) {
  if (p.planes_per_table == 4) {
    project_features_p4<T, D>(p, x, s.w, beta, after_reads, ok, fn);
    return;
  }
  project<T, D>(p, x, s.w, beta, s.sp, s.sm);
  __syncwarp();  // the warp's x rows read, its sigma tables written
  after_reads();
  const int r0 = (threadIdx.x / 32) * 16;
  const bool row_ok = ok(r0 + static_cast<int>(threadIdx.x % 16));  // the lane's row in every pair (warp_pairs)
  dispatch_planes(p, [&](auto planes) {
    constexpr int P = decltype(planes)::value, R = Items<P>::R;
    if constexpr (P != 4)
      warp_pairs<P>(r0, [&](int i, int r, int item) {
        float val[R];
        Items<P>::values(p, s.sp, s.sm, r, item, row_ok, val);
        fn(i, r, item, val);
      });
  });
}

// This lane's flag for the warp's 16 key rows from k0 (lanes l and l + 16: row k0 + l): key_ok, one load that can be
// in flight while the warp computes; warp_flags gathers the 16 flags.
__device__ __forceinline__ bool lane_key_ok(const Params& p, int b, int k0) {
  return key_ok(p, b, k0 + static_cast<int>(threadIdx.x % 16));
}

// Bit r: the flag of lane r (r < 16), i.e. of row r of the warp's 16 rows.
__device__ __forceinline__ unsigned warp_flags(bool lane_flag) { return __ballot_sync(0xffffffffu, lane_flag) & 0xffffu; }

// Starts loading (cp.async, one committed group) the warp's 16 rows of key chunk rows [key0, key0 + 64) of x (k or v)
// into the same rows of a [64][D + 8] tile: zeros where bit r of `flags` (warp row r, warp_flags) is 0, i.e. past the
// keys and for padding.
template <typename T, int D>
__device__ __forceinline__ void warp_key_rows_async(const T* x, long long stride, int key0, unsigned flags, T* tile) {
  const int r0 = (threadIdx.x / 32) * 16;
  mma::load_rows_async<16, D, 32, true>(tile + r0 * (D + 8), x, stride, key0 + r0,
                                        [flags](int r) { return ((flags >> r) & 1u) != 0; });
}

// acc[n] (N0 <= n < N1: by default the v columns n < D / 8, not z's) *= 2^d, in steps that stay normal fp32 factors
// (the exponents of two v tiles can be ~240 apart).
template <int D, int N0 = 0, int N1 = D / 8>
__device__ __forceinline__ void scale_pow2(float (&acc)[D / 8 + 1][4], int d) {
  while (d != 0) {
    const int step = d < -126 ? -126 : (d > 126 ? 126 : d);
    const float f = pow2f(step);
#pragma unroll
    for (int n = N0; n < N1; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[n][i] *= f;
    d -= step;
  }
}

// The exponent e of a v tile's 16 rows whose largest |v| is m: 0 where fp16 holds the rows' bf16 values as they are
// (m in [2^-6, 2^15): values of 2^-17 and more exact, smaller ones within 2^-25 <= 2^-19 m), else such that m 2^-e lies
// in [2^14, 2^15) (e >= -126: 2^-e a normal fp32 factor).
__device__ __forceinline__ int v_exponent(float m) {
  if (m == 0.f || (m >= 0x1p-6f && m < 0x1p15f)) return 0;
  const int e = static_cast<int>((__float_as_uint(m) >> 23) & 0xffu) - 127 - 14;
  return e < -126 ? -126 : e;
}

// The warp's 16 rows r0.. of a row-major v tile ([64][D + 8], D columns of T) rewritten in place as fp16 v 2^-e and e
// returned (warp-uniform, v_exponent of the rows' largest |v|): the product's B operand in the type of the fp16 phi(k).
// fp16 rows stay as they are (e = 0).
template <typename T, int D>
__device__ __forceinline__ int warp_rows_to_half(T* xv) {
  if constexpr (std::is_same_v<T, __half>) {
    return 0;
  } else {
    constexpr int kPer = 16 * D / 8 / 32;  // 16-byte chunks per lane
    const int lane = threadIdx.x % 32, r0 = (threadIdx.x / 32) * 16;
    static_assert(std::is_same_v<T, __nv_bfloat16>, "16-bit rows: fp16 or bf16");
    uint4 val[kPer];
    uint4* chunk[kPer];
    __nv_bfloat162 m2 = __float2bfloat162_rn(0.f);  // the largest |v| of each half, in bf16 pairs (exact, as fmaxf)
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int c = lane + 32 * i, r = r0 + c / (D / 8);
      chunk[i] = reinterpret_cast<uint4*>(xv + r * (D + 8) + 8 * (c % (D / 8)));
      val[i] = *chunk[i];
      const uint32_t words[4] = {val[i].x, val[i].y, val[i].z, val[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) m2 = __hmax2(m2, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&words[j])));
    }
    const int e = v_exponent(warp_fmax(fmaxf(__low2float(m2), __high2float(m2))));
    const auto store = [&](const auto& half_word) {
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        *chunk[i] = make_uint4(half_word(val[i].x), half_word(val[i].y), half_word(val[i].z), half_word(val[i].w));
    };
    if (e == 0) {  // the usual case (warp-uniform): the values as they are, no multiplies
      store([](uint32_t w) {
        const float2 x = mma::unpack2<T>(w);
        return mma::pack2<__half>(x.x, x.y);
      });
    } else {
      const float f = pow2f(-e);  // exact products
      store([f](uint32_t w) {
        const float2 x = mma::unpack2<T>(w);
        return mma::pack2<__half>(x.x * f, x.y * f);
      });
    }
    return e;
  }
}

// acc[n] += phi(k)^T [v, 1] for the warp's 16 features (columns 16w.. of phr: phi(k) in T halves, hi [key][feature],
// lo kC kT after) over the chunk's 64 keys, and the D / 8 + 1 n-tiles of the row-major v tile xv (column D = 1), both
// operands by ldmatrix.trans; per n-tile hi, then lo (state_delta's order), every lo product issued after all hi ones
// (two products into one accumulator back to back would wait out the first one's latency).
template <typename T, int D>
__device__ __forceinline__ void state_delta_rows(const T* phr, const T* xv, float (&acc)[D / 8 + 1][4]) {
  constexpr int kN = D / 8 + 1;
  const int lane = threadIdx.x % 32, f0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int kk = 0; kk < kC / 16; ++kk) {
    uint32_t hi[4], lo[4], b[kN][2];
    mma::load_a_trans(hi, phr, kT, f0, kk * 16, lane);
    mma::load_a_trans(lo, phr + kC * kT, kT, f0, kk * 16, lane);
    mma::for_each_b_trans<kN>(xv, D + 8, kk * 16, lane, [&](int n, const uint32_t (&bn)[2]) {
      b[n][0] = bn[0];
      b[n][1] = bn[1];
    });
#pragma unroll
    for (int n = 0; n < kN; ++n) mma::m16n8k16(acc[n], hi, b[n], T{});
#pragma unroll
    for (int n = 0; n < kN; ++n) mma::m16n8k16(acc[n], lo, b[n], T{});
  }
}

// acc[n] += phi(k)^T [v, 1] for the warp's 16 features (columns 16w.. of phk: fp16 phi(k) [key][feature]) over the
// chunk's 64 keys, and the D / 8 + 1 n-tiles of the row-major fp16 v tile xv (column D = 1) whose k-step kk holds
// v 2^-ve[kk], both operands by ldmatrix.trans. acc[n < D / 8] holds the sums times 2^-e_cur: rescaled (a warp-uniform
// branch) when a k-step's exponent differs from it; the z column (n = D / 8) is never scaled.
template <int D>
__device__ __forceinline__ void state_delta_half(const __half* phk, const __half* xv, const int* ve,
                                                 float (&acc)[D / 8 + 1][4], int& e_cur) {
  constexpr int kN = D / 8 + 1;
  const int lane = threadIdx.x % 32, f0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int kk = 0; kk < kC / 16; ++kk) {
    const int e = ve[kk];
    if (e != e_cur) {
      scale_pow2<D>(acc, e_cur - e);
      e_cur = e;
    }
    uint32_t a[4];
    mma::load_a_trans(a, phk, kT, f0, kk * 16, lane);
    mma::for_each_b_trans<kN>(xv, D + 8, kk * 16, lane,
                              [&](int n, const uint32_t (&b)[2]) { mma::m16n8k16(acc[n], a, b, __half{}); });
  }
}

// Slot `slot` of (b, h) of the group states: A (S x D) and z (S), as race_group_state_fwd_kernel writes them and the
// group scan leaves them (slot ngk: the total).
__device__ __forceinline__ float* slot_state(const Params& p, long long bh, int slot, int d) {
  return p.kstate + (bh * (p.ngk + 1) + slot) * p.features * d;
}
__device__ __forceinline__ float* slot_z(const Params& p, long long bh, int slot) {
  return p.kz + (bh * (p.ngk + 1) + slot) * p.features;
}

// fn(f, half) for the state rows f = 16w + g + 8 half < p.features (half = 0, 1) whose values acc[n][2 half],
// acc[n][2 half + 1] this lane holds: the C layout of the warp's 16 rows of a [feature][d] state, z in column D.
template <typename Fn>
__device__ __forceinline__ void for_each_state_row(const Params& p, Fn&& fn) {
  const int f0 = (threadIdx.x / 32) * 16 + (threadIdx.x % 32) / 4;
#pragma unroll
  for (int half = 0; half < 2; ++half)
    if (f0 + 8 * half < p.features) fn(f0 + 8 * half, half);
}

// Whether the forward's group states take the fp16 product (race_group_state_fwd_kernel<T, D, true>): for bf16 inputs.
// fp16 inputs keep the split one: their outputs' rounding leaves little room for 11-bit phi(k) (S = 2, N = 1,100,
// non-causal, in the emulator: 1.25x the reference's error with it, 1.02x without; the tests' bound is 2x).
template <typename T>
constexpr bool kHalfStates = std::is_same_v<T, __nv_bfloat16>;

// Per (key-chunk group, q head, batch): the group's sum_j phi(k_j) [v_j, 1]^T into slot grp of p.kstate, p.kz, with
// fp32 sums. Each warp loads (cp.async), projects and maps its 16 rows of every chunk on its own; the k rows of chunk
// kappa + 1 load from the warp's projection of chunk kappa on, its v rows (the other v tile) from the chunk's last
// barrier on. HALF (the forward): fp16 phi(k) times fp16 v 2^-e (each warp converts its v rows: warp_rows_to_half),
// phi(k) and v tiles kappa % 2 and one barrier per chunk (a warp past it knows every warp done with chunk kappa - 1's
// products, so the tiles of kappa + 1 are free). Else (the backward: its gradients need more of the state's bits)
// phi(k) split in two T halves times v in T, one phi tile and two barriers per chunk: before the halves overwrite the
// tile that the previous chunk's products read, and before this chunk's products.
template <typename T, int D, bool HALF = true>
__global__ void __launch_bounds__(kThreads, D <= 64 ? (HALF ? 4 : 3) : 2) race_group_state_fwd_kernel(const Params p) {
  extern __shared__ __align__(16) char smem_raw[];
  Tiles<T, D> s(smem_raw, Tiles<T, D>::Use::kKeyStates);
  const int grp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Heads<T> hd(p, h, b);
  const int first = grp * p.gchunks, end = min(p.nkc, first + p.gchunks), lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const int r0 = 16 * w;
  const auto key0 = [&p](int kappa) { return p.s0 + kappa * kC; };
  unsigned flags = warp_flags(lane_key_ok(p, b, key0(first) + r0));  // the warp's rows of chunk kappa
  warp_key_rows_async<T, D>(hd.k, p.sk.n, key0(first), flags, s.x);
  warp_key_rows_async<T, D>(hd.v, p.sv.n, key0(first), flags, s.xv);
  init_constants<T, D, std::conditional_t<HALF, __half, T>>(p, s);
  __syncthreads();
  float acc[D / 8 + 1][4] = {};
  int e_cur = 0;  // HALF: acc[n < D / 8] holds the sums times 2^-e_cur
  for (int kappa = first; kappa < end; ++kappa) {
    const bool more = kappa + 1 < end;
    const int buf = (kappa - first) & 1;
    T* xv = s.xv + buf * kC * (D + 8);
    T* xv_next = s.xv + (buf ^ 1) * kC * (D + 8);
    const bool next_flag = lane_key_ok(p, b, key0(kappa + 1) + r0);  // false past the keys
    unsigned next_flags = 0;
    mma::cp_async_wait_prior<1>();  // the warp's k rows of this chunk (its v rows may still be on their way)
    __syncwarp();
    const auto next_keys = [&] {  // once the warp's x rows are read
      next_flags = warp_flags(next_flag);
      if (more) warp_key_rows_async<T, D>(hd.k, p.sk.n, key0(kappa + 1), next_flags, s.x);
      else mma::cp_async_commit();  // an empty group: the waits count the same groups in every chunk
    };
    const auto next_values = [&] {  // once every warp is done with chunk kappa - 1's products
      if (more) warp_key_rows_async<T, D>(hd.v, p.sv.n, key0(kappa + 1), next_flags, xv_next);
      else mma::cp_async_commit();
    };
    const auto ok = [flags, r0](int r) { return ((flags >> (r - r0)) & 1u) != 0; };
    if constexpr (HALF) {
      __half* phk = s.phk + buf * kC * kT;
      int* ve = s.ve + buf * kThreads / 32;
      warp_features<T, D>(p, s, s.x, hd.beta, next_keys, ok, [&](int, int r, int item, const auto& val) {
        constexpr int R = sizeof(val) / sizeof(val[0]);
        store_halves<R>(phk + r * kT + item * R, val);
      });
      mma::cp_async_wait_prior<1>();  // the warp's v rows of this chunk
      __syncwarp();
      const int e = warp_rows_to_half<T, D>(xv);
      if (lane == 0) ve[w] = e;
      __syncthreads();
      next_values();
      state_delta_half<D>(phk, reinterpret_cast<const __half*>(xv), ve, acc, e_cur);
    } else {
      T* phr = reinterpret_cast<T*>(s.phk);  // hi [key][feature], lo kC kT after
      uint32_t hi[16], lo[16];  // the warp's phi(k) values in T halves: 16 rows x 64 features / 32 lanes / 2 per word
      warp_features<T, D>(p, s, s.x, hd.beta, next_keys, ok, [&](int i, int, int, const auto& val) {
        constexpr int R = sizeof(val) / sizeof(val[0]);
#pragma unroll
        for (int j = 0; j < R / 2; ++j)
          mma::split2<T>(val[2 * j], val[2 * j + 1], hi[i * R / 2 + j], lo[i * R / 2 + j]);
      });
      __syncthreads();  // every warp is done with the previous chunk's phi(k) tile and v tile
      dispatch_planes(p, [&](auto planes) {
        constexpr int P = decltype(planes)::value, R = Items<P>::R;
        const auto store = [&](int i, int r, int item) {
          store_words<R>(phr + r * kT + item * R, hi + i * R / 2);
          store_words<R>(phr + (kC + r) * kT + item * R, lo + i * R / 2);
        };
        if constexpr (P == 4) warp_pairs_p4(store);
        else warp_pairs<P>(r0, store);
      });
      next_values();
      mma::cp_async_wait_prior<2>();  // the warp's v rows of this chunk
      __syncthreads();
      state_delta_rows<T, D>(phr, xv, acc);
    }
    flags = next_flags;
  }
  scale_pow2<D>(acc, e_cur);
  const int t = lane % 4;
  float* A = slot_state(p, hd.bh, grp, D);
  float* z = slot_z(p, hd.bh, grp);
  for_each_state_row(p, [&](int f, int half) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(A + (long long)f * D + n * 8 + 2 * t) = make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
    if (t == 0) z[f] = acc[D / 8][2 * half];
  });
}

// sc[n] += a b^T over the kS features: the warp's 16 rows of a times rows [8n, 8n + 8) of b (fp16 [64][kT] tiles).
__device__ __forceinline__ void scores(const __half* a, const __half* b, float (&sc)[kC / 8][4]) {
  const int lane = threadIdx.x % 32, r0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int kk = 0; kk < kS / 16; ++kk) {
    uint32_t ar[4];
    mma::load_a(ar, a, kT, r0, kk * 16, lane);
    mma::for_each_b<kC / 8>(b, kT, kk * 16, kC / 8, lane,
                            [&](int n, const uint32_t (&br)[2]) { mma::m16n8k16(sc[n], ar, br, __half{}); });
  }
}

// A registers of k-step kk (columns 16 kk .. 16 kk + 15) of x, the warp's 16 rows in the C layout, each value
// times scale[its row half] and split in two T halves: x scale = hi + lo. A register r: n-tile 2 kk + r / 2,
// elements 2 (r % 2) + {0, 1}.
template <typename T, int NT>
__device__ __forceinline__ void split_a(const float (&x)[NT][4], int kk, const float (&scale)[2], uint32_t (&hi)[4],
                                        uint32_t (&lo)[4]) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float x0 = x[2 * kk + r / 2][2 * (r % 2)] * scale[r % 2];
    const float x1 = x[2 * kk + r / 2][2 * (r % 2) + 1] * scale[r % 2];
    T h0, l0, h1, l1;
    mma::split<T>(x0, h0, l0);
    mma::split<T>(x1, h1, l1);
    hi[r] = mma::pack2<T>(to_float(h0), to_float(h1));
    lo[r] = mma::pack2<T>(to_float(l0), to_float(l1));
  }
}

// acc += (sc masked to j <= i) [v, 1]: sc the warp's 16 query rows x the chunk's kC keys (C layout; tile m and
// chunk kappa0 + m share their diagonal), in two T halves, times the chunk's vt tile.
template <typename T, int D>
__device__ __forceinline__ void masked_scores_times_v(const Tiles<T, D>& s, float (&sc)[kC / 8][4],
                                                      float (&acc)[D / 8 + 1][4]) {
  constexpr int kN = D / 8 + 1;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
  constexpr float kOne[2] = {1.f, 1.f};
#pragma unroll
  for (int n = 0; n < kC / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = r0 + g + (e >= 2 ? 8 : 0), j = n * 8 + 2 * t + (e & 1);
      if (j > i) sc[n][e] = 0.f;
    }
#pragma unroll
  for (int kk = 0; kk < kC / 16; ++kk) {
    uint32_t hi[4], lo[4];
    split_a<T>(sc, kk, kOne, hi, lo);
    mma::for_each_b<kN>(s.vt, kT, kk * 16, kN, lane, [&](int n, const uint32_t (&b)[2]) {
      mma::m16n8k16(acc[n], hi, b, T{});
      mma::m16n8k16(acc[n], lo, b, T{});
    });
  }
}

// [num, den] of one query tile (acc in the C layout; den in column D): phi(q) [A, z] from the state tile
// (tf32), plus, when `intra`, the masked chunk product (phi(q) phi(k)^T masked to j <= i) [v, 1].
template <typename T, int D>
__device__ __forceinline__ void tile_num(const Tiles<T, D>& s, bool intra, float (&acc)[D / 8 + 1][4]) {
  constexpr int kX = D + 8;
  constexpr int kN = D / 8 + 1;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int kk = 0; kk < kS / 8; ++kk) {  // fp16 features are exact in tf32
    const __half* base = s.phq + (r0 + g) * kT + kk * 8 + t;
    const uint32_t a[4] = {__float_as_uint(__half2float(base[0])), __float_as_uint(__half2float(base[8 * kT])),
                           __float_as_uint(__half2float(base[4])), __float_as_uint(__half2float(base[8 * kT + 4]))};
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const float* col = s.st + (kk * 8 + t) * kX + n * 8 + g;
      const uint32_t b[2] = {mma::to_tf32(col[0]), mma::to_tf32(col[4 * kX])};
      mma::m16n8k8_tf32(acc[n], a, b);
    }
  }
  if (intra) {
    float sc[kC / 8][4] = {};
    scores(s.phq, s.phk, sc);
    masked_scores_times_v<T, D>(s, sc, acc);
  }
}

// fn(half, n, word) for the warp's rows r0 + g + 8 half (half = 0, 1) and n-tiles n < D / 8: word = out = num / den
// at columns 8 n + 2 t, the pair packed in T (acc: [num, den] in the C layout, den in column D; rows with den = 0
// give 0), times `ratio` (num's scale over den's where they are held at different powers of two).
template <typename T, int D, typename Fn>
__device__ __forceinline__ void for_each_out_pair(const float (&acc)[D / 8 + 1][4], Fn&& fn, float ratio = 1.f) {
  const int quad = (threadIdx.x % 32) & ~3;  // den = column D, held by the quad's t = 0 lane
  const float den[2] = {__shfl_sync(0xffffffffu, acc[D / 8][0], quad), __shfl_sync(0xffffffffu, acc[D / 8][2], quad)};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float inv = den[half] > 0.f ? ratio / den[half] : 0.f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) fn(half, n, mma::pack2<T>(acc[n][2 * half] * inv, acc[n][2 * half + 1] * inv));
  }
}

// out rows [row0, row0 + 64) of one query tile: out = num / den (tile_num).
template <typename T, int D>
__device__ __forceinline__ void tile_out(const Params& p, const Tiles<T, D>& s, bool intra, int row0, T* out) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
  float acc[D / 8 + 1][4] = {};
  tile_num<T, D>(s, intra, acc);
  for_each_out_pair<T, D>(acc, [&](int half, int n, uint32_t word) {
    const int i = row0 + r0 + g + 8 * half;
    if (i < p.nq) *reinterpret_cast<uint32_t*>(out + (long long)i * D + n * 8 + 2 * t) = word;
  });
}

// Query tile m: flags, x, phi(q) (fp16) into phq, or fp32 into phi32 instead when that is not null. Backward
// (dout not null): also the tile's rows of dout into dtile ([64][D + 8]) and u into `u`. Ends with a barrier.
// s.prefetch: the x rows are already on their way (prefetch_queries), and once projected, those of query tile
// next_m (when >= 0) start loading.
// rows_async: its q rows and dout rows are on their way by cp.async (key_chunk's tile_m).
template <typename T, int D>
__device__ void query_tile(const Params& p, const Heads<T>& hd, int m, Tiles<T, D>& s, const T* dout = nullptr,
                           T* dtile = nullptr, float* u = nullptr, float* phi32 = nullptr, int next_m = -1,
                           bool rows_async = false) {
  __syncthreads();
  if (threadIdx.x < kC) s.okq[threadIdx.x] = m * kC + threadIdx.x < p.nq;
  __syncthreads();
  if (rows_async) {
    mma::cp_async_wait_all();  // this thread's copies; the barrier below publishes every thread's
  } else if (s.prefetch) {
    mma::cp_async_wait_all();  // this thread's copies; the barrier below publishes every thread's
    if (dout != nullptr) load_rows<T, D>(dout, p.sdo.n, m * kC, s.okq, dtile);
  } else if (dout != nullptr) {  // both copies' loads in flight together
    const auto ok = [&](int r) { return s.okq[r] != 0; };
    mma::RowsInFlight<kC, D, kThreads> queries, grads;
    queries.fetch(hd.q, p.sq.n, m * kC, ok);
    grads.fetch(dout, p.sdo.n, m * kC, ok);
    queries.store(s.x);
    grads.store(dtile);
  } else {
    load_rows<T, D>(hd.q, p.sq.n, m * kC, s.okq, s.x);
  }
  __syncthreads();
  project<T, D>(p, s.x, s.w, hd.beta, s.sp, s.sm, u);
  __syncthreads();
  if (s.prefetch && next_m >= 0) prefetch_queries<T, D>(p, hd, next_m, s);
  features<T>(p, s.okq, s.sp, s.sm, phi32 == nullptr ? s.phq : nullptr, nullptr, phi32);
  __syncthreads();
}

// One state (A (S, D), z (S); global memory, 16-byte aligned, read-only while the kernel runs) into s.st:
// [feature][d] fp32, z in column D, zeros elsewhere. A in 16-byte loads, four per thread in flight before
// their stores (one 4-byte load then its store per element before: 36 latencies in turn per thread at D = 64).
template <typename T, int D>
__device__ void load_state(const Params& p, const float* A, const float* z, Tiles<T, D>& s) {
  constexpr int kX = D + 8, kQuads = D / 4, kIters = kS * kQuads / kThreads, kBatch = kIters < 4 ? kIters : 4;
  static_assert(kS * kQuads % kThreads == 0 && kIters % kBatch == 0, "state tile shapes");
#pragma unroll
  for (int i0 = 0; i0 < kIters; i0 += kBatch) {
    float4 val[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = threadIdx.x + (i0 + i) * kThreads, f = e / kQuads;
      val[i] = f < p.features ? __ldg(reinterpret_cast<const float4*>(A) + e) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int e = threadIdx.x + (i0 + i) * kThreads, f = e / kQuads, c = e % kQuads;
      *reinterpret_cast<float4*>(s.st + f * kX + 4 * c) = val[i];
    }
  }
  for (int e = threadIdx.x; e < kS * 8; e += kThreads) {  // columns D..D+7: z, then zeros
    const int f = e / 8, d = e % 8;
    s.st[f * kX + D + d] = d == 0 && f < p.features ? z[f] : 0.f;
  }
}

// Key-state slot `slot` of (b, h) into s.st.
template <typename T, int D>
__device__ void load_state(const Params& p, long long bh, int slot, Tiles<T, D>& s) {
  load_state<T, D>(p, slot_state(p, bh, slot, D), slot_z(p, bh, slot), s);
}

// The warp's 16 rows of the state tile st (features 16w.., [feature][D + 8], z in column D) += delta, the C layout of
// its n-tiles n0 + n < D / 8 + 1.
template <int D, int NN>
__device__ __forceinline__ void add_state_rows(float* st, int n0, const float (&delta)[NN][4]) {
  constexpr int kX = D + 8;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, f0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float* row = st + (f0 + g + 8 * half) * kX + 2 * t;
#pragma unroll
    for (int n = 0; n < NN; ++n) {
      if (n0 + n >= D / 8 + 1) continue;
      row[(n0 + n) * 8] += delta[n][2 * half];
      row[(n0 + n) * 8 + 1] += delta[n][2 * half + 1];
    }
  }
}

// s.st += phi(k)^T [v, 1] of the chunk in pkt / vt (the caller has a barrier after the last reader of st).
template <typename T, int D>
__device__ __forceinline__ void advance_state(Tiles<T, D>& s) {
#pragma unroll 1
  for (int n0 = 0; n0 < D / 8 + 1; n0 += 4) {  // 4 n-tiles at a time: fewer live registers
    float delta[4][4] = {};
    state_delta<T, 4>(s.pkt, s.vt, n0, D / 8 + 1, delta);
    add_state_rows<D>(s.st, n0, delta);
  }
}

// The e that puts m 2^e in [2^14, 2^15) (at most 126; 0 where m is 0 or not finite): values up to m times 2^e are
// within fp16's range, at 11 significant bits down to 2^-28 m.
__device__ __forceinline__ int fp16_stage_exponent(float m) {
  const int biased = static_cast<int>(__float_as_uint(m) >> 23) & 0xff;  // m = f 2^(biased - 126), f in [0.5, 1)
  return m > 0.f && biased < 255 ? min(141 - biased, 126) : 0;
}

// The total key state (slot p.ngk of (b, h)) into s.sth in fp16 ([feature][d], z in column D, zeros elsewhere),
// every value times one power of two 2^e for the block: max |value| 2^e in [2^14, 2^15) keeps the values within
// fp16's range and at 11 significant bits (tf32's) down to 2^-28 of the largest (e = 0 when the largest is 0 or not
// finite). num and den carry the same 2^e, which num / den drops. Ends with a barrier.
template <typename T, int D>
__device__ void stage_state_fp16(const Params& p, long long bh, Tiles<T, D>& s) {
  constexpr int kX = D + 8, kQuads = D / 4, kIters = kS * kQuads / kThreads;
  static_assert(kS * kQuads % kThreads == 0 && kS <= kThreads, "state tile shapes");
  __shared__ float warp_max[kThreads / 32];
  const float* A = slot_state(p, bh, p.ngk, D);
  const float* zs = slot_z(p, bh, p.ngk);
  float4 val[kIters];
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int e = threadIdx.x + i * kThreads;
    val[i] = e / kQuads < p.features ? __ldg(reinterpret_cast<const float4*>(A) + e) : make_float4(0.f, 0.f, 0.f, 0.f);
    m = fmaxf(m, fmaxf(fmaxf(fabsf(val[i].x), fabsf(val[i].y)), fmaxf(fabsf(val[i].z), fabsf(val[i].w))));
  }
  const float z = threadIdx.x < p.features ? zs[threadIdx.x] : 0.f;
  m = fmaxf(m, fabsf(z));
  m = warp_fmax(m);
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  const float scale = pow2f(fp16_stage_exponent(m));
  const auto store = [&](__half* at, float x0, float x1, float x2, float x3) {  // hi, and lo kS kX after if split
    uint32_t hi[2], lo[2];
    mma::split2<__half>(x0 * scale, x1 * scale, hi[0], lo[0]);
    mma::split2<__half>(x2 * scale, x3 * scale, hi[1], lo[1]);
    *reinterpret_cast<uint2*>(at) = make_uint2(hi[0], hi[1]);
    if constexpr (Tiles<T, D>::kSplitState) *reinterpret_cast<uint2*>(at + kS * kX) = make_uint2(lo[0], lo[1]);
  };
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int el = threadIdx.x + i * kThreads, f = el / kQuads, c = el % kQuads;
    store(s.sth + f * kX + 4 * c, val[i].x, val[i].y, val[i].z, val[i].w);
  }
  if (threadIdx.x < kS) {  // columns D..D + 7: z, then zeros
    store(s.sth + threadIdx.x * kX + D, z, 0.f, 0.f, 0.f);
    store(s.sth + threadIdx.x * kX + D + 4, 0.f, 0.f, 0.f, 0.f);
  }
  __syncthreads();
}

// acc += phi(q) [A, z] for the warp's 16 rows of phq and the fp16 state of stage_state_fp16 (B by ldmatrix.trans
// from [feature][d]; its hi, then its lo part where split).
template <typename T, int D>
__device__ __forceinline__ void state_apply_fp16(const Tiles<T, D>& s, float (&acc)[D / 8 + 1][4]) {
  constexpr int kX = D + 8;
  const int lane = threadIdx.x % 32, r0 = (threadIdx.x / 32) * 16;
#pragma unroll
  for (int kk = 0; kk < kS / 16; ++kk) {
    uint32_t a[4];
    mma::load_a(a, s.phq, kT, r0, kk * 16, lane);
#pragma unroll
    for (int part = 0; part < (Tiles<T, D>::kSplitState ? 2 : 1); ++part)
      mma::for_each_b_trans<D / 8 + 1>(s.sth + part * kS * kX, kX, kk * 16, lane,
                                       [&](int n, const uint32_t (&b)[2]) { mma::m16n8k16(acc[n], a, b, __half{}); });
  }
}

// out = num / den for the warp's 16 rows row0 + 16w.. (for_each_out_pair) through its rows of the [64][D + 8] tile
// ot: pairs into ot, then 16-byte stores of whole rows (a warp store covers 512 contiguous bytes at D 64, where the
// pairs would be 8 rows of 16 bytes).
template <typename T, int D>
__device__ __forceinline__ void store_out_rows(const Params& p, const float (&acc)[D / 8 + 1][4], int row0, T* ot,
                                               T* out, float ratio = 1.f) {
  constexpr int kX = D + 8, kChunks = D / 8, kRowsPerPass = 32 / kChunks;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, r0 = (threadIdx.x / 32) * 16;
  for_each_out_pair<T, D>(
      acc, [&](int half, int n, uint32_t word) {
        *reinterpret_cast<uint32_t*>(ot + (r0 + g + 8 * half) * kX + n * 8 + 2 * t) = word;
      },
      ratio);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 / kRowsPerPass; ++i) {
    const int r = r0 + lane / kChunks + i * kRowsPerPass, c = lane % kChunks;
    if (row0 + r < p.nq)
      *reinterpret_cast<uint4*>(out + (long long)(row0 + r) * D + 8 * c) = *reinterpret_cast<const uint4*>(ot + r * kX + 8 * c);
  }
}

// Starts loading (cp.async, one committed group) the warp's 16 rows of query tile m into its rows of s.x.
template <typename T, int D>
__device__ __forceinline__ void warp_query_rows_async(const Params& p, const Heads<T>& hd, int m, Tiles<T, D>& s) {
  const int r0 = (threadIdx.x / 32) * 16, q0 = m * kC + r0;
  mma::load_rows_async<16, D, 32, true>(s.x + r0 * (D + 8), hd.q, p.sq.n, q0,
                                        [q0, nq = p.nq](int r) { return q0 + r < nq; });
}

// Non-causal: per (group of kGroup query tiles, q head, batch), out from the total key state. After the state is
// staged each warp walks its 16 rows of every tile on its own, with no block barrier: its x rows by cp.async (those
// of the next tile once these are projected), the projection and sigma tables, phi(q) in fp16 into its rows of phq,
// then [num, den] = phi(q) [A, z] (state_apply_fp16) and out = num / den in 16-byte row stores.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) race_query_out_fwd_kernel(const Params p) {
  extern __shared__ __align__(16) char smem_raw[];
  Tiles<T, D> s(smem_raw, Tiles<T, D>::Use::kQueryOut);
  const int grp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Heads<T> hd(p, h, b);
  T* out = static_cast<T*>(p.out) + hd.bh * p.nq * D;
  const int first = grp * kGroup, end = min(p.nqt, first + kGroup);
  warp_query_rows_async<T, D>(p, hd, first, s);
  init_constants<T, D>(p, s);
  stage_state_fp16<T, D>(p, hd.bh, s);
  for (int m = first; m < end; ++m) {
    mma::cp_async_wait_all();
    __syncwarp();
    const auto next_queries = [&] {  // once the warp's x rows are read
      if (m + 1 < end) warp_query_rows_async<T, D>(p, hd, m + 1, s);
    };
    warp_features<T, D>(p, s, s.x, hd.beta, next_queries, [&](int r) { return m * kC + r < p.nq; },
                        [&](int, int r, int item, const auto& val) {
                          constexpr int R = sizeof(val) / sizeof(val[0]);
                          store_halves<R>(s.phq + r * kT + item * R, val);
                        });
    __syncwarp();
    float acc[D / 8 + 1][4] = {};
    state_apply_fp16<T, D>(s, acc);
    store_out_rows<T, D>(p, acc, m * kC, s.ot, out);
  }
}

// Causal: per key-chunk group. PREFETCH: the kCausalOut layout, else kAll (no prefetch: for GPUs with less shared
// memory per block).
template <typename T, int D, bool PREFETCH = true>
__global__ void __launch_bounds__(kThreads, 1) race_group_out_fwd_kernel(const Params p) {
  using Use = typename Tiles<T, D>::Use;
  extern __shared__ __align__(16) char smem_raw[];
  Tiles<T, D> s(smem_raw, PREFETCH ? Use::kCausalOut : Use::kAll);
  const int grp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Heads<T> hd(p, h, b);
  T* out = static_cast<T*>(p.out) + hd.bh * p.nq * D;
  const int first = grp * p.gchunks;
  const int end = min(p.nkc, first + p.gchunks);
  if (end - 1 < p.kappa0) return;  // only keys before the first query: no tile to write
  if (PREFETCH) {
    prefetch_keys<T, D>(p, hd, b, first, s);
    if (first >= p.kappa0) prefetch_queries<T, D>(p, hd, first - p.kappa0, s);
  }
  init_constants<T, D>(p, s);
  load_state<T, D>(p, hd.bh, grp, s);  // before this group (fp32: it grows)
  for (int kappa = first; kappa < end; ++kappa) {
    const int m = kappa - p.kappa0;  // the query tile whose diagonal is in this chunk
    if (m >= 0) query_tile<T, D>(p, hd, m, s);
    const bool more = kappa + 1 < end;  // then the next chunk's rows load during this chunk's products
    key_chunk<T, D>(p, hd, b, kappa, s, m >= 0, more ? kappa + 1 : -1, more ? m + 1 : -1);
    if (m >= 0) tile_out<T, D>(p, s, true, m * kC, out);
    if (kappa + 1 == end) break;
    __syncthreads();  // every warp has read the state
    advance_state<T, D>(s);
  }
}

// The warp's 16 rows of key-state slot `slot` of (b, h) (fp32 [A, z], as race_group_state_fwd_kernel writes them) into
// acc in the C layout, zeros past the features.
template <int D>
__device__ __forceinline__ void load_warp_state(const Params& p, long long bh, int slot, float (&acc)[D / 8 + 1][4]) {
  const int t = threadIdx.x % 4;
  const float* A = slot_state(p, bh, slot, D);
  const float* z = slot_z(p, bh, slot);
#pragma unroll
  for (int n = 0; n < D / 8 + 1; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = 0.f;
  for_each_state_row(p, [&](int f, int half) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float2 a = *reinterpret_cast<const float2*>(A + (long long)f * D + n * 8 + 2 * t);
      acc[n][2 * half] = a.x;
      acc[n][2 * half + 1] = a.y;
    }
    if (t == 0) acc[D / 8][2 * half] = z[f];
  });
}

// The warp's 16 rows of the running state (acc: the v columns times 2^-e_s, z in column D as it is) into its rows of
// sth ([feature][d] fp16, z in column D), as stage_state_fp16 stages the total state but with one power of two for
// the v columns and one for z per warp: se[2w], se[2w + 1] the exponents e with staged = value 2^-e (the convention
// of state_delta_half's e_cur).
template <int D>
__device__ __forceinline__ void stage_warp_state(const float (&acc)[D / 8 + 1][4], int e_s, __half* sth, int* se) {
  constexpr int kX = D + 8;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, w = threadIdx.x / 32;
  float mv = 0.f, mz = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) mv = fmaxf(mv, fabsf(acc[n][i]));
    mz = fmaxf(mz, fabsf(acc[D / 8][i]));
  }
  // exponents floored to multiples of 8 (max 2^x in [2^7, 2^15)): the warps' usually agree, so the out kernel's
  // k-steps rarely rescale
  const int xv = fp16_stage_exponent(warp_fmax(mv)) & ~7, xz = fp16_stage_exponent(warp_fmax(mz)) & ~7;
  const float fv = pow2f(xv), fz = pow2f(xz);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    __half* row = sth + (16 * w + g + 8 * half) * kX + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8 + 1; ++n) {
      const float f = n < D / 8 ? fv : fz;
      *reinterpret_cast<uint32_t*>(row + 8 * n) = mma::pack2<__half>(acc[n][2 * half] * f, acc[n][2 * half + 1] * f);
    }
  }
  if (lane == 0) {
    se[2 * w] = e_s - xv;
    se[2 * w + 1] = -xz;
  }
}

// The chunk product's sums (rows g, g + 8 times 2^r[half]; num times 2^-e_num, den as it is) into the units of the
// state's first k-step: num times 2^(dn - r) and den times 2^(dd - r) per row, one multiply where every lane's
// factors are normal fp32 numbers (the usual case), else in steps (scale_pow2).
template <int D>
__device__ __forceinline__ void to_state_units(float (&acc)[D / 8 + 1][4], const int (&r)[2], int dn, int dd) {
  const bool normal = max(abs(dn - r[0]), abs(dn - r[1])) <= 126 && max(abs(dd - r[0]), abs(dd - r[1])) <= 126;
  if (__all_sync(0xffffffffu, normal)) {
    const float fn[2] = {pow2f(dn - r[0]), pow2f(dn - r[1])}, fd[2] = {pow2f(dd - r[0]), pow2f(dd - r[1])};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) acc[n][e] *= fn[e / 2];
      acc[D / 8][e] *= fd[e / 2];
    }
    return;
  }
  const float down[2] = {pow2f(-r[0]), pow2f(-r[1])};
#pragma unroll
  for (int n = 0; n < D / 8 + 1; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] *= down[e / 2];
  scale_pow2<D>(acc, dn);
  scale_pow2<D, D / 8, D / 8 + 1>(acc, dd);
}

// out rows row0 + 16w.. of the query tile whose diagonal is in the chunk of phk / xv / ve (fp16 phi(k) [key][feature];
// fp16 v 2^-ve[kk] per 16 keys kk, column D = 1): [num, den] = (phi(q) phi(k)^T masked to j <= i) [v, 1] + phi(q) [A, z]
// of the staged state sth / se (stage_warp_state), then num / den (store_out_rows). The chunk's product first: the
// warp's scores against keys 0 .. 16w + 15 (the later ones are masked), each row times the power of two 2^r that puts
// its largest score in [2^14, 2^15), rounded to fp16 (the A operand; for fp16 inputs two fp16 parts, hi and lo, as
// their outputs' rounding leaves too little room for 11-bit scores), and 2^r taken out of the row's fp32 sums after.
// Then the state's k-steps kk (features 16kk.., staged by warp kk). num (n < D / 8) and den (n = D / 8) are each held
// times a warp-uniform power of two that follows the operands' exponents (scale_pow2), as in state_delta_half.
template <typename T, int D>
__device__ __forceinline__ void warp_causal_out(const Params& p, const Tiles<T, D>& s, const __half* phk,
                                                const __half* xv, const int* ve, const __half* sth, const int* se,
                                                int row0, T* out) {
  constexpr int kN = D / 8 + 1;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, w = threadIdx.x / 32, r0 = 16 * w;
  float sc[kC / 8][4] = {};
#pragma unroll
  for (int kk = 0; kk < kS / 16; ++kk) {
    uint32_t a[4];
    mma::load_a(a, s.phq, kT, r0, kk * 16, lane);
    mma::for_each_b<kC / 8>(phk, kT, kk * 16, 2 * w + 2, lane,
                            [&](int n, const uint32_t (&b)[2]) { mma::m16n8k16(sc[n], a, b, __half{}); });
  }
  float mx[2] = {0.f, 0.f};  // rows g, g + 8 (scores are >= 0)
#pragma unroll
  for (int n = 0; n < kC / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (8 * n + 2 * t + (e & 1) > r0 + g + 8 * (e / 2)) sc[n][e] = 0.f;
      mx[e / 2] = fmaxf(mx[e / 2], sc[n][e]);
    }
  int r[2];  // rows g, g + 8: 11 .. 126 (scores are at most L)
  float up[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m = fmaxf(mx[half], __shfl_xor_sync(0xffffffffu, mx[half], 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    r[half] = fp16_stage_exponent(m);
    up[half] = pow2f(r[half]);
  }
  float acc[kN][4] = {};
  int e_num = ve[0];  // acc[n < D / 8] holds num 2^-e_num
#pragma unroll
  for (int kk = 0; kk < kC / 16; ++kk) {
    if (kk > w) continue;
    const int e = ve[kk];
    if (e != e_num) {
      scale_pow2<D>(acc, e_num - e);
      e_num = e;
    }
    uint32_t hi[4], lo[4];  // register r: n-tile 2 kk + r / 2, row half r % 2 (split_a's layout)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float(&c)[4] = sc[2 * kk + r / 2];
      mma::split2<__half>(c[2 * (r % 2)] * up[r % 2], c[2 * (r % 2) + 1] * up[r % 2], hi[r], lo[r]);
    }
    mma::for_each_b_trans<kN>(xv, D + 8, kk * 16, lane, [&](int n, const uint32_t (&b)[2]) {
      mma::m16n8k16(acc[n], hi, b, __half{});
      if constexpr (Tiles<T, D>::kSplitState) mma::m16n8k16(acc[n], lo, b, __half{});
    });
  }
  int e_den = se[1];  // acc[D / 8] holds den 2^-e_den
  to_state_units<D>(acc, r, e_num - se[0], -e_den);
  e_num = se[0];
#pragma unroll
  for (int kk = 0; kk < kS / 16; ++kk) {
    const int en = se[2 * kk], ed = se[2 * kk + 1];
    if (en != e_num) {
      scale_pow2<D>(acc, e_num - en);
      e_num = en;
    }
    if (ed != e_den) {
      scale_pow2<D, D / 8, D / 8 + 1>(acc, e_den - ed);
      e_den = ed;
    }
    uint32_t a[4];
    mma::load_a(a, s.phq, kT, r0, kk * 16, lane);
    mma::for_each_b_trans<kN>(sth, D + 8, kk * 16, lane,
                              [&](int n, const uint32_t (&b)[2]) { mma::m16n8k16(acc[n], a, b, __half{}); });
  }
  const int ratio = e_num - e_den;  // out = num 2^e_num / (den 2^e_den)
  if (ratio < -126 || ratio > 126) {
    scale_pow2<D>(acc, e_num);
    scale_pow2<D, D / 8, D / 8 + 1>(acc, e_den);
  }
  store_out_rows<T, D>(p, acc, row0, s.ot, out, ratio < -126 || ratio > 126 ? 1.f : pow2f(ratio));
}

// Causal, per (key-chunk group, q head, batch), each warp on its own rows: warp w loads (cp.async, a chunk ahead) and
// maps rows 16w.. of every chunk's keys and of its query tile (phi(k), phi(q) in fp16 into its rows of phk and phq),
// converts its v rows to fp16 2^-e (warp_rows_to_half) and holds features 16w.. of the running state [A, z] in fp32
// registers (from the group's prefix, slot grp). Per chunk: the warp stages its state rows in fp16 (stage_warp_state),
// a block barrier, the v rows of the next chunk start loading, each warp writes its 16 out rows of the chunk's query
// tile (warp_causal_out) and adds the chunk's phi(k)^T [v, 1] to its state rows (state_delta_half). xv and its
// exponents are double-buffered (the next chunk's v rows load during this chunk's products); phk and sth too where
// D != 64, else a second barrier ends the chunk (single tiles: three blocks per SM at D = 64; Tiles::cw_bufs).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 3 : 1) race_causal_out_fwd_kernel(const Params p) {
  extern __shared__ __align__(16) char smem_raw[];
  Tiles<T, D> s(smem_raw, Tiles<T, D>::Use::kCausalWarp);
  const int grp = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const Heads<T> hd(p, h, b);
  T* out = static_cast<T*>(p.out) + hd.bh * p.nq * D;
  const int first = grp * p.gchunks, end = min(p.nkc, first + p.gchunks), lane = threadIdx.x % 32, w = threadIdx.x / 32;
  const int r0 = 16 * w;
  if (end - 1 < p.kappa0) return;  // only keys before the first query: no tile to write
  const auto key0 = [&p](int kappa) { return p.s0 + kappa * kC; };
  const auto queries = [&](int kappa) {  // the warp's rows of chunk kappa's query tile, or an empty group
    if (kappa >= p.kappa0) warp_query_rows_async<T, D>(p, hd, kappa - p.kappa0, s);
    else mma::cp_async_commit();
  };
  unsigned flags = warp_flags(lane_key_ok(p, b, key0(first) + r0));  // the warp's key rows of chunk kappa
  warp_key_rows_async<T, D>(hd.k, p.sk.n, key0(first), flags, s.xk);  // groups per chunk: keys, queries, values
  queries(first);
  warp_key_rows_async<T, D>(hd.v, p.sv.n, key0(first), flags, s.xv);
  init_constants<T, D, __half>(p, s);
  float st[D / 8 + 1][4];
  load_warp_state<D>(p, hd.bh, grp, st);
  int e_s = 0;  // st[n < D / 8] holds the state's v columns times 2^-e_s
  __syncthreads();
  for (int kappa = first; kappa < end; ++kappa) {
    const int m = kappa - p.kappa0, buf = (kappa - first) & 1;
    const bool more = kappa + 1 < end;
    constexpr int kBufs = Tiles<T, D>::cw_bufs;
    __half* phk = s.phk + (kBufs == 2 ? buf : 0) * kC * kT;
    __half* sth = s.sth + (kBufs == 2 ? buf : 0) * kS * (D + 8);
    T* xv = s.xv + buf * kC * (D + 8);
    T* xv_next = s.xv + (buf ^ 1) * kC * (D + 8);
    int* ve = s.ve + buf * kThreads / 32;
    int* se = s.se + buf * 2 * kThreads / 32;
    const bool next_flag = lane_key_ok(p, b, key0(kappa + 1) + r0);  // false past the keys
    unsigned next_flags = 0;
    const auto store_to = [](__half* phi) {
      return [phi](int, int r, int item, const auto& val) {
        constexpr int R = sizeof(val) / sizeof(val[0]);
        store_halves<R>(phi + r * kT + item * R, val);
      };
    };
    mma::cp_async_wait_prior<2>();  // the warp's key rows of this chunk
    __syncwarp();
    const auto next_keys = [&] {  // once the warp's key rows are read
      next_flags = warp_flags(next_flag);
      if (more) warp_key_rows_async<T, D>(hd.k, p.sk.n, key0(kappa + 1), next_flags, s.xk);
      else mma::cp_async_commit();  // an empty group: the waits count the same groups in every chunk
    };
    warp_features<T, D>(p, s, s.xk, hd.beta, next_keys,
                        [flags, r0](int r) { return ((flags >> (r - r0)) & 1u) != 0; }, store_to(phk));
    mma::cp_async_wait_prior<2>();  // the warp's query rows of this chunk
    __syncwarp();
    const auto next_queries = [&] {
      if (more) queries(kappa + 1);
      else mma::cp_async_commit();
    };
    if (m >= 0)
      warp_features<T, D>(p, s, s.x, hd.beta, next_queries, [&](int r) { return m * kC + r < p.nq; },
                          store_to(s.phq));
    else
      next_queries();
    mma::cp_async_wait_prior<2>();  // the warp's v rows of this chunk
    __syncwarp();
    const int e = warp_rows_to_half<T, D>(xv);
    if (lane == 0) ve[w] = e;
    stage_warp_state<D>(st, e_s, sth, se);
    __syncthreads();
    if (more) warp_key_rows_async<T, D>(hd.v, p.sv.n, key0(kappa + 1), next_flags, xv_next);
    else mma::cp_async_commit();
    const __half* xvh = reinterpret_cast<const __half*>(xv);
    if (m >= 0) warp_causal_out<T, D>(p, s, phk, xvh, ve, sth, se, m * kC, out);
    if (!more) break;
    state_delta_half<D>(phk, xvh, ve, st, e_s);
    flags = next_flags;
    if constexpr (kBufs == 1) __syncthreads();  // every warp is done with phk and sth
  }
}

}  // namespace tc
}  // namespace race
}  // namespace hfab
