/// @file unit_plans.hpp
/// @brief What every unit's plans are made of, generic over the backend (host or CUDA) and the
/// rule: plan_impl (plans.hpp's `plan` over a fusedopt plan, rebound when tensors move),
/// plan_of (the plan of a rule builder over param, grad and states), norm plans.
///
/// Included by families.hpp (the built-in optimizers) and user_rule.hpp (user rules). A backend
/// is a struct with `make(bound_lists, void* context, int reduction_capacity)`,
/// `run(plan, rule, step_info, void* stream)`, `rebind(plan, bound_lists, void* stream)`,
/// `rebind_slot(...)` and `table_uploads(plan)` (unit_host.hpp, unit_cuda.cuh), plus the unit's
/// filter (what it compiles; filter_of below).
#pragma once

#include <fusedopt/bind.hpp>
#include <fusedopt/chain.hpp>
#include <fusedopt/numeric/quantization.hpp>
#include <fusedopt/rules/amp.hpp>
#include <fusedopt/rules/norms.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include "plans.hpp"

namespace fusedopt_torch {
namespace detail {

namespace fo = fusedopt;
namespace slot = fusedopt::slot;
namespace rules = fusedopt::rules;

template <class T>
struct tag {
  using type = T;
};

/// What a unit compiles, asked of its backend B (a unit compiled for the first step of an
/// optimizer holds the kernels of one dtype and one layout, an ahead-of-time unit every one):
/// `B::compiles_dtype(t)`, `B::compiles_layout(layout bits)` (both constexpr, default: all)
/// and `B::amp` (GradScaler's kernels too; default true). The plan functions below branch on
/// the run-time dtype and layout, and a branch B does not compile throws instead of
/// instantiating kernels.
template <class B, class = void>
struct filter_of {
  static constexpr bool dtype(dtype) { return true; }
  static constexpr bool layout(std::uint32_t) { return true; }
};
template <class B>
struct filter_of<B, std::void_t<decltype(B::compiles_dtype(dtype::f32)), decltype(B::compiles_layout(0u))>> {
  static constexpr bool dtype(dtype t) { return B::compiles_dtype(t); }
  static constexpr bool layout(std::uint32_t bits) { return B::compiles_layout(bits); }
};
template <class B, class = void>
struct compiles_amp : std::true_type {};
template <class B>
struct compiles_amp<B, std::void_t<decltype(B::amp)>> : std::bool_constant<B::amp> {};

[[noreturn]] inline void not_in_unit(char const* what)
{
  throw fo::error(std::string("fusedopt_torch: internal error: this unit has no kernels for the ") + what +
                  " asked for (the engine asks its provider for a unit per dtype and layout)");
}

/// `make(0)` where B compiles layout `Bits` (a generic lambda: its body is instantiated only
/// here), else not_in_unit.
template <class B, std::uint32_t Bits, class Make>
std::unique_ptr<plan> in_layout(Make&& make)
{
  if constexpr (filter_of<B>::layout(Bits)) {
    return make(0);
  } else {
    not_in_unit("layout");
  }
}

/// Calls `f(tag<T>{})` with the fusedopt element type of `t` (every call returns one type),
/// for the dtypes backend B compiles.
template <class B, class F>
auto by_dtype(dtype t, F&& f) -> decltype(f(tag<float>{}))
{
  using compiled = filter_of<B>;
  switch (t) {
    case dtype::f32:
      if constexpr (compiled::dtype(dtype::f32)) { return f(tag<float>{}); }
      break;
    case dtype::f64:
      if constexpr (compiled::dtype(dtype::f64)) { return f(tag<double>{}); }
      break;
    case dtype::f16:
      if constexpr (compiled::dtype(dtype::f16)) { return f(tag<fo::half>{}); }
      break;
    case dtype::bf16:
      if constexpr (compiled::dtype(dtype::bf16)) { return f(tag<fo::bfloat16>{}); }
      break;
    default:
      throw fo::error("fusedopt_torch: unknown dtype");
  }
  not_in_unit("dtype");
}

template <class T>
fo::tensor_list<T> writable(std::vector<void*> const& ptrs, std::vector<std::int64_t> const& sizes)
{
  fo::tensor_list<T> l;
  l.reserve(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) { l.push_back(static_cast<T*>(ptrs[i]), sizes[i]); }
  return l;
}

template <class T>
fo::tensor_list<T const> readonly(std::vector<void const*> const& ptrs, std::vector<std::int64_t> const& sizes)
{
  fo::tensor_list<T const> l;
  l.reserve(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) { l.push_back(static_cast<T const*>(ptrs[i]), sizes[i]); }
  return l;
}

/// Param, grad and the k-th state of `x` as fusedopt bindings.
template <class T>
auto param(lists const& x)
{
  return slot::param = writable<T>(x.param, x.sizes);
}
template <class T>
auto grad(lists const& x)
{
  return slot::grad = readonly<T>(x.grad, x.sizes);
}
template <class T>
fo::tensor_list<T> state(lists const& x, std::size_t k)
{
  FUSEDOPT_EXPECTS(k < x.states.size(), "fusedopt_torch: a state list is missing");
  return writable<T>(x.states[k], x.sizes);
}

/// A plan of backend B over lists that `Bind` makes from the tensors (so that a step whose
/// tensors moved rebinds the plan to new lists of the same geometry), running the rule `Build`
/// makes from the hyperparameters: `build.run_with(h, f)` calls `f(rule)` with the rule of this
/// step (a builder may choose among rules at run time: NAdam's product on the device, stochastic
/// rounding; each is its own kernel instantiation).
template <class B, class Plan, class Bind, class Build>
class plan_impl final : public plan {
 public:
  plan_impl(Plan p, Bind bind, Build build) : plan_(std::move(p)), bind_(bind), build_(build) {}
  static constexpr bool amp_kernels = Build::amp && compiles_amp<B>::value;
  void run(hyper const& h, step_count step, amp_inputs amp, void* stream) const override
  {
    fo::step_info info;
    info.step = step.value;
    if (step.counter != nullptr) {
      info.step = fo::scalar<std::int64_t>::from_pointer(step.counter);
      info.advance = step.counter;
    }
    if constexpr (!amp_kernels) {
      FUSEDOPT_EXPECTS(!amp.any(), Build::amp ? "fusedopt_torch: internal error: a plan without GradScaler's kernel "
                                                "was run with grad_scale or found_inf"
                                              : "fusedopt_torch: this optimizer does not take GradScaler's grad_scale "
                                                "and found_inf");
    }
    build_.run_with(h, [&](auto const& rule) {
      if constexpr (amp_kernels) {
        if (amp.any()) {
          // torch's fused kernels: grad / grad_scale, and nothing written when found_inf is set.
          auto const flag = fo::flag_pointer(const_cast<float*>(amp.found_inf));  // only read
          B::run(plan_, fo::chain(rules::divide_gradients{amp.grad_scale}, rules::skip_if_set(rule, flag)), info, stream);
          return;
        }
      }
      B::run(plan_, rule, info, stream);
    });
  }
  bool rebind(lists const& tensors, void* stream) override
  {
    auto bound = bind_(tensors);
    try {
      B::rebind(plan_, bound, stream);  // checks the geometry once on the usual path
    } catch (fo::error const&) {
      if (!plan_.can_rebind(bound)) { return false; }  // another geometry: the caller re-plans
      throw;
    }
    return true;
  }
  [[nodiscard]] std::uint64_t table_uploads() const override { return B::table_uploads(plan_); }
  [[nodiscard]] bool takes_amp() const override { return amp_kernels; }
  bool rebind_gradients(lists const& tensors, void* stream) override
  {
    grads_.resize(tensors.grad.size());  // allocates at the first call only
    for (std::size_t i = 0; i < grads_.size(); ++i) { grads_[i] = static_cast<grad_pointer>(tensors.grad[i]); }
    try {
      B::rebind_slot(plan_, fo::slot::grad, grads_.data(), grads_.size(), stream);
    } catch (fo::error const&) {
      return false;
    }
    return true;
  }

