// Helpers for the ops' autograd in C++ (csrc/<backend>/<backend>_autograd.cpp, host compiler only): each registers
// an AutogradCUDA kernel for hfab::<backend>_fwd that the dispatcher prefers on CUDA tensors to the Python
// registration in ops/<backend>/op.py (which keeps serving the CPU reference and builds without the extension).
// Why: torch.library's Python autograd wrapper costs ~0.3-0.7 ms of host time per forward + backward on the H200
// machine (csrc/nystrom/NOTES.md, "The autograd in C++").
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <initializer_list>
#include <optional>

namespace hfab {

using OptTensor = std::optional<at::Tensor>;

// The op `name` ("hfab::x") as a typed handle for calls from C++; look it up once (function-local static).
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Whether the forward must record a graph: grad mode on and one of `inputs` requires grad.
inline bool records_graph(std::initializer_list<const at::Tensor*> inputs) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : inputs)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

inline at::Tensor or_undefined(const OptTensor& t) { return t.value_or(at::Tensor()); }

inline OptTensor present(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// In a backward: the backward op runs below autograd, except under create_graph=True, where it goes through its
// own autograd (torch.library's, which raises if its result is differentiated again, as in Python).
class BackwardDispatch {
 public:
  BackwardDispatch() {
    if (!at::GradMode::is_enabled()) below_.emplace();
  }

 private:
  std::optional<at::AutoDispatchBelowADInplaceOrView> below_;
};

}  // namespace hfab
