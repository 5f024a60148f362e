/// @file rules/adam.hpp
/// @brief Adam and AdamW (torch.optim.Adam / AdamW) and their core block, scale_by_adam.
#pragma once

#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {
/// Adam's moments of one element in torch's order of operations (Adam, NAdam and RAdam share
/// them): exp_avg += (1 - beta1) * (grad - exp_avg) (torch's lerp), exp_avg_sq = beta2 *
/// exp_avg_sq + (1 - beta2) * grad^2. Returns the new moments.
template <class T>
struct adam_moments {
  T exp_avg, exp_avg_sq;
};
template <class E>
FUSEDOPT_HOST_DEVICE adam_moments<typename E::value_type> update_adam_moments(E& e, double beta1, double beta2)
{
  using T = typename E::value_type;
  T const g = e[slot::grad];
  T& m = e[slot::exp_avg];
  T& v = e[slot::exp_avg_sq];
  m += static_cast<T>(1.0 - beta1) * (g - m);
  v = static_cast<T>(beta2) * v + static_cast<T>(1.0 - beta2) * g * g;
  return {m, v};
}
}  // namespace detail

namespace rules {

/// @brief Adam's moments and bias-corrected direction:
/// exp_avg += (1 - beta1) * (grad - exp_avg); exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2;
/// with amsgrad, max_exp_avg_sq = max(max_exp_avg_sq, exp_avg_sq) is used instead of exp_avg_sq;
/// update = (exp_avg / (1 - beta1^t)) / (sqrt(v) / sqrt(1 - beta2^t) + eps), computed with the
/// bias corrections folded into two per-step constants (bitsandbytes' arithmetic):
/// update = exp_avg / (sqrt(v) + eps c2) * (c2 / c1), c1 = 1 - beta1^t, c2 = sqrt(1 - beta2^t),
/// the constants formed in double once per step: one division and one root per element where
/// torch's order takes three divisions (within a few roundings of it; docs/decisions.md, "Adam's
/// bias corrections folded into the step's constants").
struct scale_by_adam {
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> eps{1e-8};
  bool amsgrad = false;

  using reads = slots<slot::grad_t, slot::exp_avg_t, slot::exp_avg_sq_t, slot::max_exp_avg_sq_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_sq_t, slot::max_exp_avg_sq_t>;

  struct prepared {
    double beta1, beta2;
    double scaled_eps;  ///< eps * sqrt(1 - beta2^t)
    double step_scale;  ///< sqrt(1 - beta2^t) / (1 - beta1^t)
    bool amsgrad;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      auto const [m, v] = detail::update_adam_moments(e, beta1, beta2);
      T second = v;
      if constexpr (E::has(slot::max_exp_avg_sq)) {
        // Selected, not branched on (math::select says why); without amsgrad the running
        // maximum is stored back unchanged.
        T& vmax = e[slot::max_exp_avg_sq];
        T const larger = math::maximum(vmax, v);
        vmax = math::select(amsgrad, larger, vmax);
        second = math::select(amsgrad, larger, v);
      }
      T const denom = math::sqrt(second) + static_cast<T>(scaled_eps);
      e[slot::update] = m / denom * static_cast<T>(step_scale);
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& step) const
  {
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    std::int64_t const t = step.step.get();
    math::power_pair const powers = math::ipow_pair(b1, b2, t);
    double const bias_correction1 = 1.0 - powers.first;
    double const bias_correction2_sqrt = math::sqrt(1.0 - powers.second);
    return prepared{b1, b2, eps.get() * bias_correction2_sqrt, bias_correction2_sqrt / bias_correction1, amsgrad};
  }

  template <class Bound>
  void validate(Bound bound) const
  {
    FUSEDOPT_EXPECTS(!amsgrad || has_slot(bound, slot::max_exp_avg_sq), "amsgrad needs slot 'max_exp_avg_sq' bound");
    detail::expect_range("beta1", beta1, detail::unit_interval);
    detail::expect_range("beta2", beta2, detail::unit_interval);
    detail::expect_range("eps", eps, detail::non_negative);
  }
};

/// @brief torch.optim.Adam (L2 weight decay folded into the gradient).
/// Slots: param, grad, exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad.
/// The chain: negate_gradient_if(maximize) -> add_weight_decay -> scale_by_adam -> scale_by_lr -> apply_update.
struct adam : chained<adam, chain_rule<negate_gradient_if, add_weight_decay, scale_by_adam, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-3};           ///< learning rate
  scalar<double> beta1{0.9};         ///< decay of the first moment (exp_avg)
  scalar<double> beta2{0.999};       ///< decay of the second moment (exp_avg_sq)
  scalar<double> eps{1e-8};          ///< added to the bias-corrected sqrt(exp_avg_sq)
  scalar<double> weight_decay{0.0};  ///< L2: grad += weight_decay * param
  bool amsgrad = false;              ///< use the running maximum of exp_avg_sq (slot max_exp_avg_sq)
  bool maximize = false;             ///< ascend: the gradient is negated first

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay},
                 scale_by_adam{beta1, beta2, eps, amsgrad}, scale_by_lr{lr}, apply_update{});
  }
};

/// @brief torch.optim.AdamW (decoupled weight decay: param *= 1 - lr * weight_decay).
/// The chain: negate_gradient_if(maximize) -> decoupled_weight_decay -> scale_by_adam -> scale_by_lr -> apply_update.
struct adamw
  : chained<adamw, chain_rule<negate_gradient_if, decoupled_weight_decay, scale_by_adam, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-3};            ///< learning rate
  scalar<double> beta1{0.9};          ///< decay of the first moment (exp_avg)
  scalar<double> beta2{0.999};        ///< decay of the second moment (exp_avg_sq)
  scalar<double> eps{1e-8};           ///< added to the bias-corrected sqrt(exp_avg_sq)
  scalar<double> weight_decay{1e-2};  ///< decoupled: param *= 1 - lr * weight_decay
  bool amsgrad = false;               ///< use the running maximum of exp_avg_sq (slot max_exp_avg_sq)
  bool maximize = false;              ///< ascend: the gradient is negated first

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, decoupled_weight_decay{lr, weight_decay},
                 scale_by_adam{beta1, beta2, eps, amsgrad}, scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
