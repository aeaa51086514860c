// Host side of the RACE kernels shared by race_fwd.cu and race_bwd.cu: validation at the op boundary
// (clear errors naming the argument, its value and what is supported), Params, dispatch, launches.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

#include "common/host.cuh"
#include "race/race_kernels.cuh"
#include "race/race_tc_bwd_kernels.cuh"
#include "race/race_tc_kernels.cuh"

namespace hfab {
namespace race {

// Validated inputs; keeps the (possibly converted) tensors alive.
struct Inputs {
  at::Tensor q, k, v, planes, beta, mask;  // mask undefined when there is none
  Params p{};
};

// The tensor-core kernels read q, k, v with 16-byte vectors: copy the inputs that cannot be, rebind p.
inline void make_vector_readable(Inputs& in, Params& p) {
  for (at::Tensor* t : {&in.q, &in.k, &in.v}) *t = vector_readable(*t);
  bind_qkv(p, in.q, in.k, in.v);
}

// `t` with a contiguous head dim (other strides are read as they are).
inline at::Tensor unit_last_stride(const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); }

inline int div_up(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

inline Inputs prepare(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& planes, const at::Tensor& beta, const std::optional<at::Tensor>& kpm,
                      bool causal) {
  const c10::Device device = q.device();
  check_qkv(op, q, k, v, device);
  check_on_device(op, "planes", planes, device);
  check_on_device(op, "beta", beta, device);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat, op, " (CUDA kernel): dtype ",
              dtype, " is not supported; supported: float16, bfloat16, float32");
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index()));
  TORCH_CHECK(major >= 8, op, " (CUDA kernel): needs an sm_80 or newer GPU; ", device, " is sm_", major,
              "x. Run the CPU reference instead");
  const int64_t d = q.size(3);
  check_head_dim(op, d);
  TORCH_CHECK(planes.dim() == 3 && planes.size(2) == d, op, ": planes.shape=", planes.sizes(),
              "; expected (L, P, D) with D=", d);
  const int64_t num_tables = planes.size(0), num_planes = planes.size(1);
  TORCH_CHECK(num_planes >= 1 && num_planes <= kMaxPlanes && num_tables >= 1 && num_tables <= kMaxTables, op,
              " (CUDA kernel): P=", num_planes, " planes per table and L=", num_tables,
              " tables are not supported; supported: 1 <= P <= ", kMaxPlanes, ", 1 <= L <= ", kMaxTables,
              " (S = L * 2^P <= 512). Use fewer planes/tables or the CPU reference");
  TORCH_CHECK(planes.is_floating_point() && beta.is_floating_point(), op,
              ": planes and beta must be floating tensors, got ", planes.scalar_type(), " and ", beta.scalar_type());
  const int64_t hq = q.size(1);
  TORCH_CHECK(beta.dim() == 0 || (beta.dim() == 1 && beta.size(0) == hq), op, ": beta.shape=", beta.sizes(),
              "; supported: () or (Hq,)=(", hq, ",)");
  check_grid_limits(op, q.size(0), hq, q.size(2), k.size(2));

  Inputs in;
  in.q = unit_last_stride(q);
  in.k = unit_last_stride(k);
  in.v = unit_last_stride(v);
  in.planes = planes.to(at::kFloat).contiguous();
  in.beta = beta.to(at::kFloat).reshape({-1}).expand({hq}).contiguous();
  Params& p = in.p;
  if (kpm.has_value() && kpm->defined()) {
    const at::Tensor& m = *kpm;
    check_key_padding_mask(op, m, k, device);
    in.mask = m.contiguous();
    p.kpm = reinterpret_cast<const unsigned char*>(in.mask.data_ptr());
    p.kpm_stride = in.mask.size(1);
  }
  bind_qkv(p, in.q, in.k, in.v);
  p.planes = in.planes.data_ptr<float>();
  p.beta = in.beta.data_ptr<float>();
  p.hq = static_cast<int>(hq);
  p.groups = static_cast<int>(hq / k.size(1));
  p.nq = static_cast<int>(q.size(2));
  p.nk = static_cast<int>(k.size(2));
  p.planes_per_table = static_cast<int>(num_planes);
  p.tables = static_cast<int>(num_tables);
  p.lp = p.planes_per_table * p.tables;
  p.features = p.tables << p.planes_per_table;
  p.stiles = div_up(p.features, kFeat);
  p.causal = causal ? 1 : 0;
  if (causal) {  // chunk 0 starts at s0 in (-64, 0] with s0 = Nk - Nq (mod 64): query tiles align with chunks
    const int off = p.nk - p.nq;
    p.s0 = ((off % kRows) + kRows) % kRows;
    if (p.s0 > 0) p.s0 -= kRows;
    p.kappa0 = (off - p.s0) / kRows;
  }
  p.nkc = div_up(int64_t{p.nk} - p.s0, kRows);
  p.nqt = div_up(p.nq, kRows);
  return in;
}


