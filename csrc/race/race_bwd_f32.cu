// race::backward_kernels for float inputs, every head dim (the CUDA-core kernels: light enough for one file).
#include "race/race_bwd_launch.cuh"

template void hfab::race::backward_kernels<float, 32>(const char*, hfab::race::Params&, int64_t, int64_t, bool, bool,
                                                      const c10::Device&, cudaStream_t);
template void hfab::race::backward_kernels<float, 64>(const char*, hfab::race::Params&, int64_t, int64_t, bool, bool,
                                                      const c10::Device&, cudaStream_t);
template void hfab::race::backward_kernels<float, 128>(const char*, hfab::race::Params&, int64_t, int64_t, bool, bool,
                                                       const c10::Device&, cudaStream_t);
