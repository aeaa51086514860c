// Definition of race::backward_kernels<T, D>, explicitly instantiated by race_bwd_{f16,bf16}_d{32,64,128}.cu and
// race_bwd_f32.cu.
#pragma once

#include "race/race_host.cuh"

namespace hfab {
namespace race {

template <typename T, int D>
void backward_kernels(const char* op, Params& p, int64_t batch, int64_t hkv, bool tensor_cores, bool tc_keys,
                      const c10::Device& device, cudaStream_t stream) {
  const auto f32 = at::TensorOptions().device(device).dtype(at::kFloat);
  const unsigned b = static_cast<unsigned>(batch), hq = static_cast<unsigned>(p.hq);
  at::Tensor kstate, kz;  // live until the last kernel is queued; the caching allocator orders their reuse on `stream`
  bool dq_done = false;
  if constexpr (!std::is_same_v<T, float>) {
    if (tensor_cores) {  // group prefix states, then dq, den, c walking each group's chunks (or tiles)
      tc_key_states<T, D, false>(op, p, tc::kGroup, kstate, kz, f32, batch, device, stream);
      const unsigned blocks = static_cast<unsigned>(p.causal ? p.ngk : p.ngq);
      const auto dq_kernel = phi_tile_enabled() ? tc::race_group_dq_bwd_kernel<T, D, true>
                                                : tc::race_group_dq_bwd_kernel<T, D, false>;
      launch_bytes(op, dq_kernel, dim3(blocks, hq, b), tc::kThreads, tc::BwdTiles<T, D>::bytes, p, device, stream);
      dq_done = true;
    }
  }
  if (!dq_done) {
    key_states<T, D>(op, p, kstate, kz, f32, batch, device, stream);
    launch(op, race_dq_bwd_kernel<T, D>, dim3(p.nqt, hq, b), Layout::dq(p.lp, D), p, device, stream);
  }
  const int elems = p.features * D + p.features;
  const unsigned kv = static_cast<unsigned>(hkv);
  if constexpr (!std::is_same_v<T, float>) {
    if (tc_keys) {  // group sums of phi~(q) [dO, c^], their suffix over groups, then dk, dv per key-chunk group
      const int groups = tc_query_groups(p);
      launch_bytes(op, phi_tile_enabled() ? tc::race_group_qstate_bwd_kernel<T, D, true>
                                          : tc::race_group_qstate_bwd_kernel<T, D, false>,
                   dim3(groups, hq, b), tc::kThreads, tc::Tiles<T, D>::query_state_bytes, p, device, stream);
      race_scan_fwd_kernel<<<dim3(div_up(elems, kThreads), hq, b), kThreads, 0, stream>>>(
          p.qstate, p.qz, groups, p.features * D, p.features, p.hq, kSuffix);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      launch_bytes(op, phi_tile_enabled() ? tc::race_group_dkv_bwd_kernel<T, D, true>
                                          : tc::race_group_dkv_bwd_kernel<T, D, false>,
                   dim3(p.ngk, kv, b), tc::kThreads, tc::DkvTiles<T, D>::bytes, p, device, stream);
      return;
    }
  }
  launch(op, race_state_fwd_kernel<T, D, true>, dim3(p.nqt, hq, b), Layout::state(p.lp), p, device, stream);
  race_scan_fwd_kernel<<<dim3(div_up(elems, kThreads), hq, b), kThreads, 0, stream>>>(
      p.qstate, p.qz, p.nqt, p.features * D, p.features, p.hq, kSuffix);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  launch(op, race_dkv_bwd_kernel<T, D>, dim3(p.nkc, kv, b), Layout::dkv(p.lp, D), p, device, stream);
}

}  // namespace race
}  // namespace hfab
