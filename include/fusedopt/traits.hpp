/// @file traits.hpp
/// @brief What a rule declares, as public traits: the slots it reads and writes, its reduction
/// passes, its per-element body, the compute type of a set of element types, and the memory
/// traffic of one element over given lists (the benchmarks' bytes, from the declarations the
/// backends use to decide what to load and store). Slot-list algebra (contains_v, ...) is in
/// meta.hpp.
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

#include "bind.hpp"
#include "config.hpp"
#include "detail/access.hpp"
#include "detail/factored.hpp"
#include "detail/phases.hpp"
#include "detail/rule_traits.hpp"
#include "meta.hpp"
#include "rule.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief The slots `Rule` reads (named optimizers and chains: the union of their parts').
template <class Rule>
using reads_t = detail::rule_reads_t<Rule>;

/// @brief The slots `Rule` writes.
template <class Rule>
using writes_t = detail::rule_writes_t<Rule>;

/// @brief The number of reduction passes a step of `Rule` makes before its update pass.
template <class Rule>
inline constexpr int pass_count_v = detail::pass_count_v<Rule>;

/// @brief The slots reduction pass `J` of `Rule` reads.
template <class Rule, int J>
using pass_reads_t = typename detail::pass_traits<Rule, J>::reads;

/// @brief The number of factored passes (factored.hpp) a step of `Rule` makes before its
/// reduction passes.
template <class Rule>
inline constexpr int factor_count_v = detail::factor_count_v<Rule>;

/// @brief The slots factored pass `J` of `Rule` reads.
template <class Rule, int J>
using factor_reads_t = typename detail::factor_traits<Rule, J>::reads;
/// @brief The slots factored pass J stores (its owner's `stored_by_pass`; slots<> for most).
template <class Rule, int J>
using factor_stores_t = typename detail::factor_traits<Rule, J>::stores;

/// @brief The per-element body a step of `Rule` without reduction passes runs: what its
/// `prepare(step)` returns, or the rule itself bound to the step where it has no `prepare`.
template <class Rule>
using body_t = decltype(detail::prepare_rule(std::declval<Rule const&>(), std::declval<step_info const&>()));

/// @brief Whether a prepared body offers a per-tensor form, `for_tensor(std::int64_t) const`,
/// which the backends call once per chunk (rule.hpp). A rule author can `static_assert` it: a
/// `for_tensor` of another signature is not an error, only never called.
template <class Body>
inline constexpr bool has_tensor_body_v = detail::has_tensor_hook_v<Body>;

/// @brief The type rules compute in for lists of these element types (float for half and
/// bfloat16, double where a double list is bound): the widest of their `opmath_t`.
template <class... Elements>
using common_opmath_t = detail::common_opmath_t<Elements...>;

/// @brief What one element costs in memory in a step of `Rule` over `Lists` (a
/// `bound_lists<...>`, the type `fusedopt::bind` returns): per bound slot, in the lists' order,
/// whether the update pass loads and stores it, and the bytes moved.
template <class Rule, class Lists>
struct memory_traffic {
 private:
  using access = detail::access<Rule, Lists>;

  template <class Reads, class... B>
  static constexpr std::size_t read_bytes(bound_lists<B...> const*)
  {
    return (std::size_t{0} + ... +
            (detail::declares_v<Reads, typename B::slot_type> ? sizeof(std::remove_const_t<typename B::element_type>) : 0));
  }
  template <int... J>
  static constexpr std::size_t pass_bytes(std::integer_sequence<int, J...>)
  {
    return (std::size_t{0} + ... + read_bytes<pass_reads_t<Rule, J>>(static_cast<Lists const*>(nullptr)));
  }
  template <int... J>
  static constexpr std::size_t factor_bytes(std::integer_sequence<int, J...>)
  {
    return (std::size_t{0} + ... +
            (read_bytes<factor_reads_t<Rule, J>>(static_cast<Lists const*>(nullptr)) +
             read_bytes<factor_stores_t<Rule, J>>(static_cast<Lists const*>(nullptr))));
  }

 public:
  /// Whether the update pass loads (stores) slot K of the lists.
  template <std::size_t K>
  static constexpr bool loads = access::loads[K];
  template <std::size_t K>
  static constexpr bool stores = access::stores[K];
  /// Bytes of the update pass: each loaded slot once, each stored slot once.
  static constexpr std::size_t update_bytes = access::bytes_per_element();
  /// Bytes of the whole step: the update pass and every reduction and factored pass's reads
  /// and a factored pass's stores (not a factored pass's statistics and tile partials, which depend on the shapes:
  /// docs/rules.md, "Factored passes"). An 8-bit quantized slot counts 1 byte (its code) here;
  /// see exact_bytes.
  static constexpr std::size_t bytes = update_bytes + pass_bytes(std::make_integer_sequence<int, pass_count_v<Rule>>{}) +
                                       factor_bytes(std::make_integer_sequence<int, factor_count_v<Rule>>{});
  /// The update pass's bytes with the scales of quantized blocks shared out over their
  /// elements (4 / block bytes per load or store of a quantized slot); equal to update_bytes
  /// without quantized slots.
  static constexpr double exact_bytes = access::exact_bytes_per_element();
};

/// @brief Bytes one element moves in one step of `Rule` over `Lists`, every pass counted.
template <class Rule, class Lists>
inline constexpr std::size_t bytes_per_element_v = memory_traffic<Rule, Lists>::bytes;

FUSEDOPT_NAMESPACE_END
