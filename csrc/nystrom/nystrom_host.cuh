// Host side of the Nyström kernels shared by nystrom_fwd.cu and nystrom_bwd.cu: validation at the op
// boundary (clear errors naming the argument, its value and what is supported), the per-sequence state
// (real-token positions, landmarks, K2, Newton–Schulz by one kernel, the key/value buffers of the output
// kernel).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/host.cuh"
#include "nystrom/nystrom_kernels.cuh"
#include "nystrom/nystrom_tc_kernels.cuh"

namespace hfab {
namespace nystrom {

constexpr int64_t kMaxLandmarks = 128;
constexpr int64_t kMaxNewtonIter = 20;
constexpr int64_t kMaxSplits = 1024;

// Validated inputs; keeps the (possibly copied) tensors alive.
struct Inputs {
  at::Tensor q, k, v, mask, conv;  // mask, conv undefined when absent; conv fp32 (Hq, ks) contiguous
  int64_t batch = 0, hq = 0, hkv = 0, groups = 1, n = 0, d = 0, m = 0;
  int iters = 0;
  at::ScalarType conv_dtype = at::kFloat;  // conv_weight's own dtype (of its gradient)
  double kappa = 0.0, root = 1.0;
  Params p{};
};

inline int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline Inputs prepare(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const std::optional<at::Tensor>& conv_weight, const std::optional<at::Tensor>& key_padding_mask,
                      int64_t num_landmarks, int64_t newton_iter, double kappa_star, double scale) {
  const c10::Device device = q.device();
  check_qkv(op, q, k, v, device);
  TORCH_CHECK(q.size(2) == k.size(2), op, ": q ", q.sizes(), " and k ", k.sizes(),
              " must have the same sequence length (self-attention)");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op, " (CUDA kernel): dtype ", dtype,
              " is not supported; supported: float16, bfloat16. Cast q, k, v, or run on the CPU reference");
  const int major = compute_capability_major(device);
  TORCH_CHECK(major >= 8, op, " (CUDA kernel): needs an sm_80 or newer GPU; ", device, " is sm_", major,
              "x. Run the CPU reference instead");
  const int64_t d = q.size(3);
  check_head_dim(op, d);
  TORCH_CHECK(num_landmarks >= 1 && num_landmarks <= kMaxLandmarks, op, " (CUDA kernel): num_landmarks=",
              num_landmarks, " is not supported; supported: 1..", kMaxLandmarks, ". Use the CPU reference for more");
  TORCH_CHECK(newton_iter >= 0 && newton_iter <= kMaxNewtonIter, op, " (CUDA kernel): newton_iter=", newton_iter,
              " is not supported; supported: 0..", kMaxNewtonIter);
  TORCH_CHECK(kappa_star >= 0.0 && std::isfinite(kappa_star), op, ": kappa_star=", kappa_star,
              " is not supported; supported: a finite number >= 0 (0 = plain Newton–Schulz)");
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), op, ": scale=", scale, " must be a finite positive number");
  TORCH_CHECK(q.size(0) <= 65535 && q.size(1) + k.size(1) <= 65535 && q.size(0) * q.size(1) <= 65535, op, ": B=",
              q.size(0), ", Hq=", q.size(1), ", Hkv=", k.size(1),
              " exceed the CUDA grid limits (B <= 65535, Hq + Hkv <= 65535, B * Hq <= 65535)");
  TORCH_CHECK(q.size(2) < (int64_t{1} << 30), op, ": sequence length must be < 2^30, got N=", q.size(2));

  Inputs in;
  in.q = vector_readable(q);
  in.k = vector_readable(k);
  in.v = vector_readable(v);
  in.batch = q.size(0);
  in.hq = q.size(1);
  in.hkv = k.size(1);
  in.groups = in.hq / in.hkv;
  in.n = q.size(2);
  in.d = d;
  in.m = num_landmarks;
  in.iters = static_cast<int>(newton_iter);
  in.kappa = kappa_star;
  in.root = std::sqrt(scale);
  Params& p = in.p;
  if (conv_weight.has_value() && conv_weight->defined()) {
    const at::Tensor& w = *conv_weight;
    check_on_device(op, "conv_weight", w, device);
    TORCH_CHECK(w.dim() == 2 && w.size(0) == in.hq && w.size(1) % 2 == 1, op, ": conv_weight.shape=", w.sizes(),
                " is not supported; supported: (Hq, ks) = (", in.hq, ", ks) with ks odd");
    TORCH_CHECK(w.is_floating_point(), op, ": conv_weight.dtype=", w.scalar_type(), " must be floating point");
    in.conv = w.to(at::kFloat).contiguous();
    in.conv_dtype = w.scalar_type();
    p.conv = in.conv.data_ptr<float>();
    p.ks = static_cast<int>(w.size(1));
  }
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const at::Tensor& m = *key_padding_mask;
    check_key_padding_mask(op, m, k, device);
    in.mask = m.contiguous();
    p.mask = reinterpret_cast<const unsigned char*>(in.mask.data_ptr());
    p.mask_stride = in.n;
  }
  bind_qkv(p, in.q, in.k, in.v);
  p.hq = static_cast<int>(in.hq);
  p.hkv = static_cast<int>(in.hkv);
  p.groups = static_cast<int>(in.groups);
  p.n = static_cast<int>(in.n);
  p.m = static_cast<int>(in.m);
  p.root = static_cast<float>(in.root);
  return in;
}