// Launch `kernel` with `threads` threads and `bytes` of dynamic shared memory, raising a clear error if the
// GPU has too little.
template <typename Kernel>
void launch_bytes(const char* op, Kernel kernel, dim3 grid, int threads, int bytes, const Params& p,
                  const c10::Device& device, cudaStream_t stream) {
  const int limit = shared_memory_limit(device);
  TORCH_CHECK(bytes <= limit, op, " (CUDA kernel): P=", p.planes_per_table, ", L=", p.tables,
              " needs ", bytes, " bytes of shared memory per block, more than this GPU's ", limit,
              "; use fewer tables or planes");
  opt_in_shared_memory(reinterpret_cast<const void*>(kernel), bytes);
  kernel<<<grid, threads, bytes, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launch a CUDA-core kernel (kThreads threads) with `floats` of dynamic shared memory.
template <typename Kernel>
void launch(const char* op, Kernel kernel, dim3 grid, int floats, const Params& p, const c10::Device& device,
            cudaStream_t stream) {
  launch_bytes(op, kernel, grid, kThreads, floats * static_cast<int>(sizeof(float)), p, device, stream);
}

// Whether the tensor-core kernels take these inputs: fp16/bf16, S <= 64, and the block's shared memory
// (`bytes_of(std::integral_constant<int, D>)`) fits this GPU. Other inputs take the CUDA-core kernels.
template <typename BytesOf>
bool tc_applies(const at::Tensor& q, const Params& p, const c10::Device& device, BytesOf bytes_of) {
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) return false;
  if (p.features > tc::kS || p.lp > tc::kLPMax) return false;
  return dispatch_head_dim(q.size(3), bytes_of) <= shared_memory_limit(device);
}

// The tensor-core forward (race_tc_kernels.cuh): its layouts without the causal out kernel's prefetch tiles fit.
inline bool tc_forward_applies(const at::Tensor& q, const Params& p, const c10::Device& device) {
  return tc_applies(q, p, device, [](auto dim) { return tc::Tiles<__half, decltype(dim)::value>::bytes; });
}

// The tensor-core dq kernel (race_tc_bwd_kernels.cuh): 90.6 / 108.1 / 155.1 KB of shared memory at
// D = 32 / 64 / 128, within sm_80's and sm_90's limits; a GPU with less falls back to race_dq_bwd_kernel.
// Its num/den products use fp32 features (phi(q), state and phi(k) split in two tf32 halves): with tf32
// features its dbeta partials were 2.5x over the tests' bound (issue 6, csrc/race/NOTES.md).
// HFAB_RACE_TC_BACKWARD=0 selects the whole CUDA-core backward (race_dq_bwd_kernel, race_dkv_bwd_kernel) instead,
// for comparison and testing.
inline bool tensor_core_backward_enabled() {
  static const bool enabled = !env_is("HFAB_RACE_TC_BACKWARD", "0");  // read once per process
  return enabled;
}

// The tensor-core dq kernel and the key side's query-state kernel build each query tile's fp32 phi(q) once into shared
// memory (<..., PHI_TILE = true>), the dk/dv kernel each key chunk's fp32 phi(k) and its query tile's phi(q), instead
// of rebuilding every value from the sigma tables at each use (phi_at: a run-time loop over P per value); the same
// values, so the same gradients bit for bit. HFAB_RACE_PHI_TILE=0 selects the per-use
// rebuild, for comparison and testing.
inline bool phi_tile_enabled() {
  static const bool enabled = !env_is("HFAB_RACE_PHI_TILE", "0");
  return enabled;
}

// The causal out kernel loads the next chunk's rows while this chunk computes (race_group_out_fwd_kernel<..., PREFETCH =
// true>) where the GPU has causal_out_bytes of shared memory per block; otherwise, or with HFAB_RACE_PREFETCH=0 (for
// comparison and testing), it loads each chunk's rows when it needs them: the same outputs bit for bit.
inline bool causal_prefetch(const c10::Device& device, int bytes) {
  static const bool enabled = !env_is("HFAB_RACE_PREFETCH", "0");
  return enabled && bytes <= shared_memory_limit(device);
}