 private:
  using grad_pointer = typename Plan::template slot_pointer_t<fo::slot::grad_t>;
  Plan plan_;
  Bind bind_;
  Build build_;
  std::vector<grad_pointer> grads_;  // rebind_gradients' addresses, typed
};

/// A plan of backend B over the lists `bind(x)` makes.
template <class B, class Bind, class Build>
std::unique_ptr<plan> wrap(Bind bind, lists const& x, Build build, void* stream, int reduction_capacity = 0)
{
  auto p = B::make(bind(x), stream, reduction_capacity);
  return std::make_unique<plan_impl<B, decltype(p), Bind, Build>>(std::move(p), bind, build);
}

/// A hyperparameter the engine may hand over in memory (a tensor's value, refreshed every step).
inline fo::scalar<double> scalar_of(double value, double const* pointer)
{
  return pointer != nullptr ? fo::scalar<double>::from_pointer(pointer) : fo::scalar<double>(value);
}

/// A state slot stored as 8-bit blockwise states (layout::quantized): the unsigned map where
/// the slot is never negative, else the signed one.
template <class Slot>
struct q8 {};

/// How a plan binds state `S` (a slot, or q8<slot>) of parameters of element type T.
template <class S>
struct stored {
  using slot_type = S;
  template <class T>
  using element_type = T;
  static constexpr bool quantized = false;
};
template <class Slot>
struct stored<q8<Slot>> {
  using slot_type = Slot;
  template <class T>
  using element_type =
    std::conditional_t<fo::accepts_unsigned_quantization<Slot>::value, fo::unsigned_q8, fo::signed_q8>;
  static constexpr bool quantized = true;
};

/// `Slot` as plans of 8-bit (Quantized) or full-precision moments bind it.
template <bool Quantized, class Slot>
using moment = std::conditional_t<Quantized, q8<Slot>, Slot>;

// The states' size is what Python allocates (plans.hpp's quantized_state_bytes).
static_assert(fo::signed_q8::block_elements == quantized_block_elements &&
                fo::unsigned_q8::block_elements == quantized_block_elements &&
                fo::signed_q8::bytes_for(1) == quantized_state_bytes(1) &&
                fo::signed_q8::bytes_for(70000) == quantized_state_bytes(70000) &&
                fo::unsigned_q8::bytes_for(std::int64_t{1} << 33) == quantized_state_bytes(std::int64_t{1} << 33),
              "fusedopt_torch: the 8-bit state size differs from fusedopt's");

/// A state stored in float32 whatever the parameter's element type (a user rule's dtype policy:
/// layout::float_states).
template <class Slot>
struct as_float {};
template <class Slot>
struct stored<as_float<Slot>> {
  using slot_type = Slot;
  template <class T>
  using element_type = float;
  static constexpr bool quantized = false;
};

/// The rule builder a plan of element type T runs (families.hpp specialises it for the
/// low-precision options of Adam and AdamW); `enabled` false: no kernels for T.
template <class Build, class T>
struct builder_for {
  using type = Build;
  static constexpr bool enabled = true;
};

/// Param, grad and the states of `x` (in the Python class's `_state_keys` order) bound to the
/// slots `States...`.
template <class T, class... States, std::size_t... K>
auto bind_with_states(lists const& x, std::index_sequence<K...>)
{
  return fo::bind(param<T>(x), grad<T>(x),
                  (typename stored<States>::slot_type{} =
                     state<typename stored<States>::template element_type<T>>(x, K))...);
}

/// A plan of backend B running `Build`'s rule over param, grad and `States...`. The binding is
/// a captureless lambda, kept by the plan to bind moved tensors again.
template <class B, class Build, class... States>
std::unique_ptr<plan> plan_of(dtype t, lists const& x, void* s, int reduction_capacity = 0)
{
  return by_dtype<B>(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    using builder = builder_for<Build, T>;
    // fusedopt computes 8-bit states in float: no double parameters with them.
    constexpr bool quantized_double = std::is_same_v<T, double> && (stored<States>::quantized || ...);
    if constexpr (quantized_double) {
      throw fo::error("fusedopt_torch: 8-bit states are for float32, float16 and bfloat16 parameters");
    } else if constexpr (builder::enabled) {
      return wrap<B>(
        [](lists const& y) { return bind_with_states<T, States...>(y, std::index_sequence_for<States...>{}); }, x,
        typename builder::type{}, s, reduction_capacity);
    } else {
      throw fo::error("fusedopt_torch: a Kahan compensation and master weights are for bfloat16 and float16 parameters");
    }
  });
}

// ---- norm plans (clip_grad_norm_) ----------------------------------------------------------------

/// norm_plan over gradients of element type T on backend B.
template <class B, class T>
class norm_plan_impl final : public norm_plan {
  static auto bind(std::vector<void const*> const& grads, std::vector<std::int64_t> const& sizes)
  {
    return fo::bind(slot::grad = readonly<T>(grads, sizes));
  }
  // norm_of's two accumulators (sum of squares, largest magnitude).
  static constexpr int reduction_capacity = 2;
  using plan_type = decltype(B::make(bind({}, {}), nullptr, reduction_capacity));

