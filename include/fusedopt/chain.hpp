/// @file chain.hpp
/// @brief chain(r...): several rules fused into one, run in order on the same registers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "config.hpp"
#include "detail/meta.hpp"
#include "rule.hpp"
#include "scalar.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

// A tuple that stays trivially copyable (std::tuple is not), so a chain can be a kernel argument.
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

// Union of two reads/writes declarations; "every bound slot" absorbs everything.
template <class A, class B>
struct merge_declared {
  using type = set_union_t<A, B>;
};
template <class B>
struct merge_declared<all_bound_slots, B> {
  using type = all_bound_slots;
};
template <class A>
struct merge_declared<A, all_bound_slots> {
  using type = all_bound_slots;
};
template <>
struct merge_declared<all_bound_slots, all_bound_slots> {
  using type = all_bound_slots;
};

template <class... Declared>
struct merge_all {
  using type = slots<>;
};
template <class First, class... Rest>
struct merge_all<First, Rest...> {
  using type = typename merge_declared<First, typename merge_all<Rest...>::type>::type;
};

/// Prepared parts of a chain, called in order.
template <class... P>
struct prepared_chain {
  pack<P...> parts;

  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e) const
  {
    call(e, parts);
  }

  /// Each part's per-tensor body (offered only when some part has one).
  template <bool Hooked = (has_tensor_hook_v<P> || ...), std::enable_if_t<Hooked, int> = 0>
  FUSEDOPT_HOST_DEVICE auto for_tensor(std::int64_t tensor) const
  {
    return parts_for_tensor(tensor, std::index_sequence_for<P...>{});
  }

 private:
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE auto parts_for_tensor(std::int64_t tensor, std::index_sequence<K...>) const
  {
    return prepared_chain<tensor_body_t<P>...>{
      make_pack(tensor_body_t<P>(::fusedopt::detail::body_for_tensor(pack_get<K>(parts), tensor))...)};
  }

  template <class E, class... Q>
  FUSEDOPT_HOST_DEVICE static void call(E& e, pack<Q...> const& p)
  {
    if constexpr (sizeof...(Q) > 0) {
      p.head(e);
      call(e, p.tail);
    }
  }
};

}  // namespace detail

/// @brief A rule made of other rules, run one after the other on the same element registers.
/// Its `reads`, `writes` and `registers` are the unions of its parts' (a part without a
/// declaration makes the chain read/write every bound slot).
template <class... Rules>
struct chain_rule {
  static_assert(sizeof...(Rules) > 0, "fusedopt::chain needs at least one rule");

  using reads = typename detail::merge_all<detail::rule_reads_t<Rules>...>::type;
  using writes = typename detail::merge_all<detail::rule_writes_t<Rules>...>::type;
  using registers = typename detail::merge_all<detail::rule_registers_t<Rules>...>::type;

  using part_indices = std::index_sequence_for<Rules...>;

  detail::pack<Rules...> parts;

  /// @brief The K-th part, e.g. to change a hyperparameter between steps.
  template <std::size_t K>
  FUSEDOPT_HOST_DEVICE constexpr auto& get()
  {
    return detail::pack_get<K>(parts);
  }
  template <std::size_t K>
  FUSEDOPT_HOST_DEVICE constexpr auto const& get() const
  {
    return detail::pack_get<K>(parts);
  }

  FUSEDOPT_HOST_DEVICE auto prepare(step_info const& step) const
  {
    return prepare_parts(step, std::index_sequence_for<Rules...>{});
  }

  template <class Bound>
  void validate(Bound bound) const
  {
    validate_parts(bound, std::index_sequence_for<Rules...>{});
  }

 private:
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE auto prepare_parts(step_info const& step, std::index_sequence<K...>) const
  {
    using prepared = detail::prepared_chain<decltype(detail::prepare_rule(detail::pack_get<K>(parts), step))...>;
    return prepared{detail::make_pack(detail::prepare_rule(detail::pack_get<K>(parts), step)...)};
  }
  template <class Bound, std::size_t... K>
  void validate_parts(Bound bound, std::index_sequence<K...>) const
  {
    (detail::validate_rule(detail::pack_get<K>(parts), bound), ...);
  }
};

/// @brief Fuses rules into one: `chain(decoupled_weight_decay{...}, adam_moments{...}, ...)`.
template <class... Rules>
FUSEDOPT_HOST_DEVICE constexpr chain_rule<Rules...> chain(Rules... rules)
{
  return chain_rule<Rules...>{detail::make_pack(rules...)};
}

FUSEDOPT_NAMESPACE_END
