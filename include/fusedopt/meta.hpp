/// @file meta.hpp
/// @brief slots<...>: the compile-time lists of slot tags a rule declares (`reads`, `writes`,
/// `registers`), and the algebra every layer above computes with (membership, position, union,
/// removal). The bottom layer: it includes nothing of fusedopt but config.hpp.
#pragma once

#include <cstddef>
#include <type_traits>

#include "config.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief A compile-time list of slot tags, used in a rule's `reads`, `writes` and
/// `registers` declarations.
template <class... Slots>
struct slots {
  static constexpr std::size_t size = sizeof...(Slots);
};

/// @brief Whether the list `List` holds the slot type `S`. A primary template without a
/// definition, so that other list-like declarations can specialise it (detail/rule_traits.hpp
/// makes "every bound slot", a rule's default declaration, hold every slot).
template <class List, class S>
struct contains;
template <class... Ss, class S>
struct contains<slots<Ss...>, S> : std::bool_constant<(std::is_same_v<Ss, S> || ...)> {};
/// @brief Whether the type list `List` (a `slots<...>`) holds the slot type `S`.
template <class List, class S>
inline constexpr bool contains_v = contains<List, S>::value;

/// @brief The union of two lists, keeping the order of first appearance.
template <class A, class B>
struct set_union;

namespace detail {
template <class List, class S>
struct push_unique;
template <class... Ss, class S>
struct push_unique<slots<Ss...>, S> {
  using type = std::conditional_t<contains_v<slots<Ss...>, S>, slots<Ss...>, slots<Ss..., S>>;
};
}  // namespace detail

template <class A>
struct set_union<A, slots<>> {
  using type = A;
};
template <class A, class S, class... Rest>
struct set_union<A, slots<S, Rest...>> {
  using type = typename set_union<typename detail::push_unique<A, S>::type, slots<Rest...>>::type;
};
template <class A, class B>
using set_union_t = typename set_union<A, B>::type;

/// @brief The position of `S` in `List` (a compile error when `S` is not in it).
template <class List, class S>
struct index_of;
template <class S, class... Rest>
struct index_of<slots<S, Rest...>, S> : std::integral_constant<std::size_t, 0> {};
template <class Head, class... Rest, class S>
struct index_of<slots<Head, Rest...>, S>
  : std::integral_constant<std::size_t, 1 + index_of<slots<Rest...>, S>::value> {};
template <class List, class S>
inline constexpr std::size_t index_of_v = index_of<List, S>::value;

/// @brief Whether a slot appears twice in `List`.
template <class List>
struct has_duplicates;
template <>
struct has_duplicates<slots<>> : std::false_type {};
template <class S, class... Rest>
struct has_duplicates<slots<S, Rest...>>
  : std::bool_constant<contains_v<slots<Rest...>, S> || has_duplicates<slots<Rest...>>::value> {};
template <class List>
inline constexpr bool has_duplicates_v = has_duplicates<List>::value;

/// @brief `List` without the slot `S` (specialisable as `contains` is).
template <class List, class S>
struct without;
template <class S>
struct without<slots<>, S> {
  using type = slots<>;
};
template <class Head, class... Rest, class S>
struct without<slots<Head, Rest...>, S> {
  using rest = typename without<slots<Rest...>, S>::type;
  template <class L>
  struct prepend;
  template <class... Ts>
  struct prepend<slots<Ts...>> {
    using type = slots<Head, Ts...>;
  };
  using type = std::conditional_t<std::is_same_v<Head, S>, rest, typename prepend<rest>::type>;
};
template <class List, class S>
using without_t = typename without<List, S>::type;

FUSEDOPT_NAMESPACE_END
