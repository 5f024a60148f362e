/// @file rules/schedule_free.hpp
/// @brief Schedule-Free AdamW and SGD (Defazio et al. 2024, facebookresearch/schedule_free's
/// AdamWScheduleFree and SGDScheduleFree), their blocks, and the train()/eval() swap.
///
/// While training, the parameter holds y (the point where gradients are taken) and the state
/// `z` the base sequence; x, the average that is evaluated, is never stored: `schedule_free_eval`
/// turns the parameter into x (param = lerp(y, z, 1 - 1/beta1)) and `schedule_free_train` back
/// into y (param = lerp(x, z, 1 - beta1)), each one fused pass over every tensor (param, z).
///
/// The weight c_t of the average depends on two running scalars of the reference's parameter
/// group, the largest scheduled lr so far and the sum of the weights. They live in a
/// `schedule_free_state` that the caller allocates (device memory for the CUDA backend, host
/// memory for the host backend): each step reads it in `prepare` and writes its successor in an
/// after-step hook (one thread, in stream order), so the step needs no host synchronisation and
/// can be captured in a CUDA graph. At step 1 the memory is not read (the reference's initial
/// values, lr_max = -1 and weight_sum = 0, are used), and `z` is set to the parameter as loaded
/// (the reference's `z = clone(p)`), so both may start uninitialised; but initialise `z` as a
/// copy of the parameter if `schedule_free_train` may run before the first step (the reference
/// skips parameters without a `z` there).
#pragma once

#include <cstdint>

#include "../numeric/real_power.hpp"
#include "../numeric/torch_ops.hpp"
#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief The reference's running scalars, kept between steps by schedule_free_step.
struct schedule_free_state {
  double lr_max = -1.0;     ///< the largest scheduled learning rate so far
  double weight_sum = 0.0;  ///< the sum of the weights of the steps so far
};

/// @brief Schedule-Free's interpolation and step, taking the direction from `update` (the
/// normalised gradient of AdamW, the gradient of SGD, decay included):
/// y = lerp(y, z, c_t); y += lr_t (beta1 (1 - c_t) - 1) update; z -= lr_t update,
/// with lr_t = lr min(1, t / warmup_steps), lr_max = max(lr_max, lr_t),
/// weight = t^r lr_max^weight_lr_power, weight_sum += weight, c_t = weight / weight_sum (0 when
/// weight_sum is 0), all in double as the reference's Python floats (math::portable_pow).
struct schedule_free_step {
  scalar<double> lr{0.0025};
  scalar<double> beta1{0.9};  ///< AdamW's beta1, SGD's momentum
  std::int64_t warmup_steps = 0;
  scalar<double> r{0.0};
  scalar<double> weight_lr_power{2.0};
  schedule_free_state* state = nullptr;  ///< required: see the file's comment

  using reads = slots<slot::param_t, slot::z_t>;
  using writes = slots<slot::param_t, slot::z_t>;

  /// The step's scheduled lr, c_t and the state after it, from the state before it.
  struct weights {
    double lr, ckp1;
    schedule_free_state next;
  };
  FUSEDOPT_HOST_DEVICE weights weights_of(step_info const& s) const
  {
    std::int64_t const t = s.step.get();
    schedule_free_state const before = t <= 1 ? schedule_free_state{} : *state;
    auto const k = static_cast<double>(t) - 1.0;  // the reference's k: steps done
    double const sched = k < static_cast<double>(warmup_steps) ? (k + 1.0) / static_cast<double>(warmup_steps) : 1.0;
    double const lr_t = lr.get() * sched;
    double const lr_max = before.lr_max > lr_t ? before.lr_max : lr_t;  // Python's max(lr_t, lr_max)
    double const weight = math::portable_pow(k + 1.0, r.get()) * math::portable_pow(lr_max, weight_lr_power.get());
    double const weight_sum = before.weight_sum + weight;
    return {lr_t, weight_sum != 0.0 ? weight / weight_sum : 0.0, {lr_max, weight_sum}};
  }

  struct prepared {
    double ckp1, y_step, z_step;
    bool first_step;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const u = e[slot::update];
      T& y = e[slot::param];
      T const z = math::select(first_step, y, e[slot::z]);
      y = math::lerp(y, z, static_cast<T>(ckp1));
      y = y + static_cast<T>(y_step) * u;
      e[slot::z] = z - static_cast<T>(z_step) * u;
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    weights const w = weights_of(s);
    return {w.ckp1, w.lr * (beta1.get() * (1.0 - w.ckp1) - 1.0), w.lr, s.step.get() <= 1};
  }
  /// Stores the state after this step (the same values prepare formed).
  FUSEDOPT_HOST_DEVICE void after_step(reduced const&, step_info const& s) const { *state = weights_of(s).next; }

  template <class Bound>
  void validate(Bound) const
  {
    FUSEDOPT_EXPECTS(state != nullptr, "schedule-free: state must point to a schedule_free_state");
    FUSEDOPT_EXPECTS(warmup_steps >= 0, "schedule-free: warmup_steps must not be negative");
    detail::expect_range("schedule-free: lr", lr, detail::non_negative);
    detail::expect_range("schedule-free: beta1 (momentum)", beta1, detail::open_unit_interval);
  }
};

