/// @file detail/pack.hpp
/// @brief A tuple that stays trivially copyable (std::tuple is not), so that a chain of rules,
/// its prepared bodies or a kernel's register tile can be kernel arguments and locals.
#pragma once

#include <cstddef>

#include "../config.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

template <class... R>
struct pack;
template <>
struct pack<> {};
template <class Head, class... Tail>
struct pack<Head, Tail...> {
  Head head;
  pack<Tail...> tail;
};

template <class Head, class... Tail>
FUSEDOPT_HOST_DEVICE constexpr pack<Head, Tail...> make_pack(Head head, Tail... tail)
{
  if constexpr (sizeof...(Tail) == 0) {
    return pack<Head>{head, {}};
  } else {
    return pack<Head, Tail...>{head, make_pack(tail...)};
  }
}

template <std::size_t K, class Head, class... Tail>
FUSEDOPT_HOST_DEVICE constexpr auto& pack_get(pack<Head, Tail...>& p)
{
  if constexpr (K == 0) { return p.head; } else { return pack_get<K - 1>(p.tail); }
}
template <std::size_t K, class Head, class... Tail>
FUSEDOPT_HOST_DEVICE constexpr auto const& pack_get(pack<Head, Tail...> const& p)
{
  if constexpr (K == 0) { return p.head; } else { return pack_get<K - 1>(p.tail); }
}

}  // namespace detail
FUSEDOPT_NAMESPACE_END
