/// @file rules/rprop.hpp
/// @brief Rprop (torch.optim.Rprop, "resilient backpropagation") and its block scale_by_rprop.
#pragma once

#include <type_traits>

#include "../numeric/dtypes.hpp"
#include "../numeric/torch_ops.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {
/// `x` rounded to `Storage` and back to its arithmetic type; `x` itself for `void`.
template <class Storage, class T>
FUSEDOPT_HOST_DEVICE T round_through(T x)
{
  if constexpr (std::is_void_v<Storage>) {
    return x;
  } else {
    return to_opmath<T>(from_opmath<Storage>(x));
  }
}
}  // namespace detail

namespace rules {

/// @brief Rprop's step sizes and direction, in the order of torch's `_single_tensor_rprop`:
/// factor = etaplus where grad * prev > 0, etaminus where < 0, else 1;
/// step_size = clamp(step_size * factor, step_size_min, step_size_max);
/// grad' = 0 where factor == etaminus, else grad; update = sign(grad') * step_size; prev = grad'.
/// At step 1 the loaded states are ignored: step_size starts at lr and prev at 0 (torch's
/// state initialisation), so both may be bound uninitialised.
///
/// The sign is that of the product *as torch rounds it*: a product that underflows to 0 keeps
/// the step size. torch computes it, and holds the etas and the step sizes, in the gradient's
/// type; `Storage` is that type where it is narrower than the arithmetic (half, bfloat16:
/// the product, the etas, lr and the new step size are rounded to it); `void` (the default)
/// computes in the arithmetic type, which is torch's for float and double gradients.
template <class Storage = void>
struct scale_by_rprop {
  scalar<double> lr{1e-2};             ///< the step size of every element at step 1
  scalar<double> etaminus{0.5};        ///< factor where the gradient changed sign
  scalar<double> etaplus{1.2};         ///< factor where it kept its sign
  scalar<double> step_size_min{1e-6};  ///< lower clamp of the step sizes
  scalar<double> step_size_max{50.0};  ///< upper clamp

  using reads = slots<slot::grad_t, slot::prev_t, slot::step_size_t>;
  using writes = slots<slot::prev_t, slot::step_size_t>;

  struct prepared {
    double lr, etaminus, etaplus, step_size_min, step_size_max;
    bool first_step;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      auto const stored = [](T x) { return detail::round_through<Storage>(x); };
      T const g = e[slot::grad];
      T const prev = math::select(first_step, T(0), e[slot::prev]);
      T const size = math::select(first_step, stored(static_cast<T>(lr)), e[slot::step_size]);
      T const product = stored(g * prev);
      T const minus = stored(static_cast<T>(etaminus));
      T const factor = product > T(0) ? stored(static_cast<T>(etaplus)) : (product < T(0) ? minus : T(1));
      T const clamped =
        stored(math::clamp(size * factor, static_cast<T>(step_size_min), static_cast<T>(step_size_max)));
      T const direction = factor == minus ? T(0) : g;  // torch: grad[sign.eq(etaminus)] = 0
      e[slot::step_size] = clamped;
      e[slot::prev] = direction;
      e[slot::update] = math::sign(direction) * clamped;
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& step) const
  {
    return {lr.get(), etaminus.get(), etaplus.get(), step_size_min.get(), step_size_max.get(), step.step.get() <= 1};
  }

  /// @throws fusedopt::error for what torch.optim.Rprop rejects: lr < 0, etas outside 0 < etaminus < 1 < etaplus.
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("rprop: lr", lr, detail::non_negative);
    detail::expect_range("rprop: etaminus", etaminus, detail::open_unit_interval);
    detail::expect_range("rprop: etaplus", etaplus, detail::above_one);
  }
};

/// @brief torch.optim.Rprop (`etas` = (etaminus, etaplus), `step_sizes` = (step_size_min,
/// step_size_max)), for gradients and states stored as `Storage` (see scale_by_rprop; `rprop`
/// is `basic_rprop<>`, torch's arithmetic for float and double). Slots: param, grad, prev,
/// step_size. The chain: negate_gradient_if(maximize) -> scale_by_rprop -> scale_by_lr{1} (the
/// step sizes carry the learning rate: update *= -1) -> apply_update.
template <class Storage = void>
struct basic_rprop
  : chained<basic_rprop<Storage>, chain_rule<negate_gradient_if, scale_by_rprop<Storage>, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-2};             ///< initial step size
  scalar<double> etaminus{0.5};        ///< torch's etas[0]
  scalar<double> etaplus{1.2};         ///< torch's etas[1]
  scalar<double> step_size_min{1e-6};  ///< torch's step_sizes[0]
  scalar<double> step_size_max{50.0};  ///< torch's step_sizes[1]
  bool maximize = false;               ///< ascend: the gradient is negated first

  FUSEDOPT_HOST_DEVICE chain_rule<negate_gradient_if, scale_by_rprop<Storage>, scale_by_lr, apply_update> as_chain() const
  {
    return chain(negate_gradient_if{maximize},
                 scale_by_rprop<Storage>{lr, etaminus, etaplus, step_size_min, step_size_max}, scale_by_lr{1.0},
                 apply_update{});
  }
};

/// @brief torch.optim.Rprop for float and double gradients (and any other, in float arithmetic).
using rprop = basic_rprop<>;

}  // namespace rules
FUSEDOPT_NAMESPACE_END