/// @brief Schedule-Free AdamW's normalised gradient: exp_avg_sq = beta2 exp_avg_sq +
/// (1 - beta2) grad^2, denom = sqrt(exp_avg_sq / (1 - beta2^t)) + eps, update = grad / denom,
/// or with inner_momentum mu: exp_avg = mu exp_avg + (1 - mu) grad, update = (exp_avg /
/// (1 - mu^t)) / denom (exp_avg need not be bound while inner_momentum is 0).
struct scale_by_schedule_free_adam {
  scalar<double> beta2{0.999};
  scalar<double> eps{1e-8};
  scalar<double> inner_momentum{0.0};
  using reads = slots<slot::grad_t, slot::exp_avg_sq_t, slot::exp_avg_t>;
  using writes = slots<slot::exp_avg_sq_t, slot::exp_avg_t>;

  struct prepared {
    double beta2, eps, bias_correction2, inner_momentum, bias_correction1;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T& v = e[slot::exp_avg_sq];
      v = v * static_cast<T>(beta2) + static_cast<T>(1.0 - beta2) * g * g;
      T const denom = math::sqrt(v / static_cast<T>(bias_correction2)) + static_cast<T>(eps);
      T direction = g;
      if constexpr (E::has(slot::exp_avg)) {
        T& m = e[slot::exp_avg];
        T const next = m * static_cast<T>(inner_momentum) + static_cast<T>(1.0 - inner_momentum) * g;
        m = math::select(inner_momentum != 0.0, next, m);
        direction = math::select(inner_momentum != 0.0, m / static_cast<T>(bias_correction1), g);
      }
      e[slot::update] = direction / denom;
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    double const b2 = beta2.get();
    double const mu = inner_momentum.get();
    math::power_pair const powers = math::ipow_pair(b2, mu, s.step.get());
    return {b2, eps.get(), 1.0 - powers.first, mu, 1.0 - powers.second};
  }

  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("schedule-free: beta2", beta2, detail::unit_interval);
    detail::expect_range("schedule-free: eps", eps, detail::non_negative);
    detail::expect_range("schedule-free: inner_momentum", inner_momentum, detail::unit_interval);
    FUSEDOPT_EXPECTS(has_slot(bound, slot::exp_avg) || (!inner_momentum.is_pointer() && inner_momentum.value == 0),
                     "schedule-free: inner_momentum != 0 needs slot 'exp_avg' bound");
  }
};

/// @brief AdamWScheduleFree (foreach and loop paths alike). Slots: param (y while training),
/// grad, z, exp_avg_sq, and exp_avg with inner_momentum. The chain:
/// negate_gradient_if(maximize) -> scale_by_schedule_free_adam -> add_decayed_weights (the decay
/// at y) -> schedule_free_step. `state` is required (see the file's comment).
struct schedule_free_adamw : chained<schedule_free_adamw, chain_rule<negate_gradient_if, scale_by_schedule_free_adam,
                                                                     add_decayed_weights, schedule_free_step>> {
  scalar<double> lr{0.0025};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> eps{1e-8};
  scalar<double> weight_decay{0.0};  ///< evaluated at y: update += weight_decay * y
  std::int64_t warmup_steps = 0;     ///< linear warmup of the learning rate
  scalar<double> r{0.0};             ///< polynomial weighting of the average
  scalar<double> weight_lr_power{2.0};
  scalar<double> inner_momentum{0.0};
  bool maximize = false;  ///< ascend: the gradient is negated first (not in the reference)
  schedule_free_state* state = nullptr;

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, scale_by_schedule_free_adam{beta2, eps, inner_momentum},
                 add_decayed_weights{weight_decay},
                 schedule_free_step{lr, beta1, warmup_steps, r, weight_lr_power, state});
  }
};

/// @brief SGDScheduleFree. Slots: param (y while training), grad, z. The chain:
/// negate_gradient_if(maximize) -> add_weight_decay (at y, into the gradient) -> momentum{}
/// (update = grad) -> schedule_free_step. `state` is required (see the file's comment).
struct schedule_free_sgd
  : chained<schedule_free_sgd, chain_rule<negate_gradient_if, add_weight_decay, momentum, schedule_free_step>> {
  scalar<double> lr{1.0};
  scalar<double> momentum{0.9};  ///< in (0, 1)
  scalar<double> weight_decay{0.0};
  std::int64_t warmup_steps = 0;
  scalar<double> r{0.0};
  scalar<double> weight_lr_power{2.0};
  bool maximize = false;  ///< ascend: the gradient is negated first (not in the reference)
  schedule_free_state* state = nullptr;

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay}, rules::momentum{},
                 schedule_free_step{lr, momentum, warmup_steps, r, weight_lr_power, state});
  }
};

/// @brief The mode switch: param = lerp(param, z, w) with w = 1 - 1/beta1 (`ToEval`: y -> x,
/// the reference's eval()) or w = 1 - beta1 (x -> y, train()). One pass over param and z;
/// run it on the optimizer's plan. beta1 is AdamW's beta1 or SGD's momentum.
template <bool ToEval>
struct schedule_free_swap {
  scalar<double> beta1{0.9};
  using reads = slots<slot::param_t, slot::z_t>;
  using writes = slots<slot::param_t>;

  struct prepared {
    double weight;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      e[slot::param] = math::lerp(e[slot::param], e[slot::z], static_cast<T>(weight));
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const
  {
    double const b = beta1.get();
    return {ToEval ? 1.0 - 1.0 / b : 1.0 - b};
  }
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("schedule-free: beta1 (momentum)", beta1, detail::open_unit_interval);
  }
};
/// @brief y -> x (the reference's `optimizer.eval()`).
using schedule_free_eval = schedule_free_swap<true>;
/// @brief x -> y (the reference's `optimizer.train()`).
using schedule_free_train = schedule_free_swap<false>;

}  // namespace rules
FUSEDOPT_NAMESPACE_END
