/// @file rules/radam.hpp
/// @brief RAdam (torch.optim.RAdam) and its core block, scale_by_radam.
#pragma once

#include <cstdint>

#include "adam.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief RAdam's moments and rectified direction (Liu et al. 2020, as torch.optim.RAdam):
/// exp_avg and exp_avg_sq as Adam's (detail::update_adam_moments);
/// m_hat = exp_avg / (1 - beta1^t);
/// rho_inf = 2 / (1 - beta2) - 1, rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t);
/// when rho_t > 5: update = m_hat * r_t * sqrt(1 - beta2^t) / (sqrt(exp_avg_sq) + eps) with
/// r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t));
/// otherwise (the variance estimate is not yet trusted) update = m_hat.
///
/// rho_t, the branch and r_t depend only on the step, so `prepare` settles them once per
/// thread; the per-element code only selects.
struct scale_by_radam {
  scalar<double> beta1{0.9};  ///< decay of the first moment (torch's betas[0])
  scalar<double> beta2{0.999};  ///< decay of the second moment (torch's betas[1])
  scalar<double> eps{1e-8};  ///< added to the denominator for numerical stability

  using reads = slots<slot::grad_t, slot::exp_avg_t, slot::exp_avg_sq_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_sq_t>;

  /// @brief The per-step values, resolved once per thread.
  struct prepared {
    double beta1, beta2, eps, bias_correction1;
    /// r_t * sqrt(1 - beta2^t) when rectified.
    double rectifier;
    bool rectified;

    /// @brief Updates one element.
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      auto const [m, v] = detail::update_adam_moments(e, beta1, beta2);
      T const m_hat = m / static_cast<T>(bias_correction1);
      T const adaptive = static_cast<T>(rectifier) / (math::sqrt(v) + static_cast<T>(eps));
      e[slot::update] = rectified ? m_hat * adaptive : m_hat;
    }
  };

  /// @brief The per-step values of step `step` (or of any step, where they do not depend on it).
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& step) const
  {
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    std::int64_t const t = step.step.get();
    math::power_pair const powers = math::ipow_pair(b1, b2, t);
    double const beta2_t = powers.second;
    double const bias_correction2 = 1.0 - beta2_t;
    double const rho_inf = 2.0 / (1.0 - b2) - 1.0;
    double const rho_t = rho_inf - 2.0 * static_cast<double>(t) * beta2_t / bias_correction2;
    bool const rectified = rho_t > 5.0;
    double rectifier = 0.0;
    if (rectified) {
      double const r = math::sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t));
      rectifier = r * math::sqrt(bias_correction2);
    }
    return prepared{b1, b2, eps.get(), 1.0 - powers.first, rectifier, rectified};
  }

  /// @brief Rejects option values torch (or the reference implementation) rejects.
  /// @throws fusedopt::error naming the option.
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("radam: beta1", beta1, detail::unit_interval);
    detail::expect_range("radam: beta2", beta2, detail::unit_interval);
    detail::expect_range("radam: eps", eps, detail::non_negative);
  }
};

/// @brief torch.optim.RAdam, with all its options (decoupled_weight_decay gives RAdamW).
/// Slots: param, grad, exp_avg, exp_avg_sq.
///
/// The chain: negate_gradient_if(maximize) -> decoupled_weight_decay (when
/// decoupled_weight_decay) -> add_weight_decay (otherwise) -> scale_by_radam -> scale_by_lr
/// -> apply_update. The block of the weight decay not chosen gets weight_decay 0 and does
/// nothing.
struct radam : chained<radam, chain_rule<negate_gradient_if, decoupled_weight_decay, add_weight_decay, scale_by_radam,
                                         scale_by_lr, apply_update>> {
  scalar<double> lr{1e-3};  ///< learning rate
  scalar<double> beta1{0.9};  ///< decay of the first moment (torch's betas[0])
  scalar<double> beta2{0.999};  ///< decay of the second moment (torch's betas[1])
  scalar<double> eps{1e-8};  ///< added to the denominator for numerical stability
  scalar<double> weight_decay{0.0};  ///< weight decay: L2 penalty on the gradient, or decoupled (see decoupled_weight_decay)
  bool decoupled_weight_decay = false;  ///< param *= 1 - lr * weight_decay instead of the L2 penalty
  bool maximize = false;  ///< maximize the objective (negate the gradient)

  /// @brief The building blocks this optimizer is made of, with its hyperparameters.
  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    scalar<double> const none{0.0};
    return chain(negate_gradient_if{maximize},
                 rules::decoupled_weight_decay{lr, decoupled_weight_decay ? weight_decay : none},
                 add_weight_decay{decoupled_weight_decay ? none : weight_decay}, scale_by_radam{beta1, beta2, eps},
                 scale_by_lr{lr}, apply_update{});
  }

  /// @throws fusedopt::error for a negative weight_decay, and for whatever the chain's blocks reject.
  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("radam: weight_decay", weight_decay, detail::non_negative);
    chained::validate(bound);
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
