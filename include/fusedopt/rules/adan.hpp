/// @file rules/adan.hpp
/// @brief Adan (Xie et al. 2022, "Adan: Adaptive Nesterov Momentum Algorithm for Faster
/// Optimizing Deep Models"; sail-sg/Adan's `adan.py`) and its blocks.
#pragma once

#include <cstdint>

#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief Adan's three moments and direction, in the reference's order (betas are retention
/// factors, the paper's 1 - beta): diff = grad - previous grad (0 at step 1, where the
/// reference sets neg_pre_grad = -grad); exp_avg = beta1 exp_avg + (1 - beta1) grad;
/// exp_avg_diff = beta2 exp_avg_diff + (1 - beta2) diff; q = beta2 diff + grad;
/// exp_avg_sq = beta3 exp_avg_sq + (1 - beta3) q^2; neg_pre_grad = -grad;
/// update = (exp_avg / bc1 + beta2 exp_avg_diff / bc2) / (sqrt(exp_avg_sq) / sqrt(bc3) + eps),
/// bc_i = 1 - beta_i^t, with the corrections folded into per-step constants (one division).
struct scale_by_adan {
  scalar<double> beta1{0.98};
  scalar<double> beta2{0.92};
  scalar<double> beta3{0.99};
  scalar<double> eps{1e-8};

  using reads = slots<slot::grad_t, slot::exp_avg_t, slot::exp_avg_diff_t, slot::exp_avg_sq_t, slot::neg_pre_grad_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_diff_t, slot::exp_avg_sq_t, slot::neg_pre_grad_t>;

  struct prepared {
    double beta1, beta2, beta3;
    double scaled_eps;  ///< eps sqrt(bc3)
    double avg_scale;   ///< sqrt(bc3) / bc1
    double diff_scale;  ///< beta2 sqrt(bc3) / bc2
    bool first_step;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T const diff = g + math::select(first_step, -g, e[slot::neg_pre_grad]);
      T& m = e[slot::exp_avg];
      T& d = e[slot::exp_avg_diff];
      T& n = e[slot::exp_avg_sq];
      m = m * static_cast<T>(beta1) + static_cast<T>(1.0 - beta1) * g;
      d = d * static_cast<T>(beta2) + static_cast<T>(1.0 - beta2) * diff;
      T const q = diff * static_cast<T>(beta2) + g;
      n = n * static_cast<T>(beta3) + static_cast<T>(1.0 - beta3) * q * q;
      e[slot::neg_pre_grad] = -g;
      T const denom = math::sqrt(n) + static_cast<T>(scaled_eps);
      e[slot::update] = (m * static_cast<T>(avg_scale) + d * static_cast<T>(diff_scale)) / denom;
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    double const b3 = beta3.get();
    std::int64_t const t = s.step.get();
    math::power_pair const powers = math::ipow_pair(b1, b2, t);
    double const bc3_sqrt = math::sqrt(1.0 - math::ipow(b3, t));
    return {b1, b2, b3, eps.get() * bc3_sqrt, bc3_sqrt / (1.0 - powers.first), b2 * bc3_sqrt / (1.0 - powers.second), t <= 1};
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("adan: beta1", beta1, detail::unit_interval);
    detail::expect_range("adan: beta2", beta2, detail::unit_interval);
    detail::expect_range("adan: beta3", beta3, detail::unit_interval);
    detail::expect_range("adan: eps", eps, detail::non_negative);
  }
};

/// @brief The proximal form of weight decay, after the step: param /= 1 + lr * weight_decay
/// (Adan without no_prox). The divisor is exactly 1 when weight_decay is 0.
struct proximal_weight_decay {
  scalar<double> lr{1e-3};
  scalar<double> weight_decay{0.0};
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;

  struct prepared {
    double divisor;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::param] = e[slot::param] / static_cast<typename E::value_type>(divisor);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {1.0 + lr.get() * weight_decay.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("weight_decay", weight_decay, detail::non_negative);
  }
};

/// @brief Adan as sail-sg/Adan computes it (its defaults). Slots: param, grad, exp_avg,
/// exp_avg_diff, exp_avg_sq, neg_pre_grad (all may start uninitialised but exp_avg,
/// exp_avg_diff and exp_avg_sq, which start at zero). The chain: negate_gradient_if(maximize)
/// -> decoupled_weight_decay (with no_prox) -> scale_by_adan -> scale_by_lr -> apply_update ->
/// proximal_weight_decay (without no_prox); the decay not chosen gets 0.
///
/// The reference's `max_grad_norm` (clipping by the global gradient norm, default off) is
/// chain(clip_by_global_norm{max_norm}, adan{...}): one more read of the gradients; its
/// coefficient divides by norm + 1e-6 where Adan's divides by norm + eps.
struct adan : chained<adan, chain_rule<negate_gradient_if, decoupled_weight_decay, scale_by_adan, scale_by_lr,
                                       apply_update, proximal_weight_decay>> {
  scalar<double> lr{1e-3};
  scalar<double> beta1{0.98};
  scalar<double> beta2{0.92};
  scalar<double> beta3{0.99};
  scalar<double> eps{1e-8};
  scalar<double> weight_decay{0.0};
  bool no_prox = false;   ///< decay before the step (param *= 1 - lr wd) instead of after it (param /= 1 + lr wd)
  bool maximize = false;  ///< ascend: the gradient is negated first (not in the reference)

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    scalar<double> const none{0.0};
    return chain(negate_gradient_if{maximize}, decoupled_weight_decay{lr, no_prox ? weight_decay : none},
                 scale_by_adan{beta1, beta2, beta3, eps}, scale_by_lr{lr}, apply_update{},
                 proximal_weight_decay{lr, no_prox ? none : weight_decay});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
