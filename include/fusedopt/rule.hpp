/// @file rule.hpp
/// @brief What a rule is, and the element it updates.
///
/// A rule is a trivially copyable functor that updates the slots of one tensor element:
/// @code
/// struct sign_sgd {
///   fusedopt::scalar<double> lr{1e-3};
///   using reads  = fusedopt::slots<fusedopt::slot::grad_t, fusedopt::slot::param_t>;  // optional
///   using writes = fusedopt::slots<fusedopt::slot::param_t>;                          // optional
///   template <class E>
///   FUSEDOPT_HOST_DEVICE void operator()(E& e, fusedopt::step_info const&) const {
///     using T = typename E::value_type;
///     e[fusedopt::slot::param] -= T(lr.get()) * (e[fusedopt::slot::grad] > 0 ? T(1) : T(-1));
///   }
/// };
/// @endcode
/// Optional members a rule may have:
/// - `reads`, `writes`: `slots<...>` lists. Default: every bound slot is loaded, and every
///   bound slot of a non-const list is stored. Slots declared but not bound are ignored, so a
///   rule can declare an optional state (e.g. AMSGrad's max) and run without it. A slot the
///   rule changes but does not declare in `writes` is NOT stored.
/// - `registers`: register-only slots the rule uses beyond `update`.
/// - `prepare(step_info const&) const`: returns a functor `f(E&)` with the per-step values
///   (bias corrections, device scalars) computed once per thread instead of once per element.
/// - `template <class Bound> void validate(Bound) const`: throws `fusedopt::error` when the
///   rule's run-time options need a slot that is not bound (test with `fusedopt::has_slot`).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "config.hpp"
#include "detail/pack.hpp"
#include "detail/rule_traits.hpp"
#include "error.hpp"
#include "meta.hpp"
#include "numeric/dtypes.hpp"
#include "scalar.hpp"
#include "slots.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief True when the slot list `Bound` (what the backends pass to `validate`) holds `S`.
template <class... Bound, class S>
constexpr bool has_slot(slots<Bound...>, S)
{
  return contains_v<slots<Bound...>, S>;
}

/// @brief The registers of one tensor element while a rule runs: one value of type `O` per
/// bound memory slot and per register slot. `e[slot::x]` names a value; using a slot that is
/// neither bound nor a register is a compile-time error.
template <class O, class Memory, class Registers>
class element;

template <class O, class... Memory, class... Registers>
class element<O, slots<Memory...>, slots<Registers...>> {
  using all_slots = slots<Memory..., Registers...>;
  static constexpr std::size_t count = sizeof...(Memory) + sizeof...(Registers);

 public:
  /// The arithmetic type (float, or double when any bound list holds double).
  using value_type = O;
  using memory_slots = slots<Memory...>;

  /// @brief True when slot `S` can be used on this element (for `if constexpr`).
  template <class S>
  FUSEDOPT_HOST_DEVICE static constexpr bool has(S = {})
  {
    return contains_v<all_slots, S>;
  }

  template <class S>
  FUSEDOPT_HOST_DEVICE O& operator[](S)
  {
    static_assert(contains_v<all_slots, S>,
                  "fusedopt: this rule uses a slot that is not bound to a tensor list and is not a "
                  "register slot. Bind it (slot::name = list), declare it in the rule's "
                  "`registers`, or guard the use with `if constexpr (E::has(slot::name))`.");
    return values_[index_of_v<all_slots, S>];
  }
  template <class S>
  FUSEDOPT_HOST_DEVICE O const& operator[](S) const
  {
    static_assert(contains_v<all_slots, S>,
                  "fusedopt: this rule uses a slot that is not bound to a tensor list and is not a "
                  "register slot.");
    return values_[index_of_v<all_slots, S>];
  }

  /// @brief Index of the tensor (in the bound lists) this element belongs to.
  FUSEDOPT_HOST_DEVICE std::int64_t tensor() const { return tensor_; }
  /// @brief Index of this element within its tensor.
  FUSEDOPT_HOST_DEVICE std::int64_t index() const { return index_; }
  /// @brief Sets tensor() and index(); for backends.
  FUSEDOPT_HOST_DEVICE void set_position(std::int64_t tensor, std::int64_t index)
  {
    tensor_ = tensor;
    index_ = index;
  }
  FUSEDOPT_HOST_DEVICE void set_tensor(std::int64_t t) { tensor_ = t; }

