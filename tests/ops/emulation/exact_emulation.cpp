// The exact attention kernels (csrc/exact/exact_kernels.cuh) on the CPU through cuda_on_cpu.h, with the launch
// geometry of csrc/exact/exact_fwd.cu and exact_bwd.cu. A C interface for ctypes (tests/ops/test_exact_emulation.py);
// tensors are contiguous (B, H, N, D) arrays of 16-bit elements, lse (B, Hq, Nq) fp32, mask (B, Nk) bytes or null.
#include "harness.h"

#include "common/ptx.cuh"  // the emulated PTX (this folder first on the include path): the alignment probe
#include "exact/exact_kernels.cuh"

namespace {

using namespace hfab::exact;
using hfab::kTileThreads;

Params params(int d, int hq, int hkv, int nq, int nk, int causal, float scale, const void* q, const void* k,
              const void* v, const unsigned char* mask) {
  Params p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.key_padding_mask = mask;
  p.kpm_stride = nk;
  p.sq = emu::contiguous(hq, nq, d);
  p.sk = p.sv = emu::contiguous(hkv, nk, d);
  p.so = p.sdo = p.sq;
  p.hq = hq;
  p.groups = hq / hkv;
  p.nq = nq;
  p.nk = nk;
  p.scale = scale;
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  p.causal = causal;
  return p;
}

template <typename T, int D>
bool forward(const Params& p, int b) {
  using Tiles = FwdTiles<D>;
  return emu::launch(dim3(emu::blocks(p.nq, Tiles::BQ), p.hq, b), kTileThreads,
              [&] { exact_attn_fwd_kernel<T, D, Tiles::BQ, Tiles::BK>(p); });
}

template <typename T, int D>
bool backward(const Params& p, int b, int hkv) {
  using Dq = DqTiles<D>;
  using Dkv = DkvTiles<D>;
  bool ok = true;
  if (p.nq > 0) {
    ok = ok && emu::launch(dim3(emu::blocks(static_cast<long long>(p.hq) * p.nq, kTileThreads / 32), b), kTileThreads,
                           [&] { exact_delta_bwd_kernel<T, D>(p); });
    ok = ok && emu::launch(dim3(emu::blocks(p.nq, Dq::BQ), p.hq, b), kTileThreads,
                           [&] { exact_dq_bwd_kernel<T, D, Dq::BQ, Dq::BK>(p); });
  }
  if (p.nk > 0)
    ok = ok && emu::launch(dim3(emu::blocks(p.nk, Dkv::BK), hkv, b), kTileThreads,
                           [&] { exact_dkv_bwd_kernel<T, D, Dkv::BK, Dkv::BQ>(p); });
  return ok;
}

}  // namespace

extern "C" {

// out, lse = exact forward. Returns 0; 1 for an unsupported head dim, 2 when a block's threads deadlock.
int exact_fwd(int bf16, int d, int b, int hq, int hkv, int nq, int nk, int causal, float scale, const void* q,
              const void* k, const void* v, const unsigned char* mask, void* out, float* lse) {
  Params p = params(d, hq, hkv, nq, nk, causal, scale, q, k, v, mask);
  p.o = out;
  p.lse_out = lse;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() { return forward<T, D>(p, b); });
}

// dq, dk, dv = exact backward (delta: (B, Hq, Nq) fp32 scratch). Returns as exact_fwd.
int exact_bwd(int bf16, int d, int b, int hq, int hkv, int nq, int nk, int causal, float scale, const void* q,
              const void* k, const void* v, const unsigned char* mask, const void* out, const void* dout,
              const float* lse, float* delta, void* dq, void* dk, void* dv) {
  Params p = params(d, hq, hkv, nq, nk, causal, scale, q, k, v, mask);
  p.out = out;
  p.dout = dout;
  p.lse = lse;
  p.delta = delta;
  p.o = dq;
  p.dk = dk;
  p.dv = dv;
  return emu::dispatch(bf16, d, [&]<typename T, int D>() { return backward<T, D>(p, b, hkv); });
}

