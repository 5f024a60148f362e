/// @file rules/rmsprop.hpp
/// @brief RMSprop (torch.optim.RMSprop) and its blocks: scale_by_rms (plain and centered) and
/// trace (a momentum buffer that starts at zero).
#pragma once

#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief RMSprop's direction:
/// square_avg = alpha * square_avg + (1 - alpha) * grad^2;
/// with `centered`, grad_avg += (1 - alpha) * (grad - grad_avg) and
/// v = square_avg - grad_avg^2, else v = square_avg;
/// update = grad / (sqrt(v) + eps).
/// `grad_avg` need not be bound unless `centered` is set.
struct scale_by_rms {
  scalar<double> alpha{0.99};
  scalar<double> eps{1e-8};
  bool centered = false;

  using reads = slots<slot::grad_t, slot::square_avg_t, slot::grad_avg_t>;
  using writes = slots<slot::square_avg_t, slot::grad_avg_t>;

  /// The per-step values: the hyperparameters resolved once per thread.
  struct prepared {
    double alpha, eps;
    bool centered;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = detail::value_t<E>;
      T const g = e[slot::grad];
      T const one_minus_alpha = static_cast<T>(1.0 - alpha);
      T& sq = e[slot::square_avg];
      sq = static_cast<T>(alpha) * sq + one_minus_alpha * g * g;
      T v = sq;
      if constexpr (E::has(slot::grad_avg)) {
        // Selects rather than an early branch, so the host loop stays vectorisable; an unbound
        // or unused grad_avg keeps its value.
        T& avg = e[slot::grad_avg];
        T const moved = avg + one_minus_alpha * (g - avg);
        avg = centered ? moved : avg;
        v = centered ? sq - moved * moved : sq;
      }
      e[slot::update] = g / (math::sqrt(v) + static_cast<T>(eps));
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {alpha.get(), eps.get(), centered}; }

  template <class Bound>
  void validate(Bound bound) const
  {
    FUSEDOPT_EXPECTS(!centered || has_slot(bound, slot::grad_avg), "centered needs slot 'grad_avg' bound");
    detail::expect_range("alpha", alpha, detail::non_negative);
    detail::expect_range("eps", eps, detail::non_negative);
  }
};

/// @brief Momentum on the update, with a buffer the caller zero-initialises:
/// momentum_buffer = momentum * momentum_buffer + update; update = momentum_buffer.
/// Unlike rules::momentum (SGD), there is no special first step: torch's RMSprop starts its
/// buffer at zero. With momentum 0 the update passes through and `momentum_buffer` need not
/// be bound.
struct trace {
  scalar<double> momentum{0.0};

  using reads = slots<slot::momentum_buffer_t>;
  using writes = slots<slot::momentum_buffer_t>;

  /// The per-step values: the momentum resolved once per thread.
  struct prepared {
    double momentum;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      if constexpr (E::has(slot::momentum_buffer)) {
        using T = detail::value_t<E>;
        bool const enabled = momentum != 0;
        T& buf = e[slot::momentum_buffer];
        T const next = static_cast<T>(momentum) * buf + e[slot::update];
        buf = enabled ? next : buf;
        e[slot::update] = enabled ? next : e[slot::update];
      }
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {momentum.get()}; }

  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_momentum(momentum, bound);
  }
};

/// @brief torch.optim.RMSprop. Slots: param, grad, square_avg; grad_avg with `centered`;
/// momentum_buffer when momentum > 0. Every state starts at zero, as in torch.
///
/// The chain: negate_gradient_if(maximize) -> add_weight_decay -> scale_by_rms -> trace
/// -> scale_by_lr -> apply_update.
struct rmsprop
  : chained<rmsprop, chain_rule<negate_gradient_if, add_weight_decay, scale_by_rms, trace, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-2};
  scalar<double> alpha{0.99};
  scalar<double> eps{1e-8};
  scalar<double> weight_decay{0.0};
  scalar<double> momentum{0.0};
  bool centered = false;
  bool maximize = false;

  /// @brief The building blocks this optimizer is made of, with its hyperparameters.
  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay}, scale_by_rms{alpha, eps, centered},
                 trace{momentum}, scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
