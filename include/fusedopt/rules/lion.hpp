/// @file rules/lion.hpp
/// @brief Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") and its
/// core block, scale_by_lion.
#pragma once

#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief Lion's sign direction and momentum:
/// update = sign(beta1 * exp_avg + (1 - beta1) * grad), then
/// exp_avg = beta2 * exp_avg + (1 - beta2) * grad. The direction interpolates with beta1 and
/// the stored momentum with beta2; sign(0) is 0.
struct scale_by_lion {
  scalar<double> beta1{0.9};  ///< interpolation between momentum and gradient for the direction
  scalar<double> beta2{0.99};  ///< decay of the stored momentum

  using reads = slots<slot::grad_t, slot::exp_avg_t>;
  using writes = slots<slot::exp_avg_t>;

  /// @brief The per-step values, resolved once per thread.
  struct prepared {
    double beta1, beta2;

    /// @brief Updates one element.
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T& m = e[slot::exp_avg];
      e[slot::update] = math::sign(static_cast<T>(beta1) * m + static_cast<T>(1.0 - beta1) * g);
      m = static_cast<T>(beta2) * m + static_cast<T>(1.0 - beta2) * g;
    }
  };

  /// @brief The per-step values of step `step` (or of any step, where they do not depend on it).
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return prepared{beta1.get(), beta2.get()}; }

  /// @brief Rejects option values torch (or the reference implementation) rejects.
  /// @throws fusedopt::error naming the option.
  template <class Bound>
  void validate(Bound) const
  {
    // The reference implementation (lion-pytorch) accepts betas in the closed interval.
    detail::expect_range("lion: beta1", beta1, detail::closed_unit_interval);
    detail::expect_range("lion: beta2", beta2, detail::closed_unit_interval);
  }
};

/// @brief Lion, as in the paper and its reference implementation lion-pytorch, plus
/// torch's `maximize`. Slots: param, grad, exp_avg.
///
/// Per element: param *= 1 - lr * weight_decay; param -= lr * sign(beta1 * exp_avg + (1 - beta1) * grad);
/// exp_avg = beta2 * exp_avg + (1 - beta2) * grad.
/// The chain: negate_gradient_if(maximize) -> decoupled_weight_decay -> scale_by_lion ->
/// scale_by_lr -> apply_update. Lion's updates have unit size per element, so its lr is
/// typically 3-10x smaller than AdamW's and its weight_decay as much larger.
struct lion : chained<lion, chain_rule<negate_gradient_if, decoupled_weight_decay, scale_by_lion, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-4};  ///< learning rate
  scalar<double> beta1{0.9};  ///< interpolation between momentum and gradient for the direction
  scalar<double> beta2{0.99};  ///< decay of the stored momentum
  scalar<double> weight_decay{0.0};  ///< decoupled weight decay: param *= 1 - lr * weight_decay
  bool maximize = false;  ///< maximize the objective (negate the gradient)

  /// @brief The building blocks this optimizer is made of, with its hyperparameters.
  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, decoupled_weight_decay{lr, weight_decay}, scale_by_lion{beta1, beta2},
                 scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
