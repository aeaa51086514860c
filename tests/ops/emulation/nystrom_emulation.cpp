// Eight Nyström kernels (csrc/nystrom/nystrom_kernels.cuh, nystrom_tc_kernels.cuh, nystrom_tc_bwd_kernels.cuh) on the
// CPU through cuda_on_cpu.h and common/ptx.cuh of this folder, each launched as nystrom_host.cuh / nystrom_bwd.cu
// launch it: K3's forward and backward (grid (splits, ceil(m / 16 W), B Hq) of `chunk` keys each, W = row_warps(m)
// warps per block), the dk/dv kernel (grid (splits, Hkv, B) of kv_chunk keys each, the resident instance where
// resident_kv_fits), the buffer gradients of k1 (grid (splits, ceil(slots / 16 W), B Hq) of a_chunk queries
// each, W = row_warps(slots)) and dq, the output and the row statistics (grid (blocks per head, Hq, B), one or two
// query-tile stages), and the landmark means (grid (m, Hq + Hkv, B)). The rest of the Nyström backward (its split plans
// from the GPU's resident blocks, the side stream) stays with the GPU tests; this harness takes each kernel's inputs
// (buffers, row statistics, landmark-stage arrays) as arrays. A C interface for ctypes
// (tests/ops/test_nystrom_emulation.py): q, dO contiguous (B, Hq, N, D) and k, v (B, Hkv, N, D) 16-bit; fp32 arrays
// contiguous; mask (B, N) bytes, cumsum (B, N) and n_real (B,) int32, or all three null.
#include "harness.h"

namespace hfab {
namespace nystrom {
namespace tc {
// the kernels' dynamic shared memory (`extern __shared__`; see stieltjes_emulation.cpp for -fno-extern-tls-init)
alignas(16) thread_local unsigned char smem[228 * 1024];
}  // namespace tc
// the landmark-stage kernels' (at most m 128, D 128: 128 x 257 floats)
constexpr int kLandmarkSmemFloats = 128 * 257;
alignas(16) thread_local float4 landmark_smem[kLandmarkSmemFloats / 4];
}  // namespace nystrom
}  // namespace hfab

#include "nystrom/nystrom_tc_bwd_kernels.cuh"

