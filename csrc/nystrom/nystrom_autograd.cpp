// Autograd of hfab::nystrom_fwd on CUDA tensors (csrc/common/autograd.h says why in C++): the contract of
// ops/nystrom/op.py's registration. The forward's state (its second output) is saved non-differentiable and handed
// to hfab::nystrom_bwd; no zero gradient is materialised for it.
#include <torch/library.h>

#include "common/autograd.h"

namespace hfab {
namespace nystrom {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Forward = std::tuple<at::Tensor, std::vector<at::Tensor>>;
using FwdSig = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                       c10::SymInt, c10::SymInt, double, double);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    c10::SymInt, c10::SymInt, double, double, at::TensorList);

// hfab::nystrom_fwd's CUDA kernel, past this autograd kernel.
Forward forward_below_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& conv_weight, const OptTensor& key_padding_mask, int64_t num_landmarks,
                               int64_t newton_iter, double kappa_star, double scale) {
  static const auto op = typed_op<FwdSig>("hfab::nystrom_fwd");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, conv_weight, key_padding_mask, c10::SymInt(num_landmarks), c10::SymInt(newton_iter),
                 kappa_star, scale);
}

class NystromFunction : public torch::autograd::Function<NystromFunction> {
 public:
  // outputs: [out, state...]
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& conv_weight, const OptTensor& key_padding_mask, int64_t num_landmarks,
                               int64_t newton_iter, double kappa_star, double scale) {
    auto [out, state] = forward_below_autograd(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter,
                                               kappa_star, scale);
    ctx->mark_non_differentiable(state);
    ctx->set_materialize_grads(false);
    variable_list saved{q, k, v, or_undefined(conv_weight), or_undefined(key_padding_mask)};
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
    static const auto op = typed_op<BwdSig>("hfab::nystrom_bwd");
    variable_list result(9);
    if (!grads[0].defined()) return result;  // out took no part in the loss
    const BackwardDispatch dispatch;
    const variable_list saved = ctx->get_saved_variables();
    const at::TensorList state(saved.data() + 5, saved.size() - 5);
    const auto& hyper = ctx->saved_data;
    const auto [dq, dk, dv, dconv] = op.call(
        grads[0].contiguous(), saved[0], saved[1], saved[2], present(saved[3]), present(saved[4]),
        c10::SymInt(hyper.at("num_landmarks").toInt()), c10::SymInt(hyper.at("newton_iter").toInt()),
        hyper.at("kappa_star").toDouble(), hyper.at("scale").toDouble(), state);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (saved[3].defined()) result[3] = dconv;
    return result;
  }
};

Forward nystrom_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const OptTensor& conv_weight, const OptTensor& key_padding_mask, int64_t num_landmarks,
                             int64_t newton_iter, double kappa_star, double scale) {
  const at::Tensor conv = or_undefined(conv_weight);
  if (!records_graph({&q, &k, &v, &conv}))
    return forward_below_autograd(q, k, v, conv_weight, key_padding_mask, num_landmarks, newton_iter, kappa_star,
                                  scale);
  const variable_list outputs = NystromFunction::apply(q, k, v, conv_weight, key_padding_mask, num_landmarks,
                                                       newton_iter, kappa_star, scale);
  return {outputs[0], std::vector<at::Tensor>(outputs.begin() + 1, outputs.end())};
}

}  // namespace
}  // namespace nystrom
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, AutogradCUDA, m) { m.impl("nystrom_fwd", &hfab::nystrom::nystrom_fwd_autograd); }
