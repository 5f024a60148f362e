/// @file user_rule.hpp
/// @brief What a user rule's unit is made of (fusedopt_torch.rule): the names its C++ body may
/// use besides its own (user_math), the builder that makes the rule from a step's
/// hyperparameters, and its plan function. _codegen.py generates the rest: the rule itself, with
/// `#line` directives so that a compiler's messages quote the user's own lines.
#pragma once

// The whole library's rules and blocks: a rule= expression may chain any of them.
#include <fusedopt/detail/phases.hpp>
#include <fusedopt/fusedopt.hpp>
#include <fusedopt/numeric/math.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "unit_plans.hpp"

namespace fusedopt_torch {

/// @brief The functions a user rule's body and constants see unqualified, for float and double
/// alike (the body computes in the element's arithmetic type: float for float32, float16 and
/// bfloat16 parameters, double for float64 ones), on the host and on the GPU. Integer arguments
/// count as double; two arguments compute in their common type (`max(x, 0.0)` of a float x is a
/// double: write `max(x, T(0))` to stay in float).
namespace user_math {
/// The floating-point type an argument of type X computes in.
template <class X>
using real_t = std::conditional_t<std::is_integral_v<X>, double, X>;
template <class X, class Y>
using common_t = std::common_type_t<real_t<X>, real_t<Y>>;

template <class X>
FUSEDOPT_HOST_DEVICE real_t<X> sqrt(X x)
{
  return ::fusedopt::math::sqrt(static_cast<real_t<X>>(x));
}
template <class X>
FUSEDOPT_HOST_DEVICE real_t<X> abs(X x)
{
  return ::fusedopt::math::abs(static_cast<real_t<X>>(x));
}
template <class X>
FUSEDOPT_HOST_DEVICE real_t<X> exp(X x)
{
  if constexpr (std::is_same_v<real_t<X>, float>) {
    return ::expf(x);
  } else {
    return ::exp(static_cast<double>(x));
  }
}
template <class X>
FUSEDOPT_HOST_DEVICE real_t<X> log(X x)
{
  if constexpr (std::is_same_v<real_t<X>, float>) {
    return ::logf(x);
  } else {
    return ::log(static_cast<double>(x));
  }
}
template <class X>
FUSEDOPT_HOST_DEVICE real_t<X> tanh(X x)
{
  if constexpr (std::is_same_v<real_t<X>, float>) {
    return ::tanhf(x);
  } else {
    return ::tanh(static_cast<double>(x));
  }
}
/// x^y; an integer y (a step) by repeated squaring in double (fusedopt::math::ipow, the bits
/// the library's bias corrections use on host and GPU alike).
template <class X, class Y>
FUSEDOPT_HOST_DEVICE auto pow(X x, Y y)
{
  if constexpr (std::is_integral_v<Y>) {
    return static_cast<real_t<X>>(::fusedopt::math::ipow(static_cast<double>(x), static_cast<std::int64_t>(y)));
  } else if constexpr (std::is_same_v<common_t<X, Y>, float>) {
    return ::powf(x, y);
  } else {
    return ::pow(static_cast<double>(x), static_cast<double>(y));
  }
}
/// -1, 0 or 1 (0 for 0 and NaN), as torch.sign.
template <class X>
FUSEDOPT_HOST_DEVICE real_t<X> sign(X x)
{
  return ::fusedopt::math::sign(static_cast<real_t<X>>(x));
}
/// The smaller / larger of two values, in their common type.
template <class X, class Y>
FUSEDOPT_HOST_DEVICE common_t<X, Y> min(X a, Y b)
{
  auto const x = static_cast<common_t<X, Y>>(a);
  auto const y = static_cast<common_t<X, Y>>(b);
  return y < x ? y : x;
}
template <class X, class Y>
FUSEDOPT_HOST_DEVICE common_t<X, Y> max(X a, Y b)
{
  auto const x = static_cast<common_t<X, Y>>(a);
  auto const y = static_cast<common_t<X, Y>>(b);
  return x < y ? y : x;
}
/// `x` limited to [low, high].
template <class X, class L, class H>
FUSEDOPT_HOST_DEVICE real_t<X> clamp(X x, L low, H high)
{
  using R = real_t<X>;
  R const v = static_cast<R>(x);
  R const lo = static_cast<R>(low);
  R const hi = static_cast<R>(high);
  return v < lo ? lo : (hi < v ? hi : v);
}
/// `a` where `condition`, else `b`: both computed, no branch (vectorises on the host).
template <class X, class Y>
FUSEDOPT_HOST_DEVICE common_t<X, Y> where(bool condition, X a, Y b)
{
  return ::fusedopt::math::select(condition, static_cast<common_t<X, Y>>(a), static_cast<common_t<X, Y>>(b));
}
}  // namespace user_math

namespace detail {

/// The builder of a user rule `Rule` (its static `make(hyper const&)` reads the step's
/// hyperparameters from hyper::user in the spec's order), with GradScaler's kernels where
/// `Amp`.
template <class Rule, bool Amp>
struct user_builder {
  static constexpr bool amp = Amp;
  template <class F>
  void run_with(hyper const& h, F&& f) const
  {
    f(Rule::make(h));
  }
};

/// The plan of user rule `Rule` over param, grad and `States...` (the spec's states in order,
/// each a slot or as_float<slot>), `FloatStates` the layout's float_states those imply, with
/// GradScaler's kernels where `Amp`. The workspace holds the rule's reduction accumulators.
template <class B, class Rule, bool Amp, std::uint32_t FloatStates, class... States>
std::unique_ptr<plan> user_plan(family f, dtype t, layout const& l, lists const& x, void* s)
{
  FUSEDOPT_EXPECTS(f == family::user, "fusedopt_torch: internal error: a user rule's unit asked for a built-in family");
  // A unit of 8-bit states (States as q8<slot>: the rule's eight_bit) serves that layout alone.
  constexpr std::uint32_t bits = (stored<States>::quantized || ...) ? layout::quantized_bit : 0u;
  FUSEDOPT_EXPECTS(l.bits() == bits && l.float_states == FloatStates,
                   "fusedopt_torch: internal error: a user rule's states were made with another dtype policy");
  using rule_type = decltype(Rule::make(std::declval<hyper const&>()));
  constexpr int capacity = fo::detail::accumulators_v<rule_type>;
  return plan_of<B, user_builder<Rule, Amp>, States...>(t, x, s, capacity);
}

}  // namespace detail
}  // namespace fusedopt_torch
