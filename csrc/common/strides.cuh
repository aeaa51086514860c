// Element strides of a (B, H, N, D) tensor: every backend's Params holds one per input and output.
// Pure CUDA (no torch): NVRTC compiles it with the exact kernels for sm_60/sm_70.
#pragma once

namespace hfab {

struct Strides {
  long long b, h, n;  // in elements; the head dim is contiguous
};

}  // namespace hfab