// fn(Tag<T>{}, std::integral_constant<int, D>{}) for the element type and head dim of `q`.
template <typename Fn>
void dispatch(const at::Tensor& q, Fn&& fn) {
  auto by_dim = [&](auto tag) { dispatch_head_dim(q.size(3), [&](auto dim) { fn(tag, dim); }); };
  if (q.scalar_type() == at::kHalf) by_dim(Tag<__half>{});
  else by_dim(Tag<__nv_bfloat16>{});
}

// (B, Hkv, R, C) -> (B, Hq, R, C): query head h reads kv head h / groups.
inline at::Tensor group(const Inputs& in, const at::Tensor& x) {
  if (in.groups == 1) return x;
  return x.unsqueeze(2).expand({in.batch, in.hkv, in.groups, x.size(2), x.size(3)})
      .reshape({in.batch, in.hq, x.size(2), x.size(3)});
}

// (B, Hq, R, C) -> (B, Hkv, R, C): the sum over each kv head's query heads.
inline at::Tensor ungroup(const Inputs& in, const at::Tensor& x) {
  if (in.groups == 1) return x;
  return x.view({in.batch, in.hkv, in.groups, x.size(2), x.size(3)}).sum(2);
}

// Softmax over the last dim where `valid` (broadcastable bool); rows with no valid entry are 0.
inline at::Tensor masked_softmax(const at::Tensor& s, const at::Tensor& valid) {
  const at::Tensor x = s.masked_fill(valid.logical_not(), -INFINITY);
  const at::Tensor e = x.sub(x.amax(-1, true).clamp_min(-1e30)).exp();
  return e.div(e.sum(-1, true).clamp_min(1e-30));
}

// What the VJP of the Newton–Schulz stage (reference.k2_inverse) needs, from nystrom_inverse_fwd_kernel.
struct NsSaved {
  at::Tensor a, s;              // the inverted matrices (..., m, m); ‖a‖₁‖a‖∞ (..., 1, 1)
  at::Tensor zs_all;            // (B, Hq, iters + 1, m, m) contiguous: Z₀ .. Z_iters
  at::Tensor k2_input;          // kappa_star > 0: K2 (Z = NS(a) K2ᵀ), else undefined
};

