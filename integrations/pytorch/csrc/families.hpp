/// @file families.hpp
/// @brief Plans of every optimizer family, generic over the backend (host or CUDA).
///
/// Included by host_plans.cpp (host backend) and by one `.cu` per family (CUDA backend), so
/// the two paths bind the same slots and build the same rules from the same hyperparameters.
/// A backend is a struct with `make(bound_lists, void* stream, int reduction_capacity)`,
/// `run(plan, rule, step_info, void* stream)` and `rebind(plan, bound_lists, void* stream)`.
#pragma once

// The headers used, not the umbrella fusedopt.hpp: each .cu compiles only what it needs.
#include <fusedopt/bind.hpp>
#include <fusedopt/chain.hpp>
#include <fusedopt/numeric/quantization.hpp>
#include <fusedopt/rules/adadelta.hpp>
#include <fusedopt/rules/adagrad.hpp>
#include <fusedopt/rules/adam.hpp>
#include <fusedopt/rules/adamax.hpp>
#include <fusedopt/rules/amp.hpp>
#include <fusedopt/rules/kahan.hpp>
#include <fusedopt/rules/lamb.hpp>
#include <fusedopt/rules/lion.hpp>
#include <fusedopt/rules/mixed_precision.hpp>
#include <fusedopt/rules/nadam.hpp>
#include <fusedopt/rules/norms.hpp>
#include <fusedopt/rules/radam.hpp>
#include <fusedopt/rules/rmsprop.hpp>
#include <fusedopt/rules/sgd.hpp>

#include <cstdint>
#include <memory>
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

/// Whether backend B's plans are compiled for dtype `t`: every dtype, or only `B::only_dtype`
/// where B names one (cuda_backend.cuh: the largest families are compiled one dtype per
/// translation unit, so that ninja builds them in parallel).
template <class B, class = void>
struct compiles_dtype {
  static constexpr bool of(dtype) { return true; }
};
template <class B>
struct compiles_dtype<B, std::void_t<decltype(B::only_dtype)>> {
  static constexpr bool of(dtype t) { return t == B::only_dtype; }
};