// The causal forward's out kernel: per warp (race_causal_out_fwd_kernel: one block barrier per chunk, fp16 operands
// with powers of two) where the GPU has its shared memory per block; otherwise, or with HFAB_RACE_WARP_CAUSAL=0 (for
// comparison and testing), the block-wide race_group_out_fwd_kernel.
inline bool warp_causal_out(const c10::Device& device, int bytes) {
  static const bool enabled = !env_is("HFAB_RACE_WARP_CAUSAL", "0");
  return enabled && bytes <= shared_memory_limit(device);
}

// Key chunks per group of the forward's group states and causal out blocks: tc::forward_group_chunks, or
// HFAB_RACE_GROUP_CHUNKS (a positive integer, read once per process: for comparison and testing).
inline int forward_group_chunks(const Params& p, int64_t batch) {
  static const long forced = [] {
    const char* env = std::getenv("HFAB_RACE_GROUP_CHUNKS");
    if (env == nullptr || *env == '\0') return 0L;
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    TORCH_CHECK(*end == '\0' && n >= 1 && n <= 4096, "HFAB_RACE_GROUP_CHUNKS=", env,
                ": expected a number of key chunks per group from 1 to 4096, or unset (16 or 32 by length)");
    return n;
  }();
  return forced != 0 ? static_cast<int>(forced) : tc::forward_group_chunks(p.nkc, batch * p.hq, p.causal != 0);
}

inline bool tc_backward_applies(const at::Tensor& q, const Params& p, const c10::Device& device) {
  return tensor_core_backward_enabled() &&
         tc_applies(q, p, device, [](auto dim) { return tc::BwdTiles<__half, decltype(dim)::value>::bytes; });
}

// The tensor-core key side (race_group_qstate_bwd_kernel, race_group_dkv_bwd_kernel): with the tensor-core dq, when
// the key-side blocks' shared memory (DkvTiles: 97.6 / 111.1 / 150.1 KB at D = 32 / 64 / 128: sm_80 and sm_90) fits;
// otherwise the CUDA-core race_state_fwd_kernel<QUERY=true> + scan + race_dkv_bwd_kernel.
inline bool tc_key_side_applies(const at::Tensor& q, const Params& p, const c10::Device& device) {
  return tensor_core_backward_enabled() &&
         tc_applies(q, p, device, [](auto dim) { return tc::DkvTiles<__half, decltype(dim)::value>::bytes; });
}

// Query-state groups of the tensor-core key side: the key-chunk groups (causal) or groups of kGroup query tiles.
inline int tc_query_groups(const Params& p) { return div_up(p.causal ? p.nkc : p.nqt, tc::kGroup); }