namespace {

using namespace hfab::nystrom;

template <typename T, int D, bool RESIDENT, int LAND = tc::KvSmem<D, RESIDENT>::kLand>
bool key_gradients(const BwdParams& bp, int b) {
  using S = tc::KvSmem<D, RESIDENT, LAND>;
  static_assert(S::bytes <= sizeof(tc::smem), "dynamic shared memory of the emulation too small");
  const dim3 grid(emu::blocks(bp.p.n, bp.kv_chunk), bp.p.hkv, b);
  emu::shared_window = reinterpret_cast<const char*>(tc::smem);  // wgmma descriptors count from here
  return emu::launch(grid, tc::kK3Threads, [&] { tc::nystrom_kv_tc_bwd_kernel<T, D, RESIDENT, LAND>(bp); });
}

// f.template operator()<V>() for the V among VS that equals v (else the last): a runtime choice (warps per block,
// query-tile stages) as the kernel's template argument.
template <int V, int... VS, typename F>
bool with_value(int v, F f) {
  if constexpr (sizeof...(VS) == 0) {
    return f.template operator()<V>();
  } else {
    return v == V ? f.template operator()<V>() : with_value<VS...>(v, f);
  }
}

template <typename T, int D, bool FUSED>
bool buffer_gradients(const BwdParams& bp, int b) {
  return with_value<2, 4>(tc::row_warps(bp.p.slots), [&]<int W>() {
    static_assert(tc::K1Smem<D, W>::bytes <= sizeof(tc::smem), "dynamic shared memory of the emulation too small");
    if (FUSED && bp.p.slots > 16 * W) return false;  // Δ1 and dq from one slot tile only, as the host launches it
    const dim3 grid(emu::blocks(bp.p.n, bp.a_chunk), emu::blocks(bp.p.slots, 16 * W), b * bp.p.hq);
    return emu::launch(grid, 32 * W, [&] { tc::nystrom_k1_tc_bwd_kernel<T, D, W, FUSED>(bp); });
  });
}


// A query-tile kernel over grid (blocks per head, Hq, B) where the emulation has its `bytes` of shared memory.
template <typename Kernel>
bool query_tiles(int bytes, int b, int hq, int blocks_per_head, Kernel kernel) {
  if (bytes > static_cast<int>(sizeof(tc::smem))) return false;
  emu::shared_window = reinterpret_cast<const char*>(tc::smem);  // wgmma descriptors count from here
  return emu::launch(dim3(blocks_per_head, hq, b), tc::kThreads, kernel);
}

// The fields the key-side kernels (K3's, dk/dv) share: k, v, the padding mask, the scaled landmark queries.
Params key_side(int d, int hq, int hkv, int n, int m, float root, const void* k, const void* v,
                const unsigned char* mask, const float* q_land) {
  Params p{};
  p.k = k;
  p.v = v;
  p.sk = p.sv = emu::contiguous(hkv, n, d);
  p.mask = mask;
  p.mask_stride = n;
  p.hq = hq;
  p.hkv = hkv;
  p.groups = hq / hkv;
  p.n = n;
  p.m = m;
  p.root = root;
  p.q_land = const_cast<float*>(q_land);
  return p;
}

// K3's grid: key splits of `chunk`, tiles of `rows` landmarks, B Hq.
dim3 k3_grid(const Params& p, int b, int chunk, int rows) {
  return dim3(emu::blocks(p.n, chunk), emu::blocks(p.m, rows), b * p.hq);
}

// The fields the k1 and dq kernels read: q and dO, the key/value buffers, the row statistics of K1.
BwdParams query_side(int d, int hq, int n, int slots, float root, const void* q, const void* dout, const float* keys,
                     const float* vals, const int* nvalid, const float* lse1, const float* delta1) {
  BwdParams bp{};
  Params& p = bp.p;
  p.q = q;
  p.sq = emu::contiguous(hq, n, d);
  p.hq = hq;
  p.n = n;
  p.root = root;
  p.keys = keys;
  p.vals = vals;
  p.nvalid = nvalid;
  p.slots = slots;
  bp.dout = dout;
  bp.lse1 = const_cast<float*>(lse1);
  bp.delta1 = const_cast<float*>(delta1);
  return bp;
}

// The fields that spread a landmark's gradient over its segment: the mask with its ranks, real lengths, exact
// sequences, segment sizes.
void segments(BwdParams& bp, int m, const unsigned char* mask, const int* cumsum, const int* n_real,
              const unsigned char* exact, const float* counts) {
  Params& p = bp.p;
  p.m = m;
  p.mask = mask;
  p.mask_stride = p.n;
  p.n_real = n_real;
  p.counts = const_cast<float*>(counts);
  bp.cumsum = cumsum;
  bp.exact = exact;
  bp.landmarks = p.n > m;
}

}  // namespace

// K3's forward: per key split, the base-2 running max, sum and unnormalised Σ p v of each landmark row,
// part_max, part_sum (splits, B Hq, m) and part_acc (splits, B Hq, m, D) fp32.
extern "C" int nystrom_k3_fwd(int bf16, int d, int b, int hq, int hkv, int n, int m, float root, int chunk,
                              const void* k, const void* v, const unsigned char* mask, const float* q_land,
                              float* part_max, float* part_sum, float* part_acc) {
  Params p = key_side(d, hq, hkv, n, m, root, k, v, mask, q_land);
  p.chunk = chunk;
  p.part_max = part_max;
  p.part_sum = part_sum;
  p.part_acc = part_acc;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    static_assert(tc::K3Smem<D>::bytes <= sizeof(tc::smem), "dynamic shared memory of the emulation too small");
    return with_value<2, 4>(tc::row_warps(m), [&]<int W>() {
      return emu::launch(k3_grid(p, b, chunk, 16 * W), 32 * W, [&] { tc::nystrom_k3_tc_fwd_kernel<T, D, W>(p); });
    });
  });
}

