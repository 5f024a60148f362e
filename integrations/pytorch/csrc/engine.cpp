/// @file engine.cpp
/// @brief fusedopt_torch's engine: turns lists of at::Tensor into fusedopt plans and runs them.
///
/// One `engine` per Python optimizer. It keeps, per parameter group, the parameters, their
/// state tensors (the very tensors of the Python optimizer's `state`, shared) and step counts,
/// and a cache of plans: one per (device, dtype, step) bucket of the parameters that have a
/// gradient. A step compares the parameters' and gradients' addresses with the cached ones
/// (a few ns per tensor) and runs the cached plans with the group's current hyperparameters.
/// Moved addresses (new gradient tensors every step under `zero_grad(set_to_none=True)`)
/// rebind the group's plans to the new tensors (no device allocation, no synchronisation); a
/// change of which parameters have a gradient rebuilds that group's plans; a parameter without
/// state or a changed layout (amsgrad, momentum, centered, clipping) sends the work back to
/// Python.
#include "core.hpp"

#include <fusedopt/error.hpp>

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace fusedopt_torch {
namespace {

/// The structural options of a family's hyperparameters (must agree with the classes' _state_keys);
/// `float_states`: a user rule's dtype policy.
layout layout_of(family f, hyper const& h, std::uint32_t float_states)
{
  layout l;
  l.float_states = f == family::user ? float_states : 0;
  l.amsgrad = (f == family::adam || f == family::adamw) && h.amsgrad;
  l.momentum = (f == family::sgd && h.momentum != 0.0) || (f == family::rmsprop && h.momentum > 0.0);
  l.centered = f == family::rmsprop && h.centered;
  l.clip = f == family::lamb && h.max_grad_norm > 0.0;
  l.kahan = supports_low_precision(f) && h.kahan;
  l.master = supports_low_precision(f) && h.master_weights;
  return l;
}

dtype dtype_of(at::Tensor const& t)
{
  auto const type = plan_dtype(t.scalar_type());
  if (!type) {
    throw py::type_error("fusedopt_torch: parameters must be float32, float64, float16 or bfloat16, not " +
                         text(t.scalar_type()));
  }
  return *type;
}

/// Checks that `t` (the gradient or a state of parameter `p`) has p's device, shape and strides,
/// and p's dtype (or `dtype` where given: a user rule's float32 state).
void check_same_layout(at::Tensor const& p, at::Tensor const& t, char const* what, std::size_t index,
                       c10::optional<at::ScalarType> dtype = c10::nullopt)
{
  FUSEDOPT_TORCH_CHECK(t.defined(), "fusedopt_torch: parameter ", index, ": ", what, " is undefined");
  FUSEDOPT_TORCH_CHECK(!t.is_sparse(), "fusedopt_torch does not support sparse gradients (parameter ", index, ")");
  auto const expected = dtype ? *dtype : p.scalar_type();
  FUSEDOPT_TORCH_CHECK(t.scalar_type() == expected, "fusedopt_torch: parameter ", index, " is ", p.scalar_type(),
              " but its ", what, " is ", t.scalar_type(), dtype ? text(" (its rule keeps it in ") + text(expected) + ")" : "");
  FUSEDOPT_TORCH_CHECK(t.device() == p.device(), "fusedopt_torch: parameter ", index, " is on ", p.device(), " but its ", what,
              " is on ", t.device());
  FUSEDOPT_TORCH_CHECK(t.sizes() == p.sizes(), "fusedopt_torch: parameter ", index, " has shape ", p.sizes(), " but its ",
              what, " has shape ", t.sizes());
  FUSEDOPT_TORCH_CHECK(t.is_non_overlapping_and_dense() && t.strides() == p.strides(), "fusedopt_torch: parameter ", index,
              ": its ", what,
              " must be dense with the parameter's strides (an elementwise step runs over the memory of each tensor)");
}

/// Whether state `s` holds an 8-bit state (a uint8 tensor of plans.hpp's quantized_state_bytes)
/// rather than elements of its parameter's dtype.
bool holds_quantized(at::Tensor const& s) { return s.defined() && s.scalar_type() == at::kByte; }

/// Checks the 8-bit state of parameter `p`: the memory a plan reads and writes for it.
void check_quantized_state(at::Tensor const& p, at::Tensor const& s, std::size_t index)
{
  FUSEDOPT_TORCH_CHECK(s.device() == p.device(), "fusedopt_torch: parameter ", index, " is on ", p.device(),
                       " but its 8-bit state is on ", s.device());
  check_quantized_bytes(s, p.numel(), "fusedopt_torch: parameter ", index);
}

/// The dtype a state must have: the parameter's, float32 (a user rule's state kept in float32,
/// every state of layout::master), or either (before the group's layout is known).
enum class state_dtype { param, float32, either };

/// A state of parameter `p`: 8-bit states or a tensor of the parameter's layout, of the dtype
/// `expected` says.
void check_state(at::Tensor const& p, at::Tensor const& s, std::size_t index, state_dtype expected = state_dtype::param)
{
  if (holds_quantized(s)) {
    check_quantized_state(p, s, index);
  } else if (expected == state_dtype::float32 ||
             (expected == state_dtype::either && s.scalar_type() == at::kFloat)) {
    check_same_layout(p, s, "state", index, at::kFloat);
  } else {
    check_same_layout(p, s, "state", index);
  }
}

struct bucket {
  std::vector<int> members;  // indices into the group's parameters
  int device = -1;           // -1: CPU (host backend), else the CUDA device index
  std::int64_t step = 0;     // the members' step count before the next step (see counter)
  // When set (int64 scalar on the bucket's device): the count lives there instead of `step`,
  // advanced by the run and taken back by a step GradScaler skips (found_inf) on the device.
  at::Tensor counter;
  // Hyperparameters handed over in the bucket's memory: doubles [lr, beta1, beta2, mu_product]
  // (made at the first use, with a view of each): a tensor lr's or Tensor betas' values,
  // refreshed from the tensors every step in stream order, and NAdam's product under
  // capturable=True, which the step advances there (mu_on_device: b.mu_product is stale).
  at::Tensor scalars;
  // Views of scalars' first four, then of user hyperparameters given as Tensors (user rules).
  std::array<at::Tensor, 4 + hyper::max_user> scalar_views;
  bool mu_on_device = false;
  lists tensors;             // the addresses the plan is bound to (members in order)
  dtype element = dtype::f32;  // the plan's element type and layout (the unit's key)
  layout lay;
  double mu_product = 1.0;   // NAdam: the members' state['mu_product'] before the next step
  std::unique_ptr<plan> p;
#if defined(FUSEDOPT_TORCH_WITH_CUDA)
  // The stream of the last run: a run on another stream first waits for it, since the plan's
  // device tables and workspace are rewritten in stream order.
  c10::optional<c10::cuda::CUDAStream> stream;
#endif
};

struct group_data {
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> states;
  std::vector<char> has_state;  // false: no state yet (SGD without momentum has state and no tensors)
  std::vector<std::int64_t> steps;
  std::vector<double> mu_products;  // NAdam only (set_mu_products); empty for the other families
  layout lay;
  bool layout_known = false;
  // The cache: addresses the plans were built for (grad null: skipped parameter).
  std::vector<void const*> param_ptrs, grad_ptrs;
  // This step's addresses, gathered (and each new gradient checked) in one pass over the
  // tensors; a rebind takes them from here, so no tensor is read twice per step.
  std::vector<void const*> next_param_ptrs, next_grad_ptrs;
  std::vector<bucket> buckets;
  bool built = false;
  // The plans of other gradient memberships (which parameters have a gradient), kept for when
  // that membership comes back: the step inside backward steps a model's buckets in turn, and
  // MoE experts without tokens come and go. A change of membership then swaps the kept plans in
  // and rebinds them, where building new ones would retire the old (a CUDA plan's destruction
  // frees its tables, which synchronises the device). Keyed by the membership (one char per
  // parameter), at most kept_limit sets.
  struct kept_plans {
    std::vector<bucket> buckets;
    std::vector<void const*> param_ptrs, grad_ptrs;
  };
  std::map<std::vector<char>, kept_plans> kept;
};

/// At most this many memberships' plans are kept per group (group_data::kept).
constexpr std::size_t kept_limit = 64;

/// Host time of the engine's steps by phase, summed (bench/step_probe.py and bench/train_loop.py
/// print it, to tell where a step's host time goes): a few clock reads per step.
struct phase_times {
  std::int64_t steps = 0;
  std::int64_t engine_ns = 0;   // the whole of step() in C++ (the sum of the phases and the rest)
  std::int64_t scan_ns = 0;     // gathering the addresses, each new gradient's layout checked
  std::int64_t rebind_ns = 0;   // rebinds: the plans' rebind (address checks, the table upload)
  std::int64_t rebuild_ns = 0;  // rebuilds
  std::int64_t launch_ns = 0;   // from step()'s entry to the last plan's launch (what delays the GPU)
  std::int64_t run_ns = 0;      // the runs (hyperparameters, launches) and version counters
  std::int64_t table_uploads = 0;  // address-table uploads of plans no longer in use (CUDA)
};

/// Adds the time from its construction to its destruction to `total`.
class phase_clock {
 public:
  explicit phase_clock(std::int64_t& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~phase_clock()
  {
    total_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  }
  phase_clock(phase_clock const&) = delete;
  phase_clock& operator=(phase_clock const&) = delete;

 private:
  std::int64_t& total_;
  std::chrono::steady_clock::time_point start_;
};

class engine {
 public:
  /// An engine of family `f` whose plans come from the units `provider(device, dtype, layout
  /// bits, float_states, amp)` returns (a unit_api address, `load_unit`'s result): device -1 for
  /// the CPU, dtype and layout as plans.hpp's, `amp` true when the plan must take GradScaler's
  /// inputs. Called when a bucket's plan is made, never on a step's usual path. `amp`: whether
  /// the optimizer takes GradScaler's fused protocol (supports_amp, and a user rule's spec).
  engine(family f, py::object provider, bool amp)
      : family_(f), provider_(std::move(provider)), amp_(amp && supports_amp(f))
  {
  }

  /// A user rule's dtype policy: bit k set where its state k is kept in float32.
  void set_float_states(std::uint32_t mask) { float_states_ = mask; }

  /// Replaces every group: parameters, state tensors (None: no state yet) and step counts.
  void set_groups(std::vector<std::tuple<std::vector<at::Tensor>, std::vector<c10::optional<std::vector<at::Tensor>>>,
                                         std::vector<std::int64_t>>> const& groups)
  {
    std::vector<group_data> next(groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g) {
      auto const& [params, states, steps] = groups[g];
      FUSEDOPT_TORCH_CHECK(params.size() == states.size() && params.size() == steps.size(),
                  "fusedopt_torch: set_groups: lists of different lengths");
      auto& d = next[g];
      d.params = params;
      d.steps = steps;
      d.states.resize(params.size());
      d.has_state.assign(params.size(), 0);
      for (std::size_t i = 0; i < params.size(); ++i) {
        FUSEDOPT_TORCH_CHECK(params[i].defined(), "fusedopt_torch: parameter ", i, " of group ", g, " is undefined");
        FUSEDOPT_TORCH_CHECK(params[i].layout() == at::kStrided, "fusedopt_torch: parameter ", i, " of group ", g,
                    " is not a strided tensor");
        FUSEDOPT_TORCH_CHECK(params[i].is_non_overlapping_and_dense(), "fusedopt_torch: parameter ", i, " of group ", g,
                    " is not dense (fusedopt steps the memory of each tensor as one flat array)");
        dtype_of(params[i]);
        if (states[i]) {
          for (std::size_t k = 0; k < states[i]->size(); ++k) {
            // The dtype a state must have follows the group's layout (master weights: float32),
            // known at the group's first step, where check_states checks it before anything runs.
            check_state(params[i], (*states[i])[k], i, state_dtype::either);
          }
          d.states[i] = *states[i];
          d.has_state[i] = 1;
        }
      }
    }
    times_.table_uploads = table_uploads();  // of the plans dropped here
    groups_ = std::move(next);
  }

  /// One step of every group. Returns false, having changed nothing, when Python must first
  /// create states (a parameter got its first gradient, or the layout changed). `grad_scale`
  /// and `found_inf`: GradScaler's fused protocol (torch's optimizer.grad_scale / found_inf,
  /// one-element float tensors), for families with supports_amp only. `lrs`: per group, the lr
  /// when it is a tensor (read on the device at every step, without synchronising), else None.
  /// `betas`: per group, Tensor betas (beta1, beta2) read on the device likewise, else None.
  /// `on_device`: keep the step counts (and NAdam's mu_product) in the buckets' memory from now
  /// on (capturable=True). `user_tensors`: per group, a user rule's hyperparameters given as
  /// Tensors, (index in hyper::user, tensor), read on the device likewise.
  bool step(std::vector<hyper> const& hypers, c10::optional<at::Tensor> const& grad_scale,
            c10::optional<at::Tensor> const& found_inf, std::vector<c10::optional<at::Tensor>> const& lrs,
            bool on_device, std::vector<c10::optional<std::tuple<at::Tensor, at::Tensor>>> const& betas,
            std::vector<std::vector<std::tuple<int, at::Tensor>>> const& user_tensors)
  {
    FUSEDOPT_TORCH_CHECK(user_tensors.empty() || user_tensors.size() == hypers.size(), "fusedopt_torch: ",
                         user_tensors.size(), " lists of tensor hyperparameters for ", hypers.size(), " groups");
    for (auto const& group : user_tensors) {
      for (auto const& [index, t] : group) {
        FUSEDOPT_TORCH_CHECK(index >= 0 && index < hyper::max_user, "fusedopt_torch: hyperparameter index ", index,
                             " out of range");
        check_tensor_hyper(&t, "hyperparameter");
      }
    }
    FUSEDOPT_TORCH_CHECK(lrs.empty() || lrs.size() == hypers.size(), "fusedopt_torch: ", lrs.size(), " lrs for ",
                         hypers.size(), " groups");
    FUSEDOPT_TORCH_CHECK(betas.empty() || betas.size() == hypers.size(), "fusedopt_torch: ", betas.size(),
                         " betas for ", hypers.size(), " groups");
    for (auto const& lr : lrs) { check_tensor_hyper(lr ? &*lr : nullptr, "lr"); }
    for (auto const& b : betas) {
      if (b) {
        check_tensor_hyper(&std::get<0>(*b), "betas[0]");
        check_tensor_hyper(&std::get<1>(*b), "betas[1]");
      }
    }
    bool const amp = (grad_scale && grad_scale->defined()) || (found_inf && found_inf->defined());
    if (amp) {
      FUSEDOPT_TORCH_CHECK(amp_, "fusedopt_torch: this optimizer does not take GradScaler's grad_scale and found_inf");
      check_amp_tensor(grad_scale, "grad_scale");
      check_amp_tensor(found_inf, "found_inf");
    }
    FUSEDOPT_TORCH_CHECK(hypers.size() == groups_.size(), "fusedopt_torch: ", hypers.size(), " groups of hyperparameters for ",
                groups_.size(), " parameter groups");
    phase_clock const whole(times_.engine_ns);
    auto const entry = std::chrono::steady_clock::now();
    hyper_.resize(hypers.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      hyper_[g] = hypers[g];
      hyper_[g].lr_pointer = nullptr;  // set per bucket from a tensor lr
      hyper_[g].mu_product = 1.0;      // set per bucket (NAdam)
      layout const l = layout_of(family_, hyper_[g], float_states_);
      auto& d = groups_[g];
      if (!d.layout_known || l != d.lay) {
        // States were created by Python for the layout of its last rebuild: ask again.
        if (d.layout_known) { return false; }
        d.lay = l;
        d.layout_known = true;
      }
    }
    // Gather the gradients; nothing runs until every group is known to be ready.
    ++times_.steps;
    if (!gather()) { return false; }
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      if (changed_[g] == members_changed) {
        phase_clock const clock(times_.rebuild_ns);
        rebuild(g);
      } else if (changed_[g] == addresses_moved) {
        rebind(g);
      }
    }
    if (amp && !amp_seen_) {
      // The first scaled step: plans made without GradScaler's kernel are made again from a
      // unit that has it (compiled now where needed), before any bucket runs, so that a failed
      // compile changes nothing.
      for (auto& d : groups_) {
        for (auto& b : d.buckets) {
          if (!b.p->takes_amp()) {
            times_.table_uploads += static_cast<std::int64_t>(b.p->table_uploads());
            b.p = make_plan(b, b.element, b.lay, b.tensors, true);
          }
        }
      }
      amp_seen_ = true;
    }
    if (amp || on_device) {
      // From now on every bucket keeps its count in its own memory: a skipped step is only
      // known there, and a captured step must advance its own count. Reading a count back
      // (state_dict, a rebuild) synchronises.
      counted_on_device_ = true;
    }
    amp_tensors_.clear();
    phase_clock const clock(times_.run_ns);
    launched_ = entry;
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      tensor_hypers tensors;
      if (!lrs.empty() && lrs[g]) { tensors.lr = &*lrs[g]; }
      if (!betas.empty() && betas[g]) {
        tensors.beta1 = &std::get<0>(*betas[g]);
        tensors.beta2 = &std::get<1>(*betas[g]);
      }
      if (!user_tensors.empty()) { tensors.user = &user_tensors[g]; }
      run(g, amp ? &grad_scale : nullptr, amp ? &found_inf : nullptr, tensors);
    }
    times_.launch_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(launched_ - entry).count();
    amp_tensors_.clear();
    return true;
  }

  /// Every parameter with state and its step count (torch's state['step']).
  std::vector<std::vector<std::tuple<at::Tensor, std::int64_t>>> steps()
  {
    std::vector<std::vector<std::tuple<at::Tensor, std::int64_t>>> out(groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      auto& d = groups_[g];
      flush(d);
      for (std::size_t i = 0; i < d.params.size(); ++i) {
        if (d.has_state[i]) { out[g].emplace_back(d.params[i], d.steps[i]); }
      }
    }
    return out;
  }

  /// NAdam: torch's state['mu_product'] of every parameter of every group (after set_groups,
  /// before the next step; 1 for parameters without state). `single`: torch keeps it in float32
  /// (default dtype float32), so every product is rounded to float as torch's `mu_product *= mu` does.
  void set_mu_products(std::vector<std::vector<double>> const& values, bool single)
  {
    FUSEDOPT_TORCH_CHECK(values.size() == groups_.size(), "fusedopt_torch: set_mu_products: ", values.size(),
                " groups for ", groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      FUSEDOPT_TORCH_CHECK(values[g].size() == groups_[g].params.size(), "fusedopt_torch: set_mu_products: group ", g,
                  " has ", groups_[g].params.size(), " parameters, not ", values[g].size());
      groups_[g].mu_products = values[g];
      groups_[g].built = false;  // buckets are keyed by it
    }
    mu_single_ = single;
  }

  /// NAdam: every parameter with state and its mu_product (torch's state['mu_product']).
  std::vector<std::vector<std::tuple<at::Tensor, double>>> mu_products()
  {
    std::vector<std::vector<std::tuple<at::Tensor, double>>> out(groups_.size());
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      auto& d = groups_[g];
      flush(d);
      if (d.mu_products.empty()) { continue; }
      for (std::size_t i = 0; i < d.params.size(); ++i) {
        if (d.has_state[i]) { out[g].emplace_back(d.params[i], d.mu_products[i]); }
      }
    }
    return out;
  }

  /// Host time by phase since the engine was made (phase_times).
  [[nodiscard]] std::map<std::string, std::int64_t> host_times() const
  {
    return {{"steps", times_.steps},          {"engine_ns", times_.engine_ns},   {"scan_ns", times_.scan_ns},
            {"rebind_ns", times_.rebind_ns}, {"rebuild_ns", times_.rebuild_ns}, {"launch_ns", times_.launch_ns},
            {"run_ns", times_.run_ns}, {"table_uploads", table_uploads()}};
  }

  /// Address-table uploads of every plan so far, retired plans included (CUDA plans: a rebind
  /// to an address set seen recently costs none).
  [[nodiscard]] std::int64_t table_uploads() const
  {
    std::int64_t n = times_.table_uploads;
    for (auto const& d : groups_) {
      for (auto const& b : d.buckets) { n += static_cast<std::int64_t>(b.p->table_uploads()); }
      for (auto const& [members, k] : d.kept) {
        for (auto const& b : k.buckets) { n += static_cast<std::int64_t>(b.p->table_uploads()); }
      }
    }
    return n;
  }

  /// Plans built so far (tests: a changed parameter set rebuilds).
  [[nodiscard]] std::int64_t rebuilds() const { return rebuilds_; }
  /// Kept plans swapped back in so far (a membership of gradients seen before: group_data::kept).
  [[nodiscard]] std::int64_t reuses() const { return reuses_; }
  /// Groups rebound to moved tensors so far (tests and benchmarks: set_to_none rebinds).
  [[nodiscard]] std::int64_t rebinds() const { return rebinds_; }
  /// Plans in use, over all groups.
  [[nodiscard]] std::int64_t plans() const
  {
    std::int64_t n = 0;
    for (auto const& d : groups_) { n += static_cast<std::int64_t>(d.buckets.size()); }
    return n;
  }

 private:
  // Bucket step counts back into the per-parameter counts.
  static void flush(group_data& d)
  {
    for (auto& b : d.buckets) {
      if (b.counter.defined()) { b.step = b.counter.item<std::int64_t>(); }  // synchronises
      if (b.mu_on_device) { b.mu_product = b.scalar_views[3].item<double>(); }
      for (int i : b.members) { d.steps[static_cast<std::size_t>(i)] = b.step; }
      if (!d.mu_products.empty()) {
        for (int i : b.members) { d.mu_products[static_cast<std::size_t>(i)] = b.mu_product; }
      }
    }
  }

  /// Checks the states of parameter `i` of `d` for its group's layout; returns whether they are
  /// 8-bit states. Under layout::quantized every state but the Kahan compensation (the last,
  /// of the parameter's dtype) is 8-bit: a plan binds them so.
  bool check_states(group_data const& d, std::size_t i) const
  {
    auto const& states = d.states[i];
    bool const quantized = !states.empty() && holds_quantized(states.front());
    FUSEDOPT_TORCH_CHECK(!quantized || supports_quantized_states(family_), "fusedopt_torch: parameter ", i,
                         " has 8-bit states, which this optimizer does not take");
    for (std::size_t k = 0; k < states.size(); ++k) {
      bool const records = quantized && !(d.lay.kahan && k + 1 == states.size());
      if (records) {
        FUSEDOPT_TORCH_CHECK(holds_quantized(states[k]), "fusedopt_torch: parameter ", i, ": state ", k,
                             " must be 8-bit states as its first state is");
        check_quantized_state(d.params[i], states[k], i);
      } else {
        check_state(d.params[i], states[k], i, state_of(d.lay, k));
      }
    }
    return quantized;
  }

  /// The dtype of state k under layout `l`: float32 for a master layout's states and a user
  /// rule's float32 states (its dtype policy), else the parameter's.
  [[nodiscard]] state_dtype state_of(layout const& l, std::size_t k) const
  {
    bool const in_float = l.master || (family_ == family::user && k < 32 && ((float_states_ >> k) & 1u) != 0);
    return in_float ? state_dtype::float32 : state_dtype::param;
  }

  /// A plan of bucket `b` over `x` from the unit the provider gives (compiling it the first
  /// time), with GradScaler's kernel where `amp`.
  std::unique_ptr<plan> make_plan(bucket const& b, dtype t, layout const& l, lists const& x, bool amp)
  {
    std::uintptr_t address = 0;
    {
      py::gil_scoped_acquire gil;
      address = provider_(b.device, static_cast<int>(t), l.bits(), l.float_states, amp).cast<std::uintptr_t>();
    }
    unit_api const& unit = unit_at(address);
    FUSEDOPT_TORCH_CHECK(unit.make_plan != nullptr, "fusedopt_torch: internal error: the unit makes no plans");
    std::string error;
    plan* made = nullptr;
    if (b.device < 0) {
      int threads = at::get_num_threads();
      made = unit.make_plan(family_, t, l, x, &threads, &error);
    } else {
#if defined(FUSEDOPT_TORCH_WITH_CUDA)
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(b.device));
      made = unit.make_plan(family_, t, l, x, at::cuda::getCurrentCUDAStream(b.device).stream(), &error);
#else
      fail("fusedopt_torch was built without CUDA; parameters are on cuda:", b.device);
#endif
    }
    FUSEDOPT_TORCH_CHECK(made != nullptr, error);
    return std::unique_ptr<plan>(made);
  }

  /// Makes the plans of group `g` for the parameters that have a gradient now: the kept plans of
  /// that membership where there are (and `reuse`), rebound to the current addresses, else new
  /// ones. The plans replaced are kept for their membership (group_data::kept).
  void rebuild(std::size_t g, bool reuse = true)
  {
    auto& d = groups_[g];
    flush(d);
    std::size_t const n = d.params.size();
    // Counts kept on the device (capturable, GradScaler) would have to be written back into
    // kept plans: those plans are not kept.
    bool const keep = reuse && !counted_on_device_;
    if (keep && d.built && d.grad_ptrs.size() == n) {
      std::vector<char> members(n);
      for (std::size_t i = 0; i < n; ++i) { members[i] = d.grad_ptrs[i] != nullptr; }
      if (d.kept.size() >= kept_limit) { retire(d.kept.begin()->second.buckets); d.kept.erase(d.kept.begin()); }
      d.kept[std::move(members)] = group_data::kept_plans{std::move(d.buckets), d.param_ptrs, d.grad_ptrs};
    } else {
      retire(d.buckets);
      if (counted_on_device_) {  // kept plans are never reused from now on
        for (auto& entry : d.kept) { retire(entry.second.buckets); }
        d.kept.clear();
      }
    }
    d.buckets.clear();
    d.built = false;
    if (keep && reuse_kept(g)) { return; }
    d.param_ptrs.assign(n, nullptr);
    d.grad_ptrs.assign(n, nullptr);
    d.next_param_ptrs.assign(n, nullptr);  // sized here: a step allocates nothing
    d.next_grad_ptrs.assign(n, nullptr);
    // Bucket key: device, dtype, step (and NAdam's mu_product: parameters of one step may differ in it
    // when the group's betas or momentum_decay changed while some of them had no gradient), and
    // whether the states are 8-bit states.
    std::map<std::tuple<int, int, std::int64_t, double, bool>, std::vector<int>> keys;
    for (std::size_t i = 0; i < n; ++i) {
      at::Tensor const& p = d.params[i];
      d.param_ptrs[i] = p.data_ptr();
      at::Tensor const& gr = p.grad();
      if (!gr.defined()) { continue; }
      check_same_layout(p, gr, "gradient", i);
      bool const quantized = check_states(d, i);
      d.grad_ptrs[i] = gr.data_ptr();
      int const device = p.is_cuda() ? p.get_device() : -1;
      FUSEDOPT_TORCH_CHECK(p.is_cuda() || p.is_cpu(), "fusedopt_torch: parameter ", i, " is on ", p.device(),
                  "; CPU and CUDA tensors are supported");
      double const mu = d.mu_products.empty() ? 1.0 : d.mu_products[i];
      keys[{device, static_cast<int>(dtype_of(p)), d.steps[i], mu, quantized}].push_back(static_cast<int>(i));
    }
    for (auto& [key, members] : keys) {
      bucket b;
      b.device = std::get<0>(key);
      b.step = std::get<2>(key);
      b.mu_product = std::get<3>(key);
      b.members = std::move(members);
      lists x;
      std::size_t const states = d.states[static_cast<std::size_t>(b.members.front())].size();
      x.states.resize(states);
      for (int i : b.members) {
        auto const u = static_cast<std::size_t>(i);
        at::Tensor const& p = d.params[u];
        FUSEDOPT_TORCH_CHECK(d.states[u].size() == states, "fusedopt_torch: parameter ", i, " has ", d.states[u].size(),
                    " state tensors, expected ", states);
        x.sizes.push_back(p.numel());
        x.param.push_back(p.data_ptr());
        x.grad.push_back(p.grad().data_ptr());
        for (std::size_t k = 0; k < states; ++k) { x.states[k].push_back(d.states[u][k].data_ptr()); }
      }
      b.element = static_cast<dtype>(std::get<1>(key));
      b.lay = d.lay;
      b.lay.quantized = std::get<4>(key);
      // GradScaler's kernel only once a scaled step needs it (run() makes the plan again then):
      // an optimizer that is never scaled compiles and loads no more than it runs.
      b.p = make_plan(b, b.element, b.lay, x, amp_seen_);
      b.tensors = std::move(x);
      d.buckets.push_back(std::move(b));
    }
    d.built = true;
    ++rebuilds_;
  }

  void retire(std::vector<bucket>& buckets)
  {
    for (auto const& b : buckets) { times_.table_uploads += static_cast<std::int64_t>(b.p->table_uploads()); }
    buckets.clear();
  }

  /// Swaps in group g's kept plans of the current membership, rebound to the current addresses,
  /// when every bucket's members still share one step count (and NAdam's mu_product): a member
  /// stepped by another membership's plans since would need another bucket. False: none usable.
  bool reuse_kept(std::size_t g)
  {
    auto& d = groups_[g];
    std::size_t const n = d.params.size();
    std::vector<char> members(n);
    for (std::size_t i = 0; i < n; ++i) { members[i] = d.params[i].grad().defined(); }
    auto const found = d.kept.find(members);
    if (found == d.kept.end()) { return false; }
    auto kept = std::move(found->second);
    d.kept.erase(found);
    for (auto& b : kept.buckets) {
      auto const first = static_cast<std::size_t>(b.members.front());
      for (int i : b.members) {
        auto const u = static_cast<std::size_t>(i);
        bool const same = d.steps[u] == d.steps[first] && (d.mu_products.empty() || d.mu_products[u] == d.mu_products[first]);
        if (!same || check_states(d, u) != b.lay.quantized) {
          retire(kept.buckets);
          return false;
        }
      }
      b.step = d.steps[first];
      if (!d.mu_products.empty()) { b.mu_product = d.mu_products[first]; }
    }
    // The addresses now (each new gradient checked as gather checks them), then a rebind.
    d.param_ptrs = std::move(kept.param_ptrs);
    d.grad_ptrs = std::move(kept.grad_ptrs);
    d.next_param_ptrs.assign(n, nullptr);
    d.next_grad_ptrs.assign(n, nullptr);
    for (std::size_t i = 0; i < n; ++i) {
      at::Tensor const& p = d.params[i];
      at::Tensor const& gr = p.grad();
      if (gr.defined() && gr.data_ptr() != d.grad_ptrs[i]) { check_same_layout(p, gr, "gradient", i); }
      d.next_param_ptrs[i] = p.data_ptr();
      d.next_grad_ptrs[i] = gr.defined() ? gr.data_ptr() : nullptr;
    }
    d.buckets = std::move(kept.buckets);
    d.built = true;
    ++reuses_;
    rebind_buckets(g);
    return true;
  }

  /// Sets changed_ for every group from its gradients' and parameters' addresses, noting them
  /// in next_*_ptrs and checking each new gradient's layout as a rebuild would (one pass over
  /// the tensors: each is read once per step, nothing is changed). Returns false when a
  /// parameter has a gradient but no state yet (Python creates it first).
  bool gather()
  {
    phase_clock const clock(times_.scan_ns);
    changed_.assign(groups_.size(), unchanged);
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      auto& d = groups_[g];
      std::size_t const n = d.params.size();
      if (!d.built || d.param_ptrs.size() != n) { changed_[g] = members_changed; }
      for (std::size_t i = 0; i < n; ++i) {
        at::Tensor const& p = d.params[i];
        at::Tensor const& gr = p.grad();
        void const* gp = gr.defined() ? gr.data_ptr() : nullptr;
        if (gp != nullptr && !d.has_state[i]) { return false; }
        if (changed_[g] == members_changed) { continue; }
        if ((gp == nullptr) != (d.grad_ptrs[i] == nullptr)) {
          changed_[g] = members_changed;  // a gradient appeared or disappeared
          continue;
        }
        void const* pp = p.data_ptr();
        if (gp != d.grad_ptrs[i]) {
          check_same_layout(p, gr, "gradient", i);  // a new gradient tensor, before any plan sees it
          changed_[g] = addresses_moved;
        }
        if (pp != d.param_ptrs[i]) { changed_[g] = addresses_moved; }
        d.next_grad_ptrs[i] = gp;
        d.next_param_ptrs[i] = pp;
      }
    }
    return true;
  }

  /// Points the group's plans at the tensors' new addresses; rebuilds the group when a plan
  /// cannot take them (another alignment class) or a gradient's layout changed.
  void rebind(std::size_t g)
  {
    auto& d = groups_[g];
    try {
      rebind_buckets(g);
    } catch (...) {
      d.built = false;  // the cached addresses may be half updated: the next step rebuilds
      throw;
    }
  }

  void rebind_buckets(std::size_t g)
  {
    auto& d = groups_[g];
    phase_clock const clock(times_.rebind_ns);
    for (auto& b : d.buckets) {
      bool params_moved = false;
      for (std::size_t j = 0; j < b.members.size(); ++j) {
        auto const i = static_cast<std::size_t>(b.members[j]);
        b.tensors.grad[j] = d.next_grad_ptrs[i];  // checked by gather
        if (d.next_param_ptrs[i] != d.param_ptrs[i]) {
          b.tensors.param[j] = const_cast<void*>(d.next_param_ptrs[i]);
          params_moved = true;
        }
      }
      bool rebound = false;
      try {
        // Only the gradients moved (the usual case): the plan checks the new addresses alone;
        // else, or when it declines them, the lists are bound and checked whole.
        void* stream = nullptr;
#if defined(FUSEDOPT_TORCH_WITH_CUDA)
        c10::optional<c10::cuda::CUDAGuard> guard;
        if (b.device >= 0) {
          guard.emplace(static_cast<c10::DeviceIndex>(b.device));
          auto const current = at::cuda::getCurrentCUDAStream(b.device);
          follow_stream(b.stream, current);
          stream = current.stream();
        }
#endif
        rebound = (!params_moved && b.p->rebind_gradients(b.tensors, stream)) || b.p->rebind(b.tensors, stream);
      } catch (std::exception const& e) {
        fail(e.what());
      }
      if (!rebound) {
        phase_clock const rebuilding(times_.rebuild_ns);
        rebuild(g, /*reuse=*/false);  // new plans (these refused the addresses: not kept)
        return;
      }
    }
    d.grad_ptrs.swap(d.next_grad_ptrs);  // every plan follows the new addresses
    d.param_ptrs.swap(d.next_param_ptrs);
    ++rebinds_;
  }

  static void check_amp_tensor(c10::optional<at::Tensor> const& t, char const* name)
  {
    if (!t || !t->defined()) { return; }
    FUSEDOPT_TORCH_CHECK(t->numel() == 1 && t->is_floating_point(), "fusedopt_torch: ", name,
                         " must be a one-element floating-point tensor");
  }

  /// GradScaler's tensor `t` as a float32 scalar in the memory of bucket `b` (a copy when it
  /// lives elsewhere or in another dtype, kept until the step ends); null when absent.
  float const* amp_pointer(c10::optional<at::Tensor> const* t, bucket const& b)
  {
    if (t == nullptr || !*t || !(*t)->defined()) { return nullptr; }
    at::Tensor const& x = **t;
    if (x.device() == device_of(b) && x.scalar_type() == at::kFloat) { return x.data_ptr<float>(); }
    amp_tensors_.push_back(x.to(device_of(b), at::kFloat, /*non_blocking=*/false, /*copy=*/false).contiguous());
    return amp_tensors_.back().data_ptr<float>();
  }

  /// A group's hyperparameters given as tensors (null: a number in the hyper).
  struct tensor_hypers {
    at::Tensor const* lr = nullptr;
    at::Tensor const* beta1 = nullptr;
    at::Tensor const* beta2 = nullptr;
    std::vector<std::tuple<int, at::Tensor>> const* user = nullptr;  // (index in hyper::user, tensor)
    [[nodiscard]] bool any() const
    {
      return lr != nullptr || beta1 != nullptr || beta2 != nullptr || (user != nullptr && !user->empty());
    }
  };

  static void check_tensor_hyper(at::Tensor const* t, char const* name)
  {
    FUSEDOPT_TORCH_CHECK(t == nullptr || (t->numel() == 1 && t->is_floating_point()), "fusedopt_torch: a tensor ",
                         name, " must be a one-element floating-point tensor");
  }

  void run(std::size_t g, c10::optional<at::Tensor> const* grad_scale, c10::optional<at::Tensor> const* found_inf,
           tensor_hypers const& tensors)
  {
    auto& d = groups_[g];
    for (auto& b : d.buckets) {
      std::int64_t const next = b.step + 1;
      try {
        void* stream = nullptr;  // host plans take none
#if defined(FUSEDOPT_TORCH_WITH_CUDA)
        c10::optional<c10::cuda::CUDAGuard> guard;
        if (b.device >= 0) {
          guard.emplace(static_cast<c10::DeviceIndex>(b.device));
          auto const current = at::cuda::getCurrentCUDAStream(b.device);
          follow_stream(b.stream, current);  // before anything of this step is enqueued
          stream = current.stream();
        }
#endif
        hyper const& h = bucket_hyper(g, b, tensors);
        amp_inputs amp;
        amp.grad_scale = amp_pointer(grad_scale, b);
        amp.found_inf = amp_pointer(found_inf, b);
        step_count count;
        count.value = next;
        if (counted_on_device_) { count.counter = counter_of(b); }
        b.p->run(h, count, amp, stream);
        launched_ = std::chrono::steady_clock::now();
      } catch (fusedopt::error const& e) {
        // Options the rule rejects (checked before anything is written): torch raises ValueError.
        throw py::value_error(e.what());
      } catch (py::error_already_set const&) {
        throw;
      } catch (std::exception const& e) {
        fail(e.what());  // a unit's exception of a type the core does not know as fusedopt::error
      }
      b.step = next;  // not read while b.counter is set
      if (family_ == family::nadam && !b.mu_on_device) { b.mu_product = advance_mu_product(b.mu_product, hyper_[g], next); }
      // In-place writes bypass autograd's version counters: bump them as torch's ops would.
      for (int i : b.members) { d.params[static_cast<std::size_t>(i)].unsafeGetTensorImpl()->bump_version(); }
    }
  }

  enum change : char { unchanged, addresses_moved, members_changed };

  static at::Device device_of(bucket const& b)
  {
    return b.device < 0 ? at::Device(at::kCPU) : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(b.device));
  }

  /// The bucket's counter in its memory (made from its count the first time, on the current stream).
  static std::int64_t* counter_of(bucket& b)
  {
    if (!b.counter.defined()) { b.counter = at::full({}, b.step, at::TensorOptions().dtype(at::kLong).device(device_of(b))); }
    return b.counter.data_ptr<std::int64_t>();
  }

  /// The hyperparameters of bucket `b` of group `g`: the group's, with NAdam's per-bucket
  /// mu_product, and a tensor lr copied (in stream order, no synchronisation) to the bucket's memory.
  hyper const& bucket_hyper(std::size_t g, bucket& b, tensor_hypers const& tensors)
  {
    bool const mu_on_device = family_ == family::nadam && counted_on_device_;
    if (family_ != family::nadam && !tensors.any()) { return hyper_[g]; }
    bucket_hyper_ = hyper_[g];
    bucket_hyper_.mu_product = b.mu_product;
    if (!tensors.any() && !mu_on_device) { return bucket_hyper_; }
    if (!b.scalars.defined()) {
      auto const n = static_cast<std::int64_t>(b.scalar_views.size());
      b.scalars = at::empty({n}, at::TensorOptions().dtype(at::kDouble).device(device_of(b)));
      for (std::int64_t k = 0; k < n; ++k) { b.scalar_views[static_cast<std::size_t>(k)] = b.scalars.select(0, k); }
    }
    double* const memory = b.scalars.data_ptr<double>();
    // Each value copied in stream order (a captured copy reads the tensor at every replay);
    // torch allows any one-element shape ([1, 1, 1] betas in its own tests).
    auto const scalar = [](at::Tensor const& t) { return t.dim() == 0 ? t : t.reshape({}); };
    if (tensors.lr != nullptr) {
      b.scalar_views[0].copy_(scalar(*tensors.lr));
      bucket_hyper_.lr_pointer = memory;
    }
    if (tensors.beta1 != nullptr) {
      b.scalar_views[1].copy_(scalar(*tensors.beta1));
      b.scalar_views[2].copy_(scalar(*tensors.beta2));
      bucket_hyper_.beta1_pointer = memory + 1;
      bucket_hyper_.beta2_pointer = memory + 2;
    }
    if (tensors.user != nullptr) {
      for (auto const& [index, t] : *tensors.user) {
        auto const k = static_cast<std::size_t>(index);
        b.scalar_views[4 + k].copy_(scalar(t));
        bucket_hyper_.user_pointers[k] = memory + 4 + k;
      }
    }
    if (mu_on_device) {
      if (!b.mu_on_device) {
        b.scalar_views[3].fill_(b.mu_product);  // from here the step advances it there
        b.mu_on_device = true;
      }
      bucket_hyper_.mu_product_pointer = memory + 3;
      bucket_hyper_.mu_product_single = mu_single_;
    }
    return bucket_hyper_;
  }

  /// torch's `mu_product *= mu` of step `t`, in torch's precision of the state (float or double).
  [[nodiscard]] double advance_mu_product(double product, hyper const& h, std::int64_t t) const
  {
    return nadam_advanced(product, nadam_mu(h.beta1, h.momentum_decay, t), mu_single_);
  }

  family family_;
  py::object provider_;               // (device, dtype, layout bits, float_states, amp) -> unit address
  bool amp_ = false;                  // takes GradScaler's fused protocol
  bool amp_seen_ = false;             // a scaled step ran: plans are made with GradScaler's kernel
  std::uint32_t float_states_ = 0;    // a user rule's states kept in float32 (bit k: state k)
  std::vector<group_data> groups_;
  hyper bucket_hyper_;
  bool mu_single_ = true;
  std::vector<hyper> hyper_;
  std::vector<change> changed_;
  // Step counts in the buckets' memory, since the first step with GradScaler's fused protocol
  // or capturable=True.
  bool counted_on_device_ = false;
  std::vector<at::Tensor> amp_tensors_;  // this step's copies of GradScaler's tensors
  std::int64_t rebuilds_ = 0;
  std::int64_t rebinds_ = 0;
  std::int64_t reuses_ = 0;
  phase_times times_;
  std::chrono::steady_clock::time_point launched_;  // when the step's last plan run returned
};

}  // namespace

