// CUDA impl of hfab::nystrom_bwd (schema in hf_attention_backends/ops/nystrom/op.py): the exact gradient of
// nystrom_fwd through every Newton–Schulz iterate. Landmarks, real-token positions, W0 = K3 v (with K3's
// log-sum-exp), K2, the NS iterates and W = Z W0 come from the forward's kernels; the N-sized products are
// the fused kernels of nystrom_bwd_kernels.cuh (K1 and K3 recomputed from their row statistics, no N x m
// matrix, no fp32 copy of the inputs); the Newton–Schulz VJP is one kernel per (b, head) over the saved
// iterates, and the m x m products before and after it two more (nystrom_landmark_*_bwd_kernel; ATen only for the
// kappa_star ridge and the conv weight's gradient). NOTES.md "Backward".
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include <initializer_list>

#include "nystrom/nystrom_bwd_kernels.cuh"
#include "nystrom/nystrom_host.cuh"
#include "nystrom/nystrom_tc_bwd_kernels.cuh"

namespace hfab {
namespace nystrom {
namespace {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Offsets of consecutive fp32 buffers in one allocation (total floats), each 16-byte aligned.
struct Carve {
  int64_t total = 0;
  int64_t operator()(int64_t floats) {
    const int64_t at = total;
    total += div_up(floats, 4) * 4;
    return at;
  }
};

dim3 grid_of(int64_t x, int64_t y, int64_t z) {
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z));
}

// Σ of `splits` partials (splits, count) into the first, in order, for one or two arrays of that shape.
void sum_splits(std::initializer_list<float*> parts, int64_t count, int64_t splits, cudaStream_t stream) {
  if (splits == 1) return;
  SplitSums s{};
  int i = 0;
  for (float* part : parts) s.part[i++] = part;
  s.count = count;
  s.splits = static_cast<int>(splits);
  nystrom_split_sum_bwd_kernel<<<grid_of(div_up(count / 4, kThreads), i, 1), kThreads, 0, stream>>>(s);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// dA of NS(A) given dZ_iters, by nystrom_ns_bwd_kernel: back through every step, then the ‖A‖₁‖A‖∞ normalisation
// of Z₀ = Aᵀ / s (amax ties shared evenly, as torch does).
at::Tensor ns_backward(const NsSaved& saved, const at::Tensor& gz, cudaStream_t stream) {
  const at::Tensor& a = saved.a;
  const int64_t m = a.size(-1), bh = a.numel() / (m * m), iters = saved.zs_all.size(2) - 1;
  const int64_t tm = m <= 32 ? 2 : m <= 64 ? 4 : 8, mp = 16 * tm;
  const at::Tensor gz_in = gz.contiguous();
  const at::Tensor da_steps = at::empty({bh, mp, mp}, a.options());
  const at::Tensor scratch = tm == 8 ? at::empty({bh, kNsBuffers, mp, mp + 1}, a.options()) : at::Tensor();
  at::Tensor da = at::empty_like(a, at::MemoryFormat::Contiguous);
  NsBwdParams np{};
  np.a = a.data_ptr<float>();
  np.s = saved.s.data_ptr<float>();
  np.zs = saved.zs_all.data_ptr<float>();
  np.gz = gz_in.data_ptr<float>();
  np.da = da.data_ptr<float>();
  np.da_steps = da_steps.data_ptr<float>();
  np.scratch = scratch.defined() ? scratch.data_ptr<float>() : nullptr;
  np.m = static_cast<int>(m);
  np.iters = static_cast<int>(iters);
  const dim3 grid(static_cast<unsigned>(bh));
  if (tm == 2) launch_dynamic(nystrom_ns_bwd_kernel<2>, grid, kThreads, ns_bwd_smem_bytes<2>(), np, stream);
  else if (tm == 4) launch_dynamic(nystrom_ns_bwd_kernel<4>, grid, kThreads, ns_bwd_smem_bytes<4>(), np, stream);
  else launch_dynamic(nystrom_ns_bwd_kernel<8>, grid, kThreads, ns_bwd_smem_bytes<8>(), np, stream);
  return da;
}

at::Tensor k2_inverse_backward(const NsSaved& saved, const at::Tensor& gz, cudaStream_t stream) {
  if (!saved.k2_input.defined()) return ns_backward(saved, gz, stream);
  const at::Tensor& k2 = saved.k2_input;
  const at::Tensor da = ns_backward(saved, gz.matmul(k2), stream);  // Z = N K2ᵀ: dN = dZ K2
  return gz.transpose(-1, -2).matmul(saved.zs_all.select(2, -1)).add(k2.matmul(da.add(da.transpose(-1, -2))));
}

// dconv[h, t] = Σ_{b, i, d} dO[b, h, i, d] · v_masked[b, h / groups, i + t - c, d] (fp32, then conv's dtype).
at::Tensor conv_weight_grad(const Inputs& in, const at::Tensor& dout) {
  const int64_t B = in.batch, N = in.n, ks = in.conv.size(1), c = ks / 2;
  const at::Tensor dof = dout.to(at::kFloat);
  at::Tensor vf = group(in, in.v.to(at::kFloat));
  if (in.mask.defined()) vf = vf.masked_fill(in.mask.logical_not().view({B, 1, N, 1}), 0.0);
  const at::Tensor vp = at::constant_pad_nd(vf, {0, 0, c, c});
  std::vector<at::Tensor> cols;
  for (int64_t tap = 0; tap < ks; ++tap) cols.push_back(dof.mul(vp.slice(2, tap, tap + N)).sum({0, 2, 3}));
  return at::stack(cols, 1).to(in.conv_dtype).contiguous();
}

// Whether the backward runs the dk/dv kernel beside the Newton–Schulz VJP and then passes over dk once more to add
// the VJP's part (nystrom_segment_add_bwd_kernel): up to 64 MiB of dk that pass costs about as much as the VJP's lead over
// K3's backward saves (H200, B4 H16 D128 m64: N 2,048 and 4,096 faster); beyond, K3's backward alone hides the VJP.
bool late_key_pass(const at::Tensor& dk) { return dk.nbytes() <= (int64_t{64} << 20); }

template <typename T, int D>
Grads backward(Inputs& in, State& st, const at::Tensor& dout_in, cudaStream_t stream) {
  const int64_t B = in.batch, Hq = in.hq, N = in.n, S = st.slots, m = in.m, bh = B * Hq;
  const auto f32 = in.q.options().dtype(at::kFloat);
  const auto contiguous = at::MemoryFormat::Contiguous;
  const at::Tensor dout = vector_readable(dout_in.contiguous());
  at::Tensor dq = at::empty(in.q.sizes(), in.q.options().memory_format(contiguous));
  at::Tensor dk = at::empty(in.k.sizes(), in.k.options().memory_format(contiguous));
  at::Tensor dv = at::empty(in.v.sizes(), in.v.options().memory_format(contiguous));
  // the buffer gradients d keys = dS1ᵀ q_s, d vals = K1ᵀ dO (B, Hq, S, D) on tensor cores where the GPU has the
  // shared memory they need (57 / 76 KB at D 64 with two / four warps, 105 at D 128); with the forward's lse1 and one
  // slot tile per block, k1 sums Δ1 itself and writes dq's buffer part (the landmark part added after), else the
  // row-statistics kernel computes lse1 and Δ1 first and the dq kernel dq last
  const c10::Device device = in.q.device();
  const auto pick_k1 = [&]<bool FUSED>() {
    return row_tiled_or(
        S,
        []<int W>() {
          using Smem = tc::K1Smem<D, W>;
          return row_tiled<W>(tc::nystrom_k1_tc_bwd_kernel<T, D, W, FUSED>, Smem::bytes, Smem::kQueries);
        },
        cuda_core<typename K1Tiles<D>::Smem>(nystrom_k1_bwd_kernel<T, D>, K1Tiles<D>::BL, K1Tiles<D>::BQ), device);
  };
  TileKernel<BwdParams> k1 = pick_k1.template operator()<true>();
  const bool fused_k1 = st.lse1_saved && k1.tensor_cores && div_up(S, k1.rows) == 1;
  if (!fused_k1) k1 = pick_k1.template operator()<false>();
  const int64_t stiles = div_up(S, k1.rows), hkv = in.hkv;
  const auto [a_splits, a_chunk] = split_plan(N, k1.step, stiles * bh, k1.resident());
  // fp32 scratch: the row statistics (lse1: the forward's rows where k1 sums Δ1, else the row-statistics kernel's, in
  // the state's region when the state is this call's), k1's partial buffer gradients, their sums per kv head, and
  // the landmark stage's products
  Carve carve;
  const int64_t buffer = S * in.d, land = st.nystrom ? m * in.d : 0, kv = in.groups > 1 ? B * hkv * buffer : 0;
  const bool own_lse1 = !fused_k1 && st.lse1_saved;
  const int64_t at_lse1 = carve(own_lse1 ? bh * N : 0), at_delta1 = carve(bh * N);
  const int64_t at_dkeys = carve(a_splits * bh * buffer), at_dvals = carve(a_splits * bh * buffer);
  const int64_t at_dkeys_kv = carve(kv), at_dvals_kv = carve(kv);
  const int64_t at_dw0 = carve(bh * land), at_rowdot = carve(st.nystrom ? bh * m : 0), at_dkl = carve(B * hkv * land);
  const int64_t at_dkl_vjp = carve(B * hkv * land);
  const at::Tensor scratch = at::empty({carve.total}, f32);
  const auto ptr = [&](int64_t at) { return scratch.data_ptr<float>() + at; };
  BwdParams bp{};
  bp.p = in.p;
  bp.dout = dout.data_ptr();
  bp.cumsum = in.mask.defined() ? st.cumsum.data_ptr<int>() : nullptr;
  bp.exact = reinterpret_cast<const unsigned char*>(st.exact.data_ptr<bool>());
  bp.landmarks = st.nystrom;
  bp.lse1 = own_lse1 ? ptr(at_lse1) : st.lse1.data_ptr<float>();
  bp.delta1 = ptr(at_delta1);
  // Δ1 from k1 misses the rows of sequences without valid slots (only with a mask): 0 there, never read
  if (fused_k1 && in.mask.defined()) C10_CUDA_CHECK(cudaMemsetAsync(bp.delta1, 0, bh * N * 4, stream));
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  if (!fused_k1) {
    if (buffer_attention_on_tensor_cores<D>(in, device)) {
      launch_query_tiles(tc::nystrom_stats_tc_bwd_kernel<T, D, 1>, tc::OutSmem<D>::bytes(in.p.slots),
                         tc::nystrom_stats_tc_bwd_kernel<T, D, 2>, tc::OutSmem<D>::bytes(in.p.slots, 2), bp, in,
                         device, stream);
    } else {
      nystrom_stats_bwd_kernel<T, D><<<grid_of(div_up(N, OutTiles<D>::BQ), Hq, B), kThreads, 0, stream>>>(bp);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  LandmarkParams lp{};
  bp.a_chunk = static_cast<int>(a_chunk);
  bp.part_dkeys = ptr(at_dkeys);
  bp.part_dvals = ptr(at_dvals);
  k1.launch(grid_of(a_splits, stiles, bh), bp, stream);
  sum_splits({bp.part_dkeys, bp.part_dvals}, bh * buffer, a_splits, stream);
  lp.hq = static_cast<int>(Hq);
  lp.groups = static_cast<int>(in.groups);
  lp.m = static_cast<int>(m);
  lp.slots = static_cast<int>(S);
  lp.landmarks = st.nystrom;
  lp.exact = bp.exact;
  lp.dkeys = bp.part_dkeys;
  lp.dvals = bp.part_dvals;
  lp.dkeys_kv = in.groups > 1 ? ptr(at_dkeys_kv) : bp.part_dkeys;
  lp.dvals_kv = in.groups > 1 ? ptr(at_dvals_kv) : bp.part_dvals;
  bp.dkeys_kv = lp.dkeys_kv;
  bp.dvals_kv = lp.dvals_kv;
  at::Tensor dz;
  if (st.nystrom) {
    dz = at::empty({B, Hq, m, m}, f32);
    lp.w0 = st.w0.data_ptr<float>();
    lp.z = st.z.data_ptr<float>();
    lp.dz = dz.data_ptr<float>();
    lp.dw0 = ptr(at_dw0);
    lp.rowdot = ptr(at_rowdot);
    lp.dkl = ptr(at_dkl);
  }
  if (st.nystrom || in.groups > 1) {
    launch_dynamic(nystrom_landmark_vjp_bwd_kernel<D>, grid_of(div_up(S, kLandmarkRows), Hq, B), kThreads,
                   st.nystrom ? landmark_vjp_smem_bytes<D>(static_cast<int>(m)) : 0, lp, stream);
  }

  const auto launch_key_gradients = [&] {
    // the group's landmarks staged once per block where they fit 64 rows (41 / 74 / 105 KB at D 32 / 64 / 128), else
    // restaged per key tile (41 / 74 / 70 KB)
    using Resident = tc::KvSmem<D, true>;
    using Restaged = tc::KvSmem<D, false>;
    const auto launch = [&]<bool RESIDENT, int LAND>() {
      const auto kernel = tc::nystrom_kv_tc_bwd_kernel<T, D, RESIDENT, LAND>;
      const int bytes = tc::KvSmem<D, RESIDENT, LAND>::bytes;
      const auto [splits, chunk] = split_plan(N, tc::kK3Keys, in.hkv * B,
                                              resident_blocks(reinterpret_cast<const void*>(kernel), tc::kK3Threads, bytes));
      bp.kv_chunk = static_cast<int>(chunk);
      launch_dynamic(kernel, grid_of(splits, in.hkv, B), tc::kK3Threads, bytes, bp, stream);
    };
    if (tc::resident_kv_fits<D>(static_cast<int>(in.groups), static_cast<int>(m)) &&
        on_tensor_cores(Resident::bytes, device)) {
      if (tc::resident_kv_land<D>(static_cast<int>(m)) == 32) launch.template operator()<true, 32>();
      else launch.template operator()<true, Resident::kLand>();
    } else if (on_tensor_cores(Restaged::bytes, device)) {
      launch.template operator()<false, Restaged::kLand>();
    } else {
      cuda_core<typename KvTiles<D>::Smem>(nystrom_kv_bwd_kernel<T, D>, KvTiles<D>::BK)
          .launch(grid_of(div_up(N, KvTiles<D>::BK), in.hkv, B), bp, stream);
    }
  };

  // rows (B, heads, m, D) spread over their segments and added to dst (B, heads, N, D)
  const auto add_segments = [&](const float* rows, const at::Tensor& dst) {
    nystrom_segment_add_bwd_kernel<T, D><<<grid_of(div_up(N, segment_add_rows<D>), dst.size(1), B), kThreads, 0,
                                           stream>>>(bp, rows, dst.data_ptr());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  at::Tensor part_dql;
  if (st.nystrom) {  // landmark sequences: keys = K̃, vals = W = Z W0, W0 = K3 v
    // the Newton–Schulz VJP (one block per head: half the SMs at B4 H16) on a side stream, beside K3's gradients and,
    // where dk is small (late_key_pass), the dk/dv kernel on d K̃'s dS1ᵀ Q̃ part (nystrom_segment_add_bwd_kernel adds the
    // VJP's dS2ᵀ Q̃ part to dk after)
    const SideStream side(c10::cuda::getCurrentCUDAStream(device.index()), side_stream_enabled());
    const at::Tensor dk2 = side.handed_over(side.run([&](cudaStream_t ns_stream) {
      return k2_inverse_backward(st.ns, dz, ns_stream);
    }));
    // 41 / 73 / 137 KB at D 32 / 64 / 128 with four warps, 31 / 56 / 105 KB with two
    const TileKernel<BwdParams> k3 = row_tiled_or(
        m,
        []<int W>() {
          return row_tiled<W>(tc::nystrom_k3_tc_bwd_kernel<T, D, W>, tc::K3BwdSmem<D, W>::bytes, tc::kK3Keys);
        },
        cuda_core<typename K3BwdTiles<D>::Smem>(nystrom_k3_bwd_kernel<T, D>, K3BwdTiles<D>::BL, K3BwdTiles<D>::BK),
        device);
    const int64_t ltiles = div_up(m, k3.rows);
    const auto [b_splits, b_chunk] = split_plan(N, k3.step, ltiles * bh, k3.resident());
    part_dql = at::empty({b_splits, B, Hq, m, in.d}, f32);
    bp.dw0 = lp.dw0;
    bp.lse3 = st.lse3.data_ptr<float>();
    bp.rowdot = lp.rowdot;
    bp.b_chunk = static_cast<int>(b_chunk);
    bp.part_dql = part_dql.data_ptr<float>();
    k3.launch(grid_of(b_splits, ltiles, bh), bp, stream);
    sum_splits({bp.part_dql}, bh * m * in.d, b_splits, stream);
    const bool late = late_key_pass(dk);
    bp.dkl = lp.dkl;
    if (late) launch_key_gradients();
    side.join();
    lp.add_vjp_to_dkl = !late;
    lp.k2 = st.k2.data_ptr<float>();
    lp.dk2 = dk2.data_ptr<float>();
    lp.q_land = st.q_land.data_ptr<float>();
    lp.k_land = st.k_land.data_ptr<float>();
    lp.dql = bp.part_dql;
    lp.dkl_vjp = ptr(at_dkl_vjp);
    launch_dynamic(nystrom_landmark_grads_bwd_kernel<D>, grid_of(div_up(m, kLandmarkRows), hkv, B), kThreads,
                   landmark_grads_smem_bytes<D>(static_cast<int>(m)), lp, stream);
    if (late) add_segments(lp.dkl_vjp, dk);
    else launch_key_gradients();
    bp.dql = lp.dql;
    if (fused_k1) add_segments(lp.dql, dq);
  } else {
    launch_key_gradients();
  }
  if (!fused_k1) {  // dq from the query tiles, with the landmark part
    const int dq_tc_bytes = tc::DqSmem<D>::bytes(in.p.slots);  // 54 KB at D 64, m 32; 136 KB at D 128, m 64
    if (on_tensor_cores(dq_tc_bytes, device)) {
      launch_query_tiles(tc::nystrom_dq_tc_bwd_kernel<T, D, 1>, dq_tc_bytes, tc::nystrom_dq_tc_bwd_kernel<T, D, 2>,
                         tc::DqSmem<D>::bytes(in.p.slots, 2), bp, in, device, stream);
    } else {
      cuda_core<typename DqTiles<D>::Smem>(nystrom_dq_bwd_kernel<T, D>, DqTiles<D>::BQ)
          .launch(grid_of(div_up(N, DqTiles<D>::BQ), Hq, B), bp, stream);
    }
  }
  at::Tensor dconv = in.conv.defined() ? conv_weight_grad(in, dout) : at::empty({0}, in.q.options());
  return {dq, dk, dv, dconv};
}

// state: hfab::nystrom_fwd's second output on the same inputs, or empty (recomputed here).
Grads nystrom_bwd_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& conv_weight, const std::optional<at::Tensor>& key_padding_mask,
                       int64_t num_landmarks, int64_t newton_iter, double kappa_star, double scale,
                       at::TensorList state) {
  constexpr const char* kOp = "hfab::nystrom_bwd";
  const AutocastOff autocast_off;
  Inputs in = prepare(kOp, q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star, scale);
  check_on_device(kOp, "dout", dout, q.device());
  TORCH_CHECK(dout.sizes() == q.sizes(), kOp, ": dout ", dout.sizes(), " must have q's shape ", q.sizes());
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), kOp, ": dout.dtype=", dout.scalar_type(), " must be q's dtype ",
              q.scalar_type());
  const c10::cuda::CUDAGuard guard(q.device());
  const auto contiguous = at::MemoryFormat::Contiguous;
  if (q.numel() == 0) {  // no query (B, Hq or N is 0): every gradient is 0
    at::Tensor dconv = in.conv.defined() ? at::zeros(in.conv.sizes(), in.q.options().dtype(in.conv_dtype))
                                         : at::empty({0}, q.options());
    return {at::zeros(q.sizes(), q.options().memory_format(contiguous)),
            at::zeros(k.sizes(), k.options().memory_format(contiguous)),
            at::zeros(v.sizes(), v.options().memory_format(contiguous)), dconv};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  Grads grads;
  dispatch_dtype_head_dim(q, [&](auto tag, auto dim) {
    using T = typename decltype(tag)::type;
    constexpr int D = decltype(dim)::value;
    State st;
    if (state.empty()) {
      st = landmark_state<T, D>(in, stream);
      finish_state<T, D>(in, st, stream);
    } else {
      unpack_state(kOp, in, st, state);
    }
    grads = backward<T, D>(in, st, dout, stream);
  });
  return grads;
}

}  // namespace
}  // namespace nystrom
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, CUDA, m) { m.impl("nystrom_bwd", &hfab::nystrom::nystrom_bwd_cuda); }
