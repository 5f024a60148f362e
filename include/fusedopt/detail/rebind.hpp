/// @file detail/rebind.hpp
/// @brief What both backends' `plan::rebind(slot, addresses)` share: the written tensors'
/// memory, sorted once per binding, against which new addresses of a read-only slot are
/// checked without binding (and sorting) every list again.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../bind.hpp"
#include "../config.hpp"
#include "../error.hpp"
#include "../meta.hpp"
#include "../numeric/quantization.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

/// Position of `Slot` among the bound slots of `Lists`; a compile error when it is not bound.
template <class Lists, class Slot>
inline constexpr std::size_t bound_position_v = index_of_v<typename Lists::memory_slots, Slot>;

/// The memory of every written (non-const) tensor of some bound lists, sorted by address. The
/// spans do not overlap (fusedopt::bind rejects lists where they do), so the only one that
/// can overlap [begin, end) is the last one starting before `end`.
class written_memory {
 public:
  template <class Lists>
  void assign(Lists const& lists)
  {
    spans_.clear();
    add(lists, std::make_index_sequence<Lists::num_slots>{});
    std::sort(spans_.begin(), spans_.end());
  }

  [[nodiscard]] bool overlaps(std::uintptr_t begin, std::uintptr_t end) const noexcept
  {
    auto const after = std::lower_bound(spans_.begin(), spans_.end(), std::make_pair(end, std::uintptr_t{0}));
    return after != spans_.begin() && std::prev(after)->second > begin;
  }

 private:
  template <class Lists, std::size_t... K>
  void add(Lists const& lists, std::index_sequence<K...>)
  {
    (add_list<K>(lists), ...);
  }
  template <std::size_t K, class Lists>
  void add_list(Lists const& lists)
  {
    using T = typename Lists::template element_t<K>;
    if constexpr (!std::is_const_v<T>) {
      for (auto const& tensor : lists.template list<K>()) {
        if (tensor.size == 0) { continue; }
        auto const begin = reinterpret_cast<std::uintptr_t>(tensor.data);
        spans_.emplace_back(begin, begin + static_cast<std::uintptr_t>(storage_units<T>(tensor.size)) * sizeof(T));
      }
    }
  }

  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans_;
};

/// Checks the new address of tensor `t` in read-only slot K as fusedopt::bind would (not null
/// when the tensor has elements, aligned to its element, within the address space, clear of
/// every written tensor). `who` prefixes the message.
template <std::size_t K, class Lists>
void check_rebound_address(Lists const& lists, written_memory const& written, std::size_t t,
                           typename Lists::template element_t<K>* address, char const* who)
{
  using T = typename Lists::template element_t<K>;
  static_assert(std::is_const_v<T>, "fusedopt: rebind(slot, addresses) takes a slot bound read-only (const)");
  std::int64_t const size = lists.tensor_size(t);
  if (size == 0) { return; }
  char const* const name = Lists::template slot_name<K>();
  auto const begin = reinterpret_cast<std::uintptr_t>(address);
  FUSEDOPT_EXPECTS(address != nullptr, std::string(who) + ": tensor " + std::to_string(t) + " of slot '" + name +
                                         "' is null but has " + std::to_string(size) + " elements");
  FUSEDOPT_EXPECTS(begin % alignof(std::remove_const_t<T>) == 0,
                   std::string(who) + ": tensor " + std::to_string(t) + " of slot '" + name +
                     "' is not aligned to its element size");
  auto const count = static_cast<std::uintptr_t>(storage_units<T>(size));
  FUSEDOPT_EXPECTS(count <= (std::numeric_limits<std::uintptr_t>::max() - begin) / sizeof(T),
                   std::string(who) + ": tensor " + std::to_string(t) + " of slot '" + name +
                     "' would extend past the end of the address space");
  FUSEDOPT_EXPECTS(!written.overlaps(begin, begin + count * sizeof(T)),
                   std::string(who) + ": memory of tensor " + std::to_string(t) + " of slot '" + name +
                     "' overlaps a tensor the rule writes");
}

/// The checks of `rebind(slot, addresses)` common to both backends: `count` is the tensor
/// count, and every address that differs from the bound one passes check_rebound_address.
template <std::size_t K, class Lists>
void check_rebound_addresses(Lists const& lists, written_memory const& written,
                             typename Lists::template element_t<K>* const* addresses, std::size_t count,
                             char const* who)
{
  std::size_t const n = lists.num_tensors();
  FUSEDOPT_EXPECTS(count == n, std::string(who) + ": " + std::to_string(count) + " addresses for a plan of " +
                                 std::to_string(n) + " tensors");
  auto const& current = lists.template list<K>();
  for (std::size_t t = 0; t < n; ++t) {
    if (addresses[t] != current[t].data) { check_rebound_address<K>(lists, written, t, addresses[t], who); }
  }
}

}  // namespace detail
FUSEDOPT_NAMESPACE_END
