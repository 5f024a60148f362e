/// @file rules/prodigy.hpp
/// @brief Prodigy (Mishchenko and Defazio 2023, "Prodigy: An Expeditiously Adaptive
/// Parameter-Free Learner"; konstmish/prodigy's `prodigy.py`) and its block scale_by_prodigy.
///
/// Prodigy estimates the distance to the solution, d, from two sums over every element of
/// every tensor: the dot product of the gradients with p0 - p and the l1 norm of its state s.
/// The reference takes them with two `.item()` per tensor. Here they are one reduction pass
/// (totals over all tensors, in double, deterministic), and d, its running maximum and the
/// running numerator live in a `prodigy_state` that the caller allocates (device memory for
/// the CUDA backend, host memory for the host backend): the update pass reads it and the new
/// d from the pass's totals, and an after-step hook (one thread, in stream order) stores the
/// new state. No host synchronisation; the step can be captured in a CUDA graph.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief Prodigy's scalars between steps (the reference's group['d'], ['d_max'],
/// ['d_numerator']). At step 1 the memory is not read: d = d_max = d0, d_numerator = 0.
struct prodigy_state {
  double d = 0.0;
  double d_max = 0.0;
  double d_numerator = 0.0;
};

/// @brief Prodigy's step (one reduction pass, then the update), for a gradient that already
/// holds the coupled weight decay (add_weight_decay in front, as the reference adds it):
/// reduction: num = sum grad (p0 - p), den = sum |s'|, s' = beta3 s + (d / d0) dlr grad
/// (safeguard_warmup: (d / d0) d grad), dlr = d lr bc (bc = sqrt(1 - beta2^t) / (1 - beta1^t)
/// with use_bias_correction, else 1); then d_numerator' = beta3 d_numerator + (d / d0) dlr num,
/// d_hat = d_coef d_numerator' / den, d' = max(d, d_hat) while d is d0, d_max' = max(d_max,
/// d_hat), d' = min(d_max', d' growth_rate). Update: s = s'; exp_avg = beta1 exp_avg +
/// d (1 - beta1) grad; exp_avg_sq = beta2 exp_avg_sq + d^2 (1 - beta2) grad^2; with
/// weight_decay (the decoupled one) param += -weight_decay dlr param; update = -dlr exp_avg /
/// (sqrt(exp_avg_sq) + d' eps) (beta1 = 0: -dlr d' grad / (...), exp_avg need not be bound).
/// When den is 0 the reference returns before updating the parameters and d (its moments and
/// s are already updated): so does this block, but the step count still advances.
struct scale_by_prodigy {
  scalar<double> lr{1.0};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> beta3{-1.0};  ///< negative: sqrt(beta2) (the reference's None)
  scalar<double> eps{1e-8};
  scalar<double> weight_decay{0.0};  ///< the decoupled decay (coupled decay: add_weight_decay in front)
  bool use_bias_correction = false;
  bool safeguard_warmup = false;
  scalar<double> d0{1e-6};
  scalar<double> d_coef{1.0};
  scalar<double> growth_rate{HUGE_VAL};
  prodigy_state* state = nullptr;  ///< required: see the file's comment

  /// Accumulator 0: sum of grad (p0 - p); accumulator 1: sum of |s'| (totals over all tensors).
  using reduction = fusedopt::reduction<reduce_op::sum, reduce_op::sum>;
  using reads = slots<slot::grad_t, slot::param_t, slot::p0_t, slot::s_t, slot::exp_avg_t, slot::exp_avg_sq_t>;
  using writes = slots<slot::param_t, slot::s_t, slot::exp_avg_t, slot::exp_avg_sq_t>;

  /// The per-step scalars before the reduction: the state the step starts from, dlr, beta3,
  /// and the coefficient of the gradient in s.
  struct before {
    prodigy_state state;
    double dlr, beta3, s_coefficient;
  };
  FUSEDOPT_HOST_DEVICE before before_of(step_info const& s) const
  {
    std::int64_t const t = s.step.get();
    double const start = d0.get();
    prodigy_state const now = t <= 1 ? prodigy_state{start, start, 0.0} : *state;
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    double bc = 1.0;
    if (use_bias_correction) {
      math::power_pair const powers = math::ipow_pair(b1, b2, t);
      bc = math::sqrt(1.0 - powers.second) / (1.0 - powers.first);
    }
    double const dlr = now.d * lr.get() * bc;
    double const b3 = beta3.get() < 0.0 ? math::sqrt(b2) : beta3.get();
    return {now, dlr, b3, (now.d / start) * (safeguard_warmup ? now.d : dlr)};
  }

  /// The state after the step, from the pass's totals; `skip` where den is 0.
  struct after {
    prodigy_state state;
    bool skip;
  };
  FUSEDOPT_HOST_DEVICE after after_of(before const& b, reduced const& r) const
  {
    double const numerator = b.state.d_numerator * b.beta3 + (b.state.d / d0.get()) * b.dlr * r.total(0);
    double const denominator = r.total(1);
    if (denominator == 0.0) { return {b.state, true}; }
    double const d_hat = d_coef.get() * numerator / denominator;
    double d = b.state.d;
    if (d == d0.get()) { d = d > d_hat ? d : d_hat; }  // Python's max(d, d_hat)
    double const d_max = b.state.d_max > d_hat ? b.state.d_max : d_hat;
    double const grown = d * growth_rate.get();
    return {{d_max < grown ? d_max : grown, d_max, numerator}, false};  // Python's min(d_max, grown)
  }

