// Autograd of hfab::race_fwd on CUDA tensors (csrc/common/autograd.h says why in C++): the contract of
// ops/race/op.py's registration. hfab::race_bwd recomputes what it needs from the inputs; planes stay fixed (no
// gradient), beta gets one.
#include <torch/library.h>

#include "common/autograd.h"

namespace hfab {
namespace race {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using FwdSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const OptTensor&, bool);
using BwdSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const OptTensor&, bool);

at::Tensor forward_below_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& planes, const at::Tensor& beta, const OptTensor& key_padding_mask,
                                  bool causal) {
  static const auto op = typed_op<FwdSig>("hfab::race_fwd");
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(q, k, v, planes, beta, key_padding_mask, causal);
}

class RaceFunction : public torch::autograd::Function<RaceFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& planes, const at::Tensor& beta, const OptTensor& key_padding_mask,
                            bool causal) {
    ctx->save_for_backward({q, k, v, planes, beta, or_undefined(key_padding_mask)});
    ctx->saved_data["causal"] = causal;
    return forward_below_autograd(q, k, v, planes, beta, key_padding_mask, causal);
  }

  // dq, dk, dv, none for planes, dbeta, none for the mask and causal
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = typed_op<BwdSig>("hfab::race_bwd");
    variable_list result(7);
    const BackwardDispatch dispatch;
    const variable_list s = ctx->get_saved_variables();
    std::tie(result[0], result[1], result[2], result[4]) =
        op.call(grads[0].contiguous(), s[0], s[1], s[2], s[3], s[4], present(s[5]),
                ctx->saved_data.at("causal").toBool());
    return result;
  }
};

at::Tensor race_fwd_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& planes,
                             const at::Tensor& beta, const OptTensor& key_padding_mask, bool causal) {
  if (!records_graph({&q, &k, &v, &planes, &beta}))
    return forward_below_autograd(q, k, v, planes, beta, key_padding_mask, causal);
  return RaceFunction::apply(q, k, v, planes, beta, key_padding_mask, causal);
}

}  // namespace
}  // namespace race
}  // namespace hfab

TORCH_LIBRARY_IMPL(hfab, AutogradCUDA, m) { m.impl("race_fwd", &hfab::race::race_fwd_autograd); }
