/// @file slots.hpp
/// @brief Slots: the named values a rule reads and writes for each tensor element.
///
/// A memory slot (`param`, `grad`, `exp_avg`, ...) is bound to a tensor list with
/// `slot::param = list`. A register slot (`update`) lives only in registers for the duration
/// of one element's update; it starts at zero. Users declare their own with
/// FUSEDOPT_MEMORY_SLOT(name) and FUSEDOPT_REGISTER_SLOT(name) at namespace scope.
#pragma once

#include <type_traits>
#include <utility>

#include "config.hpp"
#include "meta.hpp"
#include "tensor_list.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief Base of memory slot tags (CRTP). Use FUSEDOPT_MEMORY_SLOT rather than deriving by hand.
template <class Derived>
struct memory_slot {
  static constexpr bool in_memory = true;
  /// @brief Binds this slot to a tensor list (the list is copied; the tensors are not).
  template <class T>
  [[nodiscard]] binding<Derived, T> operator=(tensor_list<T> list) const
  {
    return binding<Derived, T>{std::move(list)};
  }
};

/// @brief Base of register slot tags (CRTP). Use FUSEDOPT_REGISTER_SLOT.
template <class Derived>
struct register_slot {
  static constexpr bool in_memory = false;
};

template <class S>
inline constexpr bool is_memory_slot_v = S::in_memory;

FUSEDOPT_NAMESPACE_END

/// Declares a memory slot `name` (an object of type `name_t`) at the current namespace scope.
#define FUSEDOPT_MEMORY_SLOT(id)                                   \
  struct id##_t : ::fusedopt::memory_slot<id##_t> {                \
    using ::fusedopt::memory_slot<id##_t>::operator=;              \
    static constexpr char const* name = #id;                       \
  };                                                               \
  inline constexpr id##_t id {}

/// Declares a register-only slot `name` (an object of type `name_t`), zero at the start of
/// every element's update.
#define FUSEDOPT_REGISTER_SLOT(id)                  \
  struct id##_t : ::fusedopt::register_slot<id##_t> { \
    static constexpr char const* name = #id;        \
  };                                                \
  inline constexpr id##_t id {}

FUSEDOPT_NAMESPACE_BEGIN

/// @brief The predefined slots. Names follow the state keys of `torch.optim`.
namespace slot {
FUSEDOPT_MEMORY_SLOT(param);            ///< the parameter being optimized
FUSEDOPT_MEMORY_SLOT(grad);             ///< its gradient
FUSEDOPT_MEMORY_SLOT(master);           ///< fp32 master copy of a low-precision param
FUSEDOPT_MEMORY_SLOT(remainder);        ///< low bits completing a bf16 param to fp32
FUSEDOPT_MEMORY_SLOT(exp_avg);          ///< first moment (Adam family)
FUSEDOPT_MEMORY_SLOT(exp_avg_sq);       ///< second moment (Adam family)
FUSEDOPT_MEMORY_SLOT(max_exp_avg_sq);   ///< running max of exp_avg_sq (AMSGrad)
FUSEDOPT_MEMORY_SLOT(exp_inf);          ///< exponentially weighted infinity norm (Adamax)
FUSEDOPT_MEMORY_SLOT(momentum_buffer);  ///< momentum (SGD, RMSprop)
FUSEDOPT_MEMORY_SLOT(sum_sq);           ///< sum of squared gradients (Adagrad's `sum`)
FUSEDOPT_MEMORY_SLOT(square_avg);       ///< running average of squared gradients (RMSprop, Adadelta)
FUSEDOPT_MEMORY_SLOT(acc_delta);        ///< running average of squared updates (Adadelta)
FUSEDOPT_MEMORY_SLOT(grad_avg);         ///< running average of gradients (centered RMSprop)
FUSEDOPT_REGISTER_SLOT(update);         ///< the step direction flowing from gradient to parameter
// The states of the optimizers of rules/rprop.hpp ... rules/prodigy.hpp, named after their
// references' state keys (docs/rules.md, "More optimizers").
FUSEDOPT_MEMORY_SLOT(prev);             ///< the previous step's gradient, 0 where its sign flipped (Rprop)
FUSEDOPT_MEMORY_SLOT(step_size);        ///< per-element step size (Rprop)
FUSEDOPT_MEMORY_SLOT(ax);               ///< the averaged parameter (ASGD)
FUSEDOPT_MEMORY_SLOT(z);                ///< Schedule-Free's z sequence (the parameter holds y while training)
FUSEDOPT_MEMORY_SLOT(exp_avg_slow);     ///< slow EMA of gradients (AdEMAMix; its fast EMA is exp_avg)
FUSEDOPT_MEMORY_SLOT(exp_avg_diff);     ///< EMA of gradient differences (Adan)
FUSEDOPT_MEMORY_SLOT(neg_pre_grad);     ///< the previous step's gradient, negated (Adan)
FUSEDOPT_MEMORY_SLOT(s);                ///< Prodigy's EMA of d-weighted gradients
FUSEDOPT_MEMORY_SLOT(p0);               ///< the parameter before the first step (Prodigy)
FUSEDOPT_REGISTER_SLOT(tensor_lr);      ///< a learning rate formed per tensor by a reducing block (StableAdamW)
}  // namespace slot

/// @brief Whether slot `S` may be bound to `std::int16_t` lists. False for every slot but
/// `slot::remainder`, whose values are integers by construction (the low bits of a split
/// bfloat16 parameter, see rules/mixed_precision.hpp): a parameter, gradient or state stored
/// as an integer would be truncated at every step. Specialise it (true_type) for a slot of
/// your own that holds integers.
template <class S>
struct accepts_integer_elements : std::false_type {};
/// The remainder of split-bfloat16 parameters is an integer.
template <>
struct accepts_integer_elements<slot::remainder_t> : std::true_type {};

/// @brief Whether slot `S` may be bound to 8-bit states quantized with the unsigned map
/// (`blockwise8<unsigned_dynamic_map>`), which holds no negative value: true for the states
/// that are never negative (second moments, running maxima, sums of squares). Specialise it
/// (true_type) for a non-negative slot of your own.
template <class S>
struct accepts_unsigned_quantization : std::false_type {};
template <>
struct accepts_unsigned_quantization<slot::exp_avg_sq_t> : std::true_type {};
template <>
struct accepts_unsigned_quantization<slot::max_exp_avg_sq_t> : std::true_type {};
template <>
struct accepts_unsigned_quantization<slot::exp_inf_t> : std::true_type {};
template <>
struct accepts_unsigned_quantization<slot::sum_sq_t> : std::true_type {};
template <>
struct accepts_unsigned_quantization<slot::square_avg_t> : std::true_type {};
template <>
struct accepts_unsigned_quantization<slot::acc_delta_t> : std::true_type {};

FUSEDOPT_NAMESPACE_END
