/// @file detail/phases.hpp
/// @brief How a rule splits into reduction passes and an update pass. Backends ask only this
/// header: how many passes, what each pass reads and accumulates, the per-pass bodies, the
/// final body and the after-step hooks. Chains derive all of it from their parts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../chain.hpp"
#include "../config.hpp"
#include "../meta.hpp"
#include "../reduce.hpp"
#include "../rule.hpp"
#include "../scalar.hpp"
#include "pack.hpp"
#include "rule_traits.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

/// Number of reduction passes of a rule.
template <class R, class = void>
struct pass_count : std::integral_constant<int, is_reducing<R>::value ? 1 : 0> {};
template <class R>
inline constexpr int pass_count_v = pass_count<R>::value;
template <class R>
struct pass_count<R, std::enable_if_t<is_named_v<R>>> : pass_count<typename R::chain_type> {};
template <class... Parts>
struct pass_count<chain_rule<Parts...>, void> : std::integral_constant<int, (0 + ... + pass_count<Parts>::value)> {};

/// Offset of part K of a chain in a numbering of its parts' passes of one kind, `Count<Part>`
/// of them each (pass_count: reduction passes; factor_count: factored passes): the passes of
/// the parts before it.
template <template <class, class = void> class Count, std::size_t K, class... Parts>
FUSEDOPT_HOST_DEVICE constexpr int counted_offset()
{
  constexpr int counts[] = {Count<Parts>::value..., 0};
  int offset = 0;
  // `!=`, not `<`: with K = 0, `i < K` is nvcc's warning 186 (an error under --Werror=all-warnings).
  for (std::size_t i = 0; i != K; ++i) { offset += counts[i]; }
  return offset;
}

/// The part of a chain that owns pass J of such a numbering (sizeof...(Parts) if none does).
template <template <class, class = void> class Count, int J, class... Parts>
FUSEDOPT_HOST_DEVICE constexpr std::size_t counted_owner()
{
  constexpr int counts[] = {Count<Parts>::value..., 0};
  int offset = 0;
  for (std::size_t i = 0; i < sizeof...(Parts); ++i) {
    if (J < offset + counts[i]) { return i; }
    offset += counts[i];
  }
  return sizeof...(Parts);
}

/// Pass offset of part K of a chain: the reduction passes of the parts before it.
template <std::size_t K, class... Parts>
FUSEDOPT_HOST_DEVICE constexpr int part_offset()
{
  return counted_offset<pass_count, K, Parts...>();
}

/// The part of a chain that owns reduction pass J.
template <int J, class... Parts>
FUSEDOPT_HOST_DEVICE constexpr std::size_t part_of_pass()
{
  return counted_owner<pass_count, J, Parts...>();
}

// ---- what pass J accumulates and reads ----------------------------------------------------

template <class R, int J, class = void>
struct pass_traits;

template <class R, bool = has_finish<R>::value>
struct finished_size_of : std::integral_constant<int, 0> {};
template <class R>
struct finished_size_of<R, true> : std::integral_constant<int, R::finished_size> {};

/// A reducing leaf: its only pass.
template <class R>
struct pass_traits<R, 0, std::enable_if_t<is_reducing<R>::value>> {
  using reduction = typename R::reduction;
  using reads = rule_reads_t<R>;
  /// Doubles per tensor the rule's finish writes after the pass (has_finish), 0 without one.
  static constexpr int finished_size = finished_size_of<R>::value;
};

template <class Parts, std::size_t P>
struct parts_reads;
template <class... Parts, std::size_t P>
struct parts_reads<slots<Parts...>, P> {
  template <std::size_t... K>
  static auto merge(std::index_sequence<K...>) -> typename merge_all<rule_reads_t<std::tuple_element_t<K, std::tuple<Parts...>>>...>::type;
  using type = decltype(merge(std::make_index_sequence<P>{}));
};

template <int J, class... Parts>
struct pass_traits<chain_rule<Parts...>, J, void> {
  static constexpr std::size_t part = part_of_pass<J, Parts...>();
  using owner = std::tuple_element_t<part, std::tuple<Parts...>>;
  static constexpr int offset = part_offset<part, Parts...>();
  using inner = pass_traits<owner, J - offset>;
  using reduction = typename inner::reduction;
  static constexpr int finished_size = inner::finished_size;
  // The parts before the owner run in full: their reads are needed too.
  using reads = typename merge_declared<typename parts_reads<slots<Parts...>, part>::type, typename inner::reads>::type;
};

/// A named optimizer: its chain's pass.
template <class R, int J>
struct pass_traits<R, J, std::enable_if_t<is_named_v<R>>> : pass_traits<typename R::chain_type, J> {};

/// Accumulators the reduction passes of R need in all, each pass's finished values counted
/// with its accumulators: what a plan's reduction capacity must hold (both backends check it
/// before a step writes anything).
template <class R, int... J>
constexpr int accumulators_of(std::integer_sequence<int, J...>)
{
  return (0 + ... + (pass_traits<R, J>::reduction::size + pass_traits<R, J>::finished_size));
}
template <class R>
inline constexpr int accumulators_v = accumulators_of<R>(std::make_integer_sequence<int, pass_count_v<R>>{});

// ---- bodies -------------------------------------------------------------------------------

template <class R>
FUSEDOPT_HOST_DEVICE auto prepare_final(R const& rule, step_info const& step, reduced const* results);

template <class... Parts, std::size_t... K>
FUSEDOPT_HOST_DEVICE auto prepare_final_parts(chain_rule<Parts...> const& c, step_info const& step,
                                              reduced const* results, std::index_sequence<K...>)
{
  using prepared = prepared_chain<decltype(prepare_final(c.template get<K>(), step, results))...>;
  return prepared{make_pack(prepare_final(c.template get<K>(), step, results + part_offset<K, Parts...>())...)};
}