// K3's backward: per key split, the partial dQ̃ (splits, B Hq, m, D) fp32; exact[b] sequences write zeros.
extern "C" int nystrom_k3_bwd(int bf16, int d, int b, int hq, int hkv, int n, int m, float root, int chunk,
                              const void* k, const void* v, const unsigned char* mask, const float* q_land,
                              const unsigned char* exact, const float* dw0, const float* lse3, const float* rowdot,
                              float* part_dql) {
  BwdParams bp{};
  bp.p = key_side(d, hq, hkv, n, m, root, k, v, mask, q_land);
  bp.exact = exact;
  bp.b_chunk = chunk;
  bp.dw0 = dw0;
  bp.lse3 = lse3;
  bp.rowdot = rowdot;
  bp.part_dql = part_dql;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    return with_value<2, 4>(tc::row_warps(m), [&]<int W>() {
      static_assert(tc::K3BwdSmem<D, W>::bytes <= sizeof(tc::smem), "dynamic shared memory of the emulation too small");
      return emu::launch(k3_grid(bp.p, b, chunk, 16 * W), 32 * W, [&] { tc::nystrom_k3_tc_bwd_kernel<T, D, W>(bp); });
    });
  });
}

// part_dkeys, part_dvals: (ceil(N / a_chunk), B Hq, slots, D) fp32. With `fused` (slots <= 64) the kernel sums Δ1
// itself and writes it to delta1 and dq's buffer part to dq (B, Hq, N, D), else reads Δ1 there (dq untouched).
extern "C" int nystrom_k1_bwd(int bf16, int d, int b, int hq, int n, int slots, float root, int a_chunk, int fused,
                              const void* q, const void* dout, const float* keys, const float* vals, const int* nvalid,
                              const float* lse1, float* delta1, float* part_dkeys, float* part_dvals, void* dq) {
  BwdParams bp = query_side(d, hq, n, slots, root, q, dout, keys, vals, nvalid, lse1, delta1);
  bp.a_chunk = a_chunk;
  bp.part_dkeys = part_dkeys;
  bp.part_dvals = part_dvals;
  bp.dq = dq;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    return fused ? buffer_gradients<T, D, true>(bp, b) : buffer_gradients<T, D, false>(bp, b);
  });
}

// dq (B, Hq, N, D); dql (B, Hq, m, D) and counts (B, m) for landmark sequences (n > m and not exact[b]).
extern "C" int nystrom_dq_bwd(int bf16, int d, int b, int hq, int n, int m, int slots, float root, int blocks_per_head,
                              int stages, const void* q, const void* dout, const float* keys, const float* vals,
                              const int* nvalid, const float* lse1, const float* delta1, const unsigned char* mask,
                              const int* cumsum, const int* n_real, const unsigned char* exact, const float* dql,
                              const float* counts, void* dq) {
  BwdParams bp = query_side(d, hq, n, slots, root, q, dout, keys, vals, nvalid, lse1, delta1);
  segments(bp, m, mask, cumsum, n_real, exact, counts);
  bp.dql = dql;
  bp.dq = dq;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    return with_value<1, 2>(stages, [&]<int STAGES>() {
      return query_tiles(tc::DqSmem<D>::bytes(slots, STAGES), b, hq, blocks_per_head,
                         [&] { tc::nystrom_dq_tc_bwd_kernel<T, D, STAGES>(bp); });
    });
  });
}

