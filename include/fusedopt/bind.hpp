/// @file bind.hpp
/// @brief Binding slots to tensor lists, and validating the lists.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "meta.hpp"
#include "numeric/quantization.hpp"
#include "slots.hpp"
#include "tensor_list.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {
struct bound_lists_access;

/// False only for a list quantized with the unsigned map bound to a slot that may be negative.
template <class Slot, class T>
constexpr bool map_fits_slot()
{
  if constexpr (is_blockwise_v<T>) {
    return std::remove_const_t<T>::map_type::is_signed || accepts_unsigned_quantization<Slot>::value;
  } else {
    return true;
  }
}
}  // namespace detail

/// @brief Several slots bound to tensor lists of equal length: tensor `i` of every list is
/// one parameter (its value, gradient, states...). Made by `fusedopt::bind`, which validates
/// the lists; immutable afterwards.
template <class... Bindings>
class bound_lists {
  static_assert(sizeof...(Bindings) > 0, "fusedopt::bind needs at least one binding");
  static_assert(!has_duplicates_v<slots<typename Bindings::slot_type...>>,
                "fusedopt::bind: a slot is bound twice");
  // Checked here, where every backend's lists pass, rather than in tensor_list: a list does
  // not know the slot it will be bound to.
  static_assert(((!std::is_same_v<std::remove_const_t<typename Bindings::element_type>, std::int16_t> ||
                  accepts_integer_elements<typename Bindings::slot_type>::value) &&
                 ...),
                "fusedopt::bind: a std::int16_t list can only be bound to slot::remainder (a parameter, "
                "gradient or state in int16 would be truncated to integers at every step); use a floating "
                "type, or specialise fusedopt::accepts_integer_elements for a slot of your own");
  static_assert((detail::map_fits_slot<typename Bindings::slot_type, typename Bindings::element_type>() && ...),
                "fusedopt::bind: an unsigned_dynamic_map state can only hold non-negative values (exp_avg_sq, "
                "max_exp_avg_sq, exp_inf, sum_sq, square_avg, acc_delta); use signed_dynamic_map, or specialise "
                "fusedopt::accepts_unsigned_quantization for a slot of your own");

 public:
  /// The bound memory slots, in binding order.
  using memory_slots = slots<typename Bindings::slot_type...>;
  static constexpr std::size_t num_slots = sizeof...(Bindings);
  /// Element type of the K-th binding (possibly const).
  template <std::size_t K>
  using element_t = typename std::tuple_element_t<K, std::tuple<Bindings...>>::element_type;

  /// @brief Validates and keeps copies of the lists (not of the tensors).
  /// @throws fusedopt::error if the lists have different lengths, a size is negative, a
  /// tensor has different sizes in different slots, a pointer is null with a non-zero size,
  /// a tensor's bytes would extend past the end of the address space, or the memory of a
  /// written (non-const) tensor overlaps any other bound tensor.
  explicit bound_lists(Bindings... bindings) : bindings_(std::move(bindings)...) { validate(); }

  /// @brief Number of tensors (the common length of every list).
  [[nodiscard]] std::size_t num_tensors() const { return std::get<0>(bindings_).list.size(); }

  /// @brief The list bound at position K.
  template <std::size_t K>
  [[nodiscard]] tensor_list<element_t<K>> const& list() const
  {
    return std::get<K>(bindings_).list;
  }

  /// @brief Number of elements of tensor `i` (the same in every slot).
  [[nodiscard]] std::int64_t tensor_size(std::size_t i) const { return list<0>()[i].size; }

  /// @brief Name of the K-th bound slot.
  template <std::size_t K>
  [[nodiscard]] static constexpr char const* slot_name() noexcept
  {
    return slot_names[K];
  }

  /// @brief Address of element 0 of tensor `i` in the K-th list, type-erased.
  template <std::size_t K>
  [[nodiscard]] void* address(std::size_t i) const
  {
    auto const& tensor = list<K>()[i];
    if constexpr (is_blockwise_v<element_t<K>>) {
      // A quantized tensor is addressed by its codes; its scales lie before them.
      return const_cast<void*>(static_cast<void const*>(detail::quantized_codes(tensor.data, tensor.size)));
    } else {
      return const_cast<void*>(static_cast<void const*>(tensor.data));
    }
  }

 private:
  // validate() sorts one per tensor and slot at every bind (a rebind binds anew): kept small.
  struct span {
    std::uintptr_t begin, end;
    std::size_t tensor;
    std::uint16_t slot;
    bool writable;
  };

  static constexpr char const* slot_names[] = {Bindings::slot_type::name...};

