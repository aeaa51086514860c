// Autograd of hfab::nystrom_fwd on CUDA tensors, in C++ (AutogradCUDA): the same contract as the Python
// registration in hf_attention_backends/ops/nystrom/op.py (which serves the CPU reference and builds without this
// extension): the forward's state is saved non-differentiable and handed to hfab::nystrom_bwd, no zero gradient is
// materialised for it. Why C++: torch.library's Python wrapper cost ~0.74 ms of host time per fwd+bwd on the H200
// machine, as much as the kernels' GPU time at the short shapes (NOTES.md "the host as the short shapes' bound").
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

namespace hfab {
namespace nystrom {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptTensor = std::optional<at::Tensor>;

using FwdSig = std::tuple<at::Tensor, std::vector<at::Tensor>>(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const OptTensor&, const OptTensor&,
                                                               c10::SymInt, c10::SymInt, double, double);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    c10::SymInt, c10::SymInt, double, double, at::TensorList);

const c10::TypedOperatorHandle<FwdSig>& forward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hfab::nystrom_fwd", "").typed<FwdSig>();
  return op;
}

const c10::TypedOperatorHandle<BwdSig>& backward_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("hfab::nystrom_bwd", "").typed<BwdSig>();
  return op;
}

// hfab::nystrom_fwd's CUDA kernel, past this autograd kernel.
std::tuple<at::Tensor, std::vector<at::Tensor>> forward_below_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& conv_weight,
    const OptTensor& key_padding_mask, int64_t num_landmarks, int64_t newton_iter, double kappa_star, double scale) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return forward_op().call(q, k, v, conv_weight, key_padding_mask, c10::SymInt(num_landmarks),
                           c10::SymInt(newton_iter), kappa_star, scale);
}

OptTensor present(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

class NystromFunction : public torch::autograd::Function<NystromFunction> {
 public:
  // outputs: [out, state...] (state: nystrom_fwd's second output, non-differentiable)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& conv_weight, const OptTensor& key_padding_mask, int64_t num_landmarks,
                               int64_t newton_iter, double kappa_star, double scale) {
    auto [out, state] = forward_below_autograd(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter,
                                               kappa_star, scale);
    ctx->mark_non_differentiable(state);
    ctx->set_materialize_grads(false);
    variable_list saved{q, k, v, conv_weight.value_or(at::Tensor()), key_padding_mask.value_or(at::Tensor())};
    saved.insert(saved.end(), state.begin(), state.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["num_landmarks"] = num_landmarks;
    ctx->saved_data["newton_iter"] = newton_iter;
    ctx->saved_data["kappa_star"] = kappa_star;
    ctx->saved_data["scale"] = scale;
    variable_list outputs{out};
    outputs.insert(outputs.end(), state.begin(), state.end());
    return outputs;
  }

  // one gradient per forward argument: dq, dk, dv, dconv (undefined without conv_weight), none for the rest
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(9);
    const at::Tensor& dout = grads[0];
    if (!dout.defined()) return result;  // out took no part in the loss
    // create_graph=True: through nystrom_bwd's own autograd (which raises if its result is differentiated again)
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    const variable_list saved = ctx->get_saved_variables();
    const at::TensorList state(saved.data() + 5, saved.size() - 5);
    const OptTensor conv_weight = present(saved[3]);
    const auto [dq, dk, dv, dconv] = backward_op().call(
        dout.contiguous(), saved[0], saved[1], saved[2], conv_weight, present(saved[4]),
        c10::SymInt(ctx->saved_data["num_landmarks"].toInt()), c10::SymInt(ctx->saved_data["newton_iter"].toInt()),
        ctx->saved_data["kappa_star"].toDouble(), ctx->saved_data["scale"].toDouble(), state);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (conv_weight.has_value()) result[3] = dconv;
    return result;
  }
};

std::tuple<at::Tensor, std::vector<at::Tensor>> nystrom_fwd_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& conv_weight,
    const OptTensor& key_padding_mask, int64_t num_landmarks, int64_t newton_iter, double kappa_star, double scale) {
  const bool conv_requires_grad = conv_weight.has_value() && conv_weight->requires_grad();
  if (!at::GradMode::is_enabled() || !(q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                                       conv_requires_grad)) {  // no graph to record: no context, nothing saved
    return forward_below_autograd(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star,
                                  scale);
  }
  variable_list outputs = NystromFunction::apply(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter,
                                                 kappa_star, scale);
  return {outputs[0], std::vector<at::Tensor>(outputs.begin() + 1, outputs.end())};
}

}  // namespace
}  // namespace nystrom
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, AutogradCUDA, m) { m.impl("nystrom_fwd", &hfab::nystrom::nystrom_fwd_autograd); }
