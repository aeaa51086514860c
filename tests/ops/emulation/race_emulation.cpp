// The RACE kernels (csrc/race: the tensor-core kernels for fp16/bf16 with S = L 2^P <= 64, the CUDA-core kernels
// for fp32) on the CPU through cuda_on_cpu.h and common/ptx.cuh of this folder, with the launch sequence of
// csrc/race/race_fwd.cu, race_bwd.cu and race_bwd_launch.cuh on a GPU with 227 KB of shared memory per block (the
// H200: every tensor-core layout fits, the causal out kernel is the per-warp one). A C interface for ctypes
// (tests/ops/test_race_emulation.py); q, k, v, dout contiguous (B, H, N, D) of `dtype` (0 fp16, 1 bf16, 2 fp32),
// planes (L P, D) and beta (Hq,) fp32, mask (B, Nk) bytes or null.
#include <cstdlib>
#include <string>

#include "harness.h"

namespace hfab {
namespace race {
thread_local float smem[64 * 1024];  // the CUDA-core kernels' dynamic shared memory
namespace tc {
alignas(16) thread_local char smem_raw[228 * 1024];  // the tensor-core kernels'
}  // namespace tc
}  // namespace race
}  // namespace hfab

#include "race/race_tc_bwd_kernels.cuh"

