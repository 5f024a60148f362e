/// @file rules/lamb.hpp
/// @brief LAMB (You et al., "Large Batch Optimization for Deep Learning: Training BERT in 76
/// minutes") with the options of NVIDIA apex's FusedLAMB / NVLAMB, and its blocks:
/// scale_by_lamb (moments and direction) and scale_by_trust_ratio (a per-tensor reduction).
///
/// One step is two passes over memory: a reduction pass that computes each tensor's
/// ||param||^2 and ||update||^2 (reading param, grad, exp_avg, exp_avg_sq and storing
/// nothing), then the update pass (the same four reads, three writes: param, exp_avg,
/// exp_avg_sq). 11 element accesses against Adam's 7: 1.57x Adam's bytes. apex needs five
/// launches for the same step and stores the update in the gradient buffer between them.
#pragma once

#include <cfloat>
#include <cstdint>

#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"
#include "norms.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief LAMB's moments and direction, as apex's multi_tensor_lamb stage 1:
/// exp_avg = beta1 * exp_avg + beta3 * grad (beta3 = 1 - beta1 with grad_averaging, else 1);
/// exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad^2;
/// update = (exp_avg / bc1) / (sqrt(exp_avg_sq / bc2) + eps) + weight_decay * param,
/// with bc_i = 1 - beta_i^step when bias_correction, else 1. `weight_decay` here is the
/// decoupled term (apex's adam_w_mode); L2 decay goes into the gradient before this block
/// (add_weight_decay). Slots: grad, param, exp_avg, exp_avg_sq.
struct scale_by_lamb {
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> eps{1e-6};
  scalar<double> weight_decay{0.0};
  bool bias_correction = true;
  bool grad_averaging = true;

  using reads = slots<slot::grad_t, slot::param_t, slot::exp_avg_t, slot::exp_avg_sq_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_sq_t>;

  struct prepared {
    double beta1, beta2, beta3, one_minus_beta2;
    double scaled_eps;  ///< eps * sqrt(bias_correction2)
    double step_scale;  ///< sqrt(bias_correction2) / bias_correction1
    double weight_decay;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T& m = e[slot::exp_avg];
      T& v = e[slot::exp_avg_sq];
      m = m * static_cast<T>(beta1) + static_cast<T>(beta3) * g;
      v = v * static_cast<T>(beta2) + static_cast<T>(one_minus_beta2) * g * g;
      // (m / c1) / (sqrt(v / c2) + eps) with the corrections folded into two per-step
      // constants, as scale_by_adam: one division per element (docs/decisions.md).
      T const denom = math::sqrt(v) + static_cast<T>(scaled_eps);
      T const direction = m / denom * static_cast<T>(step_scale);
      // A select, not `+ 0 * param`: with no decay a non-finite param must not leak into the update.
      e[slot::update] = weight_decay != 0 ? direction + static_cast<T>(weight_decay) * e[slot::param] : direction;
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& step) const
  {
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    std::int64_t const t = step.step.get();
    math::power_pair const powers = bias_correction ? math::ipow_pair(b1, b2, t) : math::power_pair{0.0, 0.0};
    double const bias_correction1 = bias_correction ? 1.0 - powers.first : 1.0;
    double const bias_correction2_sqrt = bias_correction ? math::sqrt(1.0 - powers.second) : 1.0;
    return prepared{b1,
                    b2,
                    grad_averaging ? 1.0 - b1 : 1.0,
                    1.0 - b2,
                    eps.get() * bias_correction2_sqrt,
                    bias_correction2_sqrt / bias_correction1,
                    weight_decay.get()};
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("lamb: beta1", beta1, detail::unit_interval);
    detail::expect_range("lamb: beta2", beta2, detail::unit_interval);
    detail::expect_range("lamb: eps", eps, detail::non_negative);
    detail::expect_range("lamb: weight_decay", weight_decay, detail::non_negative);
  }
};