// The emulator itself: 0 when shuffles and votes give every lane the right values (1 otherwise).
int emulation_check_warp_ops() {
  int wrong = 0;
  const bool done = emu::launch(dim3(2, 1, 1), 64, [&] {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int x = 100 * warp + 3 * lane;
    wrong += __shfl_xor_sync(0xffffffffu, x, 5) != 100 * warp + 3 * (lane ^ 5);
    wrong += __shfl_sync(0xffffffffu, x, 7) != 100 * warp + 21;
    wrong += __all_sync(0xffffffffu, lane < 32) != 1 || __all_sync(0xffffffffu, lane != warp) != 0;
  });
  return done && wrong == 0 ? 0 : 1;
}

// 0 when a __syncthreads that one thread never reaches is reported as a deadlock (1 otherwise).
int emulation_check_deadlock() {
  const bool done = emu::launch(dim3(1, 1, 1), 64, [] {
    if (threadIdx.x == 0) return;
    __syncthreads();
  });
  return done ? 1 : 0;
}

// 0 when cp.async copies land as late as the PTX ISA allows: not before the wait that covers their committed group
// (wait_group 1 lands the older of two groups only, wait_group 0 the rest; invalid copies write zeros), and a copy
// never waited for lands when its thread exits. Otherwise the number of checks that failed.
int emulation_check_async_copies() {
  alignas(16) static unsigned char src[3][64 * 16], dst[3][64 * 16];
  std::memset(src, 7, sizeof(src));
  std::memset(dst, 1, sizeof(dst));
  int wrong = 0;
  const auto holds = [](const unsigned char* p, unsigned char value) {
    for (int i = 0; i < 16; ++i)
      if (p[i] != value) return false;
    return true;
  };
  const bool done = emu::launch(dim3(1, 1, 1), 64, [&] {
    const int t = threadIdx.x;
    hfab::mma::cp_async16(dst[0] + 16 * t, src[0] + 16 * t, true);
    hfab::mma::cp_async_commit();
    hfab::mma::cp_async16(dst[1] + 16 * t, src[1] + 16 * t, t % 2 == 0);
    hfab::mma::cp_async_commit();
    hfab::mma::cp_async16(dst[2] + 16 * t, src[2] + 16 * t, true);
    wrong += !holds(dst[0] + 16 * t, 1) || !holds(dst[1] + 16 * t, 1);
    hfab::mma::cp_async_wait_prior<1>();
    wrong += !holds(dst[0] + 16 * t, 7) || !holds(dst[1] + 16 * t, 1);
    hfab::mma::cp_async_wait_all();
    wrong += !holds(dst[1] + 16 * t, t % 2 == 0 ? 7 : 0) || !holds(dst[2] + 16 * t, 1);
  });
  for (int t = 0; t < 64; ++t) wrong += !holds(dst[2] + 16 * t, 7);
  return done ? wrong : -1;
}

// A block of 64 threads in which thread t writes slot t of a shared array and then reads slot 63 - t, with a
// __syncthreads between the two (ordered = 1) or none (a race); returns the sum of what the threads read, or -1 on a
// deadlock. The ordered sum is the same under every HFAB_EMU_SCHEDULE; the racy one depends on the schedule.
long long emulation_schedule_probe(int ordered) {
  long long sum = 0;
  const bool done = emu::launch(dim3(1, 1, 1), 64, [&] {
    __shared__ int slots[64];
    const int t = threadIdx.x;
    if (t == 0)
      for (int& v : slots) v = 0;
    __syncthreads();
    slots[t] = 1000 + t;
    if (ordered) __syncthreads();
    __syncwarp();
    sum += slots[63 - t];
  });
  return done ? sum : -1;
}

// One warp's ldmatrix.x4 (row addresses 16 bytes apart) and one cp.async per lane from a 16-byte aligned buffer plus
// `offset` bytes: emu_faults() then counts the misaligned addresses (0 for offset 0, 32 + 64 for offset 8).
int emulation_alignment_probe(int offset) {
  alignas(16) static unsigned char src[32 * 16 + 16], dst[32 * 16 + 16];
  const bool done = emu::launch(dim3(1, 1, 1), 32, [offset] {
    const int lane = threadIdx.x % 32;
    uint32_t r[4];
    hfab::mma::ldsm_x4(r, src + offset + 16 * lane);
    hfab::mma::cp_async16(dst + offset + 16 * lane, src + offset + 16 * lane, true);
  });
  return done ? 0 : 2;
}

}  // extern "C"