extern "C" int nystrom_kv_bwd(int bf16, int d, int b, int hq, int hkv, int n, int m, int slots, float root,
                              int kv_chunk, const void* k, const void* v, const unsigned char* mask, const int* cumsum,
                              const int* n_real, const unsigned char* exact, const float* q_land, const float* dw0,
                              const float* lse3, const float* rowdot, const float* dkl, const float* counts,
                              const float* dkeys_kv, const float* dvals_kv, void* dk, void* dv) {
  BwdParams bp{};
  bp.p = key_side(d, hq, hkv, n, m, root, k, v, mask, q_land);
  Params& p = bp.p;
  p.n_real = n_real;
  p.counts = const_cast<float*>(counts);
  p.slots = slots;
  bp.cumsum = cumsum;
  bp.exact = exact;
  bp.landmarks = n > m;
  bp.kv_chunk = kv_chunk;
  bp.dw0 = dw0;
  bp.lse3 = lse3;
  bp.rowdot = rowdot;
  bp.dkl = dkl;
  bp.dkeys_kv = dkeys_kv;
  bp.dvals_kv = dvals_kv;
  bp.dk = dk;
  bp.dv = dv;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    if (!tc::resident_kv_fits<D>(p.groups, m)) return key_gradients<T, D, false>(bp, b);
    return tc::resident_kv_land<D>(m) == 32 ? key_gradients<T, D, true, 32>(bp, b) : key_gradients<T, D, true>(bp, b);
  });
}

// The output (B, Hq, N, D) 16-bit: softmax attention of q over the buffers plus the conv residual of v (conv (Hq, ks)
// fp32, or null; v (B, Hkv, N, D)); mask (B, N) bytes or null; out_lse (B Hq, N) fp32: each row's base-2
// log-sum-exp, as the forward saves it for the backward.
extern "C" int nystrom_out_fwd(int bf16, int d, int b, int hq, int hkv, int n, int slots, float root,
                               int blocks_per_head, int stages, const void* q, const void* v, const float* keys,
                               const float* vals, const int* nvalid, const float* conv, int ks,
                               const unsigned char* mask, void* out, float* out_lse) {
  Params p = query_side(d, hq, n, slots, root, q, nullptr, keys, vals, nvalid, nullptr, nullptr).p;
  p.v = v;
  p.sv = emu::contiguous(hkv, n, d);
  p.hkv = hkv;
  p.groups = hq / hkv;
  p.conv = conv;
  p.ks = ks;
  p.mask = mask;
  p.mask_stride = n;
  p.out = out;
  p.out_lse = out_lse;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    return with_value<1, 2>(stages, [&]<int STAGES>() {
      return query_tiles(tc::OutSmem<D>::bytes(slots, STAGES), b, hq, blocks_per_head,
                         [&] { tc::nystrom_out_tc_fwd_kernel<T, D, STAGES>(p); });
    });
  });
}

// K1's row statistics lse1, Δ1 (B Hq, N) fp32, written by the kernel.
extern "C" int nystrom_stats_bwd(int bf16, int d, int b, int hq, int n, int slots, float root, int blocks_per_head,
                                 int stages, const void* q, const void* dout, const float* keys, const float* vals,
                                 const int* nvalid, float* lse1, float* delta1) {
  const BwdParams bp = query_side(d, hq, n, slots, root, q, dout, keys, vals, nvalid, lse1, delta1);
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    return with_value<1, 2>(stages, [&]<int STAGES>() {
      return query_tiles(tc::OutSmem<D>::bytes(slots, STAGES), b, hq, blocks_per_head,
                         [&] { tc::nystrom_stats_tc_bwd_kernel<T, D, STAGES>(bp); });
    });
  });
}

// The landmarks: segment means of the real rows times √scale, Q̃ (B, Hq, m, D) and K̃ (B, Hkv, m, D) fp32, and the
// rows per segment counts (B, m); blocks of `threads` (256, or 1,024 where segments hold 4,096 rows or more). n_real
// (B,) and pos (B, N) int32 with a mask, else both null.
extern "C" int nystrom_landmark_fwd(int bf16, int d, int b, int hq, int hkv, int n, int m, float root, int threads,
                                    const void* q, const void* k, const int* n_real, const int* pos, float* q_land,
                                    float* k_land, float* counts) {
  Params p = key_side(d, hq, hkv, n, m, root, k, nullptr, nullptr, q_land);
  p.q = q;
  p.sq = emu::contiguous(hq, n, d);
  p.n_real = n_real;
  p.pos = pos;
  p.k_land = k_land;
  p.counts = counts;
  const dim3 grid(m, hq + hkv, b);
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    if (threads == 1024) return emu::launch(grid, 1024, [&] { nystrom_landmark_fwd_kernel<T, D, 1024>(p); });
    return emu::launch(grid, kThreads, [&] { nystrom_landmark_fwd_kernel<T, D, kThreads>(p); });
  });
}