  template <std::size_t K>
  void check_list(std::vector<span>& spans) const
  {
    auto const& reference = list<0>();
    auto const& l = list<K>();
    using T = element_t<K>;
    FUSEDOPT_EXPECTS(l.size() == reference.size(),
                     std::string("slot '") + slot_names[K] + "' has " + std::to_string(l.size()) +
                       " tensors but slot '" + slot_names[0] + "' has " + std::to_string(reference.size()));
    for (std::size_t i = 0; i < l.size(); ++i) {
      // A list built from an initializer list never went through push_back's check.
      FUSEDOPT_EXPECTS(l[i].size >= 0, "tensor " + std::to_string(i) + " of slot '" + slot_names[K] +
                                         "' has a negative size " + std::to_string(l[i].size));
      FUSEDOPT_EXPECTS(l[i].size == reference[i].size,
                       "tensor " + std::to_string(i) + " has " + std::to_string(l[i].size) + " elements in slot '" +
                         slot_names[K] + "' but " + std::to_string(reference[i].size) + " in slot '" + slot_names[0] +
                         "'");
      FUSEDOPT_EXPECTS(l[i].data != nullptr || l[i].size == 0,
                       "tensor " + std::to_string(i) + " of slot '" + slot_names[K] + "' is null but has " +
                         std::to_string(l[i].size) + " elements");
      if (l[i].size > 0) {
        auto const begin = reinterpret_cast<std::uintptr_t>(l[i].data);
        if constexpr (is_blockwise_v<T>) {
          FUSEDOPT_EXPECTS(begin % alignof(T) == 0, "tensor " + std::to_string(i) + " of slot '" + slot_names[K] +
                                                      "': 8-bit state storage must be 16-byte aligned");
        }
        auto const size = static_cast<std::uintptr_t>(detail::storage_units<T>(l[i].size));
        // size * sizeof(T) or begin + bytes could wrap around: a huge tensor would then look
        // short (or empty) to the overlap sweep below and be accepted over other tensors. One
        // division rules out both: the bytes must end within the address space.
        FUSEDOPT_EXPECTS(size <= (std::numeric_limits<std::uintptr_t>::max() - begin) / sizeof(T),
                         "tensor " + std::to_string(i) + " of slot '" + slot_names[K] + "' has " +
                           std::to_string(l[i].size) + " elements in " + std::to_string(size) + " units of " +
                           std::to_string(sizeof(T)) + " bytes: they would extend past the end of the address space");
        spans.push_back(span{begin, begin + size * sizeof(T), i, K, !std::is_const_v<T>});
      }
    }
  }

  template <std::size_t... K>
  void validate_impl(std::index_sequence<K...>) const
  {
    std::vector<span> spans;
    spans.reserve(sizeof...(K) * list<0>().size());
    (check_list<K>(spans), ...);
    // Sweep by start address. A pair overlaps when the later one starts before the earlier
    // one ends; only pairs with a written side matter, so keep the furthest end seen among
    // all spans and among writable ones.
    std::sort(spans.begin(), spans.end(), [](span const& a, span const& b) { return a.begin < b.begin; });
    span const* furthest_any = nullptr;
    span const* furthest_writable = nullptr;
    for (auto const& s : spans) {
      span const* other = s.writable ? furthest_any : furthest_writable;
      if (other != nullptr && s.begin < other->end) {
        FUSEDOPT_FAIL("memory of tensor " + std::to_string(s.tensor) + " of slot '" + slot_names[s.slot] +
                      "' overlaps tensor " + std::to_string(other->tensor) + " of slot '" + slot_names[other->slot] +
                      "', and at least one of them is written");
      }
      if (furthest_any == nullptr || s.end > furthest_any->end) { furthest_any = &s; }
      if (s.writable && (furthest_writable == nullptr || s.end > furthest_writable->end)) { furthest_writable = &s; }
    }
  }

  void validate() const { validate_impl(std::index_sequence_for<Bindings...>{}); }

  // Plans' rebind(slot, addresses) re-points a read-only slot after checking each address
  // (detail/rebind.hpp): the lists stay valid without a full validation.
  friend struct detail::bound_lists_access;
  template <std::size_t K>
  void repoint(std::size_t t, element_t<K>* data) noexcept
  {
    std::get<K>(bindings_).list.set_data(t, data);
  }

  std::tuple<Bindings...> bindings_;
};

namespace detail {
struct bound_lists_access {
  template <std::size_t K, class Lists>
  static void repoint(Lists& lists, std::size_t t, typename Lists::template element_t<K>* data) noexcept
  {
    lists.template repoint<K>(t, data);
  }
};
}  // namespace detail

/// @brief Binds slots to tensor lists: `fusedopt::bind(slot::param = p, slot::grad = g, ...)`.
/// @throws fusedopt::error on invalid lists (see bound_lists).
template <class... Bindings>
[[nodiscard]] bound_lists<Bindings...> bind(Bindings... bindings)
{
  return bound_lists<Bindings...>(std::move(bindings)...);
}

FUSEDOPT_NAMESPACE_END