// Group states of the tensor-core kernels: per group of `group_chunks` key chunks (the backward's kernels take
// tc::kGroup) sum phi(k) [v, 1]^T, then their exclusive prefix (causal) or their total alone (non-causal), slot ngk:
// the total. Sets p.gchunks, p.ngk, p.ngq and p.kstate, p.kz. q, k, v must be 16-byte vector readable
// (hfab::vector_readable) and p point at them. HALF: the fp16 products (race_group_state_fwd_kernel; the forward's for
// bf16 inputs, tc::kHalfStates); the backward takes the split ones.
template <typename T, int D, bool HALF = tc::kHalfStates<T>>
void tc_key_states(const char* op, Params& p, int group_chunks, at::Tensor& gstate, at::Tensor& gz,
                   const at::TensorOptions& f32, int64_t batch, const c10::Device& device, cudaStream_t stream) {
  p.gchunks = group_chunks;
  p.ngk = div_up(p.nkc, group_chunks);
  p.ngq = div_up(p.nqt, tc::kGroup);
  gstate = at::empty({batch, p.hq, p.ngk + 1, p.features, D}, f32);
  gz = at::empty({batch, p.hq, p.ngk + 1, p.features}, f32);
  p.kstate = gstate.data_ptr<float>();
  p.kz = gz.data_ptr<float>();
  const unsigned b = static_cast<unsigned>(batch), h = static_cast<unsigned>(p.hq);
  launch_bytes(op, tc::race_group_state_fwd_kernel<T, D, HALF>, dim3(p.ngk, h, b), tc::kThreads,
               tc::Tiles<T, D>::key_states_bytes_for(p.planes_per_table), p, device, stream);
  const int elems = p.features * D + p.features;
  race_scan_fwd_kernel<<<dim3(div_up(elems, kThreads), h, b), kThreads, 0, stream>>>(
      p.kstate, p.kz, p.ngk, p.features * D, p.features, p.hq, p.causal ? kPrefix : kTotal);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Tensor-core forward: group states, their exclusive prefix (slot ngk: total), then out.
template <typename T, int D>
void tc_forward(const char* op, Params& p, at::Tensor& gstate, at::Tensor& gz, const at::TensorOptions& f32,
                int64_t batch, const c10::Device& device, cudaStream_t stream) {
  tc_key_states<T, D>(op, p, forward_group_chunks(p, batch), gstate, gz, f32, batch, device, stream);
  const unsigned b = static_cast<unsigned>(batch), h = static_cast<unsigned>(p.hq);
  const unsigned blocks = static_cast<unsigned>(p.causal ? p.ngk : p.ngq);
  const int warp_bytes = tc::Tiles<T, D>::causal_warp_bytes_for(p.planes_per_table);
  if (p.causal && warp_causal_out(device, warp_bytes))
    launch_bytes(op, tc::race_causal_out_fwd_kernel<T, D>, dim3(blocks, h, b), tc::kThreads, warp_bytes, p, device,
                 stream);
  else if (p.causal && causal_prefetch(device, tc::Tiles<T, D>::causal_out_bytes))
    launch_bytes(op, tc::race_group_out_fwd_kernel<T, D>, dim3(blocks, h, b), tc::kThreads,
                 tc::Tiles<T, D>::causal_out_bytes, p, device, stream);
  else if (p.causal)  // e.g. 99 KB per block (sm_86, sm_89) at D = 64: the tiles without the prefetch ones
    launch_bytes(op, tc::race_group_out_fwd_kernel<T, D, false>, dim3(blocks, h, b), tc::kThreads,
                 tc::Tiles<T, D>::bytes, p, device, stream);
  else  // no key tiles: packed, fewer bytes per block
    launch_bytes(op, tc::race_query_out_fwd_kernel<T, D>, dim3(blocks, h, b), tc::kThreads,
                 tc::Tiles<T, D>::query_out_bytes, p, device, stream);
}

// Forward states: per key chunk phi(k)^T v and sum phi(k), then their exclusive prefix sums (slot nkc: total).
template <typename T, int D>
void key_states(const char* op, Params& p, at::Tensor& kstate, at::Tensor& kz, const at::TensorOptions& f32,
                int64_t batch, const c10::Device& device, cudaStream_t stream) {
  kstate = at::empty({batch, p.hq, p.nkc + 1, p.features, D}, f32);
  kz = at::empty({batch, p.hq, p.nkc + 1, p.features}, f32);
  p.kstate = kstate.data_ptr<float>();
  p.kz = kz.data_ptr<float>();
  const unsigned b = static_cast<unsigned>(batch), h = static_cast<unsigned>(p.hq);
  if (p.nkc > 0)
    launch(op, race_state_fwd_kernel<T, D, false>, dim3(p.nkc, h, b), Layout::state(p.lp), p, device, stream);
  const int elems = p.features * D + p.features;
  race_scan_fwd_kernel<<<dim3(div_up(elems, kThreads), h, b), kThreads, 0, stream>>>(
      p.kstate, p.kz, p.nkc, p.features * D, p.features, p.hq, kPrefix);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The backward's launches for element type T and head dim D (race_bwd_launch.cuh), compiled in one .cu file per
// (T, D) for fp16 and bf16 (race_bwd_{f16,bf16}_d{32,64,128}.cu; race_bwd_f32.cu for float) so that the heavy
// tensor-core kernels build in parallel: the build takes as long as its slowest file. `p` holds every buffer
// but the key states, which this allocates. tensor_cores (fp16/bf16 only; tc_backward_applies): dq on
// race_group_dq_bwd_kernel, with q, k, v, dout vector readable and p pointing at them; tc_keys (tc_key_side_applies,
// implies tensor_cores): dk, dv on race_group_qstate_bwd_kernel + scan + race_group_dkv_bwd_kernel, with p.qstate,
// p.qz sized for tc_query_groups(p) + 1 slots and, when p.groups > 1, p.dk_scratch, p.dv_scratch.
template <typename T, int D>
void backward_kernels(const char* op, Params& p, int64_t batch, int64_t hkv, bool tensor_cores, bool tc_keys,
                      const c10::Device& device, cudaStream_t stream);

}  // namespace race
}  // namespace hfab
