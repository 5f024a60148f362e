/// @file detail/access.hpp
/// @brief What every backend derives from (rule, bound lists): the element type, which bound
/// slots are loaded and which are stored, scalar element load/store, and the update of a
/// block of 8-bit quantized states (numeric/quantization.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../bind.hpp"
#include "../config.hpp"
#include "../numeric/dtypes.hpp"
#include "../numeric/quantization.hpp"
#include "../rule.hpp"
#include "../meta.hpp"
#include "../slots.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

template <class... T>
using common_opmath_t =
  std::conditional_t<(std::is_same_v<opmath_t<T>, double> || ...), double, float>;

/// Elements per quantized block of list type T (1 for other types).
template <class T>
constexpr std::int64_t block_elements_of()
{
  if constexpr (is_blockwise_v<T>) {
    return std::remove_const_t<T>::block_elements;
  } else {
    return 1;
  }
}

/// Elements per quantized block of some bound lists (every quantized list of them has the
/// same); 1 when none is quantized. Backends cut tensors into chunks of whole blocks.
template <class Lists>
inline constexpr std::int64_t block_elements_v = 1;
template <class... B>
inline constexpr std::int64_t block_elements_v<bound_lists<B...>> =
  std::max({block_elements_of<typename B::element_type>()...});

/// `chunk` rounded up to whole quantized blocks of `Lists`.
template <class Lists>
constexpr std::int64_t whole_blocks(std::int64_t chunk)
{
  return (chunk + block_elements_v<Lists> - 1) / block_elements_v<Lists> * block_elements_v<Lists>;
}

template <class Rule, class Bound>
struct access;

/// The access plan of `Rule` over `bound_lists<B...>`.
template <class Rule, class... B>
struct access<Rule, bound_lists<B...>> {
  static_assert(is_rule_v<Rule>, "fusedopt: a rule must be trivially copyable (it is passed to kernels by value)");

  using rule_type = Rule;
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

  /// Whether slot K holds 8-bit quantized states: loaded dequantized like any element, stored
  /// only a block at a time (update_block, or the CUDA backend's warp per block).
  static constexpr bool quantized[sizeof...(B)] = {is_blockwise_v<typename B::element_type>...};
  static constexpr bool any_quantized = (is_blockwise_v<typename B::element_type> || ...);
  /// Elements per quantized block; 1 when no quantized slot is bound.
  static constexpr std::int64_t block_elements = block_elements_v<bound_lists<B...>>;
  static_assert(((block_elements_of<typename B::element_type>() == 1 ||
                  block_elements_of<typename B::element_type>() == block_elements) && ...),
                "fusedopt: every quantized state bound in one step must have the same block size");
  static_assert(!any_quantized || std::is_same_v<value_type, float>,
                "fusedopt: 8-bit quantized states are computed in float; no double list can be bound with them");