  struct accumulate {
    double beta3, s_coefficient;
    template <class E, class Acc>
    FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
    {
      using T = typename E::value_type;
      using A = std::remove_reference_t<decltype(acc[0])>;
      T const g = e[slot::grad];
      T const s = e[slot::s] * static_cast<T>(beta3) + static_cast<T>(s_coefficient) * g;
      acc[0] += static_cast<A>(g) * (static_cast<A>(e[slot::p0]) - static_cast<A>(e[slot::param]));
      acc[1] += static_cast<A>(math::abs(s));
    }
  };

  struct prepared {
    double beta1, beta2, beta3, s_coefficient, m_coefficient, v_coefficient, eps_d, decay, step, grad_step;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T& s = e[slot::s];
      s = s * static_cast<T>(beta3) + static_cast<T>(s_coefficient) * g;
      T& v = e[slot::exp_avg_sq];
      v = v * static_cast<T>(beta2) + static_cast<T>(v_coefficient) * g * g;
      T const denom = math::sqrt(v) + static_cast<T>(eps_d);
      T& p = e[slot::param];
      p = math::select(decay != 0.0, p + static_cast<T>(decay) * p, p);
      T direction = static_cast<T>(grad_step) * (g / denom);
      if constexpr (E::has(slot::exp_avg)) {
        T& m = e[slot::exp_avg];
        m = math::select(beta1 > 0.0, m * static_cast<T>(beta1) + static_cast<T>(m_coefficient) * g, m);
        direction = math::select(beta1 > 0.0, static_cast<T>(step) * (m / denom), direction);
      }
      e[slot::update] = direction;
    }
  };

  FUSEDOPT_HOST_DEVICE accumulate prepare_reduce(step_info const& s) const
  {
    before const b = before_of(s);
    return {b.beta3, b.s_coefficient};
  }
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s, reduced const& r) const
  {
    before const b = before_of(s);
    after const a = after_of(b, r);
    double const d = b.state.d;
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    double const keep = a.skip ? 0.0 : 1.0;  // a skipped step leaves the parameter as it was
    return {b1,
            b2,
            b.beta3,
            b.s_coefficient,
            d * (1.0 - b1),
            d * d * (1.0 - b2),
            a.state.d * eps.get(),
            -weight_decay.get() * b.dlr * keep,
            -b.dlr * keep,
            -b.dlr * a.state.d * keep};
  }
  /// Stores d, d_max and d_numerator after the step (the values prepare formed; the ones the
  /// step started from where it was skipped, which at step 1 are not in memory yet).
  FUSEDOPT_HOST_DEVICE void after_step(reduced const& r, step_info const& s) const
  {
    *state = after_of(before_of(s), r).state;
  }

  /// @throws fusedopt::error for what the reference rejects (lr, d0 and eps not positive, betas
  /// outside [0, 1)), a beta3 of 1 or more, a null state, and beta1 > 0 without exp_avg bound.
  template <class Bound>
  void validate(Bound bound) const
  {
    FUSEDOPT_EXPECTS(state != nullptr, "prodigy: state must point to a prodigy_state");
    detail::expect_range("prodigy: lr", lr, detail::positive);
    detail::expect_range("prodigy: d0", d0, detail::positive);
    detail::expect_range("prodigy: eps", eps, detail::positive);
    detail::expect_range("prodigy: beta1", beta1, detail::unit_interval);
    detail::expect_range("prodigy: beta2", beta2, detail::unit_interval);
    FUSEDOPT_EXPECTS(beta3.is_pointer() || beta3.value < 1.0, "prodigy: beta3 must be below 1 (negative: sqrt(beta2))");
    detail::expect_range("prodigy: weight_decay", weight_decay, detail::non_negative);
    FUSEDOPT_EXPECTS(has_slot(bound, slot::exp_avg) || (!beta1.is_pointer() && beta1.value == 0),
                     "prodigy: beta1 > 0 needs slot 'exp_avg' bound");
  }
};

/// @brief Copies one slot into another: `copy_slot<slot::param_t, slot::p0_t>{}` run once on
/// Prodigy's plan before its first step sets p0 to the initial parameters (the reference's
/// `p0 = p.clone()`), in one fused pass.
template <class From, class To>
struct copy_slot {
  using reads = slots<From>;
  using writes = slots<To>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    e[To{}] = e[From{}];
  }
};

/// @brief Prodigy as konstmish/prodigy computes it (its defaults; one parameter group, slice_p
/// = 1). Slots: param, grad, p0 (the parameters before the first step: fill it with
/// copy_slot<slot::param_t, slot::p0_t>), s, exp_avg (not with beta1 = 0), exp_avg_sq. The
/// chain: negate_gradient_if(maximize) -> add_weight_decay (without decouple) ->
/// scale_by_prodigy (reducing; the decoupled decay with decouple) -> apply_update. `state` is
/// required (see the file's comment).
struct prodigy
  : chained<prodigy, chain_rule<negate_gradient_if, add_weight_decay, scale_by_prodigy, apply_update>> {
  scalar<double> lr{1.0};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> beta3{-1.0};  ///< negative: sqrt(beta2) (the reference's None)
  scalar<double> eps{1e-8};
  scalar<double> weight_decay{0.0};
  bool decouple = true;
  bool use_bias_correction = false;
  bool safeguard_warmup = false;
  scalar<double> d0{1e-6};
  scalar<double> d_coef{1.0};
  scalar<double> growth_rate{HUGE_VAL};
  bool maximize = false;  ///< ascend: the gradient is negated first (not in the reference)
  prodigy_state* state = nullptr;

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    scalar<double> const none{0.0};
    return chain(negate_gradient_if{maximize}, add_weight_decay{decouple ? none : weight_decay},
                 scale_by_prodigy{lr, beta1, beta2, beta3, eps, decouple ? weight_decay : none, use_bias_correction,
                                  safeguard_warmup, d0, d_coef, growth_rate, state},
                 apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
