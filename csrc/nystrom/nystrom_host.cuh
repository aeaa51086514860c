// Host side of the Nyström kernels shared by nystrom_fwd.cu and nystrom_bwd.cu: validation at the op
// boundary (clear errors naming the argument, its value and what is supported), the per-sequence state
// (real-token positions, landmarks, K2, Newton–Schulz by one kernel, the key/value buffers of the output
// kernel).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/le.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <array>
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

// The forward's state, hfab::nystrom_fwd's second output (what its backward would otherwise recompute): two tensors,
// fp32 and int32, each a row of regions 16 bytes apart, a region empty where absent (no mask: the int32 mask regions;
// N <= m: the landmark regions; N > m without a mask: keys, which are the landmarks). Two tensors instead of one per
// region: each tensor costs host time in the autograd graph and the Python binding. The fake impl (`_state_like` in
// ops/nystrom/op.py) mirrors the two lengths.
class StateLayout {
 public:
  enum F32 : int { kKeys, kVals, kLse1, kQLand, kKLand, kCounts, kW0, kK2, kZ, kNsA, kNsS, kNsZs, kLse3, kF32Regions };
  enum I32 : int { kExact, kNvalid, kCumsum, kNReal, kPos, kI32Regions };
  using Shape = std::vector<int64_t>;

  explicit StateLayout(const Inputs& in) : f32_(f32_shapes(in), at::kFloat), i32_(i32_shapes(in), at::kInt) {
    i32_.dtypes[kExact] = at::kBool;  // B bytes
    f32_.place();
    i32_.place();
  }

  // the two tensors, uninitialised but for the bytes between regions (zero, so that equal states compare equal)
  std::vector<at::Tensor> allocate(const at::TensorOptions& options, cudaStream_t stream) const {
    std::vector<at::Tensor> blobs{at::empty({f32_.length()}, options.dtype(at::kFloat)),
                                  at::empty({i32_.length()}, options.dtype(at::kInt))};
    f32_.zero_gaps(blobs[0], stream);
    i32_.zero_gaps(blobs[1], stream);
    return blobs;
  }
  // whether `state` has this layout's lengths and dtypes, contiguous on `device`
  bool matches(at::TensorList state, const c10::Device& device) const {
    const auto fits = [&](const at::Tensor& t, at::ScalarType dtype, int64_t length) {
      return t.dim() == 1 && t.numel() == length && t.scalar_type() == dtype && t.is_contiguous() &&
             t.device() == device;
    };
    return state.size() == 2 && fits(state[0], at::kFloat, f32_.length()) && fits(state[1], at::kInt, i32_.length());
  }
  int64_t f32_length() const { return f32_.length(); }
  int64_t i32_length() const { return i32_.length(); }

  // region r of the fp32 (int32) tensor as a tensor of its shape sharing the memory; undefined where absent
  at::Tensor f32(const at::Tensor& blob, F32 r) const { return f32_.view(blob, r); }
  at::Tensor i32(const at::Tensor& blob, I32 r) const { return i32_.view(blob, r); }

 private:
  // regions of 4-byte words, each starting on a 16-byte boundary; a region's elements may be narrower (bool)
  template <int R> struct Regions {
    std::array<Shape, R> shapes;
    std::array<at::ScalarType, R> dtypes;
    std::array<int64_t, R + 1> at{};  // in words

    Regions(std::array<Shape, R> s, at::ScalarType dtype) : shapes(std::move(s)) { dtypes.fill(dtype); }
    void place() {
      for (int r = 0; r < R; ++r) {
        at[r + 1] = at[r] + div_up(div_up(bytes(r), 4), 4) * 4;
      }
    }
    int64_t bytes(int r) const { return c10::multiply_integers(shapes[r]) * c10::elementSize(dtypes[r]); }
    int64_t length() const { return at[R]; }
    void zero_gaps(const at::Tensor& blob, cudaStream_t stream) const {
      char* base = static_cast<char*>(blob.data_ptr());
      for (int r = 0; r < R; ++r) {
        const int64_t end = at[r] * 4 + bytes(r), gap = at[r + 1] * 4 - end;
        if (gap > 0) C10_CUDA_CHECK(cudaMemsetAsync(base + end, 0, gap, stream));
      }
    }
    // a view of `blob` (which outlives it: the state tensor, or the caller's saved copy); the device given, so that
    // no pointer query runs
    at::Tensor view(const at::Tensor& blob, int r) const {
      if (bytes(r) == 0) return at::Tensor();
      char* base = static_cast<char*>(blob.data_ptr()) + at[r] * 4;
      return at::for_blob(base, shapes[r]).options(blob.options().dtype(dtypes[r])).target_device(blob.device())
          .make_tensor();
    }
  };