namespace {

using namespace hfab::race;
using std::vector;

int div_up(long long a, long long b) { return static_cast<int>((a + b - 1) / b); }

Params params(int d, int hq, int hkv, int nq, int nk, int causal, int planes_per_table, int tables, const void* q,
              const void* k, const void* v, const float* planes, const float* beta, const unsigned char* mask) {
  Params p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.sq = p.sdo = emu::contiguous(hq, nq, d);
  p.sk = p.sv = emu::contiguous(hkv, nk, d);
  p.kpm = mask;
  p.kpm_stride = nk;
  p.planes = planes;
  p.beta = beta;
  p.hq = hq;
  p.groups = hq / hkv;
  p.nq = nq;
  p.nk = nk;
  p.planes_per_table = planes_per_table;
  p.tables = tables;
  p.lp = planes_per_table * tables;
  p.features = tables << planes_per_table;
  p.stiles = div_up(p.features, kFeat);
  p.causal = causal;
  if (causal) {
    const int off = nk - nq;
    p.s0 = ((off % kRows) + kRows) % kRows;
    if (p.s0 > 0) p.s0 -= kRows;
    p.kappa0 = (off - p.s0) / kRows;
  }
  p.nkc = div_up(static_cast<long long>(nk) - p.s0, kRows);
  p.nqt = div_up(nq, kRows);
  return p;
}

bool tensor_cores(int dtype, const Params& p) { return dtype != 2 && p.features <= tc::kS && p.lp <= tc::kLPMax; }

bool scan(float* state, float* z, int n, int d, const Params& p, int b, ScanMode mode) {
  const int elems = p.features * d + p.features;
  return emu::launch(dim3(div_up(elems, kThreads), p.hq, b), kThreads, [&] {
    race_scan_fwd_kernel(state, z, n, p.features * d, p.features, p.hq, mode);
  });
}

template <typename T, int D, bool HALF>
bool tc_key_states(Params& p, int group_chunks, int b, vector<float>& state, vector<float>& z) {
  p.gchunks = group_chunks;
  p.ngk = div_up(p.nkc, group_chunks);
  p.ngq = div_up(p.nqt, tc::kGroup);
  state.assign(static_cast<size_t>(b) * p.hq * (p.ngk + 1) * p.features * D, NAN);
  z.assign(static_cast<size_t>(b) * p.hq * (p.ngk + 1) * p.features, NAN);
  p.kstate = state.data();
  p.kz = z.data();
  return emu::launch(dim3(p.ngk, p.hq, b), tc::kThreads, [&] { tc::race_group_state_fwd_kernel<T, D, HALF>(p); }) &&
         scan(p.kstate, p.kz, p.ngk, D, p, b, p.causal ? kPrefix : kTotal);
}

template <typename T, int D>
bool key_states(Params& p, int b, vector<float>& state, vector<float>& z) {
  state.assign(static_cast<size_t>(b) * p.hq * (p.nkc + 1) * p.features * D, NAN);
  z.assign(static_cast<size_t>(b) * p.hq * (p.nkc + 1) * p.features, NAN);
  p.kstate = state.data();
  p.kz = z.data();
  return (p.nkc == 0 ||
          emu::launch(dim3(p.nkc, p.hq, b), kThreads, [&] { race_state_fwd_kernel<T, D, false>(p); })) &&
         scan(p.kstate, p.kz, p.nkc, D, p, b, kPrefix);
}

// The forward's key chunks per group: tc::forward_group_chunks as on the GPU, or HFAB_RACE_GROUP_CHUNKS (read per
// call; here only) so that small inputs run other group sizes than the GPU picks for them.
int forward_group_chunks(const Params& p, int b) {
  const char* v = std::getenv("HFAB_RACE_GROUP_CHUNKS");
  return v != nullptr ? std::atoi(v) : tc::forward_group_chunks(p.nkc, static_cast<long long>(b) * p.hq, p.causal != 0);
}

// Whether the switch `name` is set to 0 (read per call here; the GPU host reads it once per process).
bool switched_off(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == "0";
}

// HFAB_RACE_WARP_CAUSAL=0: the block-wide causal out kernel, as on the GPU.
bool block_causal_out() { return switched_off("HFAB_RACE_WARP_CAUSAL"); }

// HFAB_RACE_PHI_TILE=0: the backward kernels rebuild phi at each use (<..., PHI_TILE = false>), as on the GPU.
// fn(std::bool_constant<PHI_TILE>) launches.
template <typename Fn>
bool with_phi_tile(Fn&& fn) {
  return switched_off("HFAB_RACE_PHI_TILE") ? fn(std::false_type{}) : fn(std::true_type{});
}

template <typename T, int D>
bool forward(Params& p, int b, bool tc_path) {
  vector<float> state, z;
  if constexpr (!std::is_same_v<T, float>) {
    if (tc_path) {
      if (!tc_key_states<T, D, tc::kHalfStates<T>>(p, forward_group_chunks(p, b), b, state, z)) return false;
      const unsigned blocks = static_cast<unsigned>(p.causal ? p.ngk : p.ngq);
      if (p.causal)
        return block_causal_out()
                   ? emu::launch(dim3(blocks, p.hq, b), tc::kThreads, [&] { tc::race_group_out_fwd_kernel<T, D>(p); })
                   : emu::launch(dim3(blocks, p.hq, b), tc::kThreads, [&] { tc::race_causal_out_fwd_kernel<T, D>(p); });
      return emu::launch(dim3(blocks, p.hq, b), tc::kThreads, [&] { tc::race_query_out_fwd_kernel<T, D>(p); });
    }
  }
  return key_states<T, D>(p, b, state, z) &&
         emu::launch(dim3(p.nqt, p.hq, b), kThreads, [&] { race_out_fwd_kernel<T, D>(p); });
}

template <typename T, int D>
bool backward(Params& p, int b, int hkv, bool tc_path) {
  vector<float> state, z;
  bool dq_done = false;
  if constexpr (!std::is_same_v<T, float>) {
    if (tc_path) {
      if (!tc_key_states<T, D, false>(p, tc::kGroup, b, state, z)) return false;
      const unsigned blocks = static_cast<unsigned>(p.causal ? p.ngk : p.ngq);
      if (!with_phi_tile([&](auto tile) {
            return emu::launch(dim3(blocks, p.hq, b), tc::kThreads,
                               [&] { tc::race_group_dq_bwd_kernel<T, D, decltype(tile)::value>(p); });
          }))
        return false;
      dq_done = true;
    }
  }
  if (!dq_done && !(key_states<T, D>(p, b, state, z) &&
                    emu::launch(dim3(p.nqt, p.hq, b), kThreads, [&] { race_dq_bwd_kernel<T, D>(p); })))
    return false;
  if constexpr (!std::is_same_v<T, float>) {
    if (tc_path) {
      const int groups = div_up(p.causal ? p.nkc : p.nqt, tc::kGroup);
      return with_phi_tile([&](auto tile) {
        constexpr bool kTile = decltype(tile)::value;
        return emu::launch(dim3(groups, p.hq, b), tc::kThreads,
                           [&] { tc::race_group_qstate_bwd_kernel<T, D, kTile>(p); }) &&
               scan(p.qstate, p.qz, groups, D, p, b, kSuffix) &&
               emu::launch(dim3(p.ngk, hkv, b), tc::kThreads, [&] { tc::race_group_dkv_bwd_kernel<T, D, kTile>(p); });
      });
    }
  }
  return emu::launch(dim3(p.nqt, p.hq, b), kThreads, [&] { race_state_fwd_kernel<T, D, true>(p); }) &&
         scan(p.qstate, p.qz, p.nqt, D, p, b, kSuffix) &&
         emu::launch(dim3(p.nkc, hkv, b), kThreads, [&] { race_dkv_bwd_kernel<T, D>(p); });
}

// fn.template operator()<T, D>() for dtype 0 fp16, 1 bf16, 2 fp32: the C interface's codes (harness.h).
template <typename Fn>
int dispatch(int dtype, int d, Fn&& fn) {
  if (dtype != 2) return emu::dispatch(dtype, d, fn);
  if (d == 32) return fn.template operator()<float, 32>() ? 0 : 2;
  if (d == 64) return fn.template operator()<float, 64>() ? 0 : 2;
  if (d == 128) return fn.template operator()<float, 128>() ? 0 : 2;
  return 1;
}

size_t elem_bytes(int dtype) { return dtype == 2 ? 4 : 2; }

}  // namespace

