// Autograd of hfab::stieltjes_fwd on CUDA tensors (csrc/common/autograd.h says why in C++): the contract of
// ops/stieltjes/op.py's registration. A forward that records a graph runs with backward_state=True whatever the
// caller passed (the backward needs u and sum P); the row maxima, the poles, u and sum P are saved for
// hfab::stieltjes_bwd and are not differentiable.
#include <torch/library.h>

#include "common/autograd.h"

namespace hfab {
namespace stieltjes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Forward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using FwdSig = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, bool, double, double,
                       c10::SymInt, bool);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const OptTensor&,
                                                              bool, double, double);

Forward forward_below_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale, double order,
                               int64_t newton_iter, bool backward_state) {
  static const auto op = typed_op<FwdSig>("hfab::stieltjes_fwd");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, key_padding_mask, causal, scale, order, c10::SymInt(newton_iter), backward_state);
}

class StieltjesFunction : public torch::autograd::Function<StieltjesFunction> {
 public:
  // outputs: [out, rowmax, lam, u, lsum]
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale, double order,
                               int64_t newton_iter) {
    auto [out, rowmax, lam, u, lsum] =
        forward_below_autograd(q, k, v, key_padding_mask, causal, scale, order, newton_iter, true);
    ctx->mark_non_differentiable({rowmax, lam, u, lsum});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, rowmax, lam, u, lsum, or_undefined(key_padding_mask)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["order"] = order;
    return {out, rowmax, lam, u, lsum};
  }

  // dq, dk, dv, none for the mask, causal, scale, order, newton_iter
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BwdSig>("hfab::stieltjes_bwd");
    variable_list result(8);
    if (!grads[0].defined()) return result;
    const BackwardDispatch dispatch;
    const variable_list s = ctx->get_saved_variables();
    const auto& hyper = ctx->saved_data;
    std::tie(result[0], result[1], result[2]) =
        op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], s[6], present(s[7]),
                hyper.at("causal").toBool(), hyper.at("scale").toDouble(), hyper.at("order").toDouble());
    return result;
  }
};

Forward stieltjes_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale, double order,
                               int64_t newton_iter, bool backward_state) {
  if (!records_graph({&q, &k, &v}))
    return forward_below_autograd(q, k, v, key_padding_mask, causal, scale, order, newton_iter, backward_state);
  const variable_list outputs =
      StieltjesFunction::apply(q, k, v, key_padding_mask, causal, scale, order, newton_iter);
  return {outputs[0], outputs[1], outputs[2], outputs[3], outputs[4]};
}

}  // namespace
}  // namespace stieltjes
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, AutogradCUDA, m) { m.impl("stieltjes_fwd", &hfab::stieltjes::stieltjes_fwd_autograd); }