  static Shape when(bool present, Shape shape) { return present ? shape : Shape{0}; }
  static std::array<Shape, kF32Regions> f32_shapes(const Inputs& in) {
    const int64_t B = in.batch, H = in.hq, N = in.n, D = in.d, m = in.m, S = std::min(m, N);
    const bool land = N > m;
    return {when(in.mask.defined() || !land, {B, H, S, D}), {B, H, S, D}, {B, H, N},
            when(land, {B, H, m, D}), when(land, {B, in.hkv, m, D}), when(land, {B, m}), when(land, {B, H, m, D}),
            when(land, {B, H, m, m}), when(land, {B, H, m, m}), when(land, {B, H, m, m}), when(land, {B, H, 1, 1}),
            when(land, {B, H, in.iters + 1, m, m}), when(land, {B, H, m})};
  }
  static std::array<Shape, kI32Regions> i32_shapes(const Inputs& in) {
    const int64_t B = in.batch, N = in.n;
    const bool masked = in.mask.defined();
    return {Shape{B}, Shape{B}, when(masked, {B, N}), when(masked, {B}), when(masked, {B, N})};
  }

  Regions<kF32Regions> f32_;
  Regions<kI32Regions> i32_;
};

// Per-call state of the attention term: views of the two state tensors (StateLayout), filled by the forward's kernels
// (landmark_state, finish_state, the output kernel's lse1) or read back by the backward (unpack_state).
struct State {
  std::vector<at::Tensor> tensors;  // StateLayout's two
  at::Tensor cumsum, n_real, pos;  // int32 (B, N), (B,), (B, N); undefined without a mask
  bool nystrom = false;            // N > m: a sequence may take the landmark path
  at::Tensor exact;                // (B,) bool: n <= m (exact softmax attention)
  at::Tensor q_land, k_land, counts, k_land_g, k2, z, w0, lse3;  // lse3: K3's base-2 log-sum-exp (B, Hq, m)
  NsSaved ns;
  int64_t slots = 0;               // rows of the key/value buffers: min(m, N)
  at::Tensor keys, vals, nvalid;   // (B, Hq, slots, D) fp32 contiguous; (B,) int32
  at::Tensor lse1;                 // (B, Hq, N) fp32: the output rows' row_lse
  bool lse1_saved = false;         // lse1 holds the forward's (else a backward that recomputed the state fills it)
};

// `st`'s views of its two tensors.
inline void bind_views(const Inputs& in, State& st) {
  const StateLayout layout(in);
  using L = StateLayout;
  const at::Tensor &f = st.tensors[0], &i = st.tensors[1];
  st.nystrom = in.n > in.m;
  st.slots = std::min(in.m, in.n);
  st.exact = layout.i32(i, L::kExact);
  st.nvalid = layout.i32(i, L::kNvalid);
  st.cumsum = layout.i32(i, L::kCumsum);
  st.n_real = layout.i32(i, L::kNReal);
  st.pos = layout.i32(i, L::kPos);
  st.keys = layout.f32(f, L::kKeys);
  st.vals = layout.f32(f, L::kVals);
  st.lse1 = layout.f32(f, L::kLse1);
  st.q_land = layout.f32(f, L::kQLand);
  st.k_land = layout.f32(f, L::kKLand);
  st.counts = layout.f32(f, L::kCounts);
  st.w0 = layout.f32(f, L::kW0);
  st.k2 = layout.f32(f, L::kK2);
  st.z = layout.f32(f, L::kZ);
  st.ns.a = layout.f32(f, L::kNsA);
  st.ns.s = layout.f32(f, L::kNsS);
  st.ns.zs_all = layout.f32(f, L::kNsZs);
  st.ns.k2_input = in.kappa > 0.0 ? st.k2 : at::Tensor();
  st.lse3 = layout.f32(f, L::kLse3);
}

// The landmark keys per q head (st.k_land_g) once st.k_land holds them; without a mask they are the keys (absent
// from the state).
inline void group_landmark_keys(const Inputs& in, State& st) {
  st.k_land_g = group(in, st.k_land);
  if (!in.mask.defined()) st.keys = st.k_land_g.contiguous();
}

// A fresh state for `in` (uninitialised: the forward's kernels fill it).
inline State new_state(const Inputs& in) {
  State st;
  st.tensors = StateLayout(in).allocate(in.q.options(), c10::cuda::getCurrentCUDAStream(in.q.device().index()));
  bind_views(in, st);
  return st;
}

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

// The inverse kernel's parameters and its scratch (kept alive until the kernels have run).
struct InverseStage {
  InvParams ip{};
  at::Tensor scratch;
};