  /// @brief This element's place in the run of consecutive elements the backend gives the same
  /// body one after the other: the element is lane vector_lane() of vector_width() elements,
  /// indices index() - vector_lane() to index() - vector_lane() + vector_width() - 1 of its
  /// tensor, run in lane order through one body object before the next run. A body may work
  /// out what the run shares once, at lane 0, and keep it in `mutable` members for the other
  /// lanes (factored_lookup::factor_of: an element's row, found once per vector), if it runs
  /// that work for every lane, unconditionally, lane 0 first. Width 1 (each element alone)
  /// unless the backend says otherwise: the CUDA backend's vector path sets its vector width
  /// (as compile-time constants, after unrolling).
  FUSEDOPT_HOST_DEVICE int vector_lane() const { return vector_lane_; }
  FUSEDOPT_HOST_DEVICE int vector_width() const { return vector_width_; }
  /// @brief Sets vector_lane() and vector_width(); for backends.
  FUSEDOPT_HOST_DEVICE void set_vector_lane(int lane, int width)
  {
    vector_lane_ = lane;
    vector_width_ = width;
  }

  /// @brief True where the backend knows that index() is below 2^31 (an element of a tensor of
  /// fewer elements); false (the default) says nothing. factored_lookup then locates the
  /// element in 32 bits without testing its tensor's size: the CUDA tiles kernel of a factored
  /// pass sets it (a constant there), so that its elements' lookups have no branch.
  FUSEDOPT_HOST_DEVICE bool narrow_index() const { return narrow_index_; }
  /// @brief Sets narrow_index(); for backends.
  FUSEDOPT_HOST_DEVICE void set_narrow_index(bool narrow) { narrow_index_ = narrow; }

  /// @brief Raw access by position (memory slots first, in binding order); for backends.
  FUSEDOPT_HOST_DEVICE O& at(std::size_t i) { return values_[i]; }
  FUSEDOPT_HOST_DEVICE O const& at(std::size_t i) const { return values_[i]; }

 private:
  O values_[count > 0 ? count : 1];
  std::int64_t tensor_ = 0;
  std::int64_t index_ = 0;
  int vector_lane_ = 0;
  int vector_width_ = 1;
  bool narrow_index_ = false;
};

namespace detail {

/// A rule without `prepare`, paired with the step it runs for.
template <class R>
struct bound_step {
  R rule;
  step_info step;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e) const
  {
    rule(e, step);
  }
};

/// The per-element functor for one step: `rule.prepare(step)` where the rule has it.
template <class R>
FUSEDOPT_HOST_DEVICE auto prepare_rule(R const& rule, step_info const& step)
{
  if constexpr (has_prepare<R>::value) {
    return rule.prepare(step);
  } else {
    return bound_step<R>{rule, step};
  }
}

/// The body to run over the elements of `tensor`: `body.for_tensor(tensor)` where it has the
/// hook, else `body` itself (a reference: no copy).
template <class B>
FUSEDOPT_HOST_DEVICE decltype(auto) body_for_tensor(B const& body, std::int64_t tensor)
{
  if constexpr (has_tensor_hook_v<B>) {
    return body.for_tensor(tensor);
  } else {
    (void)tensor;
    return (body);
  }
}

/// The type of a wrapper's part after body_for_tensor (by value).
template <class B>
using tensor_body_t =
  std::decay_t<decltype(::fusedopt::detail::body_for_tensor(std::declval<B const&>(), std::int64_t{}))>;

/// The per-tensor bodies of a pack of bodies (a chain's parts, the groups' bodies).
template <class... B, std::size_t... K>
FUSEDOPT_HOST_DEVICE pack<tensor_body_t<B>...> bodies_for_tensor(pack<B...> const& bodies, std::int64_t tensor,
                                                                  std::index_sequence<K...>)
{
  return make_pack(tensor_body_t<B>(::fusedopt::detail::body_for_tensor(pack_get<K>(bodies), tensor))...);
}
template <class... B>
FUSEDOPT_HOST_DEVICE pack<tensor_body_t<B>...> bodies_for_tensor(pack<B...> const& bodies, std::int64_t tensor)
{
  return bodies_for_tensor(bodies, tensor, std::index_sequence_for<B...>{});
}

