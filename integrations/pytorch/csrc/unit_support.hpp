/// @file unit_support.hpp
/// @brief The host unit's conversions of 8-bit states (unit_api::quantize_state and
/// dequantize_state): what Python uses to turn full-precision states (a loaded torch.optim
/// state_dict) into 8-bit states and back, with the bits a step stores and reads. Include after
/// unit_host.hpp.
#pragma once

#include "unit_plans.hpp"

namespace fusedopt_torch {
namespace detail {

/// Slot = the gradient slot's values: a step's store of new state values, without its arithmetic.
template <class Slot>
struct store_grad_into {
  using reads = fo::slots<slot::grad_t>;
  using writes = fo::slots<Slot>;
  template <class E>
  void operator()(E& e, fo::step_info const&) const
  {
    e[Slot{}] = e[slot::grad];
  }
};

/// param = Slot: the state's values as a step loads them.
template <class Slot>
struct load_into_param {
  using reads = fo::slots<Slot>;
  using writes = fo::slots<slot::param_t>;
  template <class E>
  void operator()(E& e, fo::step_info const&) const
  {
    e[slot::param] = e[Slot{}];
  }
};

/// Runs the conversion `Rule<Slot>` over the floats and the 8-bit storage of one state on the
/// host: `Slot` a slot the map suits (exp_avg: signed, exp_avg_sq: unsigned), `bind(slot,
/// tag<storage type>)` the lists.
template <template <class> class Rule, class Bind>
void convert(bool is_signed, int threads, Bind const& bind)
{
  auto const run = [&](auto s, auto storage) {
    fo::host::options o;
    o.threads = threads;
    fo::host::apply(Rule<decltype(s)>{}, bind(s, storage), fo::step_info{1}, o);
  };
  if (is_signed) {
    run(slot::exp_avg, tag<fo::signed_q8>{});
  } else {
    run(slot::exp_avg_sq, tag<fo::unsigned_q8>{});
  }
}

inline bool quantize_state(float const* values, std::int64_t n, void* state, bool is_signed, int threads,
                           std::string* error)
{
  return ran(error, [&] {
    convert<store_grad_into>(is_signed, threads, [&](auto s, auto storage) {
      using Q = typename decltype(storage)::type;
      return fo::bind(slot::grad = readonly<float>({values}, {n}), decltype(s){} = writable<Q>({state}, {n}));
    });
  });
}

inline bool dequantize_state(void const* state, std::int64_t n, float* values, bool is_signed, int threads,
                             std::string* error)
{
  return ran(error, [&] {
    convert<load_into_param>(is_signed, threads, [&](auto s, auto storage) {
      using Q = typename decltype(storage)::type;
      return fo::bind(slot::param = writable<float>({values}, {n}), decltype(s){} = readonly<Q>({state}, {n}));
    });
  });
}

}  // namespace detail
}  // namespace fusedopt_torch
