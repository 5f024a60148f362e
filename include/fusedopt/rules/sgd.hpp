/// @file rules/sgd.hpp
/// @brief SGD with momentum, dampening, Nesterov, weight decay and maximize (torch.optim.SGD).
#pragma once

#include "../chain.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief torch.optim.SGD. Slots: param, grad, and momentum_buffer when momentum != 0.
///
/// The chain: negate_gradient_if(maximize) -> add_weight_decay -> momentum -> scale_by_lr
/// -> apply_update. As in torch, the momentum buffer is set to the gradient at step 1.
struct sgd : chained<sgd, chain_rule<negate_gradient_if, add_weight_decay, momentum, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-3};            ///< learning rate
  scalar<double> momentum{0.0};       ///< heavy-ball factor; 0: plain SGD, no buffer needed
  scalar<double> dampening{0.0};      ///< the gradient enters the buffer scaled by 1 - dampening
  scalar<double> weight_decay{0.0};   ///< L2: grad += weight_decay * param
  bool nesterov = false;              ///< step along grad + momentum * buf (needs dampening 0)
  bool maximize = false;              ///< ascend: the gradient is negated first

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay},
                 rules::momentum{momentum, dampening, nesterov}, scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
