/// @file detail/access.hpp
/// @brief What every backend derives from (rule, bound lists): the element type, which bound
/// slots are loaded and which are stored, and scalar element load/store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../bind.hpp"
#include "../config.hpp"
#include "../numeric/dtypes.hpp"
#include "../rule.hpp"
#include "../meta.hpp"
#include "../slots.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

template <class... T>
using common_opmath_t =
  std::conditional_t<(std::is_same_v<opmath_t<T>, double> || ...), double, float>;

template <class Rule, class Bound>
struct access;

/// The access plan of `Rule` over `bound_lists<B...>`.
template <class Rule, class... B>
struct access<Rule, bound_lists<B...>> {
  static_assert(is_rule_v<Rule>, "fusedopt: a rule must be trivially copyable (it is passed to kernels by value)");

  using memory = slots<typename B::slot_type...>;
  using registers = set_union_t<slots<slot::update_t>, rule_registers_t<Rule>>;
  using value_type = common_opmath_t<std::remove_const_t<typename B::element_type>...>;
  using element_type = element<value_type, memory, registers>;
  static constexpr std::size_t num_slots = sizeof...(B);

  template <std::size_t K>
  using element_t = std::remove_const_t<typename bound_lists<B...>::template element_t<K>>;

  // Sized explicitly: nvcc rejects `if constexpr (loads[K])` when the bound is deduced from the
  // initializer ("expression must have a constant value"), so the host backend would not compile in .cu files.
  static constexpr bool loads[sizeof...(B)] = {declares_v<rule_reads_t<Rule>, typename B::slot_type>...};
  static constexpr bool stores[sizeof...(B)] = {
    (declares_v<rule_writes_t<Rule>, typename B::slot_type> && !std::is_const_v<typename B::element_type>)...};

  static_assert(((std::is_same_v<rule_writes_t<Rule>, all_bound_slots> ||
                  !contains_v<rule_writes_t<Rule>, typename B::slot_type> ||
                  !std::is_const_v<typename B::element_type>) && ...),
                "fusedopt: the rule declares that it writes a slot bound to a const tensor list");

  /// Loads element `i` of every read slot (others start at zero), given each slot's base.
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void load(element_type& e, void* const* bases, std::int64_t i, std::index_sequence<K...>)
  {
    (load_one<K, loads[K]>(e, bases, i), ...);
  }
  /// Loads element `i` of every slot in `Reads` (a reduction pass's reads).
  template <class Reads, std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void load_reads(element_type& e, void* const* bases, std::int64_t i,
                                              std::index_sequence<K...>)
  {
    (load_one<K, declares_v<Reads, typename B::slot_type>>(e, bases, i), ...);
  }
  template <std::size_t K, bool Load>
  FUSEDOPT_HOST_DEVICE static void load_one(element_type& e, void* const* bases, std::int64_t i)
  {
    if constexpr (Load) {
      e.at(K) = to_opmath<value_type>(static_cast<element_t<K> const*>(bases[K])[i]);
    } else {
      e.at(K) = value_type(0);
    }
  }

  /// Stores element `i` of every written slot.
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void store(element_type const& e, void* const* bases, std::int64_t i,
                                         std::index_sequence<K...>)
  {
    (store_one<K>(e, bases, i), ...);
  }
  template <std::size_t K>
  FUSEDOPT_HOST_DEVICE static void store_one(element_type const& e, void* const* bases, std::int64_t i)
  {
    if constexpr (stores[K]) {
      static_cast<element_t<K>*>(bases[K])[i] = from_opmath<element_t<K>>(e.at(K));
    }
  }

  /// Registers start at zero.
  FUSEDOPT_HOST_DEVICE static void clear_registers(element_type& e)
  {
    for (std::size_t r = num_slots; r < num_slots + registers::size; ++r) { e.at(r) = value_type(0); }
  }

  /// Load, run the prepared rule, store: one element, scalar path.
  template <class Prepared>
  FUSEDOPT_HOST_DEVICE static void update(Prepared const& body, void* const* bases, std::int64_t tensor, std::int64_t i)
  {
    element_type e;
    e.set_position(tensor, i);
    load(e, bases, i, std::make_index_sequence<num_slots>{});
    clear_registers(e);
    body(e);
    store(e, bases, i, std::make_index_sequence<num_slots>{});
  }

  /// Load what a reduction pass reads, run its accumulating body: one element, nothing stored.
  template <class Reads, class Prepared, class Acc>
  FUSEDOPT_HOST_DEVICE static void accumulate(Prepared const& body, void* const* bases, std::int64_t tensor,
                                              std::int64_t i, Acc& acc)
  {
    element_type e;
    e.set_position(tensor, i);
    load_reads<Reads>(e, bases, i, std::make_index_sequence<num_slots>{});
    clear_registers(e);
    body(e, acc);
  }

  /// Bytes one element moves through memory (each loaded slot once, each stored slot once).
  static constexpr std::size_t bytes_per_element()
  {
    std::size_t const sizes[] = {sizeof(std::remove_const_t<typename B::element_type>)...};
    std::size_t total = 0;
    for (std::size_t k = 0; k < num_slots; ++k) { total += (loads[k] ? sizes[k] : 0) + (stores[k] ? sizes[k] : 0); }
    return total;
  }
};

}  // namespace detail
FUSEDOPT_NAMESPACE_END
