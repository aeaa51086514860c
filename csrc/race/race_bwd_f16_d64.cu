// race::backward_kernels for __half inputs and head dim 64 (one file per element type and head dim: the heavy
// tensor-core kernels build in parallel).
#include "race/race_bwd_launch.cuh"

template void hfab::race::backward_kernels<__half, 64>(const char*, hfab::race::Params&, int64_t,
    int64_t, bool, bool, const c10::Device&, cudaStream_t);