 public:
  norm_plan_impl(std::vector<void const*> const& grads, std::vector<std::int64_t> const& sizes, void* s)
      : plan_(B::make(bind(grads, sizes), s, reduction_capacity))
  {
  }
  void run(bool inf, double* total, void* stream) const override
  {
    B::run(plan_, rules::norm_of<slot::grad_t>{inf ? fo::norm_kind::inf : fo::norm_kind::l2, nullptr, total},
           fo::step_info{}, stream);
  }
  bool rebind(std::vector<void const*> const& grads, std::vector<std::int64_t> const& sizes, void* stream) override
  {
    auto bound = bind(grads, sizes);
    try {
      B::rebind(plan_, bound, stream);  // checks the geometry once on the usual path, as plan_impl
    } catch (fo::error const&) {
      if (!plan_.can_rebind(bound)) { return false; }  // another geometry: the caller makes a new plan
      throw;
    }
    return true;
  }

 private:
  plan_type plan_;
};

template <class B>
std::unique_ptr<norm_plan> norm_plan_of(dtype t, std::vector<void const*> const& grads,
                                        std::vector<std::int64_t> const& sizes, void* s)
{
  return by_dtype<B>(t, [&](auto tg) -> std::unique_ptr<norm_plan> {
    return std::make_unique<norm_plan_impl<B, typename decltype(tg)::type>>(grads, sizes, s);
  });
}

}  // namespace detail
}  // namespace fusedopt_torch
