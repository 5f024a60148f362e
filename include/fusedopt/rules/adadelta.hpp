/// @file rules/adadelta.hpp
/// @brief Adadelta (torch.optim.Adadelta) and its direction block, scale_by_adadelta.
#pragma once

#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief Adadelta's direction, in torch's order of operations:
/// square_avg = rho * square_avg + (1 - rho) * grad^2;
/// delta = sqrt(acc_delta + eps) / sqrt(square_avg + eps) * grad;
/// acc_delta = rho * acc_delta + (1 - rho) * delta^2;
/// update = delta (acc_delta sees delta before the learning rate scales it).
struct scale_by_adadelta {
  scalar<double> rho{0.9};
  scalar<double> eps{1e-6};

  using reads = slots<slot::grad_t, slot::square_avg_t, slot::acc_delta_t>;
  using writes = slots<slot::square_avg_t, slot::acc_delta_t>;

  /// The per-step values: the hyperparameters resolved once per thread.
  struct prepared {
    double rho, eps;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = detail::value_t<E>;
      T const r = static_cast<T>(rho);
      T const one_minus_rho = static_cast<T>(1.0 - rho);
      T const ep = static_cast<T>(eps);
      T const g = e[slot::grad];
      T& sq = e[slot::square_avg];
      T& acc = e[slot::acc_delta];
      sq = r * sq + one_minus_rho * g * g;
      T const delta = math::sqrt(acc + ep) / math::sqrt(sq + ep) * g;
      acc = r * acc + one_minus_rho * delta * delta;
      e[slot::update] = delta;
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {rho.get(), eps.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("rho", rho, detail::closed_unit_interval);
    detail::expect_range("eps", eps, detail::non_negative);
  }
};

/// @brief torch.optim.Adadelta. Slots: param, grad, square_avg, acc_delta (both start at zero).
///
/// The chain: negate_gradient_if(maximize) -> add_weight_decay -> scale_by_adadelta
/// -> scale_by_lr -> apply_update.
struct adadelta
  : chained<adadelta, chain_rule<negate_gradient_if, add_weight_decay, scale_by_adadelta, scale_by_lr, apply_update>> {
  scalar<double> lr{1.0};
  scalar<double> rho{0.9};
  scalar<double> eps{1e-6};
  scalar<double> weight_decay{0.0};
  bool maximize = false;

  /// @brief The building blocks this optimizer is made of, with its hyperparameters.
  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay}, scale_by_adadelta{rho, eps},
                 scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