void bind_engine(py::module_& m)
{
  py::class_<engine>(m, "Engine")
    .def(py::init<family, py::object, bool>(), py::arg("family"), py::arg("provider"), py::arg("amp"))
    .def("set_float_states", &engine::set_float_states, py::arg("mask"))
    .def("set_groups", &engine::set_groups, py::arg("groups"))
    .def("step", &engine::step, py::arg("hypers"), py::arg("grad_scale") = py::none(),
         py::arg("found_inf") = py::none(), py::arg("lrs") = std::vector<c10::optional<at::Tensor>>{},
         py::arg("on_device") = false,
         py::arg("betas") = std::vector<c10::optional<std::tuple<at::Tensor, at::Tensor>>>{},
         py::arg("user_tensors") = std::vector<std::vector<std::tuple<int, at::Tensor>>>{})
    // The same step with the GIL released while it runs (the plans run in C++ alone; a unit's
    // provider is called under the GIL it takes back): fusedopt_torch.CPUOffload's host steps on
    // its worker thread, while autograd's thread runs backward's Python hooks.
    .def("step_released", &engine::step, py::call_guard<py::gil_scoped_release>(), py::arg("hypers"),
         py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
         py::arg("lrs") = std::vector<c10::optional<at::Tensor>>{}, py::arg("on_device") = false,
         py::arg("betas") = std::vector<c10::optional<std::tuple<at::Tensor, at::Tensor>>>{},
         py::arg("user_tensors") = std::vector<std::vector<std::tuple<int, at::Tensor>>>{})
    .def("steps", &engine::steps)
    .def("set_mu_products", &engine::set_mu_products, py::arg("values"), py::arg("single"))
    .def("mu_products", &engine::mu_products)
    .def("rebuilds", &engine::rebuilds)
    .def("reuses", &engine::reuses)
    .def("rebinds", &engine::rebinds)
    .def("host_times", &engine::host_times)
    .def("plans", &engine::plans);
}

}  // namespace fusedopt_torch