/// The update-pass body of any rule; `results` holds its reduction passes' results in pass order.
/// A chain's runs its parts from chain_rule::resume on.
template <class R>
FUSEDOPT_HOST_DEVICE auto prepare_final(R const& rule, step_info const& step, reduced const* results)
{
  if constexpr (is_reducing<R>::value) {
    return rule.prepare(step, results[0]);
  } else if constexpr (is_chain<R>::value) {
    return prepare_final_parts(rule, step, results, typename R::update_parts{});
  } else if constexpr (is_named_v<R> && pass_count_v<R> > 0) {
    return prepare_final(rule.as_chain(), step, results);
  } else {
    return prepare_rule(rule, step);
  }
}

/// The body that finishes pass J's results per tensor: the owner's prepare_finish (only where
/// pass_traits<R, J>::finished_size > 0).
template <int J, class R>
FUSEDOPT_HOST_DEVICE auto prepare_finish(R const& rule, step_info const& step)
{
  if constexpr (is_reducing<R>::value) {
    static_assert(J == 0, "a reducing rule has one pass");
    return rule.prepare_finish(step);
  } else if constexpr (is_chain<R>::value) {
    using traits = pass_traits<R, J>;
    return prepare_finish<J - traits::offset>(rule.template get<traits::part>(), step);
  } else {
    return prepare_finish<J>(rule.as_chain(), step);
  }
}

/// Runs the parts before the pass's owner, then the owner's accumulating body.
template <class Prefix, class Inner>
struct reduce_after {
  Prefix prefix;
  Inner inner;
  template <class E, class Acc>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
  {
    prefix(e);
    inner(e, acc);
  }

  template <bool Hooked = has_tensor_hook_v<Prefix> || has_tensor_hook_v<Inner>, std::enable_if_t<Hooked, int> = 0>
  FUSEDOPT_HOST_DEVICE auto for_tensor(std::int64_t tensor) const
  {
    return reduce_after<tensor_body_t<Prefix>, tensor_body_t<Inner>>{
      ::fusedopt::detail::body_for_tensor(prefix, tensor), ::fusedopt::detail::body_for_tensor(inner, tensor)};
  }
};

template <int J, class R>
FUSEDOPT_HOST_DEVICE auto prepare_pass(R const& rule, step_info const& step, reduced const* results);

template <int J, class... Parts, std::size_t... K>
FUSEDOPT_HOST_DEVICE auto prepare_pass_parts(chain_rule<Parts...> const& c, step_info const& step,
                                             reduced const* results, std::index_sequence<K...>)
{
  constexpr std::size_t part = part_of_pass<J, Parts...>();
  constexpr int offset = part_offset<part, Parts...>();
  auto inner = prepare_pass<J - offset>(c.template get<part>(), step, results + offset);
  using prefix_type = prepared_chain<decltype(prepare_final(c.template get<K>(), step, results))...>;
  prefix_type prefix{};
  if constexpr (sizeof...(K) > 0) {
    prefix = prefix_type{make_pack(prepare_final(c.template get<K>(), step, results + part_offset<K, Parts...>())...)};
  }
  return reduce_after<prefix_type, decltype(inner)>{prefix, inner};
}

/// The accumulating body of pass J.
template <int J, class R>
FUSEDOPT_HOST_DEVICE auto prepare_pass(R const& rule, step_info const& step, reduced const* results)
{
  if constexpr (is_reducing<R>::value) {
    static_assert(J == 0, "a reducing rule has one pass");
    return rule.prepare_reduce(step);
  } else if constexpr (is_chain<R>::value) {
    return prepare_pass_parts<J>(rule, step, results,
                                 std::make_index_sequence<pass_traits<R, J>::part>{});
  } else {
    return prepare_pass<J>(rule.as_chain(), step, results);
  }
}

// ---- after-step hooks ---------------------------------------------------------------------

template <class R>
FUSEDOPT_HOST_DEVICE void after_step(R const& rule, step_info const& step, reduced const* results);

template <class... Parts, std::size_t... K>
FUSEDOPT_HOST_DEVICE void after_step_parts(chain_rule<Parts...> const& c, step_info const& step, reduced const* results,
                                           std::index_sequence<K...>)
{
  (after_step(c.template get<K>(), step, results + part_offset<K, Parts...>()), ...);
}

/// True when a rule or one of its parts has work to do once per step after the update.
template <class R, class = void>
struct needs_after_step : has_after_step<R> {};
template <class... Parts>
struct needs_after_step<chain_rule<Parts...>> : std::bool_constant<(needs_after_step<Parts>::value || ...)> {};
template <class R>
struct needs_after_step<R, std::enable_if_t<!has_after_step<R>::value && is_named_v<R>>>
  : needs_after_step<typename R::chain_type> {};

/// Runs every after-step hook of the rule, in chain order.
template <class R>
FUSEDOPT_HOST_DEVICE void after_step(R const& rule, step_info const& step, reduced const* results)
{
  if constexpr (has_after_step<R>::value) {
    // A hook of a rule without passes gets empty results: `results` then points past the
    // last pass's results (or is null when the whole rule has none).
    if constexpr (pass_count_v<R> > 0) {
      rule.after_step(results[0], step);
    } else {
      rule.after_step(reduced{}, step);
    }
  } else if constexpr (is_chain<R>::value) {
    after_step_parts(rule, step, results, typename R::part_indices{});
  } else if constexpr (is_named_v<R> && needs_after_step<R>::value) {
    after_step(rule.as_chain(), step, results);
  }
}

}  // namespace detail
FUSEDOPT_NAMESPACE_END
