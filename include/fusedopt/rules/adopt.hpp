/// @file rules/adopt.hpp
/// @brief ADOPT (Taniguchi et al. 2024, "ADOPT: Modified Adam Can Converge with Any beta2 with
/// the Optimal Rate"; iShohei220/adopt's `_single_tensor_adopt`) and its block scale_by_adopt.
#pragma once

#include <cstdint>

#include "../numeric/real_power.hpp"
#include "../numeric/torch_ops.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief ADOPT's direction. Step 1 only initialises: exp_avg_sq += grad^2, update = 0 (no
/// decay either). Then, with k = t - 1 (the reference's step before its increment):
/// n = clamp(grad / max(sqrt(exp_avg_sq), eps), -k^clip_exp, k^clip_exp) (no clamp without
/// `clip`; the reference's default clip_lambda is step**0.25), exp_avg = lerp(exp_avg, n,
/// 1 - beta1), update = exp_avg (+ weight_decay * param: the decoupled decay, folded in so
/// that the learning-rate block scales it), and only then exp_avg_sq = beta2 exp_avg_sq +
/// (1 - beta2) grad^2: the second moment of step t does not see its own gradient.
struct scale_by_adopt {
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.9999};
  scalar<double> eps{1e-6};
  bool clip = true;                  ///< clamp the normalised gradient (the reference's clip_lambda)
  scalar<double> clip_exp{0.25};     ///< the bound is k^clip_exp
  scalar<double> weight_decay{0.0};  ///< decoupled decay (the reference's decouple=True)

  using reads = slots<slot::grad_t, slot::param_t, slot::exp_avg_t, slot::exp_avg_sq_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_sq_t>;

  struct prepared {
    double beta1, beta2, eps, bound, weight_decay;
    bool first_step;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T& m = e[slot::exp_avg];
      T& v = e[slot::exp_avg_sq];
      T const denom = math::maximum(math::sqrt(v), static_cast<T>(eps));  // torch.clamp(min=eps), NaN kept
      T const normed = g / denom;
      T const b = static_cast<T>(bound);
      T const next = math::lerp(m, math::clamp(normed, -b, b), static_cast<T>(1.0 - beta1));
      m = math::select(first_step, m, next);
      T const decayed = math::select(weight_decay != 0.0, next + static_cast<T>(weight_decay) * e[slot::param], next);
      e[slot::update] = math::select(first_step, T(0), decayed);
      v = math::select(first_step, v + g * g, v * static_cast<T>(beta2) + static_cast<T>(1.0 - beta2) * g * g);
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    double const k = static_cast<double>(s.step.get()) - 1.0;
    double const bound = clip && k >= 1.0 ? math::portable_pow(k, clip_exp.get()) : HUGE_VAL;
    return {beta1.get(), beta2.get(), eps.get(), bound, weight_decay.get(), k < 1.0};
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("adopt: beta1", beta1, detail::unit_interval);
    detail::expect_range("adopt: beta2", beta2, detail::unit_interval);
    detail::expect_range("adopt: eps", eps, detail::non_negative);
    detail::expect_range("adopt: weight_decay", weight_decay, detail::non_negative);
  }
};

/// @brief ADOPT as its reference computes it (its defaults). Slots: param, grad, exp_avg,
/// exp_avg_sq (both starting at zero). The chain: negate_gradient_if(maximize) ->
/// add_weight_decay (without decouple) -> scale_by_adopt (the decoupled decay with decouple) ->
/// scale_by_lr -> apply_update.
struct adopt
  : chained<adopt, chain_rule<negate_gradient_if, add_weight_decay, scale_by_adopt, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-3};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.9999};
  scalar<double> eps{1e-6};
  bool clip = true;               ///< the reference's clip_lambda (None: false)
  scalar<double> clip_exp{0.25};  ///< clip_lambda = step ** clip_exp
  scalar<double> weight_decay{0.0};
  bool decouple = false;  ///< decoupled decay (param -= lr wd param) instead of L2 into the gradient
  bool maximize = false;  ///< ascend: the gradient is negated first

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    scalar<double> const none{0.0};
    return chain(negate_gradient_if{maximize}, add_weight_decay{decouple ? none : weight_decay},
                 scale_by_adopt{beta1, beta2, eps, clip, clip_exp, decouple ? weight_decay : none}, scale_by_lr{lr},
                 apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