// Per-call state of the attention term.
struct State {
  at::Tensor cumsum, n_real, pos;  // int32 (B, N), (B,), (B, N); undefined without a mask
  bool nystrom = false;            // N > m: a sequence may take the landmark path
  at::Tensor exact;                // (B,) bool: n <= m (exact softmax attention)
  at::Tensor q_land, k_land, counts, k_land_g, k2, z, w0;
  NsSaved ns;
  int64_t slots = 0;               // rows of the key/value buffers: min(m, N)
  at::Tensor keys, vals, nvalid;   // (B, Hq, slots, D) fp32 contiguous; (B,) int32
  at::Tensor lse1;                 // (B, Hq, N) fp32: the forward's output rows' row_lse; undefined when recomputed
};

// kernel<<<grid, threads, bytes, stream>>>(arg) with its dynamic shared memory opted in (needed above 48 KB).
template <typename Arg>
void launch_dynamic(void (*kernel)(Arg), dim3 grid, int threads, int bytes, const Arg& arg, cudaStream_t stream) {
  opt_in_shared_memory(reinterpret_cast<const void*>(kernel), bytes);
  kernel<<<grid, threads, bytes, stream>>>(arg);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A kernel over row tiles and its launch shape: threads and dynamic shared memory per block; for the split-N kernels
// the rows per block (landmarks, buffer slots) and the tile along N (`step`: the split plan's tile). The tensor-core
// kernels of W warps (row_tiled: 32 W threads, 16 W rows) or a CUDA-core one (cuda_core: kThreads, a shared-memory
// struct as dynamic shared memory, opted in above 48 KB).
template <typename Arg> struct TileKernel {
  void (*kernel)(Arg);
  int threads, bytes, rows, step;
  bool tensor_cores;

  int64_t resident() const { return resident_blocks(reinterpret_cast<const void*>(kernel), threads, bytes); }
  void launch(dim3 grid, const Arg& arg, cudaStream_t stream) const {
    launch_dynamic(kernel, grid, threads, bytes, arg, stream);
  }
};

template <int W, typename Arg> TileKernel<Arg> row_tiled(void (*kernel)(Arg), int bytes, int step) {
  return {kernel, 32 * W, bytes, 16 * W, step, true};
}

template <typename Smem, typename Arg> TileKernel<Arg> cuda_core(void (*kernel)(Arg), int rows = 0, int step = 0) {
  return {kernel, kThreads, static_cast<int>(sizeof(Smem)), rows, step, false};
}

// launch(TM) with the m x m kernels' tile count for m landmarks: the least TM of 2, 4, 8 with m <= 16 TM.
template <typename Launch>
void by_landmarks(int64_t m, Launch launch) {
  if (m <= 32) launch(std::integral_constant<int, 2>{});
  else if (m <= 64) launch(std::integral_constant<int, 4>{});
  else launch(std::integral_constant<int, 8>{});
}

// The inverse kernel's parameters and the buffers they point to (kept alive until the kernels have run).
struct InverseStage {
  InvParams ip{};
  at::Tensor scratch, zs;
};

// K2 and Z (reference.k2_inverse) by nystrom_inverse_fwd_kernel, one block per (b, q head), enqueued on `side`: it
// needs the landmarks only, so it runs beside K3's kernels. With `save` also the NS iterates, A and ‖A‖₁‖A‖∞ for
// the backward. Every buffer is allocated on the caller's stream, before the side stream's work.
template <int D>
InverseStage inverse_stage(const Inputs& in, State& st, bool save, const SideStream& side) {
  const auto f32 = in.q.options().dtype(at::kFloat);
  const int64_t B = in.batch, H = in.hq, m = in.m, bh = B * H;
  InverseStage stage;
  InvParams& ip = stage.ip;
  st.k2 = at::empty({B, H, m, m}, f32);
  st.z = at::empty({B, H, m, m}, f32);
  ip.q_land = st.q_land.data_ptr<float>();
  ip.k_land = st.k_land.data_ptr<float>();
  ip.k2 = st.k2.data_ptr<float>();
  ip.z = st.z.data_ptr<float>();
  ip.hq = static_cast<int>(H);
  ip.groups = static_cast<int>(in.groups);
  ip.m = static_cast<int>(m);
  ip.iters = in.iters;
  ip.ridge = in.kappa > 0.0;
  ip.kappa = static_cast<float>(in.kappa);
  if (m > 64) {
    stage.scratch = at::empty({bh, 2, 128, 128}, f32);
    ip.scratch = stage.scratch.data_ptr<float>();
  }
  if (save) {
    stage.zs = at::empty({B, H, in.iters + 1, m, m}, f32);
    st.ns.a = at::empty({B, H, m, m}, f32);
    st.ns.s = at::empty({B, H, 1, 1}, f32);
    ip.zs = stage.zs.data_ptr<float>();
    ip.a = st.ns.a.data_ptr<float>();
    ip.s = st.ns.s.data_ptr<float>();
    st.ns.zs_all = stage.zs;
    if (in.kappa > 0.0) st.ns.k2_input = st.k2;
  }
  side.run([&](cudaStream_t side_stream) {
    by_landmarks(m, [&](auto tm) {
      constexpr int TM = decltype(tm)::value;
      launch_dynamic(nystrom_inverse_fwd_kernel<TM, D>, dim3(static_cast<unsigned>(bh)), kThreads,
                     inv_smem_bytes<TM>(), ip, side_stream);
    });
  });
  return stage;
}

// W = Z W0 (B, Hq, m, D) by nystrom_w_fwd_kernel, after the inverse stage's Z.
template <int D>
at::Tensor z_times_w0(const Inputs& in, InverseStage& stage, const at::Tensor& w0_in, cudaStream_t stream) {
  const at::Tensor w0 = w0_in.contiguous();
  at::Tensor w = at::empty({in.batch, in.hq, in.m, in.d}, in.q.options().dtype(at::kFloat));
  InvParams& ip = stage.ip;
  ip.w0 = w0.data_ptr<float>();
  ip.w = w.data_ptr<float>();
  by_landmarks(in.m, [&](auto tm) {
    constexpr int TM = decltype(tm)::value;
    launch_dynamic(nystrom_w_fwd_kernel<TM, D>, dim3(static_cast<unsigned>(in.batch * in.hq)), kThreads,
                   w_smem_bytes<TM, D>(), ip, stream);
  });
  return w;
}

// Real-token positions (with a mask) and, when N > m, the landmarks; fills the kernels' pointers in in.p.
template <typename T, int D>
State landmark_state(Inputs& in, cudaStream_t stream) {
  State st;
  Params& p = in.p;
  const auto i32 = in.q.options().dtype(at::kInt);
  const auto f32 = in.q.options().dtype(at::kFloat);
  if (in.mask.defined()) {
    st.cumsum = in.mask.to(at::kInt).cumsum(1, at::kInt).contiguous();
    st.n_real = st.cumsum.select(1, in.n - 1).contiguous();
    st.pos = at::zeros({in.batch, in.n}, i32);
    const int64_t total = in.batch * in.n;
    nystrom_positions_fwd_kernel<<<static_cast<unsigned>(div_up(total, kThreads)), kThreads, 0, stream>>>(
        p.mask, p.mask_stride, st.cumsum.data_ptr<int>(), st.pos.data_ptr<int>(), total, p.n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    p.n_real = st.n_real.data_ptr<int>();
    p.pos = st.pos.data_ptr<int>();
  }
  st.nystrom = in.n > in.m;
  st.slots = std::min(in.m, in.n);
  if (!st.nystrom) return st;
  st.q_land = at::empty({in.batch, in.hq, in.m, in.d}, f32);
  st.k_land = at::empty({in.batch, in.hkv, in.m, in.d}, f32);
  st.counts = at::empty({in.batch, in.m}, f32);
  p.q_land = st.q_land.data_ptr<float>();
  p.k_land = st.k_land.data_ptr<float>();
  p.counts = st.counts.data_ptr<float>();
  const dim3 grid(static_cast<unsigned>(in.m), static_cast<unsigned>(in.hq + in.hkv),
                  static_cast<unsigned>(in.batch));
  // long segments (N 2M, m 32: 256 blocks of 65,536 rows) in blocks of 1,024 threads: with 256 the SMs held two
  // blocks each, too few loads in flight to stream from HBM (H200: 2.3 TB/s, with 1,024 4.5); short ones in 256 (the
  // block's final sum over its row slots grows with the threads)
  if (in.n / in.m >= 4096) nystrom_landmark_fwd_kernel<T, D, 1024><<<grid, 1024, 0, stream>>>(p);
  else nystrom_landmark_fwd_kernel<T, D, kThreads><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return st;
}

// (splits, chunk) of a split-N kernel over n rows in tiles of `tile`, `other` blocks sharing each split, `resident`
// blocks held by the GPU at once (resident_blocks): the fewest splits with the least waves per split,
// ceil(splits · other / resident) / splits, among at most about two waves of blocks (a partial last wave costs a
// whole one: 5 splits x 64 heads on 264 resident blocks run 2 waves of N / 5, 4 splits one wave of N / 4); chunk is
// a multiple of tile, every split non-empty.
inline std::pair<int64_t, int64_t> split_plan(int64_t n, int64_t tile, int64_t other, int64_t resident) {
  const int64_t tiles = div_up(n, tile);
  const int64_t most = std::min({std::max<int64_t>(2 * resident / other, 1), tiles, kMaxSplits});
  const auto waves = [&](int64_t splits) { return div_up(splits * other, resident); };
  int64_t best = 1;
  for (int64_t splits = 2; splits <= most; ++splits) {
    if (waves(splits) * best < waves(best) * splits) best = splits;
  }
  const int64_t chunk = div_up(tiles, best) * tile;
  return {div_up(n, chunk), chunk};
}

// The tensor-core kernels (nystrom_tc_kernels.cuh: K3 and the output; nystrom_tc_bwd_kernels.cuh: the backward's
// row statistics and buffer gradients) where the GPU has their shared memory; HFAB_NYSTROM_TC=0 selects the
// CUDA-core kernels everywhere, for comparison and testing.
inline bool tensor_cores_enabled() {
  static const bool enabled = !env_is("HFAB_NYSTROM_TC", "0");  // read once per process
  return enabled;
}

// The m x m stages beside the N-sized kernels on a side stream (SideStream); HFAB_NYSTROM_SIDE_STREAM=0 runs them on
// the caller's stream in turn, for profiles of each kernel alone and for testing.
inline bool side_stream_enabled() {
  static const bool enabled = !env_is("HFAB_NYSTROM_SIDE_STREAM", "0");  // read once per process
  return enabled;
}

// Whether a tensor-core kernel needing `bytes` of dynamic shared memory runs (else its CUDA-core twin).
inline bool on_tensor_cores(int bytes, const c10::Device& device) {
  return tensor_cores_enabled() && bytes <= shared_memory_limit(device);
}

// The row-tiled tensor-core kernel for `rows` rows per head, instance.template operator()<W>() at W = row_warps(rows),
// where the GPU has its shared memory; else `fallback`, its CUDA-core twin.
template <typename Arg, typename Instance>
TileKernel<Arg> row_tiled_or(int64_t rows, const Instance& instance, const TileKernel<Arg>& fallback,
                             const c10::Device& device) {
  const TileKernel<Arg> k =
      tc::row_warps(rows) == 2 ? instance.template operator()<2>() : instance.template operator()<4>();
  return on_tensor_cores(k.bytes, device) ? k : fallback;
}

// Whether the attention over the key/value buffer (the forward's output, the backward's row statistics) runs on
// tensor cores: sm_90 always; sm_80 (163 KB per block) lacks the shared memory at D = 128 with more than 112 slots.
template <int D>
bool buffer_attention_on_tensor_cores(const Inputs& in, const c10::Device& device) {
  return on_tensor_cores(tc::OutSmem<D>::bytes(in.p.slots), device);
}

// Launch a tensor-core kernel over query tiles (tc::attend_tiles, the dq kernel): blocks stage their head's buffer
// once and take every gridDim.x-th query tile, about 4 blocks per SM in all, as few blocks per head as keep each
// block's tile count (32 tiles: 8 blocks of 4, not 9 blocks of 3 or 4). `two` (`two_bytes` of dynamic shared memory)
// copies a block's next tile during this one; it runs where it fits and the GPU holds as many of its blocks as of
// `one`'s (`one_bytes`), which loads each tile after the last.
template <typename Arg>
void launch_query_tiles(void (*one)(Arg), int one_bytes, void (*two)(Arg), int two_bytes, const Arg& arg,
                        const Inputs& in, const c10::Device& device, cudaStream_t stream) {
  const int64_t tiles = div_up(in.n, tc::kBQ);
  const int64_t wanted = std::min(tiles, std::max<int64_t>(1, div_up(4 * multiprocessor_count(device),
                                                                     in.batch * in.hq)));
  const int64_t per_head = div_up(tiles, div_up(tiles, wanted));
  const dim3 grid(static_cast<unsigned>(per_head), static_cast<unsigned>(in.hq), static_cast<unsigned>(in.batch));
  const bool staged = per_head < tiles && two_bytes <= shared_memory_limit(device) &&
                      resident_blocks(reinterpret_cast<const void*>(two), tc::kThreads, two_bytes) >=
                          resident_blocks(reinterpret_cast<const void*>(one), tc::kThreads, one_bytes);
  if (staged) launch_dynamic(two, grid, tc::kThreads, two_bytes, arg, stream);
  else launch_dynamic(one, grid, tc::kThreads, one_bytes, arg, stream);
}

// W0 = K3 v (B, Hq, m, D): split-N partials from nystrom_k3_tc_fwd_kernel (or nystrom_k3_fwd_kernel), merged in a
// fixed order by nystrom_k3_merge_fwd_kernel. With `lse`, also the base-2 log-sum-exp of each landmark's scores over
// the real keys (B, Hq, m): K3 = exp2(s - lse).
template <typename T, int D>
at::Tensor k3_values(Inputs& in, cudaStream_t stream, at::Tensor* lse = nullptr) {
  Params& p = in.p;
  const TileKernel<Params> k3 = row_tiled_or(
      in.m,
      []<int W>() { return row_tiled<W>(tc::nystrom_k3_tc_fwd_kernel<T, D, W>, tc::K3Smem<D>::bytes, tc::kK3Keys); },
      TileKernel<Params>{nystrom_k3_fwd_kernel<T, D>, kThreads, 0, K3Tiles<D>::BL, K3Tiles<D>::BK, false},
      in.q.device());
  const int64_t bh = in.batch * in.hq, ltiles = div_up(in.m, k3.rows);
  const auto [splits, chunk] = split_plan(in.n, k3.step, ltiles * bh, k3.resident());
  const auto f32 = in.q.options().dtype(at::kFloat);
  at::Tensor part_max = at::empty({splits, bh, in.m}, f32);
  at::Tensor part_sum = at::empty({splits, bh, in.m}, f32);
  at::Tensor part_acc = at::empty({splits, bh, in.m, in.d}, f32);
  p.splits = static_cast<int>(splits);
  p.chunk = static_cast<int>(chunk);
  p.part_max = part_max.data_ptr<float>();
  p.part_sum = part_sum.data_ptr<float>();
  p.part_acc = part_acc.data_ptr<float>();
  k3.launch(dim3(static_cast<unsigned>(splits), static_cast<unsigned>(ltiles), static_cast<unsigned>(bh)), p, stream);
  at::Tensor w0 = at::empty({in.batch, in.hq, in.m, in.d}, f32);
  if (lse != nullptr) *lse = at::empty({in.batch, in.hq, in.m}, f32);
  const int64_t rows = bh * in.m;
  nystrom_k3_merge_fwd_kernel<<<static_cast<unsigned>(div_up(rows * in.d / 4, kThreads)), kThreads, 0, stream>>>(
      p.part_max, p.part_sum, p.part_acc, static_cast<int>(splits), rows, static_cast<int>(in.d),
      w0.data_ptr<float>(), lse != nullptr ? lse->data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return w0;
}

// The output kernel's key/value buffers in in.p.
inline void bind_buffers(Inputs& in, const State& st) {
  in.p.keys = st.keys.data_ptr<float>();
  in.p.vals = st.vals.data_ptr<float>();
  in.p.nvalid = st.nvalid.data_ptr<int>();
  in.p.slots = static_cast<int>(st.slots);
}

// K2, Z, W = Z W0 and the output kernel's key/value buffers (landmarks where n > m, real tokens where n <= m);
// `w0_of()` enqueues K3's kernels on `stream` and returns W0 = K3 v (called where n > m only, while the inverse
// kernel runs on a side stream); `save`: keep what the backward needs (st.k2, st.z, st.ns).
template <int D, typename W0Of>
void finish_state(Inputs& in, State& st, W0Of w0_of, bool save, cudaStream_t stream) {
  const auto i32 = in.q.options().dtype(at::kInt);
  const auto i64 = in.q.options().dtype(at::kLong);
  const bool need_exact = !st.nystrom || in.mask.defined();
  at::Tensor kg, vg, nvalid_exact;
  if (need_exact) {  // the first `slots` real tokens of each sequence
    const at::Tensor gpos = in.mask.defined() ? st.pos.slice(1, 0, st.slots).to(at::kLong)
                                              : at::arange(st.slots, i64).unsqueeze(0).expand({in.batch, st.slots});
    const at::Tensor idx = gpos.view({in.batch, 1, st.slots, 1}).expand({in.batch, in.hkv, st.slots, in.d});
    kg = group(in, in.k.gather(2, idx).to(at::kFloat).mul(in.root));
    vg = group(in, in.v.gather(2, idx).to(at::kFloat));
    nvalid_exact = in.mask.defined() ? st.n_real.clamp_max(st.slots).to(at::kInt)
                                     : at::full({in.batch}, st.slots, i32);
  }
  if (!st.nystrom) {
    st.exact = at::full({in.batch}, true, in.q.options().dtype(at::kBool));
    st.keys = kg.contiguous();
    st.vals = vg.contiguous();
    st.nvalid = nvalid_exact.contiguous();
  } else {
    st.k_land_g = group(in, st.k_land);
    const SideStream side(c10::cuda::getCurrentCUDAStream(in.q.device().index()), side_stream_enabled());
    InverseStage inverse = inverse_stage<D>(in, st, save, side);
    st.w0 = w0_of();
    side.join();
    const at::Tensor w = z_times_w0<D>(in, inverse, st.w0, stream);
    if (in.mask.defined()) {
      st.exact = st.n_real.le(in.m);
      const at::Tensor ex = st.exact.view({in.batch, 1, 1, 1});
      st.keys = at::where(ex, kg, st.k_land_g).contiguous();
      st.vals = at::where(ex, vg, w).contiguous();
      st.nvalid = at::where(st.exact, nvalid_exact, at::full({in.batch}, in.m, i32)).to(at::kInt).contiguous();
    } else {
      st.exact = at::full({in.batch}, false, in.q.options().dtype(at::kBool));
      st.keys = st.k_land_g.contiguous();
      st.vals = w.contiguous();
      st.nvalid = at::full({in.batch}, in.m, i32);
    }
  }
  bind_buffers(in, st);
}

// The forward's state, the second output of hfab::nystrom_fwd, so that its backward recomputes nothing: kStateSize
// tensors in this order, an absent one as an empty tensor (no mask: the three mask entries; N <= m: every landmark
// entry; N > m without a mask: keys, which are the landmarks), none at all when q is empty. The fake impl
// (`_state_like` in ops/nystrom/op.py) mirrors these shapes and dtypes.
enum StateSlot : int {
  kExact, kNvalid, kKeys, kVals, kCumsum, kNReal, kPos,                 // every sequence
  kQLand, kKLand, kCounts, kW0, kK2, kZ, kNsA, kNsS, kNsZs, kLse3,      // landmark sequences (N > m)
  kLse1,                                                                // every sequence: (B, Hq, N) row_lse
  kStateSize
};

inline std::vector<at::Tensor> pack_state(const Inputs& in, const State& st, const at::Tensor& lse3) {
  const auto none = [&](at::ScalarType dtype) { return at::empty({0}, in.q.options().dtype(dtype)); };
  const auto f32 = [&](const at::Tensor& t) { return st.nystrom ? t : none(at::kFloat); };
  const auto i32 = [&](const at::Tensor& t) { return in.mask.defined() ? t : none(at::kInt); };
  return {st.exact, st.nvalid, st.nystrom && !in.mask.defined() ? none(at::kFloat) : st.keys, st.vals,
          i32(st.cumsum), i32(st.n_real), i32(st.pos),
          f32(st.q_land), f32(st.k_land), f32(st.counts), f32(st.w0), f32(st.k2), f32(st.z), f32(st.ns.a),
          f32(st.ns.s), f32(st.ns.zs_all), f32(lse3), st.lse1};
}

// `st`, `lse3` and the kernels' pointers in in.p from pack_state's tensors (the backward's alternative to
// recomputing them).
inline void unpack_state(const char* op, Inputs& in, State& st, at::Tensor& lse3, at::TensorList saved) {
  TORCH_CHECK(saved.size() == kStateSize, op, ": state holds ", saved.size(), " tensors; expected ", kStateSize,
              " (the second output of hfab::nystrom_fwd on the same inputs) or none (the backward recomputes it)");
  st.nystrom = in.n > in.m;
  st.slots = std::min(in.m, in.n);
  const at::Tensor& vals = saved[kVals];
  TORCH_CHECK(vals.dim() == 4 && vals.size(0) == in.batch && vals.size(1) == in.hq && vals.size(2) == st.slots &&
                  vals.size(3) == in.d && vals.scalar_type() == at::kFloat && vals.is_contiguous() &&
                  vals.device() == in.q.device(),
              op, ": state does not belong to these inputs (value buffer ", vals.sizes(), ", expected [", in.batch,
              ", ", in.hq, ", ", st.slots, ", ", in.d, "] fp32 on ", in.q.device(), ")");
  st.exact = saved[kExact];
  st.nvalid = saved[kNvalid];
  st.vals = vals;
  st.lse1 = saved[kLse1];
  TORCH_CHECK(st.lse1.sizes() == at::IntArrayRef({in.batch, in.hq, in.n}) && st.lse1.scalar_type() == at::kFloat &&
                  st.lse1.is_contiguous(),
              op, ": state does not belong to these inputs (row log-sum-exp ", st.lse1.sizes(), ", expected [",
              in.batch, ", ", in.hq, ", ", in.n, "] fp32)");
  if (in.mask.defined()) {
    st.cumsum = saved[kCumsum];
    st.n_real = saved[kNReal];
    st.pos = saved[kPos];
    in.p.n_real = st.n_real.data_ptr<int>();
    in.p.pos = st.pos.data_ptr<int>();
  }
  if (st.nystrom) {
    st.q_land = saved[kQLand];
    st.k_land = saved[kKLand];
    st.counts = saved[kCounts];
    st.w0 = saved[kW0];
    st.k2 = saved[kK2];
    st.z = saved[kZ];
    st.ns.a = saved[kNsA];
    st.ns.s = saved[kNsS];
    st.ns.zs_all = saved[kNsZs];
    if (in.kappa > 0.0) st.ns.k2_input = st.k2;
    st.k_land_g = group(in, st.k_land);
    lse3 = saved[kLse3];
    in.p.q_land = st.q_land.data_ptr<float>();
    in.p.k_land = st.k_land.data_ptr<float>();
    in.p.counts = st.counts.data_ptr<float>();
  }
  st.keys = st.nystrom && !in.mask.defined() ? st.k_land_g.contiguous() : saved[kKeys];
  bind_buffers(in, st);
}

}  // namespace nystrom
}  // namespace hfab
