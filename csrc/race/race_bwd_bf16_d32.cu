// race::backward_kernels for __nv_bfloat16 inputs and head dim 32 (one file per element type and head dim: the heavy
// tensor-core kernels build in parallel).
#include "race/race_bwd_launch.cuh"

template void hfab::race::backward_kernels<__nv_bfloat16, 32>(const char*, hfab::race::Params&, int64_t,
    int64_t, bool, bool, const c10::Device&, cudaStream_t);