// K2, Z, the Newton–Schulz iterates, A and ‖A‖₁‖A‖∞ (reference.k2_inverse; into st's views) by
// nystrom_inverse_fwd_kernel, one block per (b, q head), enqueued on `side`: it needs the landmarks only, so it runs
// beside K3's kernels. Every buffer is allocated on the caller's stream, before the side stream's work.
template <int D>
InverseStage inverse_stage(const Inputs& in, State& st, const SideStream& side) {
  const int64_t m = in.m, bh = in.batch * in.hq;
  InverseStage stage;
  InvParams& ip = stage.ip;
  ip.q_land = st.q_land.data_ptr<float>();
  ip.k_land = st.k_land.data_ptr<float>();
  ip.k2 = st.k2.data_ptr<float>();
  ip.z = st.z.data_ptr<float>();
  ip.zs = st.ns.zs_all.data_ptr<float>();
  ip.a = st.ns.a.data_ptr<float>();
  ip.s = st.ns.s.data_ptr<float>();
  ip.hq = static_cast<int>(in.hq);
  ip.groups = static_cast<int>(in.groups);
  ip.m = static_cast<int>(m);
  ip.iters = in.iters;
  ip.ridge = in.kappa > 0.0;
  ip.kappa = static_cast<float>(in.kappa);
  if (m > 64) {
    stage.scratch = at::empty({bh, 2, 128, 128}, in.q.options().dtype(at::kFloat));
    ip.scratch = stage.scratch.data_ptr<float>();
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

// W = Z W0 (B, Hq, m, D) into `w` by nystrom_w_fwd_kernel, after the inverse stage's Z.
template <int D>
void z_times_w0(const Inputs& in, InverseStage& stage, const at::Tensor& w0, const at::Tensor& w, cudaStream_t stream) {
  InvParams& ip = stage.ip;
  ip.w0 = w0.data_ptr<float>();
  ip.w = w.data_ptr<float>();
  by_landmarks(in.m, [&](auto tm) {
    constexpr int TM = decltype(tm)::value;
    launch_dynamic(nystrom_w_fwd_kernel<TM, D>, dim3(static_cast<unsigned>(in.batch * in.hq)), kThreads,
                   w_smem_bytes<TM, D>(), ip, stream);
  });
}

// Real-token positions (with a mask) and, when N > m, the landmarks, into a new state; fills the kernels' pointers
// in in.p.
template <typename T, int D>
State landmark_state(Inputs& in, cudaStream_t stream) {
  State st = new_state(in);
  Params& p = in.p;
  if (in.mask.defined()) {
    at::cumsum_out(st.cumsum, in.mask, 1, at::kInt);
    st.n_real.copy_(st.cumsum.select(1, in.n - 1));
    const int64_t total = in.batch * in.n;
    nystrom_positions_fwd_kernel<<<static_cast<unsigned>(div_up(total, kThreads)), kThreads, 0, stream>>>(
        p.mask, p.mask_stride, st.cumsum.data_ptr<int>(), st.pos.zero_().data_ptr<int>(), total, p.n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    p.n_real = st.n_real.data_ptr<int>();
    p.pos = st.pos.data_ptr<int>();
  }
  if (!st.nystrom) return st;
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

// W0 = K3 v (B, Hq, m, D) into st.w0: split-N partials from nystrom_k3_tc_fwd_kernel (or nystrom_k3_fwd_kernel),
// merged in a fixed order by nystrom_k3_merge_fwd_kernel, which also writes st.lse3, the base-2 log-sum-exp of each
// landmark's scores over the real keys (B, Hq, m): K3 = exp2(s - lse3).
template <typename T, int D>
void k3_values(Inputs& in, State& st, cudaStream_t stream) {
  Params& p = in.p;
  const TileKernel<Params> k3 = row_tiled_or(
      in.m,
      []<int W>() { return row_tiled<W>(tc::nystrom_k3_tc_fwd_kernel<T, D, W>, tc::K3Smem<D>::bytes, tc::kK3Keys); },
      TileKernel<Params>{nystrom_k3_fwd_kernel<T, D>, kThreads, 0, K3Tiles<D>::BL, K3Tiles<D>::BK, false},
      in.q.device());
  const int64_t bh = in.batch * in.hq, ltiles = div_up(in.m, k3.rows);
  const auto [splits, chunk] = split_plan(in.n, k3.step, ltiles * bh, k3.resident());
  const auto f32 = in.q.options().dtype(at::kFloat);
  const int64_t rows = bh * in.m;
  const at::Tensor parts = at::empty({splits * rows * (in.d + 2)}, f32);  // acc (splits, rows, D), max, sum (splits, rows)
  p.splits = static_cast<int>(splits);
  p.chunk = static_cast<int>(chunk);
  p.part_acc = parts.data_ptr<float>();
  p.part_max = p.part_acc + splits * rows * in.d;
  p.part_sum = p.part_max + splits * rows;
  k3.launch(dim3(static_cast<unsigned>(splits), static_cast<unsigned>(ltiles), static_cast<unsigned>(bh)), p, stream);
  nystrom_k3_merge_fwd_kernel<<<static_cast<unsigned>(div_up(rows * in.d / 4, kThreads)), kThreads, 0, stream>>>(
      p.part_max, p.part_sum, p.part_acc, static_cast<int>(splits), rows, static_cast<int>(in.d),
      st.w0.data_ptr<float>(), st.lse3.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The output kernel's key/value buffers in in.p.
inline void bind_buffers(Inputs& in, const State& st) {
  in.p.keys = st.keys.data_ptr<float>();
  in.p.vals = st.vals.data_ptr<float>();
  in.p.nvalid = st.nvalid.data_ptr<int>();
  in.p.slots = static_cast<int>(st.slots);
}

// K2, Z, W = Z W0 and the output kernel's key/value buffers (landmarks where n > m, real tokens where n <= m) into
// st's views: K3's kernels on `stream` while the inverse kernel runs on a side stream.
template <typename T, int D>
void finish_state(Inputs& in, State& st, cudaStream_t stream) {
  const auto i64 = in.q.options().dtype(at::kLong);
  const int64_t B = in.batch;
  const bool need_exact = !st.nystrom || in.mask.defined();
  at::Tensor kg, vg, nvalid_exact;
  if (need_exact) {  // the first `slots` real tokens of each sequence
    const at::Tensor gpos = in.mask.defined() ? st.pos.slice(1, 0, st.slots).to(at::kLong)
                                              : at::arange(st.slots, i64).unsqueeze(0).expand({B, st.slots});
    const at::Tensor idx = gpos.view({B, 1, st.slots, 1}).expand({B, in.hkv, st.slots, in.d});
    kg = group(in, in.k.gather(2, idx).to(at::kFloat).mul(in.root));
    vg = group(in, in.v.gather(2, idx).to(at::kFloat));
    nvalid_exact = in.mask.defined() ? st.n_real.clamp_max(st.slots) : at::full({B}, st.slots, st.nvalid.options());
  }
  if (!st.nystrom) {
    st.exact.fill_(true);
    st.keys.copy_(kg);
    st.vals.copy_(vg);
    st.nvalid.copy_(nvalid_exact);
  } else {
    group_landmark_keys(in, st);
    const SideStream side(c10::cuda::getCurrentCUDAStream(in.q.device().index()), side_stream_enabled());
    InverseStage inverse = inverse_stage<D>(in, st, side);
    k3_values<T, D>(in, st, stream);
    side.join();
    if (in.mask.defined()) {
      const at::Tensor w = at::empty_like(st.vals);
      z_times_w0<D>(in, inverse, st.w0, w, stream);
      at::le_out(st.exact, st.n_real, in.m);
      const at::Tensor ex = st.exact.view({B, 1, 1, 1});
      at::where_out(st.keys, ex, kg, st.k_land_g);
      at::where_out(st.vals, ex, vg, w);
      st.nvalid.copy_(at::where(st.exact, nvalid_exact, in.m));
    } else {
      z_times_w0<D>(in, inverse, st.w0, st.vals, stream);
      C10_CUDA_CHECK(cudaMemsetAsync(st.exact.data_ptr(), 0, B, stream));
      st.nvalid.fill_(in.m);
    }
  }
  bind_buffers(in, st);
}

// The forward's state from hfab::nystrom_bwd's `state` argument (StateLayout's two tensors), its views in `st` and
// the kernels' pointers in in.p.
inline void unpack_state(const char* op, Inputs& in, State& st, at::TensorList saved) {
  const StateLayout layout(in);
  TORCH_CHECK(layout.matches(saved, in.q.device()), op, ": state does not belong to these inputs: expected the two "
              "tensors of hfab::nystrom_fwd's second output on the same inputs (fp32 [", layout.f32_length(),
              "], int32 [", layout.i32_length(), "] on ", in.q.device(), "), or none (the backward recomputes it); got ",
              saved.size(), " tensors");
  st.tensors = saved.vec();
  bind_views(in, st);
  st.lse1_saved = true;
  if (in.mask.defined()) {
    in.p.n_real = st.n_real.data_ptr<int>();
    in.p.pos = st.pos.data_ptr<int>();
  }
  if (st.nystrom) {
    group_landmark_keys(in, st);
    in.p.q_land = st.q_land.data_ptr<float>();
    in.p.k_land = st.k_land.data_ptr<float>();
    in.p.counts = st.counts.data_ptr<float>();
  }
  bind_buffers(in, st);
}

}  // namespace nystrom
}  // namespace hfab
