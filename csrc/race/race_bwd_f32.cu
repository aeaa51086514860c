// race::backward_kernels for float inputs (one file per element type: the backward kernels build in parallel).
#include "race/race_bwd_launch.cuh"

template void hfab::race::backward_kernels<float>(const char*, hfab::race::Params&, int64_t, int64_t, int64_t, bool, bool,
                                               const c10::Device&, cudaStream_t);
