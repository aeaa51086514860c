// The Nyström dk/dv kernel (nystrom_kv_tc_bwd_kernel, csrc/nystrom/nystrom_tc_bwd_kernels.cuh) on the CPU through
// cuda_on_cpu.h and common/ptx.cuh of this folder, launched as csrc/nystrom/nystrom_bwd.cu launches it: grid (splits,
// Hkv, B) of kv_chunk keys each, the resident instance where KvSmem::fits(groups, m). The rest of the Nyström backward
// (its split plans from the GPU's resident blocks, the side stream) stays with the GPU tests; this harness takes the
// kernel's inputs (landmarks, dW0, lse3, rowdot, d K̃ rows, segment counts) as arrays. A C interface for ctypes
// (tests/ops/test_nystrom_emulation.py): k, v contiguous (B, Hkv, N, D) 16-bit; mask (B, N) bytes, cumsum (B, N) and
// n_real (B,) int32, or all three null.
#include "harness.h"

namespace hfab {
namespace nystrom {
namespace tc {
// the kernels' dynamic shared memory (`extern __shared__`; see stieltjes_emulation.cpp for -fno-extern-tls-init)
alignas(16) thread_local unsigned char smem[228 * 1024];
}  // namespace tc
}  // namespace nystrom
}  // namespace hfab

#include "nystrom/nystrom_tc_bwd_kernels.cuh"

namespace {

using namespace hfab::nystrom;

template <typename T, int D, bool RESIDENT>
bool key_gradients(const BwdParams& bp, int b) {
  using S = tc::KvSmem<D, RESIDENT>;
  static_assert(S::bytes <= sizeof(tc::smem), "dynamic shared memory of the emulation too small");
  const dim3 grid(emu::blocks(bp.p.n, bp.kv_chunk), bp.p.hkv, b);
  return emu::launch(grid, tc::kK3Threads, [&] { tc::nystrom_kv_tc_bwd_kernel<T, D, RESIDENT>(bp); });
}

}  // namespace

extern "C" int nystrom_kv_bwd(int bf16, int d, int b, int hq, int hkv, int n, int m, int slots, float root,
                              int kv_chunk, const void* k, const void* v, const unsigned char* mask, const int* cumsum,
                              const int* n_real, const unsigned char* exact, const float* q_land, const float* dw0,
                              const float* lse3, const float* rowdot, const float* dkl, const float* counts,
                              const float* dkeys_kv, const float* dvals_kv, void* dk, void* dv) {
  BwdParams bp{};
  Params& p = bp.p;
  p.k = k;
  p.v = v;
  p.sk = p.sv = emu::contiguous(hkv, n, d);
  p.mask = mask;
  p.mask_stride = n;
  p.n_real = n_real;
  p.hq = hq;
  p.hkv = hkv;
  p.groups = hq / hkv;
  p.n = n;
  p.m = m;
  p.root = root;
  p.q_land = const_cast<float*>(q_land);
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
  const bool resident = tc::KvSmem<64, true>::fits(p.groups, m);
  return emu::dispatch(bf16, d, [&]<typename T, int D>() {
    return resident ? key_gradients<T, D, true>(bp, b) : key_gradients<T, D, false>(bp, b);
  });
}