/// Calls `f(tag<T>{})` with the fusedopt element type of `t` (every call returns one type),
/// for the dtypes backend B compiles (compiles_dtype).
template <class B, class F>
auto by_dtype(dtype t, F&& f) -> decltype(f(tag<float>{}))
{
  using compiled = compiles_dtype<B>;
  switch (t) {
    case dtype::f32:
      if constexpr (compiled::of(dtype::f32)) { return f(tag<float>{}); }
      break;
    case dtype::f64:
      if constexpr (compiled::of(dtype::f64)) { return f(tag<double>{}); }
      break;
    case dtype::f16:
      if constexpr (compiled::of(dtype::f16)) { return f(tag<fo::half>{}); }
      break;
    case dtype::bf16:
      if constexpr (compiled::of(dtype::bf16)) { return f(tag<fo::bfloat16>{}); }
      break;
    default:
      throw fo::error("fusedopt_torch: unknown dtype");
  }
  throw fo::error("fusedopt_torch: internal error: a plan function of one dtype called for another");
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
  void run(hyper const& h, step_count step, amp_inputs amp, void* stream) const override
  {
    fo::step_info info;
    info.step = step.value;
    if (step.counter != nullptr) {
      info.step = fo::scalar<std::int64_t>::from_pointer(step.counter);
      info.advance = step.counter;
    }
    if constexpr (!Build::amp) {
      FUSEDOPT_EXPECTS(!amp.any(), "fusedopt_torch: this optimizer does not take GradScaler's grad_scale and found_inf");
    }
    build_.run_with(h, [&](auto const& rule) {
      if constexpr (Build::amp) {
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

// ---- rules from hyperparameters -----------------------------------------------------------

/// A hyperparameter the engine may hand over in memory (a tensor's value, refreshed every step).
inline fo::scalar<double> scalar_of(double value, double const* pointer)
{
  return pointer != nullptr ? fo::scalar<double>::from_pointer(pointer) : fo::scalar<double>(value);
}

// has_<field><R>: whether rule R has a member named as hyper's field (rules name their options
// as torch does).
#define FUSEDOPT_TORCH_HAS_MEMBER(name)                                                    \
  template <class R, class = void>                                                         \
  struct has_##name : std::false_type {};                                                  \
  template <class R>                                                                       \
  struct has_##name<R, std::void_t<decltype(std::declval<R&>().name)>> : std::true_type {};
FUSEDOPT_TORCH_HYPER_NUMBERS(FUSEDOPT_TORCH_HAS_MEMBER)
FUSEDOPT_TORCH_HYPER_FLAGS(FUSEDOPT_TORCH_HAS_MEMBER)
FUSEDOPT_TORCH_HAS_MEMBER(mu_product)
#undef FUSEDOPT_TORCH_HAS_MEMBER

/// Rule R from the hyperparameters: every member of R named as one of hyper's fields takes its
/// value (the others keep R's defaults); lr, the betas and NAdam's mu_product are read from the
/// engine's memory where it hands them over. A family needs no mapping of its own.
template <class R>
R rule_of(hyper const& h)
{
  R r;
#define FUSEDOPT_TORCH_SET(name) \
  if constexpr (has_##name<R>::value) { r.name = h.name; }
  FUSEDOPT_TORCH_HYPER_NUMBERS(FUSEDOPT_TORCH_SET)
  FUSEDOPT_TORCH_HYPER_FLAGS(FUSEDOPT_TORCH_SET)
#undef FUSEDOPT_TORCH_SET
  r.lr = scalar_of(h.lr, h.lr_pointer);
  if constexpr (has_beta1<R>::value) { r.beta1 = scalar_of(h.beta1, h.beta1_pointer); }
  if constexpr (has_beta2<R>::value) { r.beta2 = scalar_of(h.beta2, h.beta2_pointer); }
  if constexpr (has_mu_product<R>::value) { r.mu_product = scalar_of(h.mu_product, h.mu_product_pointer); }
  return r;
}

inline auto clipped_lamb_rule(hyper const& h)
{
  return fo::chain(rules::clip_by_global_norm{h.max_grad_norm}, rule_of<rules::lamb>(h));
}

/// A family's rule from the hyperparameters (`Make`), stored in the plan. `amp`: the family
/// takes GradScaler's fused protocol (supports_amp), so its plans also instantiate the AMP rule.
template <auto Make, bool Amp = false>
struct builder {
  static constexpr bool amp = Amp;
  template <class F>
  void run_with(hyper const& h, F&& f) const
  {
    f(Make(h));
  }
};

/// Low-precision parameters of element type T (layout::kahan, hyper::stochastic_rounding):
/// with a compensation slot bound (`Compensated`), the family's rule under rules::with_kahan;
/// without, under stochastic rounding of the parameter when asked for (bfloat16 only). Other
/// element types run the rule as it is (Python refuses both options for them).
template <class Build, class T, bool Compensated>
struct low_precision : Build {
  template <class F>
  void run_with(hyper const& h, F&& f) const
  {
    Build::run_with(h, [&](auto const& rule) {
      using R = std::decay_t<decltype(rule)>;
      if constexpr (Compensated && (std::is_same_v<T, fo::bfloat16> || std::is_same_v<T, fo::half>)) {
        f(rules::with_kahan<R, T>{rule});
      } else if constexpr (!Compensated && std::is_same_v<T, fo::bfloat16>) {
        if (h.stochastic_rounding) {
          f(fo::chain(rule, rules::stochastic_round_param{stochastic_rounding_seed}));
        } else {
          f(rule);
        }
      } else {
        f(rule);
      }
    });
  }
  /// The seed of the parameters' stochastic rounding: the random bits of an element depend on
  /// it, the step, the tensor and the element (rules::stochastic_round).
  static constexpr std::uint64_t stochastic_rounding_seed = 0x5eed;
};

/// Marks a family's builder for low-precision options: plan_of resolves it per element type.
template <class Build, bool Compensated>
struct low_precision_of {};

template <class Build, class T>
struct builder_for {
  using type = Build;
  static constexpr bool enabled = true;
};
template <class Build, bool Compensated, class T>
struct builder_for<low_precision_of<Build, Compensated>, T> {
  using type = low_precision<Build, T, Compensated>;
  // A compensation state only for 16-bit parameters: no kernels for the others.
  static constexpr bool enabled = !Compensated || std::is_same_v<T, fo::bfloat16> || std::is_same_v<T, fo::half>;
};

using build_sgd = builder<rule_of<rules::sgd>, true>;
using build_adam = builder<rule_of<rules::adam>, true>;
using build_adamw = builder<rule_of<rules::adamw>, true>;
using build_adagrad = builder<rule_of<rules::adagrad>, true>;
using build_rmsprop = builder<rule_of<rules::rmsprop>>;
using build_lamb = builder<rule_of<rules::lamb>>;
using build_clipped_lamb = builder<clipped_lamb_rule>;
using build_lion = builder<rule_of<rules::lion>>;
using build_radam = builder<rule_of<rules::radam>>;
using build_adamax = builder<rule_of<rules::adamax>>;
using build_adadelta = builder<rule_of<rules::adadelta>>;

struct build_nadam : builder<rule_of<rules::nadam>> {
  /// capturable=True: the product in the plan's memory, advanced there after the step.
  template <class F>
  void run_with(hyper const& h, F&& f) const
  {
    auto const r = rule_of<rules::nadam>(h);
    if (h.mu_product_pointer == nullptr) {
      f(r);
    } else {
      f(fo::chain(r, rules::advance_mu_product{h.mu_product_pointer, r.beta1, r.momentum_decay, h.mu_product_single}));
    }
  }
};

// ---- plans per family (one function per .cu) -----------------------------------------------

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
      throw fo::error("fusedopt_torch: a Kahan compensation is for bfloat16 and float16 parameters");
    }
  });
}

template <class B, bool Quantized = false>
std::unique_ptr<plan> sgd_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  if constexpr (Quantized) {
    // A bucket without momentum has no states, so it never has quantized ones.
    FUSEDOPT_EXPECTS(l.momentum, "fusedopt_torch: 8-bit SGD states need momentum");
    return plan_of<B, build_sgd, q8<slot::momentum_buffer_t>>(t, x, s);
  } else {
    return l.momentum ? plan_of<B, build_sgd, slot::momentum_buffer_t>(t, x, s) : plan_of<B, build_sgd>(t, x, s);
  }
}

template <class B, class Build, bool Quantized = false>
std::unique_ptr<plan> adam_plan_of(dtype t, layout const& l, lists const& x, void* s)
{
  // States: exp_avg, exp_avg_sq, [max_exp_avg_sq: amsgrad], [kahan_comp: kahan].
  using namespace slot;
  using m = moment<Quantized, exp_avg_t>;
  using v = moment<Quantized, exp_avg_sq_t>;
  using plain = low_precision_of<Build, false>;
  using compensated = low_precision_of<Build, true>;
  if (l.amsgrad) {
    if constexpr (Quantized) {
      // No AMSGrad with 8-bit moments: Python refuses it, and no kernels are built for it.
      throw fo::error("fusedopt_torch: 8-bit Adam states have no AMSGrad variant");
    } else {
      return l.kahan ? plan_of<B, compensated, m, v, max_exp_avg_sq_t, compensation_t>(t, x, s)
                     : plan_of<B, plain, m, v, max_exp_avg_sq_t>(t, x, s);
    }
  }
  return l.kahan ? plan_of<B, compensated, m, v, compensation_t>(t, x, s) : plan_of<B, plain, m, v>(t, x, s);
}

template <class B>
std::unique_ptr<plan> adam_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  return adam_plan_of<B, build_adam>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adamw_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  return adam_plan_of<B, build_adamw>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adagrad_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return plan_of<B, build_adagrad, slot::sum_sq_t>(t, x, s);
}