extern "C" {

// out = the RACE forward (`out` of Nq x D rows per (b, h), any prior content). Returns 0; 1 for an unsupported
// head dim, 2 when a block's threads deadlock.
int race_fwd(int dtype, int d, int b, int hq, int hkv, int nq, int nk, int causal, int planes_per_table, int tables,
             const void* q, const void* k, const void* v, const float* planes, const float* beta,
             const unsigned char* mask, void* out) {
  Params p = params(d, hq, hkv, nq, nk, causal, planes_per_table, tables, q, k, v, planes, beta, mask);
  const bool tc_path = tensor_cores(dtype, p);
  const size_t out_bytes = static_cast<size_t>(b) * hq * nq * d * elem_bytes(dtype);
  if (nk == 0 || (tc_path && causal && p.kappa0 < 0)) std::memset(out, 0, out_bytes);  // as race_fwd.cu
  if (nq == 0 || nk == 0) return 0;
  p.out = out;
  return dispatch(dtype, d, [&]<typename T, int D>() { return forward<T, D>(p, b, tc_path); });
}

// dq, dk, dv and dbeta (per head, (Hq,) fp32) = the RACE backward. Returns as race_fwd.
int race_bwd(int dtype, int d, int b, int hq, int hkv, int nq, int nk, int causal, int planes_per_table, int tables,
             const void* q, const void* k, const void* v, const float* planes, const float* beta,
             const unsigned char* mask, const void* dout, void* dq, void* dk, void* dv, float* dbeta) {
  Params p = params(d, hq, hkv, nq, nk, causal, planes_per_table, tables, q, k, v, planes, beta, mask);
  const bool tc_path = tensor_cores(dtype, p);
  const bool unvisited = tc_path && causal && p.kappa0 < 0;  // race_bwd.cu zero-fills these
  const float fill = unvisited ? 0.f : NAN;
  if (unvisited) std::memset(dq, 0, static_cast<size_t>(b) * hq * nq * d * elem_bytes(dtype));
  const int qslots = (tc_path ? div_up(causal ? p.nkc : p.nqt, tc::kGroup) : p.nqt) + 1;
  vector<float> den(static_cast<size_t>(b) * hq * nq, fill), cq(den.size(), fill);
  vector<float> qstate(static_cast<size_t>(b) * hq * qslots * p.features * d, NAN);
  vector<float> qz(static_cast<size_t>(b) * hq * qslots * p.features, NAN);
  vector<float> scratch;
  if (tc_path && p.groups > 1) {
    scratch.assign(2 * static_cast<size_t>(b) * hkv * nk * d, NAN);
    p.dk_scratch = scratch.data();
    p.dv_scratch = scratch.data() + scratch.size() / 2;
  }
  vector<float> part_q(static_cast<size_t>(b) * hq * p.nqt, fill), part_k(static_cast<size_t>(b) * hq * p.nkc, NAN);
  p.dout = dout;
  p.out = dq;
  p.dk = dk;
  p.dv = dv;
  p.den = den.data();
  p.cq = cq.data();
  p.qstate = qstate.data();
  p.qz = qz.data();
  p.dbeta_q = part_q.data();
  p.dbeta_k = part_k.data();
  const int rc = dispatch(dtype, d, [&]<typename T, int D>() { return backward<T, D>(p, b, hkv, tc_path); });
  if (rc != 0) return rc;
  return emu::launch(dim3(hq, 1, 1), kThreads, [&] {
           race_dbeta_bwd_kernel(p.dbeta_q, p.dbeta_k, b, hq, p.nqt, p.nkc, dbeta);
         }) ? 0 : 2;
}

}  // extern "C"
