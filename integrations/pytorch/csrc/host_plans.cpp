/// @file host_plans.cpp
/// @brief Plans of the host backend (CPU tensors): every family, every dtype.
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

}  // namespace detail

std::unique_ptr<plan> make_host_plan(family f, dtype t, layout const& l, lists const& x, int threads)
{
  using B = detail::host_backend;
  // The backends' `make` take a `void*` context: the stream on CUDA, the thread count here.
  void* const s = &threads;
  switch (f) {
#define FUSEDOPT_TORCH_CASE(name, plans) \
  case family::name: return detail::plans##_plan<B>(f, t, l, x, s);
    FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_CASE)
#undef FUSEDOPT_TORCH_CASE
  }
  throw fusedopt::error("fusedopt_torch: unknown optimizer family");
}

double nadam_mu(double beta1, double momentum_decay, std::int64_t t)
{
  return fusedopt::rules::scale_by_nadam::mu(beta1, momentum_decay, t);
}

double nadam_advanced(double product, double mu, bool single)
{
  return fusedopt::rules::advance_mu_product::advanced(product, mu, single);
}

}  // namespace fusedopt_torch
