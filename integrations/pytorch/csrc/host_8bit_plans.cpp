/// @file host_8bit_plans.cpp
/// @brief Host plans of 8-bit states (layout::quantized), and the quantizer Python uses to
/// convert full-precision states (a loaded torch.optim state_dict) into 8-bit states.
#include "host_backend.hpp"

namespace fusedopt_torch {
namespace detail {

std::unique_ptr<plan> host_quantized_plan(family f, dtype t, layout const& l, lists const& x, int threads)
{
  using B = host_backend;
  void* const s = &threads;  // host_backend::make's context
  switch (f) {
#define FUSEDOPT_TORCH_CASE(name, plans) \
  case family::name: return plans##_plan<B>(f, t, l, x, s);
    FUSEDOPT_TORCH_QUANTIZED_FAMILIES(FUSEDOPT_TORCH_CASE)
#undef FUSEDOPT_TORCH_CASE
    default: break;
  }
  throw fo::error("fusedopt_torch: this optimizer has no 8-bit states");
}

namespace {

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

}  // namespace
}  // namespace detail

void quantize_state(float const* values, std::int64_t n, void* state, bool is_signed, int threads)
{
  using namespace detail;
  convert<store_grad_into>(is_signed, threads, [&](auto s, auto storage) {
    using Q = typename decltype(storage)::type;
    return fo::bind(slot::grad = readonly<float>({values}, {n}), decltype(s){} = writable<Q>({state}, {n}));
  });
}

void dequantize_state(void const* state, std::int64_t n, float* values, bool is_signed, int threads)
{
  using namespace detail;
  convert<load_into_param>(is_signed, threads, [&](auto s, auto storage) {
    using Q = typename decltype(storage)::type;
    return fo::bind(slot::param = writable<float>({values}, {n}), decltype(s){} = readonly<Q>({state}, {n}));
  });
}

}  // namespace fusedopt_torch
