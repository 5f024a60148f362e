/// @file libtorch/plans.hpp
/// @brief The torch-free layer of fusedopt::libtorch: a bucket's tensors as raw pointers and
/// sizes, the plan interface the optimizers step through, the families (which state slots each
/// rule binds), the host backend's plans, and `cuda_steps`, the interface of the CUDA plans a
/// project compiles in one `.cu` file of its own (`fusedopt/libtorch/cuda_steps.cuh`).
///
/// Nothing here includes torch or CUDA: it compiles with any C++17 compiler and with nvcc, so
/// that the optimizers (host code with torch's headers, which nvcc does not compile) and the
/// CUDA kernels (nvcc, no torch) meet through it. A stream is a `void*` (a `cudaStream_t`).
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusedopt {
namespace libtorch {

/// @brief Element type of every list of one plan (param, grad and states share it, as in torch).
enum class element_type : int { f32, f64, f16, bf16 };

/// @brief The tensors of one plan, one entry per parameter: `states[k][t]` is the k-th state
/// (in the order `family<Rule>` binds them) of parameter t.
struct plan_tensors {
  std::vector<std::int64_t> sizes;
  std::vector<void*> params;
  std::vector<void const*> grads;
  std::vector<std::vector<void*>> states;
};

/// @brief The layout bits of the library's extras (fusedopt::libtorch::extras), above a
/// family's own bits (its optional slots, `family<Rule>`): each changes the plan's lists or the
/// rule it runs, so a plan is built per combination. Host plans take them (the families that
/// list them in `family<Rule>::extras`); CUDA plans (cuda_plans.cuh) are built without.
struct layout_extras {
  /// A compensation state of the parameter's type bound last (bfloat16 and float16 parameters;
  /// rules::with_kahan).
  static constexpr std::int64_t kahan = std::int64_t{1} << 8;
  /// The moments (exp_avg signed, exp_avg_sq unsigned) as fusedopt's 8-bit blockwise states
  /// (blockwise8: uint8 storage of `quantized_state_bytes(numel)` bytes; not float64).
  static constexpr std::int64_t quantized = std::int64_t{1} << 9;
  /// rules::clip_by_global_norm in front: the gradients scaled to `step_extras::max_grad_norm`
  /// over the plan's tensors.
  static constexpr std::int64_t clip = std::int64_t{1} << 10;
  /// Stochastic rounding of the stored parameter (bfloat16 parameters;
  /// rules::stochastic_round_param with `step_extras::seed`).
  static constexpr std::int64_t stochastic_rounding = std::int64_t{1} << 11;
  static constexpr std::int64_t all = kahan | quantized | clip | stochastic_rounding;
};

/// @brief The bytes of an 8-bit state of `elements` elements (a 1-D uint8 tensor):
/// fusedopt::signed_q8's storage, which unsigned_q8 shares.
constexpr std::int64_t quantized_state_bytes(std::int64_t elements) { return signed_q8::bytes_for(elements); }
static_assert(signed_q8::bytes_for(70000) == unsigned_q8::bytes_for(70000), "one size for both 8-bit maps");

/// @brief The values a plan's extras read at every step (layout_extras).
struct step_extras {
  double max_grad_norm = 0;  ///< layout_extras::clip
  std::uint64_t seed = 0;    ///< layout_extras::stochastic_rounding: the random bits' seed
};

/// @brief What a plan is asked for: the element type, the layout (which optional state slots
/// are bound: `family<Rule>`, and layout_extras), the tensors, and for CUDA plans the device
/// index and the stream (a `cudaStream_t`) the plan is built on.
struct plan_request {
  element_type type = element_type::f32;
  std::int64_t layout = 0;
  plan_tensors const* tensors = nullptr;
  int device = -1;
  void* stream = nullptr;
};

/// @brief A bucket's plan over lists of fixed geometry (sizes, element type, alignment): run it
/// once per step, rebind it when tensors move.
template <class Rule>
class plan {
 public:
  virtual ~plan() = default;
  /// @brief One step of `rule` (with the plan's extras: `extras` their values); `stream` a
  /// `cudaStream_t` (ignored by host plans). A CUDA plan
  /// enqueues it without synchronising.
  /// @throws fusedopt::error as the backend's run does.
  virtual void run(Rule const& rule, step_extras const& extras, step_info const& step, void* stream) const = 0;
  /// @brief Points the plan at new gradients (`count` addresses, one per tensor, in the plan's
  /// order), everything else where it was: what `zero_grad()` (gradients set to none) needs at
  /// every step. No allocation; a CUDA plan uploads the addresses asynchronously on `stream`,
  /// or switches to a table that holds them already (fusedopt::cuda::options::address_tables).
  /// @throws fusedopt::error, leaving the plan unchanged, on an address the plan cannot take
  /// (overlapping a written tensor, another alignment class: rebind or rebuild).
  virtual void rebind_grads(void const* const* grads, std::size_t count, void* stream) = 0;
  /// @brief Points the plan at `tensors`, the lists it was made from at new addresses. Returns
  /// false, changing nothing, when their geometry differs (then make a new plan).
  /// @throws fusedopt::error on invalid lists (overlapping outputs, pageable memory for CUDA).
  virtual bool rebind(plan_tensors const& tensors, void* stream) = 0;
};

/// @brief Which state slots rule `Rule` binds, per layout: `with_lists<T, Storage>(layout, f)`
/// calls `f(bind)` with a captureless callable making the bound lists of element type T (the
/// states stored as `Storage` says) from plan_tensors (kept by the plan to bind moved tensors
/// again), `Mask` the layout bits compiled; `reduction_capacity`, the accumulators the rule's
/// reduction passes need (0: none); `extras`, the layout_extras its host plans take, and
/// `layouts_with_extras`, its layout bits that combine with them. Specialised per family below.
template <class Rule>
struct family;

namespace detail {

template <class T>
tensor_list<T> writable(std::vector<void*> const& ptrs, std::vector<std::int64_t> const& sizes)
{
  tensor_list<T> l;
  l.reserve(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) { l.push_back(static_cast<T*>(ptrs[i]), sizes[i]); }
  return l;
}

template <class T>
tensor_list<T const> readonly(std::vector<void const*> const& ptrs, std::vector<std::int64_t> const& sizes)
{
  tensor_list<T const> l;
  l.reserve(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) { l.push_back(static_cast<T const*>(ptrs[i]), sizes[i]); }
  return l;
}

/// How the states are stored: every state in the parameter's element type T.
struct plain_storage {
  template <class Slot, class T>
  using element = T;
  static constexpr bool compensated = false;
};

/// The moments as 8-bit blockwise states (layout_extras::quantized): unsigned where the slot
/// holds no negative values (exp_avg_sq), else signed; other states in T.
struct quantized_moments {
  template <class Slot>
  static constexpr bool is_moment = std::is_same_v<Slot, slot::exp_avg_t> || std::is_same_v<Slot, slot::exp_avg_sq_t>;
  template <class Slot, class T>
  using element = std::conditional_t<
    is_moment<Slot>, std::conditional_t<accepts_unsigned_quantization<Slot>::value, unsigned_q8, signed_q8>, T>;
  static constexpr bool compensated = false;
};

/// `Base`'s states, then a Kahan compensation of T (layout_extras::kahan).
template <class Base>
struct with_compensation : Base {
  static constexpr bool compensated = true;
};

/// Param, grad and state k of `x` bound to the slots `Slots...` in order, stored as `Storage`
/// says (and the compensation last where it has one).
template <class T, class Storage, class... Slots, std::size_t... K>
auto bind_states(plan_tensors const& x, std::index_sequence<K...>)
{
  if constexpr (Storage::compensated) {
    return ::fusedopt::bind(slot::param = writable<T>(x.params, x.sizes), slot::grad = readonly<T>(x.grads, x.sizes),
                            (Slots{} = writable<typename Storage::template element<Slots, T>>(x.states[K], x.sizes))...,
                            slot::compensation = writable<T>(x.states[sizeof...(Slots)], x.sizes));
  } else {
    return ::fusedopt::bind(slot::param = writable<T>(x.params, x.sizes), slot::grad = readonly<T>(x.grads, x.sizes),
                            (Slots{} = writable<typename Storage::template element<Slots, T>>(x.states[K], x.sizes))...);
  }
}

/// A captureless binder of param, grad and the states `Slots...` (a layout of a family), stored
/// as `Storage` says.
template <class T, class Storage, class... Slots>
struct binder {
  auto operator()(plan_tensors const& x) const
  {
    FUSEDOPT_EXPECTS(x.states.size() == sizeof...(Slots) + (Storage::compensated ? 1 : 0),
                     "fusedopt::libtorch: internal error: a state list is missing");
    return bind_states<T, Storage, Slots...>(x, std::index_sequence_for<Slots...>{});
  }
};

}  // namespace detail

namespace detail {
/// Adam and AdamW: exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad (layout 1).
struct adam_states {
  static constexpr int reduction_capacity = 0;
  static constexpr std::int64_t extras = layout_extras::all;
  static constexpr std::int64_t layouts_with_extras = 0;  // no amsgrad with them
  template <class T, class Storage, std::int64_t Mask = ~std::int64_t{0}, class F>
  static decltype(auto) with_lists(std::int64_t layout, F&& f)
  {
    if constexpr ((Mask & 1) != 0) {
      if (layout == 1) {
        return f(detail::binder<T, Storage, slot::exp_avg_t, slot::exp_avg_sq_t, slot::max_exp_avg_sq_t>{});
      }
    }
    return f(detail::binder<T, Storage, slot::exp_avg_t, slot::exp_avg_sq_t>{});
  }
};
}  // namespace detail
template <>
struct family<rules::adamw> : detail::adam_states {};
template <>
struct family<rules::adam> : detail::adam_states {};

/// SGD: the momentum buffer with momentum (layout 1), nothing without.
template <>
struct family<rules::sgd> {
  static constexpr int reduction_capacity = 0;
  static constexpr std::int64_t extras = layout_extras::clip;
  static constexpr std::int64_t layouts_with_extras = 1;
  template <class T, class Storage, std::int64_t Mask = ~std::int64_t{0}, class F>
  static decltype(auto) with_lists(std::int64_t layout, F&& f)
  {
    if (layout == 1) { return f(detail::binder<T, Storage, slot::momentum_buffer_t>{}); }
    return f(detail::binder<T, Storage>{});
  }
};

/// Adagrad: sum_sq (torch's state `sum`).
template <>
struct family<rules::adagrad> {
  static constexpr int reduction_capacity = 0;
  static constexpr std::int64_t extras = 0;
  static constexpr std::int64_t layouts_with_extras = 0;
  template <class T, class Storage, std::int64_t Mask = ~std::int64_t{0}, class F>
  static decltype(auto) with_lists(std::int64_t /*layout*/, F&& f)
  {
    return f(detail::binder<T, Storage, slot::sum_sq_t>{});
  }
};

/// RMSprop: square_avg, then momentum_buffer with momentum (layout bit 1) and grad_avg when
/// centered (layout bit 2), in that order (torch's state order).
template <>
struct family<rules::rmsprop> {
  static constexpr std::int64_t momentum_bit = 1, centered_bit = 2;
  static constexpr int reduction_capacity = 0;
  static constexpr std::int64_t extras = 0;
  static constexpr std::int64_t layouts_with_extras = 0;
  template <class T, class Storage, std::int64_t Mask = ~std::int64_t{0}, class F>
  static decltype(auto) with_lists(std::int64_t layout, F&& f)
  {
    using detail::binder;
    switch (layout & (momentum_bit | centered_bit)) {
      case momentum_bit: return f(binder<T, Storage, slot::square_avg_t, slot::momentum_buffer_t>{});
      case centered_bit: return f(binder<T, Storage, slot::square_avg_t, slot::grad_avg_t>{});
      case momentum_bit | centered_bit:
        return f(binder<T, Storage, slot::square_avg_t, slot::momentum_buffer_t, slot::grad_avg_t>{});
      default: break;
    }
    return f(binder<T, Storage, slot::square_avg_t>{});
  }
};

/// Lion: exp_avg.
template <>
struct family<rules::lion> {
  static constexpr int reduction_capacity = 0;
  static constexpr std::int64_t extras = layout_extras::clip;
  static constexpr std::int64_t layouts_with_extras = 0;
  template <class T, class Storage, std::int64_t Mask = ~std::int64_t{0}, class F>
  static decltype(auto) with_lists(std::int64_t /*layout*/, F&& f)
  {
    return f(detail::binder<T, Storage, slot::exp_avg_t>{});
  }
};

/// LAMB: exp_avg, exp_avg_sq; its trust ratio's reduction pass sums two accumulators per tensor.
template <>
struct family<rules::lamb> {
  static constexpr int reduction_capacity = 2;
  static constexpr std::int64_t extras = 0;
  static constexpr std::int64_t layouts_with_extras = 0;
  template <class T, class Storage, std::int64_t Mask = ~std::int64_t{0}, class F>
  static decltype(auto) with_lists(std::int64_t /*layout*/, F&& f)
  {
    return f(detail::binder<T, Storage, slot::exp_avg_t, slot::exp_avg_sq_t>{});
  }
};

namespace detail {

/// Calls f(T{}) with the fusedopt element type of `t`.
template <class F>
decltype(auto) by_element_type(element_type t, F&& f)
{
  switch (t) {
    case element_type::f64: return f(double{});
    case element_type::f16: return f(::fusedopt::half{});
    case element_type::bf16: return f(::fusedopt::bfloat16{});
    case element_type::f32: break;
  }
  return f(float{});
}

/// The rule a plan of element type T runs for `Rule` with the extras `Clip`, `Kahan` and
/// `Stochastic` (layout_extras): rules::clip_by_global_norm in front, the whole under
/// rules::with_kahan, or stochastic rounding of the parameter after it.
template <class T, bool Clip, bool Kahan, bool Stochastic>
struct extra_rules {
  static_assert(!(Kahan && Stochastic), "fusedopt::libtorch: Kahan compensation or stochastic rounding, not both");
  template <class Rule>
  static auto apply(Rule const& rule, step_extras const& x)
  {
    if constexpr (Clip) {
      return finish(::fusedopt::chain(rules::clip_by_global_norm{x.max_grad_norm}, rule), x);
    } else {
      return finish(rule, x);
    }
  }
  template <class R>
  static auto finish(R const& rule, step_extras const& x)
  {
    if constexpr (Kahan) {
      static_cast<void>(x);
      return rules::with_kahan<R, T>{rule};
    } else if constexpr (Stochastic) {
      return ::fusedopt::chain(rule, rules::stochastic_round_param{x.seed});
    } else {
      static_cast<void>(x);
      return rule;
    }
  }
};

/// plan<Rule> over a fusedopt plan of backend B (its per-plan state: B's instance), bound with
/// `Bind`, running `Rule` as `Extras` (extra_rules) makes it.
template <class Rule, class B, class Plan, class Bind, class Extras>
class plan_impl final : public plan<Rule> {
 public:
  plan_impl(B backend, Plan p) : backend_(std::move(backend)), plan_(std::move(p)) {}
  void run(Rule const& rule, step_extras const& extras, step_info const& step, void* stream) const override
  {
    backend_.run(plan_, Extras::apply(rule, extras), step, stream);
  }
  void rebind_grads(void const* const* grads, std::size_t count, void* stream) override
  {
    grads_.resize(count);  // allocates at the first call only
    for (std::size_t i = 0; i < count; ++i) { grads_[i] = static_cast<grad_pointer>(grads[i]); }
    backend_.rebind_slot(plan_, slot::grad, grads_.data(), count, stream);
  }
  bool rebind(plan_tensors const& tensors, void* stream) override
  {
    auto const lists = Bind{}(tensors);  // validated as any lists (overlap, alignment)
    if (!plan_.can_rebind(lists)) { return false; }
    backend_.rebind(plan_, lists, stream);
    return true;
  }

 private:
  using grad_pointer = typename Plan::template slot_pointer_t<slot::grad_t>;
  mutable B backend_;  // per-plan backend state (a CUDA plan's last stream and its event)
  Plan plan_;
  std::vector<grad_pointer> grads_;
};

/// A plan of element type T, its states stored as `Storage`, its rule with the extras `Clip`,
/// `Kahan`, `Stochastic`.
template <class Rule, class T, class Storage, bool Clip, bool Kahan, bool Stochastic, class MakeBackend>
std::unique_ptr<plan<Rule>> make_plan_as(MakeBackend& make_backend, plan_request const& request)
{
  std::int64_t const family_layout = request.layout & ~layout_extras::all;
  // With extras, only the family's layouts that take them are compiled (not Adam's amsgrad).
  constexpr bool extended = Clip || Kahan || Stochastic || !std::is_same_v<Storage, plain_storage>;
  constexpr std::int64_t mask = extended ? family<Rule>::layouts_with_extras : ~std::int64_t{0};
  FUSEDOPT_EXPECTS((family_layout & ~mask) == 0,
                   "fusedopt::libtorch: this layout (amsgrad) takes none of the extras (layout_extras)");
  return family<Rule>::template with_lists<T, Storage, mask>(family_layout, [&](auto bind) -> std::unique_ptr<plan<Rule>> {
    auto backend = make_backend();
    // clip_by_global_norm's pass sums two accumulators of its own.
    int const capacity = family<Rule>::reduction_capacity + (Clip ? 2 : 0);
    auto p = backend.make(bind(*request.tensors), capacity, request.stream);
    using extras = extra_rules<T, Clip, Kahan, Stochastic>;
    return std::make_unique<plan_impl<Rule, decltype(backend), decltype(p), decltype(bind), extras>>(std::move(backend),
                                                                                                     std::move(p));
  });
}

/// make_plan_as for the extras in `request.layout` (layout_extras) that family<Rule> takes.
template <class Rule, class T, class MakeBackend>
std::unique_ptr<plan<Rule>> make_plan_with_extras(MakeBackend& make_backend, plan_request const& request)
{
  constexpr std::int64_t taken = family<Rule>::extras;
  constexpr bool sixteen_bit = std::is_same_v<T, ::fusedopt::bfloat16> || std::is_same_v<T, ::fusedopt::half>;
  std::int64_t const extras = request.layout & layout_extras::all;
  FUSEDOPT_EXPECTS((extras & ~taken) == 0, "fusedopt::libtorch: this optimizer takes no such extra (layout_extras)");
  bool const clip = (extras & layout_extras::clip) != 0;
  using no = std::false_type;
  using yes = std::true_type;
  auto const with_clip = [&](auto storage, auto kahan, auto stochastic) -> std::unique_ptr<plan<Rule>> {
    using S = decltype(storage);
    constexpr bool compensated = decltype(kahan)::value, rounded = decltype(stochastic)::value;
    if constexpr ((taken & layout_extras::clip) != 0) {
      if (clip) { return make_plan_as<Rule, T, S, true, compensated, rounded>(make_backend, request); }
    }
    return make_plan_as<Rule, T, S, false, compensated, rounded>(make_backend, request);
  };
  auto const with_rounding = [&](auto storage) -> std::unique_ptr<plan<Rule>> {
    if constexpr (sixteen_bit && (taken & layout_extras::kahan) != 0) {
      if ((extras & layout_extras::kahan) != 0) { return with_clip(with_compensation<decltype(storage)>{}, yes{}, no{}); }
    }
    if constexpr (std::is_same_v<T, ::fusedopt::bfloat16> && (taken & layout_extras::stochastic_rounding) != 0) {
      if ((extras & layout_extras::stochastic_rounding) != 0) { return with_clip(storage, no{}, yes{}); }
    }
    FUSEDOPT_EXPECTS((extras & (layout_extras::kahan | layout_extras::stochastic_rounding)) == 0,
                     "fusedopt::libtorch: Kahan compensation is for bfloat16 and float16 parameters, stochastic "
                     "rounding for bfloat16 ones");
    return with_clip(storage, no{}, no{});
  };
  // fusedopt computes 8-bit states in float: none for double parameters.
  if constexpr (!std::is_same_v<T, double> && (taken & layout_extras::quantized) != 0) {
    if ((extras & layout_extras::quantized) != 0) { return with_rounding(quantized_moments{}); }
  }
  FUSEDOPT_EXPECTS((extras & layout_extras::quantized) == 0,
                   "fusedopt::libtorch: 8-bit states are for float32, float16 and bfloat16 parameters");
  return with_rounding(plain_storage{});
}

}  // namespace detail

/// @brief The plan of rule `Rule` that `request` asks for, on backend B: `make_backend()`
/// returns the per-plan backend object, which has `make(lists, reduction_capacity, stream)`,
/// `run(plan, rule, step, stream)`, `rebind(plan, lists, stream)` and `rebind_slot(plan, slot,
/// addresses, count, stream)`. Used by the host backend here and the CUDA one in
/// cuda_steps.cuh. `WithExtras`: the plans of the extras in `request.layout` (layout_extras)
/// are compiled too (the host backend's); without (CUDA's: their kernels are not compiled), a
/// layout with extras is refused.
/// @throws fusedopt::error as the backend's plan constructor does (validation, allocation).
template <class Rule, bool WithExtras = true, class MakeBackend>
std::unique_ptr<plan<Rule>> make_plan(MakeBackend&& make_backend, plan_request const& request)
{
  return detail::by_element_type(request.type, [&](auto element) -> std::unique_ptr<plan<Rule>> {
    using T = decltype(element);
    if constexpr (WithExtras) {
      return detail::make_plan_with_extras<Rule, T>(make_backend, request);
    } else {
      FUSEDOPT_EXPECTS((request.layout & layout_extras::all) == 0,
                       "fusedopt::libtorch: the library's extras (8-bit states, Kahan compensation, stochastic "
                       "rounding, clipping) are not compiled for these plans");
      return detail::make_plan_as<Rule, T, detail::plain_storage, false, false, false>(make_backend, request);
    }
  });
}

/// @brief The host backend's per-plan object for make_plan: plans on `threads` threads (torch's
/// intra-op pool size, at::get_num_threads(), as the optimizers pass).
struct host_backend {
  int threads = 1;
  template <class Lists>
  auto make(Lists lists, int reduction_capacity, void* /*stream*/) const
  {
    host::options o;
    o.threads = threads;
    o.reduction_capacity = reduction_capacity;
    return host::make_plan(std::move(lists), o);
  }
  template <class Plan, class Rule>
  void run(Plan const& p, Rule const& rule, step_info const& step, void* /*stream*/) const
  {
    p.run(rule, step);
  }
  template <class Plan, class Lists>
  void rebind(Plan& p, Lists const& lists, void* /*stream*/) const
  {
    p.rebind(lists);
  }
  template <class Plan, class Slot, class Pointer>
  void rebind_slot(Plan& p, Slot s, Pointer const* addresses, std::size_t count, void* /*stream*/) const
  {
    p.rebind(s, addresses, count);
  }
};

/// @brief fusedopt's CUDA plans for the optimizers' CUDA tensors, made by `make_cuda_steps()`
/// in a `.cu` file of the project (cuda_steps.cuh) and handed to an optimizer
/// (`fusedopt::libtorch::cuda_config`). One `make_plan` per family: the rule argument only
/// selects the overload. Thread-compatible: one optimizer's step at a time per plan.
class cuda_steps {
 public:
  virtual ~cuda_steps() = default;
  /// @brief A CUDA plan on device `request.device`, built on `request.stream` (the plan's
  /// construction allocates its tables and synchronises that stream: not under capture).
  /// @throws fusedopt::error on invalid lists or a failed CUDA call.
  virtual std::unique_ptr<plan<rules::adamw>> make_plan(rules::adamw const&, plan_request const& request) const = 0;
  virtual std::unique_ptr<plan<rules::adam>> make_plan(rules::adam const&, plan_request const& request) const = 0;
  virtual std::unique_ptr<plan<rules::sgd>> make_plan(rules::sgd const&, plan_request const& request) const = 0;
  virtual std::unique_ptr<plan<rules::adagrad>> make_plan(rules::adagrad const&, plan_request const& request) const = 0;
  virtual std::unique_ptr<plan<rules::rmsprop>> make_plan(rules::rmsprop const&, plan_request const& request) const = 0;
  virtual std::unique_ptr<plan<rules::lion>> make_plan(rules::lion const&, plan_request const& request) const = 0;
  virtual std::unique_ptr<plan<rules::lamb>> make_plan(rules::lamb const&, plan_request const& request) const = 0;
  /// @brief Whether `stream` (a `cudaStream_t` of device `device`) is being captured into a
  /// CUDA graph.
  /// @throws fusedopt::error if the query fails.
  [[nodiscard]] virtual bool capturing(int device, void* stream) const = 0;
};

/// @brief fusedopt's CUDA plans for fusedopt::libtorch's optimizers. Declared here, defined by
/// `fusedopt/libtorch/cuda_steps.cuh`: include that header in exactly one `.cu` file of the
/// program (compiled by nvcc, without torch's headers) and call this from host code.
/// @throws fusedopt::error if a CUDA call fails.
std::shared_ptr<cuda_steps const> make_cuda_steps();

}  // namespace libtorch
}  // namespace fusedopt
