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
};

}  // namespace detail

std::unique_ptr<plan> make_host_plan(family f, dtype t, layout const& l, lists const& x, int threads)
{
  using B = detail::host_backend;
  // The backends' `make` take a `void*` context: the stream on CUDA, the thread count here.
  void* const s = &threads;
  switch (f) {
    case family::sgd: return detail::sgd_plan<B>(t, l, x, s);
    case family::adam:
    case family::adamw: return detail::adam_plan<B>(f, t, l, x, s);
    case family::adagrad: return detail::adagrad_plan<B>(t, l, x, s);
    case family::rmsprop: return detail::rmsprop_plan<B>(t, l, x, s);
    case family::lamb: return detail::lamb_plan<B>(t, l, x, s);
    case family::lion: return detail::lion_plan<B>(t, l, x, s);
    case family::radam: return detail::radam_plan<B>(t, l, x, s);
    case family::adamax: return detail::adamax_plan<B>(t, l, x, s);
    case family::adadelta: return detail::adadelta_plan<B>(t, l, x, s);
    case family::nadam: return detail::nadam_plan<B>(t, l, x, s);
  }
  throw fusedopt::error("fusedopt_torch: unknown optimizer family");
}

double nadam_mu(double beta1, double momentum_decay, std::int64_t t)
{
  return fusedopt::rules::scale_by_nadam::mu(beta1, momentum_decay, t);
}

}  // namespace fusedopt_torch
