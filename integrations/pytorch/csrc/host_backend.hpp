/// @file host_backend.hpp
/// @brief The host backend for families.hpp, shared by host_plans.cpp and host_8bit_plans.cpp
/// (two translation units, compiled in parallel).
#pragma once

#include <fusedopt/host/backend.hpp>

#include "families.hpp"

namespace fusedopt_torch {
namespace detail {

struct host_backend {
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

/// make_host_plan for a bucket of 8-bit states (layout::quantized): FUSEDOPT_TORCH_QUANTIZED_FAMILIES'
/// plans, in host_8bit_plans.cpp. @throws fusedopt::error for another family.
std::unique_ptr<plan> host_quantized_plan(family f, dtype t, layout const& l, lists const& x, int threads);

}  // namespace detail
}  // namespace fusedopt_torch
