// CUDA kernels on the CPU, for tests on machines without a GPU. Every CUDA thread of a block is a fiber (ucontext)
// on one OS thread; blocks run one after another. __syncthreads waits for the block's fibers, __syncwarp and every
// warp shuffle / vote for the warp's 32 (a shuffle: all lanes publish their value, wait, read the source lane's,
// wait); a fiber runs until it waits, so the interleaving is deterministic. __shared__ variables are thread_local
// (the block's fibers share the OS thread; one block at a time), so `extern __shared__` (dynamic shared memory) is
// a thread_local array that the harness defines. Inline PTX: common/ptx.cuh here replaces csrc/common/ptx.cuh when
// this folder comes first on the include path. cp.async copies land as late as the PTX ISA allows: at the wait that
// covers their committed group, or when their thread exits, so a read before that wait sees the old bytes. The order
// in which fibers run is chosen per launch (emu::Schedule): a read that no barrier orders after another thread's write
// sees other bytes under another schedule, so a kernel whose results differ between schedules has a race. Not
// modelled: the GPU's memory model beyond barriers and cp.async, timing.
//
// Include this first, then the kernel header; emu::launch(grid, threads, [&] { kernel(params); }) returns false
// when the block's threads deadlock (e.g. a __syncthreads that not all of them reach).
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#undef __shared__
#define __shared__ thread_local
#define __launch_bounds__(...)

using std::max;
using std::min;

inline uint3 threadIdx, blockIdx;
inline dim3 gridDim, blockDim;

