/// @file chain.hpp
/// @brief chain(r...): several rules fused into one, run in order on the same registers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "config.hpp"
#include "detail/pack.hpp"
#include "detail/rule_traits.hpp"
#include "meta.hpp"
#include "rule.hpp"
#include "scalar.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

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
  FUSEDOPT_HOST_DEVICE prepared_chain<tensor_body_t<P>...> for_tensor(std::int64_t tensor) const
  {
    return {bodies_for_tensor(parts, tensor)};
  }

 private:
  template <class E, class... Q>
  FUSEDOPT_HOST_DEVICE static void call(E& e, pack<Q...> const& p)
  {
    if constexpr (sizeof...(Q) > 0) {
      p.head(e);
      call(e, p.tail);
    }
  }
};

/// The union of the declarations of parts From, From + 1, ... (the parts an update pass runs).
template <std::size_t From, class Indices, class... Declared>
struct merge_from;
template <std::size_t From, std::size_t... K, class... Declared>
struct merge_from<From, std::index_sequence<K...>, Declared...> {
  using type = typename merge_all<std::conditional_t<(K >= From), Declared, slots<>>...>::type;
};

/// K + From for each K: the indices of a chain's parts from From on.
template <std::size_t From, std::size_t... K>
FUSEDOPT_HOST_DEVICE constexpr std::index_sequence<(K + From)...> parts_from(std::index_sequence<K...>)
{
  return {};
}

/// True when every slot of `Writes` is in `Stored` (never for "every bound slot").
template <class Writes, class Stored>
struct writes_stored : std::false_type {};
template <class... S, class Stored>
struct writes_stored<slots<S...>, Stored> : std::bool_constant<(contains_v<Stored, S> && ...)> {};

}  // namespace detail

/// @brief A rule made of other rules, run one after the other on the same element registers.
/// Its `reads`, `writes` and `registers` are the unions of its parts' (a part without a
/// declaration makes the chain read/write every bound slot): those of the parts its update pass
/// runs, from `resume` on (all of them unless a part's factored pass stores: rule_traits.hpp).
template <class... Rules>
struct chain_rule {
  static_assert(sizeof...(Rules) > 0, "fusedopt::chain needs at least one rule");

  /// The first part the update pass runs: the last part whose factored pass stores slots
  /// (detail::resume_part; 0 when none does). The parts before it ran in that pass, which
  /// stored what they wrote, so the update neither runs them nor loads what only they read.
  static constexpr std::size_t resume = detail::resume_part<Rules...>();
  using reads = typename detail::merge_from<resume, std::index_sequence_for<Rules...>, detail::rule_reads_t<Rules>...>::type;
  using writes = typename detail::merge_from<resume, std::index_sequence_for<Rules...>, detail::rule_writes_t<Rules>...>::type;
  using registers = typename detail::merge_all<detail::rule_registers_t<Rules>...>::type;

  using part_indices = std::index_sequence_for<Rules...>;
  /// The parts the update pass runs: resume, resume + 1, ...
  using update_parts = decltype(detail::parts_from<resume>(std::make_index_sequence<sizeof...(Rules) - resume>{}));

  detail::pack<Rules...> parts;

 private:
  template <std::size_t... K>
  static constexpr bool prefix_writes_stored(std::index_sequence<K...>)
  {
    using stored = detail::pass_stored_t<std::tuple_element_t<resume, std::tuple<Rules...>>>;
    return ((K >= resume || detail::writes_stored<detail::rule_writes_t<Rules>, stored>::value) && ...);
  }
  static_assert(prefix_writes_stored(std::index_sequence_for<Rules...>{}),
                "fusedopt: a part before one whose factored pass stores (stored_by_pass) may write only slots that "
                "pass stores: the update pass does not run it again");

 public:
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

  /// The update's body: the parts from `resume` on, in order.
  FUSEDOPT_HOST_DEVICE auto prepare(step_info const& step) const { return prepare_parts(step, update_parts{}); }

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
