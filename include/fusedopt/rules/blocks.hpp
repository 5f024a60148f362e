/// @file rules/blocks.hpp
/// @brief Building blocks that optimizers are chained from (in the style of Optax).
///
/// The data flow through one element:
/// - `grad` (register copy of the gradient) is transformed in place by blocks such as
///   negate_gradient_if and add_weight_decay; it is never stored unless a rule declares it.
/// - a direction block (momentum, adam_direction, ...) turns grad and states into `update`;
/// - scale_by_lr multiplies `update` by -lr, apply_update adds it to `param`.
///
/// The files of rules/ include this header for the vocabulary of a block (config, error, the
/// math, rule, scalar and slots headers it includes) and chained.hpp for a named optimizer.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../config.hpp"
#include "../error.hpp"
#include "../numeric/math.hpp"
#include "../rule.hpp"
#include "../scalar.hpp"
#include "../slots.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {
template <class E>
using value_t = typename E::value_type;

/// The checks of a momentum option whose buffer (`momentum_buffer`) is needed only when it is
/// not 0: rules::momentum (SGD, LARS) and rules::trace (RMSprop).
template <class Bound>
void expect_momentum(scalar<double> const& momentum, Bound bound)
{
  expect_range("momentum", momentum, non_negative);
  FUSEDOPT_EXPECTS(momentum.is_pointer() || momentum.value == 0 || has_slot(bound, slot::momentum_buffer),
                   "momentum != 0 needs slot 'momentum_buffer' bound");
  FUSEDOPT_EXPECTS(!momentum.is_pointer() || has_slot(bound, slot::momentum_buffer),
                   "a momentum read from memory needs slot 'momentum_buffer' bound");
}
}  // namespace detail

namespace rules {

// Every block resolves its scalars (which may be pointers) once per thread in `prepare`, so
// the per-element code sees plain values: no loads through pointers, no branches the host
// compiler cannot turn into selects, so its loops vectorise.

/// @brief Negates the gradient register when `enabled` (torch's `maximize=True`).
struct negate_gradient_if {
  bool enabled = false;
  using reads = slots<slot::grad_t>;
  using writes = slots<>;

  // A sign-bit flip rather than a select: one select fewer keeps GCC's if-conversion within
  // its limits when SGD chains this with weight decay and momentum, so that loop vectorises.
  struct prepared {
    bool enabled;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::grad] = math::negate_if(e[slot::grad], enabled);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {enabled}; }
};

/// @brief `Slot` += weight_decay * param, nothing when weight_decay is 0 (as torch skips it):
/// the gradient's L2 decay (add_weight_decay) and the update's (add_decayed_weights).
template <class Slot>
struct add_weighted_param {
  scalar<double> weight_decay{0.0};
  using reads = std::conditional_t<is_memory_slot_v<Slot>, slots<Slot, slot::param_t>, slots<slot::param_t>>;
  using writes = slots<>;

  struct prepared {
    double weight_decay;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      auto const wd = static_cast<detail::value_t<E>>(weight_decay);
      e[Slot{}] = math::select(weight_decay != 0, e[Slot{}] + wd * e[slot::param], e[Slot{}]);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {weight_decay.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("weight_decay", weight_decay, detail::non_negative);
  }
};

/// @brief L2 weight decay folded into the gradient: grad += weight_decay * param
/// (skipped when weight_decay is 0, as torch does).
using add_weight_decay = add_weighted_param<slot::grad_t>;

/// @brief Weight decay added to the direction (Optax's add_decayed_weights): update +=
/// weight_decay * param, so that the learning-rate block scales it with the update (AdEMAMix,
/// Schedule-Free AdamW's decay "at y").
using add_decayed_weights = add_weighted_param<slot::update_t>;

/// @brief Decoupled weight decay (AdamW): param *= 1 - lr * weight_decay (skipped when
/// weight_decay is 0).
struct decoupled_weight_decay {
  scalar<double> lr{1e-3};
  scalar<double> weight_decay{1e-2};
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;

  // The factor is exactly 1 when weight_decay is 0, and x * 1 == x: no branch needed.
  FUSEDOPT_HOST_DEVICE detail::scale_slot<slot::param_t> prepare(step_info const&) const
  {
    double const wd = weight_decay.get();
    return {wd != 0 ? 1.0 - lr.get() * wd : 1.0};
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("weight_decay", weight_decay, detail::non_negative);
  }
};

/// @brief Heavy-ball momentum with dampening and Nesterov (torch.optim.SGD):
/// buf = grad at step 1, else momentum * buf + (1 - dampening) * grad;
/// update = nesterov ? grad + momentum * buf : buf. With momentum 0, update = grad and
/// `momentum_buffer` need not be bound.
struct momentum {
  scalar<double> momentum{0.0};
  scalar<double> dampening{0.0};
  bool nesterov = false;
  using reads = slots<slot::grad_t, slot::momentum_buffer_t>;
  using writes = slots<slot::momentum_buffer_t>;