/// The per-element body `slot *= factor`, the factor formed once per step (a learning rate, a
/// clipping coefficient) or per tensor (a trust ratio): what most blocks' prepare returns.
template <class Slot>
struct scale_slot {
  double factor;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e) const
  {
    e[Slot{}] *= static_cast<typename E::value_type>(factor);
  }
};

/// Runs the rule's run-time check of its options against the bound slots, if it has one.
template <class R, class Bound>
void validate_rule(R const& rule, Bound bound)
{
  if constexpr (has_validate<R, Bound>::value) { rule.validate(bound); }
}

/// Where a hyperparameter's value may lie, and how a message says so.
struct value_range {
  double low, high;
  bool low_included, high_included;
  char const* text;  ///< "must ...", after the option's name

  [[nodiscard]] constexpr bool holds(double v) const
  {
    return (low_included ? v >= low : v > low) && (high_included ? v <= high : v < high);
  }
};
inline constexpr value_range non_negative{0, HUGE_VAL, true, true, "must not be negative"};
inline constexpr value_range positive{0, HUGE_VAL, false, true, "must be positive"};
inline constexpr value_range above_one{1, HUGE_VAL, false, true, "must be > 1"};
inline constexpr value_range unit_interval{0, 1, true, false, "must be in [0, 1)"};          ///< betas
inline constexpr value_range closed_unit_interval{0, 1, true, true, "must be in [0, 1]"};
inline constexpr value_range open_unit_interval{0, 1, false, false, "must be in (0, 1)"};
inline constexpr value_range half_open_unit_interval{0, 1, false, true, "must be in (0, 1]"};

/// Checks an option of a rule's `validate`: "<name> <range's text>[ (<note>)]" when the value is
/// outside `range` (NaN included). A value read through a pointer is not checked: on the CUDA
/// backend it is device memory, which the host does not read (rules keep defined behaviour for
/// any value read there).
/// @throws fusedopt::error
template <class T>
void expect_range(char const* name, scalar<T> const& option, value_range const& range, char const* note = nullptr)
{
  FUSEDOPT_EXPECTS(option.is_pointer() || range.holds(static_cast<double>(option.value)),
                   std::string(name) + " " + range.text + (note != nullptr ? std::string(" (") + note + ")" : ""));
}

/// Checks the step a run is about to take, for every rule: steps are 1-based (step_info's
/// contract, torch's `state['step']` after its increment). Step 0 or below makes bias
/// corrections 1 - beta^t zero (Adam, AdamW, LAMB, Adamax, RAdam: every parameter NaN or
/// infinite), NAdam's products meaningless, SGD's momentum restart and Adagrad's decay wrong,
/// so it is refused rather than left to the few rules that would notice. Backends call this
/// before anything is written, `step.advance` included.
///
/// `host_memory` says whether a step given as a pointer can be read here: the host backend's
/// pointers are host memory and are checked (with the count `advance` will produce when it
/// points at the same counter), and so is the counter `advance` would increment past
/// INT64_MAX. A CUDA backend's pointers are device memory: reading them would need a
/// synchronisation that a step must not have, so only a step given as a value is checked
/// there; rules keep defined behaviour for any int64 step they read on the device.
/// @throws fusedopt::error naming the step.
inline void validate_step(step_info const& step, bool host_memory)
{
  if (step.step.is_pointer() && !host_memory) { return; }
  std::int64_t t = step.step.get();
  if (host_memory && step.advance != nullptr) {
    FUSEDOPT_EXPECTS(*step.advance < std::numeric_limits<std::int64_t>::max(),
                     "step_info::advance: the step counter is at INT64_MAX; one more step would overflow it");
    if (step.step.pointer == step.advance) { ++t; }  // the rule reads the advanced count
  }
  FUSEDOPT_EXPECTS(t >= 1, "step " + std::to_string(t) +
                             ": steps are 1-based (the first step is 1, as torch's state['step'] after its "
                             "increment); a loop counting from 0 must pass step_info{i + 1}");
}

}  // namespace detail

/// @brief Compile-time checks every backend applies to a rule.
template <class R>
inline constexpr bool is_rule_v = std::is_trivially_copyable_v<R>;

FUSEDOPT_NAMESPACE_END
