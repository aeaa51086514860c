// The Stieltjes attention kernels (csrc/stieltjes/stieltjes_kernels.cuh, tensor cores) on the CPU through
// cuda_on_cpu.h and common/ptx.cuh of this folder, with the launch geometry of csrc/stieltjes/stieltjes_fwd.cu and
// stieltjes_bwd.cu. A C interface for ctypes (tests/ops/test_stieltjes_emulation.py); tensors are contiguous
// (B, H, N, D) arrays of 16-bit elements, row states (B, Hq, Nq) fp32, mask (B, Nk) bytes or null.
#include "harness.h"

namespace hfab {
namespace stieltjes {
// The kernels' dynamic shared memory (`extern __shared__`; built with -fno-extern-tls-init: g++'s wrapper for an
// extern thread_local otherwise calls an initialiser that a -fPIC library resolves to address 0).
alignas(16) thread_local unsigned char smem_raw[228 * 1024];
}  // namespace stieltjes
}  // namespace hfab

#include "stieltjes/stieltjes_kernels.cuh"

namespace {

using namespace hfab::stieltjes;


Params params(int d, int hq, int hkv, int nq, int nk, int causal, float scale, float order, const void* q,
              const void* k, const void* v, const unsigned char* mask) {
  Params p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.kpm = mask;
  p.kpm_sb = nk;
  p.kpm_sn = 1;
  p.sq = p.sdo = emu::contiguous(hq, nq, d);
  p.sk = p.sv = emu::contiguous(hkv, nk, d);
  p.hq = hq;
  p.groups = hq / hkv;
  p.nq = nq;
  p.nk = nk;
  p.scale = scale;
  p.order = order;
  p.causal = causal;
  return p;
}

template <typename Smem>
void check_smem() {
  static_assert(sizeof(Smem) <= sizeof(smem_raw), "dynamic shared memory of the emulation too small");
}

template <typename T, int D, int IORD, bool STATE>
bool forward(const Params& p, int b) {
  using Cfg = FwdCfg<D>;
  check_smem<typename Cfg::Smem>();
  return emu::launch(dim3(emu::blocks(p.nq, Cfg::BQ), p.hq, b), kThreads,
                     [&] { stieltjes_fwd_kernel<T, D, IORD, STATE>(p); });
}

template <typename T, int D, int IORD>
bool backward(const Params& p, int b, int hkv) {
  using Dq = DqCfg<D>;
  using Dkv = DkvCfg<D>;
  check_smem<typename Dq::Smem>();
  check_smem<typename Dkv::Smem>();
  bool ok = true;
  if (p.nq > 0)
    ok = ok && emu::launch(dim3(emu::blocks(p.nq, Dq::BQ), p.hq, b), kThreads,
                           [&] { stieltjes_dq_kernel<T, D, IORD>(p); });
  if (p.nk > 0)
    ok = ok && emu::launch(dim3(emu::blocks(p.nk, Dkv::BK), hkv, b), kThreads,
                           [&] { stieltjes_dkv_kernel<T, D, IORD>(p); });
  return ok;
}

// fn.template operator()<T, D, IORD>() with IORD as stieltjes_host.cuh picks it (4, 2: fast paths; 0: any order).
template <typename Fn>
int dispatch(int bf16, int d, float order, Fn&& fn) {
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    if (order == 4.0f) return fn.template operator()<T, D, 4>();
    if (order == 2.0f) return fn.template operator()<T, D, 2>();
    return fn.template operator()<T, D, 0>();
  });
}

}  // namespace

extern "C" {

// out, rowmax, lam = the Stieltjes forward; with u (B, Hq, Nq, D) and lsum (B, Hq, Nq) not null, the training
// variant that also writes them. Returns 0; 1 for an unsupported head dim, 2 when a block deadlocks.
int stieltjes_fwd(int bf16, int d, int b, int hq, int hkv, int nq, int nk, int causal, float scale, float order,
                  int newton_iter, const void* q, const void* k, const void* v, const unsigned char* mask, void* out,
                  float* rowmax, float* lam, float* u, float* lsum) {
  Params p = params(d, hq, hkv, nq, nk, causal, scale, order, q, k, v, mask);
  p.o = out;
  p.rowmax = rowmax;
  p.lam = lam;
  p.u = u;
  p.lsum = lsum;
  p.newton_iter = newton_iter;
  const bool state = u != nullptr && lsum != nullptr;
  return dispatch(bf16, d, order, [&]<typename T, int D, int IORD>() {
    return state ? forward<T, D, IORD, true>(p, b) : forward<T, D, IORD, false>(p, b);
  });
}

// dq, dk, dv = the Stieltjes backward from the training forward's u and lsum (delta: (B, Hq, Nq) fp32 scratch).
// Returns as stieltjes_fwd.
int stieltjes_bwd(int bf16, int d, int b, int hq, int hkv, int nq, int nk, int causal, float scale, float order,
                  const void* q, const void* k, const void* v, const unsigned char* mask, const void* dout,
                  const float* rowmax, const float* lam, const float* u, const float* lsum, float* delta, void* dq,
                  void* dk, void* dv) {
  Params p = params(d, hq, hkv, nq, nk, causal, scale, order, q, k, v, mask);
  p.dout = dout;
  p.rowmax = const_cast<float*>(rowmax);
  p.lam = const_cast<float*>(lam);
  p.u = const_cast<float*>(u);
  p.lsum = const_cast<float*>(lsum);
  p.delta = delta;
  p.o = dq;
  p.dk = dk;
  p.dv = dv;
  return dispatch(bf16, d, order, [&]<typename T, int D, int IORD>() { return backward<T, D, IORD>(p, b, hkv); });
}

}  // extern "C"
