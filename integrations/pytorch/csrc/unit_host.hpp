/// @file unit_host.hpp
/// @brief The host backend of a unit (CPU tensors): fusedopt::host plans on the thread count
/// the context points to (torch.get_num_threads()).
#pragma once

#include <fusedopt/host/backend.hpp>

#include <cstddef>
#include <cstdint>

#include "unit_export.hpp"

namespace fusedopt_torch {
namespace detail {

struct unit_backend {
  template <class Lists>
  static auto make(Lists lists, void* threads, int reduction_capacity)
  {
    fusedopt::host::options o;
    o.reduction_capacity = reduction_capacity;
    o.threads = *static_cast<int const*>(threads);
    return fusedopt::host::make_plan(std::move(lists), o);
  }
  template <class Plan, class Rule>
  static void run(Plan const& p, Rule const& r, fusedopt::step_info const& step, void*)
  {
    p.run(r, step);
  }
  template <class Plan, class Lists>
  static void rebind(Plan& p, Lists const& lists, void*)
  {
    p.rebind(lists);
  }
  template <class Plan, class Slot, class Pointer>
  static void rebind_slot(Plan& p, Slot s, Pointer const* addresses, std::size_t n, void*)
  {
    p.rebind(s, addresses, n);
  }
  template <class Plan>
  static std::uint64_t table_uploads(Plan const&)
  {
    return 0;  // host plans read their addresses from host memory
  }
};

}  // namespace detail
}  // namespace fusedopt_torch