template <class B>
std::unique_ptr<plan> rmsprop_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  // State order: square_avg, then momentum_buffer (with momentum), then grad_avg (centered).
  using namespace slot;
  if (l.momentum && l.centered) {
    return plan_of<B, build_rmsprop, square_avg_t, momentum_buffer_t, grad_avg_t>(t, x, s);
  }
  if (l.momentum) { return plan_of<B, build_rmsprop, square_avg_t, momentum_buffer_t>(t, x, s); }
  if (l.centered) { return plan_of<B, build_rmsprop, square_avg_t, grad_avg_t>(t, x, s); }
  return plan_of<B, build_rmsprop, square_avg_t>(t, x, s);
}

template <class B>
std::unique_ptr<plan> lamb_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  // The trust ratio needs two accumulators, the clip one more in its own pass.
  constexpr int capacity = 4;
  using namespace slot;
  return l.clip ? plan_of<B, build_clipped_lamb, exp_avg_t, exp_avg_sq_t>(t, x, s, capacity)
                : plan_of<B, build_lamb, exp_avg_t, exp_avg_sq_t>(t, x, s, capacity);
}

template <class B, bool Quantized = false>
std::unique_ptr<plan> lion_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return plan_of<B, build_lion, moment<Quantized, slot::exp_avg_t>>(t, x, s);
}

template <class B>
std::unique_ptr<plan> radam_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return plan_of<B, build_radam, slot::exp_avg_t, slot::exp_avg_sq_t>(t, x, s);
}

template <class B>
std::unique_ptr<plan> adamax_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return plan_of<B, build_adamax, slot::exp_avg_t, slot::exp_inf_t>(t, x, s);
}

template <class B>
std::unique_ptr<plan> adadelta_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return plan_of<B, build_adadelta, slot::square_avg_t, slot::acc_delta_t>(t, x, s);
}

template <class B>
std::unique_ptr<plan> nadam_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  // torch's mu_product is a scalar per bucket (hyper::mu_product), not a slot.
  return plan_of<B, build_nadam, slot::exp_avg_t, slot::exp_avg_sq_t>(t, x, s);
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

// ---- plans of 8-bit moments (FUSEDOPT_TORCH_QUANTIZED_FAMILIES; one function per .cu) ----------

template <class B>
std::unique_ptr<plan> sgd8bit_plan(family f, dtype t, layout const& l, lists const& x, void* s)
{
  return sgd_plan<B, true>(f, t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adam8bit_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  return adam_plan_of<B, build_adam, true>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adamw8bit_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  return adam_plan_of<B, build_adamw, true>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> lion8bit_plan(family f, dtype t, layout const& l, lists const& x, void* s)
{
  return lion_plan<B, true>(f, t, l, x, s);
}

}  // namespace detail
}  // namespace fusedopt_torch