// Σ of `splits` partials (splits, count) fp32 into the first, for one array or two (second != null).
extern "C" int nystrom_split_sum(float* first, float* second, long long count, int splits) {
  SplitSums s{{first, second}, count, splits};
  const dim3 grid(emu::blocks(static_cast<int>(count / 4), kThreads), second != nullptr ? 2 : 1);
  return emu::launch(grid, kThreads, [&] { nystrom_split_sum_bwd_kernel(s); }) ? 0 : 2;
}

// The m x m stage before the Newton–Schulz VJP: dkeys, dvals, w0 (B Hq, m, D), z, dz (B Hq, m, m); dkeys_kv, dvals_kv
// (B, Hkv, m, D), written where Hq > Hkv; dw0 (B Hq, m, D), rowdot (B Hq, m), dkl (B, Hkv, m, D).
extern "C" int nystrom_landmark_vjp(int d, int b, int hq, int hkv, int m, const unsigned char* exact,
                                    const float* dkeys, const float* dvals, const float* w0, const float* z,
                                    float* dkeys_kv, float* dvals_kv, float* dz, float* dw0, float* rowdot,
                                    float* dkl) {
  LandmarkParams lp{};
  lp.hq = hq;
  lp.groups = hq / hkv;
  lp.m = m;
  lp.slots = m;
  lp.landmarks = true;
  lp.exact = exact;
  lp.dkeys = dkeys;
  lp.dvals = dvals;
  lp.dkeys_kv = dkeys_kv;
  lp.dvals_kv = dvals_kv;
  lp.w0 = w0;
  lp.z = z;
  lp.dz = dz;
  lp.dw0 = dw0;
  lp.rowdot = rowdot;
  lp.dkl = dkl;
  return emu::dispatch(0, d, [&]<typename T, int D>() {
    if (landmark_vjp_smem_bytes<D>(m) > kLandmarkSmemFloats * 4) return false;
    return emu::launch(dim3(emu::blocks(m, kLandmarkRows), hq, b), kThreads,
                       [&] { nystrom_landmark_vjp_bwd_kernel<D>(lp); });
  });
}

// The m x m stage after it: k2, dk2 (B Hq, m, m); q_land (B Hq, m, D), k_land (B, Hkv, m, D); dql (B Hq, m, D): K3's
// part in, dQ̃ out; with add_vjp_to_dkl dkl += the VJP part of d K̃, else dkl_vjp = it (B, Hkv, m, D).
extern "C" int nystrom_landmark_grads(int d, int b, int hq, int hkv, int m, int add_vjp_to_dkl, const float* k2,
                                      const float* dk2, const float* q_land, const float* k_land, float* dql,
                                      float* dkl, float* dkl_vjp) {
  LandmarkParams lp{};
  lp.hq = hq;
  lp.groups = hq / hkv;
  lp.m = m;
  lp.landmarks = true;
  lp.add_vjp_to_dkl = add_vjp_to_dkl != 0;
  lp.k2 = k2;
  lp.dk2 = dk2;
  lp.q_land = q_land;
  lp.k_land = k_land;
  lp.dql = dql;
  lp.dkl = dkl;
  lp.dkl_vjp = dkl_vjp;
  return emu::dispatch(0, d, [&]<typename T, int D>() {
    if (landmark_grads_smem_bytes<D>(m) > kLandmarkSmemFloats * 4) return false;
    return emu::launch(dim3(emu::blocks(m, kLandmarkRows), hkv, b), kThreads,
                       [&] { nystrom_landmark_grads_bwd_kernel<D>(lp); });
  });
}
