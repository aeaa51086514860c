// Autograd of hfab::stieltjes_fwd on CUDA tensors (csrc/common/autograd.h says why in C++): the contract of
// ops/stieltjes/op.py's registration. out, the row maxima and the poles are saved for hfab::stieltjes_bwd; the last
// two are not differentiable.
#include <torch/library.h>

#include "common/autograd.h"

namespace hfab {
namespace stieltjes {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Forward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using FwdSig = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, bool, double, double,
                       c10::SymInt);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const OptTensor&, bool, double,
                                                              double);

Forward forward_below_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale, double order,
                               int64_t newton_iter) {
  static const auto op = typed_op<FwdSig>("hfab::stieltjes_fwd");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, key_padding_mask, causal, scale, order, c10::SymInt(newton_iter));
}

class StieltjesFunction : public torch::autograd::Function<StieltjesFunction> {
 public:
  // outputs: [out, rowmax, lam]
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale, double order,
                               int64_t newton_iter) {
    auto [out, rowmax, lam] = forward_below_autograd(q, k, v, key_padding_mask, causal, scale, order, newton_iter);
    ctx->mark_non_differentiable({rowmax, lam});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, out, rowmax, lam, or_undefined(key_padding_mask)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["order"] = order;
    return {out, rowmax, lam};
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
        op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], s[5], present(s[6]),
                hyper.at("causal").toBool(), hyper.at("scale").toDouble(), hyper.at("order").toDouble());
    return result;
  }
};

Forward stieltjes_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale, double order,
                               int64_t newton_iter) {
  if (!records_graph({&q, &k, &v}))
    return forward_below_autograd(q, k, v, key_padding_mask, causal, scale, order, newton_iter);
  const variable_list outputs =
      StieltjesFunction::apply(q, k, v, key_padding_mask, causal, scale, order, newton_iter);
  return {outputs[0], outputs[1], outputs[2]};
}

}  // namespace
}  // namespace stieltjes
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, AutogradCUDA, m) { m.impl("stieltjes_fwd", &hfab::stieltjes::stieltjes_fwd_autograd); }
