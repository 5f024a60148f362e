/// @file rules/adagrad.hpp
/// @brief Adagrad (torch.optim.Adagrad) and its blocks: scale_by_adagrad and the
/// inverse-time learning-rate decay scale_by_decayed_lr.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "../numeric/dtypes.hpp"
#include "../tensor_list.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief Adagrad's accumulator and direction: sum_sq += grad^2;
/// update = grad / (sqrt(sum_sq) + eps).
///
/// `sum_sq` starts at whatever the caller put in its memory: torch's
/// `initial_accumulator_value` (see fill_initial_accumulator).
struct scale_by_adagrad {
  scalar<double> eps{1e-10};

  using reads = slots<slot::grad_t, slot::sum_sq_t>;
  using writes = slots<slot::sum_sq_t>;

  /// The per-step values: eps resolved once per thread.
  struct prepared {
    double eps;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = detail::value_t<E>;
      T const g = e[slot::grad];
      T& sum = e[slot::sum_sq];
      sum += g * g;
      e[slot::update] = g / (math::sqrt(sum) + static_cast<T>(eps));
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {eps.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("eps", eps, detail::non_negative);
  }
};

/// @brief torch.optim.Adagrad. Slots: param, grad, sum_sq (torch's state `sum`).
///
/// The chain: negate_gradient_if(maximize) -> add_weight_decay -> scale_by_adagrad
/// -> scale_by_decayed_lr -> apply_update.
///
/// torch's `initial_accumulator_value` is not a field: it is the value the caller stores in
/// the `sum_sq` tensors before the first step (torch fills `state['sum']` with it when the
/// optimizer is built). fill_initial_accumulator does that for host memory.
struct adagrad
  : chained<adagrad, chain_rule<negate_gradient_if, add_weight_decay, scale_by_adagrad, scale_by_decayed_lr,
                                apply_update>> {
  scalar<double> lr{1e-2};
  scalar<double> lr_decay{0.0};
  scalar<double> weight_decay{0.0};
  scalar<double> eps{1e-10};
  bool maximize = false;

  /// @brief The building blocks this optimizer is made of, with its hyperparameters.
  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay}, scale_by_adagrad{eps},
                 scale_by_decayed_lr{lr, {lr_decay}}, apply_update{});
  }
};

/// @brief Sets every element of the (host memory) `sum_sq` tensors to
/// `initial_accumulator_value`, as torch.optim.Adagrad does when it creates its state.
/// For device memory, fill the tensors with the same value by the means of that device.
/// @param sums the tensors bound to slot::sum_sq, in host memory
/// @param initial_accumulator_value torch's `initial_accumulator_value` (default 0)
/// @throws fusedopt::error if the value is negative (torch rejects it too).
template <class T>
void fill_initial_accumulator(tensor_list<T> const& sums, double initial_accumulator_value)
{
  static_assert(!std::is_const_v<T>, "fill_initial_accumulator writes the tensors: use a non-const list");
  FUSEDOPT_EXPECTS(initial_accumulator_value >= 0,
                   "initial_accumulator_value must not be negative, got " + std::to_string(initial_accumulator_value));
  T const value = from_opmath<T>(static_cast<opmath_t<T>>(initial_accumulator_value));
  for (auto const& t : sums) {
    for (std::int64_t i = 0; i < t.size; ++i) { t.data[i] = value; }
  }
}

}  // namespace rules
FUSEDOPT_NAMESPACE_END