  struct prepared {
    double momentum, one_minus_dampening;
    bool first_step, nesterov;

    // Every case is computed and selected with math::select (the flags are the same for
    // every element of a step): a branch, an early return or a conditional whose arithmetic
    // the compiler sinks into a branch keeps GCC from vectorising the host loop.
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = detail::value_t<E>;
      T const g = e[slot::grad];
      if constexpr (E::has(slot::momentum_buffer)) {
        T& buf = e[slot::momentum_buffer];
        T const mu = static_cast<T>(momentum);
        T const old = buf;
        T const blended = mu * old + static_cast<T>(one_minus_dampening) * g;
        T const next = math::select(first_step, g, blended);
        bool const active = momentum != 0;
        buf = math::select(active, next, old);  // with momentum 0 the buffer is left as it was
        T const direction = math::select(nesterov, g + mu * next, next);
        e[slot::update] = math::select(active, direction, g);
      } else {
        e[slot::update] = g;
      }
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    return {momentum.get(), 1.0 - dampening.get(), s.step.get() <= 1, nesterov};
  }

  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_momentum(momentum, bound);
    FUSEDOPT_EXPECTS(!nesterov || momentum.is_pointer() || dampening.is_pointer() ||
                       (momentum.value > 0 && dampening.value == 0),
                     "nesterov momentum requires a momentum and zero dampening");
  }
};

/// @brief A constant learning rate (the schedule of scale_by_lr): lr at every step.
struct constant_lr {
  static constexpr double default_lr = 1e-3;
  FUSEDOPT_HOST_DEVICE double at(scalar<double> const& lr, step_info const&) const { return lr.get(); }
  template <class Bound>
  void validate(Bound) const
  {
  }
};

/// @brief Adagrad's inverse-time decay (torch's `clr`): lr / (1 + (step - 1) * lr_decay).
struct inverse_time_decay {
  static constexpr double default_lr = 1e-2;
  scalar<double> lr_decay{0.0};
  FUSEDOPT_HOST_DEVICE double at(scalar<double> const& lr, step_info const& s) const
  {
    // In double: `step - 1` in int64 overflows at INT64_MIN (a step read from memory is not
    // checked on the device); the two agree for every |step| < 2^53.
    double const steps_before = static_cast<double>(s.step.get()) - 1.0;
    return lr.get() / (1.0 + steps_before * lr_decay.get());
  }
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("lr_decay", lr_decay, detail::non_negative);
  }
};

/// @brief The learning rate with a first-moment bias correction folded in (torch's `clr` in
/// Adamax): lr / (1 - beta^step), with math::ipow so that host and device agree to the bit.
struct bias_corrected {
  static constexpr double default_lr = 2e-3;
  scalar<double> beta{0.9};
  FUSEDOPT_HOST_DEVICE double at(scalar<double> const& lr, step_info const& s) const
  {
    double const bias_correction = 1.0 - math::ipow(beta.get(), s.step.get());
    return lr.get() / bias_correction;
  }
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("beta1", beta, detail::unit_interval);
  }
};

/// @brief update *= -lr(step): the learning rate of the step under `Schedule` (constant_lr,
/// inverse_time_decay, bias_corrected, or one of one's own with `at(lr, step)` (the rate of
/// the step, `lr` being the scalar, read where the schedule needs it),
/// `default_lr` and `validate`), formed once per step in double (Optax's
/// scale_by_learning_rate with a schedule). The three aliases below are the library's.
template <class Schedule>
struct scale_by_scheduled_lr {
  scalar<double> lr{Schedule::default_lr};
  Schedule schedule{};
  using reads = slots<>;
  using writes = slots<>;

  FUSEDOPT_HOST_DEVICE detail::scale_slot<slot::update_t> prepare(step_info const& s) const
  {
    // The type spelled out: for `return {-schedule.at(lr, s)};` nvcc 13's front end hands the
    // host compiler `return -(schedule).at(lr, s);` (braces dropped), which does not compile.
    return detail::scale_slot<slot::update_t>{-schedule.at(lr, s)};
  }

  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("learning rate", lr, detail::non_negative);
    schedule.validate(bound);
  }
};

/// @brief update *= -lr.
using scale_by_lr = scale_by_scheduled_lr<constant_lr>;
/// @brief update *= -lr / (1 + (step - 1) * lr_decay) (Adagrad): `scale_by_decayed_lr{lr, {lr_decay}}`.
using scale_by_decayed_lr = scale_by_scheduled_lr<inverse_time_decay>;
/// @brief update *= -lr / (1 - beta^step) (Adamax): `scale_by_bias_corrected_lr{lr, {beta}}`.
using scale_by_bias_corrected_lr = scale_by_scheduled_lr<bias_corrected>;

/// @brief param += update.
struct apply_update {
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    e[slot::param] += e[slot::update];
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
