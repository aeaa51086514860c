// Autograd of hfab::exact_fwd on CUDA tensors (csrc/common/autograd.h says why in C++): the contract of
// ops/exact/op.py's registration. out and its log-sum-exp are saved for hfab::exact_bwd; lse is not differentiable.
#include <torch/library.h>

#include "common/autograd.h"

namespace hfab {
namespace exact {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Forward = std::tuple<at::Tensor, at::Tensor>;
using FwdSig = Forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, bool, double);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const OptTensor&, bool, double);

Forward forward_below_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale) {
  static const auto op = typed_op<FwdSig>("hfab::exact_fwd");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, key_padding_mask, causal, scale);
}

class ExactFunction : public torch::autograd::Function<ExactFunction> {
 public:
  // outputs: [out, lse]
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const OptTensor& key_padding_mask, bool causal, double scale) {
    auto [out, lse] = forward_below_autograd(q, k, v, key_padding_mask, causal, scale);
    ctx->mark_non_differentiable({lse});
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, out, lse, or_undefined(key_padding_mask)});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    return {out, lse};
  }

  // dq, dk, dv, none for the mask, causal, scale
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BwdSig>("hfab::exact_bwd");
    variable_list result(6);
    if (!grads[0].defined()) return result;
    const BackwardDispatch dispatch;
    const variable_list s = ctx->get_saved_variables();
    std::tie(result[0], result[1], result[2]) =
        op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], present(s[5]),
                ctx->saved_data.at("causal").toBool(), ctx->saved_data.at("scale").toDouble());
    return result;
  }
};

Forward exact_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const OptTensor& key_padding_mask, bool causal, double scale) {
  if (!records_graph({&q, &k, &v})) return forward_below_autograd(q, k, v, key_padding_mask, causal, scale);
  const variable_list outputs = ExactFunction::apply(q, k, v, key_padding_mask, causal, scale);
  return {outputs[0], outputs[1]};
}

}  // namespace
}  // namespace exact
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, AutogradCUDA, m) { m.impl("exact_fwd", &hfab::exact::exact_fwd_autograd); }
