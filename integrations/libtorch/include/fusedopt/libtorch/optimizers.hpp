/// @file optimizers.hpp
/// @brief fusedopt's fused steps as libtorch optimizers: `fusedopt::libtorch::AdamW`, `Adam` and
/// `SGD` subclass `torch::optim::Optimizer` with torch's own options and per-parameter state
/// classes (`torch::optim::AdamWOptions`, `AdamWParamState`, ...), so param groups, LR
/// schedulers (`options().set_lr()`), `torch::save`/`torch::load` checkpoints and code written
/// for `torch::optim::AdamW` work unchanged, and a checkpoint of either loads into the other.
///
/// A step runs one fused pass per bucket (the parameters of a group with the same dtype and
/// step count) through fusedopt's host backend: every element of p, grad and the states loaded
/// once and stored once, where torch::optim's C++ step launches 8-9 operations per tensor.
/// Plans are built at the first step of a bucket and kept; new gradient tensors
/// (`zero_grad()` sets them to none) are rebound, anything else that moved rebuilds the plan.
///
/// This version steps CPU tensors (float, double, half, bfloat16); CUDA tensors are refused
/// with a clear error (docs/libtorch.md, "Status").
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <ATen/Parallel.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusedopt {
namespace libtorch {
namespace detail {

/// The key torch's Optimizer::state() uses for a parameter: its TensorImpl's address, as a
/// string (torch 1.x) or as a pointer (torch 2.x).
template <class Map>
typename Map::key_type state_key(torch::Tensor const& p)
{
  using key = typename Map::key_type;
  if constexpr (std::is_same_v<key, std::string>) {
    std::ostringstream out;
    out << p.unsafeGetTensorImpl();
    return out.str();
  } else {
    return static_cast<key>(p.unsafeGetTensorImpl());
  }
}

/// Calls f(T{}) with T the fusedopt element type of `type`; refuses the others.
template <class F>
void dispatch(c10::ScalarType type, char const* name, F&& f)
{
  switch (type) {
    case c10::ScalarType::Float: f(float{}); break;
    case c10::ScalarType::Double: f(double{}); break;
    case c10::ScalarType::Half: f(::fusedopt::half{}); break;
    case c10::ScalarType::BFloat16: f(::fusedopt::bfloat16{}); break;
    default: TORCH_CHECK(false, name, ": parameters of dtype ", type, " are not supported (float, double, half, bfloat16)");
  }
}

/// n tensors' data as a fusedopt list of T (T const for read-only slots).
template <class T>
::fusedopt::tensor_list<T> list_of(std::vector<torch::Tensor> const& tensors)
{
  ::fusedopt::tensor_list<T> list;
  for (auto const& t : tensors) { list.push_back(static_cast<T*>(t.data_ptr()), t.numel()); }
  return list;
}

/// A bucket's plan, whatever its lists: run a rule, rebind the gradients.
template <class Rule>
struct plan_handle {
  virtual ~plan_handle() = default;
  virtual void run(Rule const& rule, ::fusedopt::step_info const& step) const = 0;
  virtual void rebind_grads(std::vector<torch::Tensor> const& grads) = 0;
};

template <class Rule, class Plan>
class host_plan_handle final : public plan_handle<Rule> {
 public:
  explicit host_plan_handle(Plan plan) : plan_(std::move(plan)) {}
  void run(Rule const& rule, ::fusedopt::step_info const& step) const override { plan_.run(rule, step); }
  void rebind_grads(std::vector<torch::Tensor> const& grads) override
  {
    addresses_.clear();
    for (auto const& g : grads) { addresses_.push_back(static_cast<grad_pointer>(g.data_ptr())); }
    plan_.rebind(::fusedopt::slot::grad, addresses_.data(), addresses_.size());
  }

 private:
  using grad_pointer = typename Plan::template slot_pointer_t<::fusedopt::slot::grad_t>;
  Plan plan_;
  std::vector<grad_pointer> addresses_;
};

/// A host plan over `lists` behind a plan_handle of Rule, on as many threads as torch's
/// intra-op pool (at::get_num_threads(): torch::set_num_threads applies to the step too).
template <class Rule, class Lists>
std::unique_ptr<plan_handle<Rule>> host_plan(Lists lists)
{
  ::fusedopt::host::options options;
  options.threads = at::get_num_threads();
  auto plan = ::fusedopt::host::make_plan(std::move(lists), options);
  return std::make_unique<host_plan_handle<Rule, decltype(plan)>>(std::move(plan));
}

/// One bucket of a group: its parameters (held, so that their memory is not reused while the
/// plan points at it), the addresses its plan was built over, its plan.
template <class Rule>
struct bucket {
  std::vector<torch::Tensor> params;
  std::vector<void*> addresses;  // params' and states' data, in the plan's order
  std::vector<void const*> grads;
  std::unique_ptr<plan_handle<Rule>> plan;
};

}  // namespace detail

/// @brief What the three optimizers share: torch::optim::Optimizer with a fused step.
/// `Derived` provides `name`, `state_tensors(p, options, state)` (the states in slot order,
/// created as torch creates them), `layout(options, state)` (which optional slots the plan
/// binds), `next_step(state)` (the 1-based step the rule takes), `make_plan<T>(params, grads,
/// states, options)`, `rule(options)` and `advance(state)` (after the step).
template <class Derived, class Options, class ParamState, class Rule>
class fused_optimizer : public torch::optim::Optimizer {
 public:
  using torch::optim::Optimizer::Optimizer;

  /// One fused step of every parameter with a gradient; returns the closure's loss (or an
  /// undefined tensor). Nothing is written when a parameter is refused (checked first).
  torch::Tensor step(LossClosure closure = nullptr) override
  {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    // Every group is checked and bucketed (its states created) before any is stepped: a refused
    // parameter or state leaves every tensor as it was.
    buckets_.resize(param_groups_.size());
    for (auto const& group : param_groups_) { check_group(group); }
    std::vector<group_members> members;
    for (auto& group : param_groups_) { members.push_back(collect_group(group)); }
    for (std::size_t g = 0; g < param_groups_.size(); ++g) { step_group(g, members[g]); }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override
  {
    torch::optim::serialize<ParamState, Options>(archive, *this);
  }

  /// Loads a checkpoint of this optimizer or of torch's own (same keys); the plans are rebuilt.
  void load(torch::serialize::InputArchive& archive) override
  {
    torch::optim::serialize<ParamState, Options>(archive, *this);
    buckets_.clear();
  }

  /// How many plans were built (one per bucket, again when its tensors moved or changed).
  [[nodiscard]] std::int64_t plan_builds() const noexcept { return builds_; }

 private:
  using state_map = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

  Derived& self() { return static_cast<Derived&>(*this); }

  void check_group(torch::optim::OptimizerParamGroup const& group)
  {
    for (auto const& p : group.params()) {
      auto const& g = p.grad();
      if (!g.defined()) { continue; }
      TORCH_CHECK(!g.is_sparse(), Derived::name, " does not support sparse gradients");
      TORCH_CHECK(p.device().is_cpu(), Derived::name,
                  ": this version of fusedopt::libtorch steps CPU tensors only; got a parameter on ", p.device());
      TORCH_CHECK(g.device() == p.device() && g.scalar_type() == p.scalar_type() && g.sizes() == p.sizes(),
                  Derived::name, ": a gradient of ", g.sizes(), " ", g.scalar_type(), " on ", g.device(),
                  " for a parameter of ", p.sizes(), " ", p.scalar_type(), " on ", p.device());
      TORCH_CHECK(p.is_contiguous() && g.is_contiguous(), Derived::name,
                  ": parameters and gradients must be contiguous");
    }
  }

  // Buckets: the parameters with a gradient of one dtype and layout (the rule's optional
  // slots), split by step count (a parameter that had no gradient at some step lags); plans are
  // kept by (dtype, layout, rank of the step count), so the usual bucket keeps its plan while
  // its step count advances.
  using bucket_key = std::tuple<int, std::int64_t, std::size_t>;

  /// A bucket's parameters, their torch states and their state tensors (in slot order, per
  /// parameter), as collected before any step.
  struct members {
    std::vector<torch::Tensor> params;
    std::vector<ParamState*> states;
    std::vector<torch::Tensor> state_tensors;
  };
  /// A group's buckets by (dtype, layout, step).
  using group_members = std::map<std::tuple<int, std::int64_t, std::int64_t>, members>;

  group_members collect_group(torch::optim::OptimizerParamGroup& group)
  {
    auto const& options = static_cast<Options const&>(group.options());
    group_members out;
    for (auto const& p : group.params()) {
      if (!p.grad().defined()) { continue; }
      auto& slot = state_[detail::state_key<state_map>(p)];
      if (!slot) { slot = std::make_unique<ParamState>(); }
      auto& state = static_cast<ParamState&>(*slot);
      auto const tensors = self().state_tensors(p, options, state);  // created as torch creates them
      for (auto const& t : tensors) {
        TORCH_CHECK(t.is_contiguous() && t.scalar_type() == p.scalar_type() && t.sizes() == p.sizes(),
                    Derived::name, ": a state tensor must be contiguous, of its parameter's dtype and shape");
      }
      // The key after the states exist: SGD's step depends on whether its buffer is new.
      auto& m = out[{static_cast<int>(p.scalar_type()), self().layout(options, state), self().next_step(state)}];
      m.state_tensors.insert(m.state_tensors.end(), tensors.begin(), tensors.end());
      m.params.push_back(p);
      m.states.push_back(&state);
    }
    return out;
  }

  void step_group(std::size_t g, group_members const& buckets)
  {
    auto const& options = static_cast<Options const&>(param_groups_[g].options());
    auto& kept = buckets_[g];
    std::map<bucket_key, detail::bucket<Rule>> next;
    std::tuple<int, std::int64_t> previous{-1, -1};
    std::size_t rank = 0;
    for (auto const& [key, m] : buckets) {
      std::tuple<int, std::int64_t> const kind{std::get<0>(key), std::get<1>(key)};
      rank = kind == previous ? rank + 1 : 0;
      previous = kind;
      bucket_key const id{std::get<0>(key), std::get<1>(key), rank};
      auto found = kept.find(id);
      detail::bucket<Rule> b = found != kept.end() ? std::move(found->second) : detail::bucket<Rule>{};
      run_bucket(b, m, options, std::get<2>(key));
      next.emplace(id, std::move(b));
    }
    kept = std::move(next);
  }

  void run_bucket(detail::bucket<Rule>& b, members const& m, Options const& options, std::int64_t step)
  {
    std::vector<torch::Tensor> grads;
    std::vector<void*> addresses;
    std::vector<void const*> grad_addresses;
    for (auto const& p : m.params) {
      grads.push_back(p.grad());
      grad_addresses.push_back(p.grad().data_ptr());
      addresses.push_back(p.data_ptr());
    }
    for (auto const& t : m.state_tensors) { addresses.push_back(t.data_ptr()); }
    if (b.plan == nullptr || b.addresses != addresses) {
      detail::dispatch(m.params.front().scalar_type(), Derived::name, [&](auto element) {
        using T = decltype(element);
        b.plan = self().template make_plan<T>(m.params, grads, m.state_tensors, options);
      });
      b.params = m.params;
      b.addresses = std::move(addresses);
      b.grads = grad_addresses;
      ++builds_;
    } else if (b.grads != grad_addresses) {
      b.plan->rebind_grads(grads);
      b.grads = grad_addresses;
    }
    b.plan->run(self().rule(options), ::fusedopt::step_info{step});
    for (auto* state : m.states) { self().advance(*state); }
    for (auto const& p : m.params) { p.unsafeGetTensorImpl()->bump_version(); }  // written through data_ptr
    for (auto const& t : m.state_tensors) { t.unsafeGetTensorImpl()->bump_version(); }
  }

  std::vector<std::map<bucket_key, detail::bucket<Rule>>> buckets_;
  std::int64_t builds_ = 0;
};

/// @brief What Adam and AdamW share: the states (exp_avg, exp_avg_sq, and max_exp_avg_sq with
/// amsgrad, created as torch creates them), the plan, the rule's options and the step count.
template <class Derived, class Options, class ParamState, class Rule>
class adam_family : public fused_optimizer<Derived, Options, ParamState, Rule> {
 public:
  adam_family(std::vector<torch::optim::OptimizerParamGroup> const& groups, Options const& defaults)
      : fused_optimizer<Derived, Options, ParamState, Rule>(groups, std::make_unique<Options>(defaults))
  {
    // torch::optim::Adam's and AdamW's constructors' checks.
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.eps() >= 0, "Invalid epsilon value: ", defaults.eps());
    auto const [b1, b2] = defaults.betas();
    TORCH_CHECK(0 <= b1 && b1 < 1, "Invalid beta parameter at index 0: ", b1);
    TORCH_CHECK(0 <= b2 && b2 < 1, "Invalid beta parameter at index 1: ", b2);
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
  }

  // The hooks fused_optimizer calls.
  static std::vector<torch::Tensor> state_tensors(torch::Tensor const& p, Options const& o, ParamState& s)
  {
    if (!s.exp_avg().defined()) {
      s.step(0);
      s.exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      s.exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
    if (o.amsgrad() && !s.max_exp_avg_sq().defined()) {
      s.max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
    if (o.amsgrad()) { return {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}; }
    return {s.exp_avg(), s.exp_avg_sq()};
  }
  static std::int64_t layout(Options const& o, ParamState const&) { return o.amsgrad() ? 1 : 0; }
  static std::int64_t next_step(ParamState const& s) { return s.step() + 1; }
  static void advance(ParamState& s) { s.step(s.step() + 1); }
  static Rule rule(Options const& o)
  {
    Rule r;
    r.lr = o.lr();
    r.beta1 = std::get<0>(o.betas());
    r.beta2 = std::get<1>(o.betas());
    r.eps = o.eps();
    r.weight_decay = o.weight_decay();
    r.amsgrad = o.amsgrad();
    return r;
  }

  /// The plan over exp_avg, exp_avg_sq (and max_exp_avg_sq) per parameter, in `states` in that
  /// order.
  template <class T>
  static std::unique_ptr<detail::plan_handle<Rule>> make_plan(std::vector<torch::Tensor> const& params,
                                                              std::vector<torch::Tensor> const& grads,
                                                              std::vector<torch::Tensor> const& states,
                                                              Options const& o)
  {
    std::size_t const per = o.amsgrad() ? 3 : 2;
    std::vector<torch::Tensor> m, v, vmax;
    for (std::size_t t = 0; t < params.size(); ++t) {
      m.push_back(states[t * per]);
      v.push_back(states[t * per + 1]);
      if (o.amsgrad()) { vmax.push_back(states[t * per + 2]); }
    }
    namespace slot = ::fusedopt::slot;
    if (o.amsgrad()) {
      return detail::host_plan<Rule>(::fusedopt::bind(
        slot::param = detail::list_of<T>(params), slot::grad = detail::list_of<T const>(grads),
        slot::exp_avg = detail::list_of<T>(m), slot::exp_avg_sq = detail::list_of<T>(v),
        slot::max_exp_avg_sq = detail::list_of<T>(vmax)));
    }
    return detail::host_plan<Rule>(::fusedopt::bind(slot::param = detail::list_of<T>(params),
                                                    slot::grad = detail::list_of<T const>(grads),
                                                    slot::exp_avg = detail::list_of<T>(m),
                                                    slot::exp_avg_sq = detail::list_of<T>(v)));
  }
};

/// @brief torch::optim::AdamW, fused (torch::optim::AdamWOptions, AdamWParamState): decoupled
/// weight decay.
class AdamW : public adam_family<AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState,
                                 ::fusedopt::rules::adamw> {
 public:
  static constexpr char const* name = "AdamW";

  explicit AdamW(std::vector<torch::optim::OptimizerParamGroup> const& groups,
                 torch::optim::AdamWOptions const& defaults = {})
      : adam_family(groups, defaults)
  {
  }
  explicit AdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions const& defaults = {})
      : AdamW({torch::optim::OptimizerParamGroup(std::move(params))}, defaults)
  {
  }
};

/// @brief torch::optim::Adam, fused (torch::optim::AdamOptions, AdamParamState): L2 weight decay
/// added to the gradient, as torch's C++ Adam.
class Adam : public adam_family<Adam, torch::optim::AdamOptions, torch::optim::AdamParamState,
                                ::fusedopt::rules::adam> {
 public:
  static constexpr char const* name = "Adam";

  explicit Adam(std::vector<torch::optim::OptimizerParamGroup> const& groups,
                torch::optim::AdamOptions const& defaults = {})
      : adam_family(groups, defaults)
  {
  }
  explicit Adam(std::vector<torch::Tensor> params, torch::optim::AdamOptions const& defaults = {})
      : Adam({torch::optim::OptimizerParamGroup(std::move(params))}, defaults)
  {
  }
};

/// @brief torch::optim::SGD, fused (torch::optim::SGDOptions, SGDParamState: the momentum buffer,
/// created from the first step's gradient as torch does).
class SGD : public fused_optimizer<SGD, torch::optim::SGDOptions, torch::optim::SGDParamState,
                                   ::fusedopt::rules::sgd> {
 public:
  static constexpr char const* name = "SGD";

  explicit SGD(std::vector<torch::optim::OptimizerParamGroup> const& groups, torch::optim::SGDOptions defaults)
      : fused_optimizer(groups, std::make_unique<torch::optim::SGDOptions>(defaults))
  {
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.momentum() >= 0, "Invalid momentum value: ", defaults.momentum());
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
    TORCH_CHECK(!defaults.nesterov() || (defaults.momentum() > 0 && defaults.dampening() == 0),
                "Nesterov momentum requires a momentum and zero dampening");
  }
  explicit SGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults)
      : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults))
  {
  }

  // SGD keeps no step count (torch's SGDParamState has none): a buffer created at this step
  // takes the gradient (step 1 for the rule), an existing one is updated (step 2). Buffers
  // created and not yet stepped are remembered here (a loaded buffer is an existing one).
  std::vector<torch::Tensor> state_tensors(torch::Tensor const& p, torch::optim::SGDOptions const& o,
                                           torch::optim::SGDParamState& s)
  {
    if (o.momentum() == 0) { return {}; }
    if (!s.momentum_buffer().defined()) {
      s.momentum_buffer(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      fresh_.push_back(s.momentum_buffer().unsafeGetTensorImpl());
    }
    return {s.momentum_buffer()};
  }
  static std::int64_t layout(torch::optim::SGDOptions const& o, torch::optim::SGDParamState const&)
  {
    return o.momentum() == 0 ? 0 : 1;
  }
  std::int64_t next_step(torch::optim::SGDParamState const& s) const { return fresh(s) ? 1 : 2; }
  void advance(torch::optim::SGDParamState& s)
  {
    if (!s.momentum_buffer().defined()) { return; }
    auto const impl = s.momentum_buffer().unsafeGetTensorImpl();
    fresh_.erase(std::remove(fresh_.begin(), fresh_.end(), impl), fresh_.end());
  }

  template <class T>
  static std::unique_ptr<detail::plan_handle<::fusedopt::rules::sgd>> make_plan(
    std::vector<torch::Tensor> const& params, std::vector<torch::Tensor> const& grads,
    std::vector<torch::Tensor> const& states, torch::optim::SGDOptions const& o)
  {
    namespace slot = ::fusedopt::slot;
    if (o.momentum() == 0) {
      return detail::host_plan<::fusedopt::rules::sgd>(
        ::fusedopt::bind(slot::param = detail::list_of<T>(params), slot::grad = detail::list_of<T const>(grads)));
    }
    return detail::host_plan<::fusedopt::rules::sgd>(::fusedopt::bind(slot::param = detail::list_of<T>(params),
                                                                      slot::grad = detail::list_of<T const>(grads),
                                                                      slot::momentum_buffer = detail::list_of<T>(states)));
  }
  static ::fusedopt::rules::sgd rule(torch::optim::SGDOptions const& o)
  {
    ::fusedopt::rules::sgd r;
    r.lr = o.lr();
    r.momentum = o.momentum();
    r.dampening = o.dampening();
    r.weight_decay = o.weight_decay();
    r.nesterov = o.nesterov();
    return r;
  }

  void load(torch::serialize::InputArchive& archive) override
  {
    fused_optimizer::load(archive);
    fresh_.clear();  // loaded buffers continue
  }

 private:
  bool fresh(torch::optim::SGDParamState const& s) const
  {
    return s.momentum_buffer().defined() &&
           std::find(fresh_.begin(), fresh_.end(), s.momentum_buffer().unsafeGetTensorImpl()) != fresh_.end();
  }

  std::vector<c10::TensorImpl const*> fresh_;
};

}  // namespace libtorch
}  // namespace fusedopt