  /// Loads element `i` of every read slot (others start at zero), given each slot's base;
  /// quantized slots look their codes up in `maps` (anything with `get<Map>()`, global_maps
  /// by default).
  template <std::size_t... K, class Maps = global_maps>
  FUSEDOPT_HOST_DEVICE static void load(element_type& e, void* const* bases, std::int64_t i, std::index_sequence<K...>,
                                        Maps const& maps = {})
  {
    (load_one<K, loads[K]>(e, bases, i, maps), ...);
  }
  /// The bound slots a pass declaring `Reads` loads.
  template <class Reads>
  static constexpr int reads_count = (int{declares_v<Reads, typename B::slot_type>} + ... + 0);
  /// Loads element `i` of every slot in `Reads` (a reduction pass's reads).
  template <class Reads, std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void load_reads(element_type& e, void* const* bases, std::int64_t i,
                                              std::index_sequence<K...>)
  {
    (load_one<K, declares_v<Reads, typename B::slot_type>>(e, bases, i, global_maps{}), ...);
  }
  template <std::size_t K, bool Load, class Maps>
  FUSEDOPT_HOST_DEVICE static void load_one(element_type& e, void* const* bases, std::int64_t i, Maps const& maps)
  {
    if constexpr (Load && quantized[K]) {
      using T = element_t<K>;
      // bases[K] is where the tensor's codes start (quantized_codes); its scales lie before.
      auto const* codes = static_cast<std::uint8_t const*>(bases[K]);
      e.at(K) = dequantize(maps.template get<typename T::map_type>(), codes[T::code_offset(i)],
                           load_scale(codes, static_cast<std::uint64_t>(i / T::block_elements)));
    } else if constexpr (Load) {
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
    if constexpr (stores[K] && !quantized[K]) {
      static_cast<element_t<K>*>(bases[K])[i] = from_opmath<element_t<K>>(e.at(K));
    }
  }

  /// Stores element `i` of every bound slot in `Stored` (what a factored pass stores:
  /// stored_by_pass); slots bound to const lists are not stored.
  template <class Stored, std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void store_stored(element_type const& e, void* const* bases, std::int64_t i,
                                                std::index_sequence<K...>)
  {
    static_assert(((!contains_v<Stored, typename B::slot_type> || !is_blockwise_v<typename B::element_type>) && ...),
                  "fusedopt: a factored pass cannot store 8-bit quantized states");
    (store_if<K, contains_v<Stored, typename B::slot_type> && !std::is_const_v<typename B::element_type>>(e, bases, i),
     ...);
  }
  template <std::size_t K, bool Store>
  FUSEDOPT_HOST_DEVICE static void store_if(element_type const& e, void* const* bases, std::int64_t i)
  {
    if constexpr (Store) { static_cast<element_t<K>*>(bases[K])[i] = from_opmath<element_t<K>>(e.at(K)); }
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
    static_assert(!stores_quantized, "fusedopt: quantized states are stored a block at a time (update_block)");
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

  // ---- Quantized states: a block is updated as a whole ----------------------------------
  //
  // Every element of the block is loaded and updated; then, per quantized slot the rule
  // writes, the block's new scale is the largest |value| and every element is stored as the
  // code nearest to value / scale. A block whose values of a slot all came out as they were
  // loaded keeps that slot's codes and scale (a skipped step, a tensor no group updates:
  // quantizing dequantized values again could move the scale); a block with a non-finite
  // value keeps them too, so one NaN or infinity never poisons the scale of its neighbours.

  static constexpr bool stores_quantized = ((is_blockwise_v<typename B::element_type> &&
                                             declares_v<rule_writes_t<Rule>, typename B::slot_type> &&
                                             !std::is_const_v<typename B::element_type>) ||
                                            ...);

  /// What a block's updated elements say about each quantized slot: the largest |value| as
  /// bits (an unsigned maximum, exact in any order; a NaN's bits exceed infinity's, so a
  /// non-finite block has max_bits >= 0x7f800000) and whether a value differs from its load.
  struct block_summary {
    std::uint32_t max_bits[num_slots];
    bool changed[num_slots];
  };

  FUSEDOPT_HOST_DEVICE static block_summary empty_summary()
  {
    block_summary s{};
    return s;
  }

  /// Folds one updated element (`after`; `before` as loaded) into the summary.
  FUSEDOPT_HOST_DEVICE static void summarize(block_summary& s, element_type const& after, element_type const& before)
  {
    summarize(s, after, before, std::make_index_sequence<num_slots>{});
  }
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void summarize(block_summary& s, element_type const& after, element_type const& before,
                                             std::index_sequence<K...>)
  {
    (summarize_one<K>(s, after, before), ...);
  }
  template <std::size_t K>
  FUSEDOPT_HOST_DEVICE static void summarize_one(block_summary& s, element_type const& after, element_type const& before)
  {
    if constexpr (quantized[K] && stores[K]) {
      std::uint32_t const magnitude = float_bits(after.at(K)) & 0x7fffffffu;
      s.max_bits[K] = magnitude > s.max_bits[K] ? magnitude : s.max_bits[K];
      // A slot the rule writes without reading started at 0, not at its stored value.
      s.changed[K] = s.changed[K] || !loads[K] || after.at(K) != before.at(K);
    }
  }

  /// Calls `f(max_bits, changed)` on the entries of every quantized slot the rule stores (the
  /// CUDA backend folds a warp's summaries through it).
  template <class F>
  FUSEDOPT_HOST_DEVICE static void for_each_stored_quantized(block_summary& s, F const& f)
  {
    for_each_stored_quantized(s, f, std::make_index_sequence<num_slots>{});
  }
  template <class F, std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void for_each_stored_quantized(block_summary& s, F const& f, std::index_sequence<K...>)
  {
    (visit_stored_quantized<K>(s, f), ...);
  }
  template <std::size_t K, class F>
  FUSEDOPT_HOST_DEVICE static void visit_stored_quantized(block_summary& s, F const& f)
  {
    if constexpr (quantized[K] && stores[K]) { f(s.max_bits[K], s.changed[K]); }
  }

  /// Whether the block's codes and scale of slot K are written: changed, and all finite.
  template <std::size_t K>
  FUSEDOPT_HOST_DEVICE static bool rewrites(block_summary const& s)
  {
    return s.changed[K] && s.max_bits[K] < 0x7f800000u;
  }

  /// Stores element `i` of every written slot, quantized slots with the block's summary (their
  /// codes searched in `maps`, as in load).
  template <std::size_t... K, class Maps = global_maps>
  FUSEDOPT_HOST_DEVICE static void store_in_block(element_type const& e, void* const* bases, std::int64_t i,
                                                  block_summary const& s, std::index_sequence<K...>,
                                                  Maps const& maps = {})
  {
    (store_code<K>(e, bases, i, s, maps), ...);
    (store_one<K>(e, bases, i), ...);
  }
  template <std::size_t K, class Maps>
  FUSEDOPT_HOST_DEVICE static void store_code(element_type const& e, void* const* bases, std::int64_t i,
                                              block_summary const& s, Maps const& maps)
  {
    if constexpr (stores[K] && quantized[K]) {
      if (rewrites<K>(s)) {
        using T = element_t<K>;
        static_cast<std::uint8_t*>(bases[K])[T::code_offset(i)] =
          quantize(maps.template get<typename T::map_type>(), e.at(K), inverse_scale(bits_float(s.max_bits[K])));
      }
    }
  }

  /// Stores the new scale of block `block` of every quantized slot the block rewrites.
  FUSEDOPT_HOST_DEVICE static void store_scales(void* const* bases, std::int64_t block, block_summary const& s)
  {
    store_scales(bases, block, s, std::make_index_sequence<num_slots>{});
  }
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE static void store_scales(void* const* bases, std::int64_t block, block_summary const& s,
                                                std::index_sequence<K...>)
  {
    (store_scale<K>(bases, block, s), ...);
  }
  template <std::size_t K>
  FUSEDOPT_HOST_DEVICE static void store_scale(void* const* bases, std::int64_t block, block_summary const& s)
  {
    if constexpr (stores[K] && quantized[K]) {
      if (rewrites<K>(s)) {
        ::fusedopt::detail::store_scale(bases[K], static_cast<std::uint64_t>(block), bits_float(s.max_bits[K]));
      }
    }
  }

  /// Elements [begin, begin + count) of one tensor, `begin` a multiple of block_elements and
  /// count at most block_elements: one block, updated as a whole, one element at a time. The
  /// definition of a block's update: the host backend runs the same steps in loops that
  /// vectorise (host::plan; tests/host/quantized_states.cpp checks its bits against this), the
  /// CUDA backend spreads them over a warp.
  template <class Prepared>
  static void update_block(Prepared const& body, void* const* bases, std::int64_t tensor, std::int64_t begin,
                           std::int64_t count)
  {
    element_type e[block_elements];
    block_summary s = empty_summary();
    for (std::int64_t n = 0; n < count; ++n) {
      e[n].set_position(tensor, begin + n);
      load(e[n], bases, begin + n, std::make_index_sequence<num_slots>{});
      clear_registers(e[n]);
      element_type const before = e[n];
      body(e[n]);
      summarize(s, e[n], before);
    }
    for (std::int64_t n = 0; n < count; ++n) {
      store_in_block(e[n], bases, begin + n, s, std::make_index_sequence<num_slots>{});
    }
    store_scales(bases, begin / block_elements, s);
  }

  /// Bytes one element moves through memory (each loaded slot once, each stored slot once);
  /// a quantized slot counts its code only (see exact_bytes_per_element).
  static constexpr std::size_t bytes_per_element()
  {
    std::size_t const sizes[] = {storage_size<typename B::element_type>()...};
    std::size_t total = 0;
    for (std::size_t k = 0; k < num_slots; ++k) { total += (loads[k] ? sizes[k] : 0) + (stores[k] ? sizes[k] : 0); }
    return total;
  }
  /// The same with each quantized block's scale shared out over its elements (4 / Block bytes
  /// more per load or store of a quantized slot).
  static constexpr double exact_bytes_per_element()
  {
    double const scales[] = {quantized_scale_bytes<typename B::element_type>()...};
    double total = static_cast<double>(bytes_per_element());
    for (std::size_t k = 0; k < num_slots; ++k) { total += (loads[k] ? scales[k] : 0) + (stores[k] ? scales[k] : 0); }
    return total;
  }

 private:
  template <class T>
  static constexpr std::size_t storage_size()
  {
    return is_blockwise_v<T> ? 1 : sizeof(std::remove_const_t<T>);
  }
  template <class T>
  static constexpr double quantized_scale_bytes()
  {
    return is_blockwise_v<T> ? 4.0 / static_cast<double>(block_elements_of<T>()) : 0.0;
  }
};

}  // namespace detail
FUSEDOPT_NAMESPACE_END
