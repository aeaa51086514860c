// What every <backend>_emulation.cpp needs beside cuda_on_cpu.h: contiguous strides, grid sizes, and the dispatch
// of a (dtype, head dim) pair to a template.
#pragma once

#include "common/strides.cuh"
#include "cuda_on_cpu.h"

namespace emu {

inline hfab::Strides contiguous(int h, int n, int d) {
  return {static_cast<long long>(h) * n * d, static_cast<long long>(n) * d, d};
}

inline unsigned blocks(long long n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

// fn.template operator()<T, D>() (returning false on a deadlock) for bf16 in {0, 1} and d in {32, 64, 128}.
// Returns 0 done, 1 unsupported d, 2 deadlock: the C interface's codes.
template <typename Fn>
int dispatch(int bf16, int d, Fn&& fn) {
  auto by_dim = [&]<typename T>() {
    if (d == 32) return fn.template operator()<T, 32>() ? 0 : 2;
    if (d == 64) return fn.template operator()<T, 64>() ? 0 : 2;
    if (d == 128) return fn.template operator()<T, 128>() ? 0 : 2;
    return 1;
  };
  return bf16 ? by_dim.template operator()<__nv_bfloat16>() : by_dim.template operator()<__half>();
}

}  // namespace emu

// The misaligned operand addresses counted since the last call (emu::faults), reset: every library has this one
// translation unit, so the definition lives here.
extern "C" int emu_faults() {
  const int n = emu::faults;
  emu::faults = 0;
  return n;
}