/// @brief Layer-wise trust ratio (LAMB's): update *= ||param|| / ||update|| per tensor,
/// clamped to `max_trust_ratio`, and 1 where either norm is 0 (apex's rule). Both norms are
/// measured in a reduction pass over the element as the chain leaves it at this point, so the
/// update pass recomputes the same update and scales it: nothing is stored between passes.
///
/// `always_adapt = false` reproduces apex FusedLAMB without `use_nvlamb`: the ratio is then
/// applied only while `weight_decay` (the optimizer's, read only for this test) is not 0.
struct scale_by_trust_ratio {
  /// Largest ratio applied (no clamp by default).
  scalar<double> max_trust_ratio{DBL_MAX};
  bool always_adapt = true;
  scalar<double> weight_decay{0.0};

  /// Accumulator 0: sum of param^2; accumulator 1: sum of update^2 (per tensor).
  using reduction = fusedopt::reduction<reduce_op::sum, reduce_op::sum>;
  using reads = slots<slot::param_t>;
  using writes = slots<>;

  struct prepared {
    reduced norms;
    double max_trust_ratio;
    bool adapt;

    FUSEDOPT_HOST_DEVICE double ratio(std::int64_t tensor) const
    {
      if (!adapt) { return 1.0; }
      double const param_norm = math::sqrt(norms.tensor(tensor, 0));
      double const update_norm = math::sqrt(norms.tensor(tensor, 1));
      if (param_norm == 0.0 || update_norm == 0.0) { return 1.0; }
      double const ratio = param_norm / update_norm;
      return ratio > max_trust_ratio ? max_trust_ratio : ratio;
    }

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    /// The update scaled by the ratio, formed once per tensor rather than per element (the same bits).
    FUSEDOPT_HOST_DEVICE detail::scale_slot<slot::update_t> for_tensor(std::int64_t tensor) const
    {
      return {ratio(tensor)};
    }
  };

  FUSEDOPT_HOST_DEVICE detail::accumulate_squares<slot::param_t, slot::update_t> prepare_reduce(step_info const&) const
  {
    return {};
  }
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const
  {
    return prepared{r, max_trust_ratio.get(), always_adapt || weight_decay.get() != 0.0};
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("trust ratio: max_trust_ratio", max_trust_ratio, detail::positive);
  }
};

/// @brief LAMB as apex's FusedLAMB computes it (defaults are apex's). Slots: param, grad,
/// exp_avg, exp_avg_sq.
///
/// The chain: add_weight_decay (L2, when !adam_w_mode) -> scale_by_lamb (decoupled decay
/// added to the update when adam_w_mode) -> scale_by_trust_ratio -> scale_by_lr ->
/// apply_update, i.e. param -= lr * ratio * update with ratio = ||param|| / ||update|| per
/// tensor (1 where a norm is 0, at most max_trust_ratio). With `use_nvlamb` false and
/// weight_decay 0 the ratio is 1 (apex's behaviour); `use_nvlamb` applies it always (NVLAMB,
/// the paper's algorithm).
///
/// apex's `max_grad_norm` is not an option here: chain clip_by_global_norm in front,
/// `chain(clip_by_global_norm{max_norm}, lamb{...})`, which costs one more read of the
/// gradients. Its coefficient is torch's clip_grad_norm_ (max_norm / (norm + 1e-6), at most 1)
/// where apex divides by norm / max_norm when norm > max_norm: the two differ by that 1e-6.
struct lamb
  : chained<lamb, chain_rule<add_weight_decay, scale_by_lamb, scale_by_trust_ratio, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-3};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> eps{1e-6};
  scalar<double> weight_decay{0.01};
  /// Divide the moments by 1 - beta^step.
  bool bias_correction = true;
  /// beta3 = 1 - beta1 (true) or 1 (false) in exp_avg's update.
  bool grad_averaging = true;
  /// Decoupled weight decay added to the update (true) or L2 decay added to the gradient.
  bool adam_w_mode = true;
  /// Apply the trust ratio also when weight_decay is 0 (NVLAMB).
  bool use_nvlamb = false;
  /// Upper clamp of the trust ratio (none by default, as apex).
  scalar<double> max_trust_ratio{DBL_MAX};

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    scalar<double> const none{0.0};
    return chain(add_weight_decay{adam_w_mode ? none : weight_decay},
                 scale_by_lamb{beta1, beta2, eps, adam_w_mode ? weight_decay : none, bias_correction, grad_averaging},
                 scale_by_trust_ratio{max_trust_ratio, use_nvlamb, weight_decay}, scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
