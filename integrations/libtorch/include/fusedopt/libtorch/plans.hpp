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

/// @brief What a plan is asked for: the element type, the layout (which optional state slots
/// are bound: `family<Rule>`), the tensors, and for CUDA plans the device index and the stream
/// (a `cudaStream_t`) the plan is built on.
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
  /// @brief One step of `rule`; `stream` a `cudaStream_t` (ignored by host plans). A CUDA plan
  /// enqueues it without synchronising.
  /// @throws fusedopt::error as the backend's run does.
  virtual void run(Rule const& rule, step_info const& step, void* stream) const = 0;
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

/// @brief Which state slots rule `Rule` binds, per layout: `with_lists<T>(layout, f)` calls
/// `f(bind)` with a captureless callable making the bound lists of element type T from
/// plan_tensors (kept by the plan to bind moved tensors again); `reduction_capacity`, the
/// accumulators the rule's reduction passes need (0: none). Specialised per family below.
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

/// Param, grad and state k of `x` bound to the slots `Slots...` in order.
template <class T, class... Slots, std::size_t... K>
auto bind_states(plan_tensors const& x, std::index_sequence<K...>)
{
  return ::fusedopt::bind(slot::param = writable<T>(x.params, x.sizes), slot::grad = readonly<T>(x.grads, x.sizes),
                          (Slots{} = writable<T>(x.states[K], x.sizes))...);
}

/// A captureless binder of param, grad and the states `Slots...` (a layout of a family).
template <class T, class... Slots>
struct binder {
  auto operator()(plan_tensors const& x) const
  {
    FUSEDOPT_EXPECTS(x.states.size() == sizeof...(Slots), "fusedopt::libtorch: internal error: a state list is missing");
    return bind_states<T, Slots...>(x, std::index_sequence_for<Slots...>{});
  }
};

}  // namespace detail

namespace detail {
/// Adam and AdamW: exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad (layout 1).
struct adam_states {
  static constexpr int reduction_capacity = 0;
  template <class T, class F>
  static decltype(auto) with_lists(std::int64_t layout, F&& f)
  {
    if (layout == 1) { return f(detail::binder<T, slot::exp_avg_t, slot::exp_avg_sq_t, slot::max_exp_avg_sq_t>{}); }
    return f(detail::binder<T, slot::exp_avg_t, slot::exp_avg_sq_t>{});
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
  template <class T, class F>
  static decltype(auto) with_lists(std::int64_t layout, F&& f)
  {
    if (layout == 1) { return f(detail::binder<T, slot::momentum_buffer_t>{}); }
    return f(detail::binder<T>{});
  }
};

/// Adagrad: sum_sq (torch's state `sum`).
template <>
struct family<rules::adagrad> {
  static constexpr int reduction_capacity = 0;
  template <class T, class F>
  static decltype(auto) with_lists(std::int64_t /*layout*/, F&& f)
  {
    return f(detail::binder<T, slot::sum_sq_t>{});
  }
};

/// RMSprop: square_avg, then momentum_buffer with momentum (layout bit 1) and grad_avg when
/// centered (layout bit 2), in that order (torch's state order).
template <>
struct family<rules::rmsprop> {
  static constexpr std::int64_t momentum_bit = 1, centered_bit = 2;
  static constexpr int reduction_capacity = 0;
  template <class T, class F>
  static decltype(auto) with_lists(std::int64_t layout, F&& f)
  {
    using detail::binder;
    switch (layout & (momentum_bit | centered_bit)) {
      case momentum_bit: return f(binder<T, slot::square_avg_t, slot::momentum_buffer_t>{});
      case centered_bit: return f(binder<T, slot::square_avg_t, slot::grad_avg_t>{});
      case momentum_bit | centered_bit:
        return f(binder<T, slot::square_avg_t, slot::momentum_buffer_t, slot::grad_avg_t>{});
      default: break;
    }
    return f(binder<T, slot::square_avg_t>{});
  }
};

/// Lion: exp_avg.
template <>
struct family<rules::lion> {
  static constexpr int reduction_capacity = 0;
  template <class T, class F>
  static decltype(auto) with_lists(std::int64_t /*layout*/, F&& f)
  {
    return f(detail::binder<T, slot::exp_avg_t>{});
  }
};

/// LAMB: exp_avg, exp_avg_sq; its trust ratio's reduction pass sums two accumulators per tensor.
template <>
struct family<rules::lamb> {
  static constexpr int reduction_capacity = 2;
  template <class T, class F>
  static decltype(auto) with_lists(std::int64_t /*layout*/, F&& f)
  {
    return f(detail::binder<T, slot::exp_avg_t, slot::exp_avg_sq_t>{});
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

/// plan<Rule> over a fusedopt plan of backend B (its per-plan state: B's instance), bound with
/// `Bind`.
template <class Rule, class B, class Plan, class Bind>
class plan_impl final : public plan<Rule> {
 public:
  plan_impl(B backend, Plan p) : backend_(std::move(backend)), plan_(std::move(p)) {}
  void run(Rule const& rule, step_info const& step, void* stream) const override
  {
    backend_.run(plan_, rule, step, stream);
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

}  // namespace detail

/// @brief The plan of rule `Rule` that `request` asks for, on backend B: `make_backend()`
/// returns the per-plan backend object, which has `make(lists, reduction_capacity, stream)`,
/// `run(plan, rule, step, stream)`, `rebind(plan, lists, stream)` and `rebind_slot(plan, slot,
/// addresses, count, stream)`. Used by the host backend here and the CUDA one in
/// cuda_steps.cuh.
/// @throws fusedopt::error as the backend's plan constructor does (validation, allocation).
template <class Rule, class MakeBackend>
std::unique_ptr<plan<Rule>> make_plan(MakeBackend&& make_backend, plan_request const& request)
{
  return detail::by_element_type(request.type, [&](auto element) -> std::unique_ptr<plan<Rule>> {
    using T = decltype(element);
    return family<Rule>::template with_lists<T>(request.layout, [&](auto bind) -> std::unique_ptr<plan<Rule>> {
      auto backend = make_backend();
      auto p = backend.make(bind(*request.tensors), family<Rule>::reduction_capacity, request.stream);
      return std::make_unique<detail::plan_impl<Rule, decltype(backend), decltype(p), decltype(bind)>>(std::move(backend),
                                                                                                       std::move(p));
    });
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