namespace emu {

// Operand addresses that the GPU requires aligned and this emulation would not notice (ldmatrix row addresses,
// cp.async source and destination: 16 bytes), counted by common/ptx.cuh; the harness's emu_faults() takes the count
// after each call, and tests/ops/emulation fails the call's test on any.
inline int faults = 0;
inline void require_aligned(const void* p, unsigned bytes) {
  if (reinterpret_cast<uintptr_t>(p) % bytes != 0) ++faults;
}

constexpr size_t kStackBytes = 256 * 1024;

struct Barrier {
  unsigned size = 0, count = 0;
  unsigned long generation = 0;
};

struct AsyncCopy {
  void* dst;
  std::array<unsigned char, 16> bytes;  // the source, read when the copy was issued
};

struct Fiber {
  ucontext_t context;
  bool done = false;
  const Barrier* waiting = nullptr;  // the barrier this fiber waits at, and its generation then
  unsigned long waiting_generation = 0;
  std::vector<AsyncCopy> open_copies;                 // issued since the last commit
  std::vector<std::vector<AsyncCopy>> copy_groups;  // committed, oldest first
};

struct Block {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  Barrier all;
  std::vector<Barrier> warps;
  std::vector<std::array<unsigned char, 64>> slots;  // one value per thread, for shuffles, votes, mma
  unsigned running = 0;
  unsigned long progress = 0;  // arrivals and exits: a scheduler round without any is a deadlock
  const std::function<void()>* body = nullptr;
};

inline Block* current = nullptr;

// HFAB_EMU_SCHEDULE, read at each launch: kLockstep (unset or 0) runs the threads in order, each until it waits, so the
// warps advance together by about one warp operation per round; kWarpByWarp (1) runs each warp until all its threads
// wait at a block barrier or end; kReversed (2) as kWarpByWarp with the blocks, warps and lanes in reverse order.
enum class Schedule { kLockstep, kWarpByWarp, kReversed };
inline Schedule schedule_from_environment() {
  const char* s = std::getenv("HFAB_EMU_SCHEDULE");
  if (s == nullptr || s[0] == '\0' || std::strcmp(s, "0") == 0) return Schedule::kLockstep;
  if (std::strcmp(s, "1") == 0) return Schedule::kWarpByWarp;
  if (std::strcmp(s, "2") == 0) return Schedule::kReversed;
  std::fprintf(stderr, "HFAB_EMU_SCHEDULE=%s: expected 0, 1 or 2\n", s);
  std::abort();
}

inline void yield() { swapcontext(&current->fibers[current->running].context, &current->scheduler); }

inline void wait(Barrier& b) {
  const unsigned long generation = b.generation;
  ++current->progress;
  if (++b.count == b.size) {
    b.count = 0;
    ++b.generation;
    return;
  }
  Fiber& me = current->fibers[current->running];
  me.waiting = &b;  // the scheduler resumes this fiber only once the generation moved on
  me.waiting_generation = generation;
  while (b.generation == generation) yield();
  me.waiting = nullptr;
}

inline Barrier& warp_barrier() { return current->warps[threadIdx.x / 32]; }

// Every lane's `v` (index: lane), from every lane of this thread's warp (each must call it).
template <typename V>
std::array<V, 32> gather(const V& v) {
  static_assert(sizeof(V) <= 64, "a lane's value up to 64 bytes");
  std::memcpy(current->slots[threadIdx.x].data(), &v, sizeof(V));
  wait(warp_barrier());
  std::array<V, 32> all;
  for (unsigned lane = 0; lane < 32; ++lane)
    std::memcpy(&all[lane], current->slots[threadIdx.x / 32 * 32 + lane].data(), sizeof(V));
  wait(warp_barrier());
  return all;
}

// The value `v` of lane `src` of this thread's warp.
template <typename V>
V exchange(const V& v, unsigned src) { return gather(v)[src % 32]; }

inline Fiber& this_fiber() { return current->fibers[current->running]; }

// cp.async of 16 bytes (src nullptr: zeros): read now, written to dst when its group lands.
inline void copy_async(void* dst, const void* src) {
  AsyncCopy c{dst, {}};
  if (src != nullptr) std::memcpy(c.bytes.data(), src, 16);
  this_fiber().open_copies.push_back(c);
}
inline void commit_copies() {
  Fiber& me = this_fiber();
  me.copy_groups.push_back(std::move(me.open_copies));
  me.open_copies.clear();
}
inline void land(const std::vector<AsyncCopy>& group) {
  for (const AsyncCopy& c : group) std::memcpy(c.dst, c.bytes.data(), 16);
}
// cp.async.wait_group n: every committed group but the newest n lands.
inline void land_copies_but_newest(size_t n) {
  auto& groups = this_fiber().copy_groups;
  if (groups.size() <= n) return;
  const auto end = groups.end() - static_cast<std::ptrdiff_t>(n);
  for (auto g = groups.begin(); g != end; ++g) land(*g);
  groups.erase(groups.begin(), end);
}

inline void fiber_main() {
  (*current->body)();
  Fiber& me = this_fiber();  // copies never waited for land when their thread ends
  land_copies_but_newest(0);
  land(me.open_copies);
  me.done = true;
  ++current->progress;
}

// Whether fiber t can run: not done, and not waiting at a barrier whose generation has not moved on.
inline bool runnable(const Block& block, unsigned t) {
  const Fiber& f = block.fibers[t];
  return !f.done && (f.waiting == nullptr || f.waiting->generation != f.waiting_generation);
}

// Runs fiber t until it waits or ends; false once it has ended.
inline bool run_fiber(Block& block, unsigned t) {
  block.running = t;
  threadIdx = make_uint3(t, 0, 0);
  swapcontext(&block.scheduler, &block.fibers[t].context);
  return !block.fibers[t].done;
}

// One scheduler round over a block's threads; returns how many ended in it.
inline unsigned schedule_round(Block& block, unsigned threads, Schedule order) {
  unsigned ended = 0;
  if (order == Schedule::kLockstep) {
    for (unsigned t = 0; t < threads; ++t)
      if (runnable(block, t)) ended += !run_fiber(block, t);
    return ended;
  }
  const bool reversed = order == Schedule::kReversed;
  const unsigned warps = threads / 32;
  for (unsigned i = 0; i < warps; ++i) {
    const unsigned w = reversed ? warps - 1 - i : i;
    for (bool ran = true; ran;) {  // until every thread of the warp waits at a block barrier or has ended
      ran = false;
      for (unsigned j = 0; j < 32; ++j) {
        const unsigned t = 32 * w + (reversed ? 31 - j : j);
        if (!runnable(block, t)) continue;
        ran = true;
        ended += !run_fiber(block, t);
      }
    }
  }
  return ended;
}

// Runs body() once per thread of every block of `grid` (threads: a multiple of 32), in the order HFAB_EMU_SCHEDULE
// names. False on a deadlock.
inline bool launch(dim3 grid, unsigned threads, const std::function<void()>& body) {
  gridDim = grid;
  blockDim = dim3(threads, 1, 1);
  const Schedule order = schedule_from_environment();
  const unsigned long blocks = static_cast<unsigned long>(grid.x) * grid.y * grid.z;
  for (unsigned long i = 0; i < blocks; ++i) {
    const unsigned long id = order == Schedule::kReversed ? blocks - 1 - i : i;
    blockIdx = make_uint3(id % grid.x, id / grid.x % grid.y, id / grid.x / grid.y);
    Block block;
    block.fibers.resize(threads);
    block.all.size = threads;
    block.warps.resize((threads + 31) / 32);
    for (auto& w : block.warps) w.size = 32;
    block.slots.resize(threads);
    block.body = &body;
    current = &block;
    static std::vector<std::unique_ptr<char[]>> stacks;  // reused by every block
    while (stacks.size() < threads) stacks.push_back(std::make_unique_for_overwrite<char[]>(kStackBytes));
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = block.fibers[t];
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = stacks[t].get();
      f.context.uc_stack.ss_size = kStackBytes;
      f.context.uc_link = &block.scheduler;
      makecontext(&f.context, fiber_main, 0);
    }
    for (unsigned alive = threads; alive > 0;) {
      const unsigned long before = block.progress;
      alive -= schedule_round(block, threads, order);
      if (alive > 0 && block.progress == before) {
        current = nullptr;
        return false;
      }
    }
    current = nullptr;
  }
  return true;
}

}  // namespace emu

inline void __syncthreads() { emu::wait(emu::current->all); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::warp_barrier()); }
inline int __syncthreads_or(int pred) {  // every thread's predicate through its slot, between two block barriers
  std::memcpy(emu::current->slots[threadIdx.x].data(), &pred, sizeof(pred));
  emu::wait(emu::current->all);
  int any = 0;
  for (const auto& slot : emu::current->slots) {
    int v;
    std::memcpy(&v, slot.data(), sizeof(v));
    any |= v != 0;
  }
  emu::wait(emu::current->all);
  return any;
}
template <typename V>
V __shfl_sync(unsigned, V v, int src) {
  return emu::exchange(v, static_cast<unsigned>(src));
}
template <typename V>
V __shfl_xor_sync(unsigned, V v, int mask) {
  return emu::exchange(v, (threadIdx.x % 32) ^ mask);
}
inline unsigned __ballot_sync(unsigned, int pred) {  // bit l: lane l's predicate
  const auto all = emu::gather(pred != 0);
  unsigned bits = 0;
  for (unsigned lane = 0; lane < 32; ++lane) bits |= all[lane] ? 1u << lane : 0u;
  return bits;
}
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == 0xffffffffu ? 1 : 0; }
template <typename V> V __ldg(const V* p) { return *p; }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned u; std::memcpy(&u, &x, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float __log2f(float x) { return std::log2(x); }
