/// @file rules/adamax.hpp
/// @brief Adamax (torch.optim.Adamax) and its blocks: scale_by_adamax and the bias-corrected
/// learning rate scale_by_bias_corrected_lr.
#pragma once

#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief Adamax's direction (no bias correction):
/// exp_avg += (1 - beta1) * (grad - exp_avg);
/// exp_inf = max(beta2 * exp_inf, |grad| + eps) (NaN-propagating, as torch.maximum);
/// update = exp_avg / exp_inf.
struct scale_by_adamax {
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> eps{1e-8};

  using reads = slots<slot::grad_t, slot::exp_avg_t, slot::exp_inf_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_inf_t>;

  /// The per-step values: the hyperparameters resolved once per thread.
  struct prepared {
    double beta1, beta2, eps;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = detail::value_t<E>;
      T const g = e[slot::grad];
      T& m = e[slot::exp_avg];
      T& u = e[slot::exp_inf];
      m += static_cast<T>(1.0 - beta1) * (g - m);
      u = math::maximum(static_cast<T>(beta2) * u, math::abs(g) + static_cast<T>(eps));
      e[slot::update] = m / u;
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {beta1.get(), beta2.get(), eps.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("beta1", beta1, detail::unit_interval);
    detail::expect_range("beta2", beta2, detail::unit_interval);
    detail::expect_range("eps", eps, detail::non_negative);
  }
};

/// @brief torch.optim.Adamax. Slots: param, grad, exp_avg, exp_inf (both start at zero).
///
/// The chain: negate_gradient_if(maximize) -> add_weight_decay -> scale_by_adamax
/// -> scale_by_bias_corrected_lr -> apply_update.
struct adamax : chained<adamax, chain_rule<negate_gradient_if, add_weight_decay, scale_by_adamax,
                                           scale_by_bias_corrected_lr, apply_update>> {
  scalar<double> lr{2e-3};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> eps{1e-8};
  scalar<double> weight_decay{0.0};
  bool maximize = false;

  /// @brief The building blocks this optimizer is made of, with its hyperparameters.
  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay}, scale_by_adamax{beta1, beta2, eps},
                 scale_by_bias_corrected_lr{lr, {beta1}}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
