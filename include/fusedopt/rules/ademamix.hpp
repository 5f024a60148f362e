/// @file rules/ademamix.hpp
/// @brief AdEMAMix (Pagliardini et al. 2024, "The AdEMAMix Optimizer: Better, Faster,
/// Older"; apple/ml-ademamix's PyTorch reference) and its block scale_by_ademamix.
#pragma once

#include <cstdint>

#include "../numeric/real_power.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief AdEMAMix's two EMAs of the gradient and its direction:
/// exp_avg = beta1 exp_avg + (1 - beta1) grad (the fast EMA; with beta1 = 0 it is the gradient
/// and need not be bound), exp_avg_slow = beta3_t exp_avg_slow + (1 - beta3_t) grad,
/// exp_avg_sq = beta2 exp_avg_sq + (1 - beta2) grad^2,
/// update = (exp_avg / bc1 + alpha_t exp_avg_slow) / (sqrt(exp_avg_sq) / sqrt(bc2) + eps),
/// bc_i = 1 - beta_i^t, computed with the corrections folded into per-step constants (one
/// division per element, as scale_by_adam). The reference's schedulers, with t the step:
/// alpha_t = alpha min(1, t / alpha_warmup) and beta3_t = f^-1((1 - a) f(beta1) + a f(beta3)),
/// a = t / beta3_warmup, while t < beta3_warmup, f(b) = ln(0.5) / ln(b + 1e-8) - 1,
/// f^-1(x) = 0.5^(1 / (x + 1)) (the half-life is interpolated linearly); a warmup of 0 is the
/// reference's None (no scheduler).
struct scale_by_ademamix {
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> beta3{0.9999};
  scalar<double> alpha{2.0};
  std::int64_t alpha_warmup = 0;
  std::int64_t beta3_warmup = 0;
  scalar<double> eps{1e-8};

  using reads = slots<slot::grad_t, slot::exp_avg_t, slot::exp_avg_slow_t, slot::exp_avg_sq_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_slow_t, slot::exp_avg_sq_t>;

  /// The reference's `linear_hl_warmup_scheduler` from beta1 to beta3 at step t.
  FUSEDOPT_HOST_DEVICE static double scheduled_beta3(double beta1, double beta3, std::int64_t warmup, std::int64_t t)
  {
    if (t >= warmup) { return beta3; }
    double const a = static_cast<double>(t) / static_cast<double>(warmup);
    double const log_half = math::portable_log(0.5);
    double const f1 = log_half / math::portable_log(beta1 + 1e-8) - 1.0;
    double const f3 = log_half / math::portable_log(beta3 + 1e-8) - 1.0;
    return math::portable_pow(0.5, 1.0 / ((1.0 - a) * f1 + a * f3 + 1.0));
  }

  struct prepared {
    double beta1, beta2, beta3;
    double scaled_eps;  ///< eps sqrt(bc2)
    double fast_scale;  ///< sqrt(bc2) / bc1
    double slow_scale;  ///< alpha_t sqrt(bc2)

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T fast = g;
      if constexpr (E::has(slot::exp_avg)) {
        T& m = e[slot::exp_avg];
        m = math::select(beta1 != 0.0, m * static_cast<T>(beta1) + static_cast<T>(1.0 - beta1) * g, m);
        fast = math::select(beta1 != 0.0, m, g);
      }
      T& slow = e[slot::exp_avg_slow];
      slow = slow * static_cast<T>(beta3) + static_cast<T>(1.0 - beta3) * g;
      T& v = e[slot::exp_avg_sq];
      v = v * static_cast<T>(beta2) + static_cast<T>(1.0 - beta2) * g * g;
      T const denom = math::sqrt(v) + static_cast<T>(scaled_eps);
      e[slot::update] = (fast * static_cast<T>(fast_scale) + slow * static_cast<T>(slow_scale)) / denom;
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    std::int64_t const t = s.step.get();
    math::power_pair const powers = math::ipow_pair(b1, b2, t);
    double const bc2_sqrt = math::sqrt(1.0 - powers.second);
    double const alpha_t = t < alpha_warmup ? static_cast<double>(t) / static_cast<double>(alpha_warmup) * alpha.get()
                                            : alpha.get();
    double const b3 = scheduled_beta3(b1, beta3.get(), beta3_warmup, t);
    return {b1, b2, b3, eps.get() * bc2_sqrt, bc2_sqrt / (1.0 - powers.first), alpha_t * bc2_sqrt};
  }

  /// @throws fusedopt::error for what the reference rejects (betas outside [0, 1), negative
  /// alpha or eps), negative warmups, and beta1 != 0 without `exp_avg` bound.
  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("ademamix: beta1", beta1, detail::unit_interval);
    detail::expect_range("ademamix: beta2", beta2, detail::unit_interval);
    detail::expect_range("ademamix: beta3", beta3, detail::unit_interval);
    detail::expect_range("ademamix: alpha", alpha, detail::non_negative);
    detail::expect_range("ademamix: eps", eps, detail::non_negative);
    FUSEDOPT_EXPECTS(alpha_warmup >= 0 && beta3_warmup >= 0, "ademamix: alpha_warmup and beta3_warmup must not be negative");
    FUSEDOPT_EXPECTS(has_slot(bound, slot::exp_avg) || (!beta1.is_pointer() && beta1.value == 0),
                     "ademamix: beta1 != 0 needs slot 'exp_avg' (the fast EMA) bound");
  }
};

/// @brief AdEMAMix as apple/ml-ademamix's PyTorch reference (its defaults; bitsandbytes' class
/// defaults to alpha 5 and weight_decay 1e-2). Slots: param, grad, exp_avg (the fast EMA,
/// the reference's exp_avg_fast; not needed with beta1 = 0), exp_avg_slow, exp_avg_sq. The
/// chain: negate_gradient_if(maximize) -> scale_by_ademamix -> add_decayed_weights (the
/// reference's update += weight_decay * param) -> scale_by_lr -> apply_update.
struct ademamix : chained<ademamix, chain_rule<negate_gradient_if, scale_by_ademamix, add_decayed_weights, scale_by_lr,
                                               apply_update>> {
  scalar<double> lr{1e-3};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> beta3{0.9999};
  scalar<double> alpha{2.0};
  std::int64_t beta3_warmup = 0;  ///< steps of the beta3 scheduler; 0: none
  std::int64_t alpha_warmup = 0;  ///< steps of the alpha scheduler; 0: none
  scalar<double> eps{1e-8};
  scalar<double> weight_decay{0.0};
  bool maximize = false;  ///< ascend: the gradient is negated first (not in the reference)

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize},
                 scale_by_ademamix{beta1, beta2, beta3, alpha, alpha_warmup, beta3_warmup, eps},
                 add_decayed_weights{weight_decay}, scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
