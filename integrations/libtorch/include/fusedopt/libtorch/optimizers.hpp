/// @file optimizers.hpp
/// @brief fusedopt's fused steps as libtorch optimizers: `fusedopt::libtorch::AdamW`, `Adam`,
/// `SGD`, `Adagrad` and `RMSprop` subclass `torch::optim::Optimizer` with torch's own options and
/// per-parameter state classes (`torch::optim::AdamWOptions`, `AdamWParamState`, ...), so param
/// groups, LR schedulers (`options().set_lr()`), `torch::save`/`torch::load` checkpoints and code
/// written for `torch::optim::AdamW` work unchanged, and a checkpoint of either loads into the
/// other. `Lion` and `LAMB` (no torch::optim class) bring their own options and states.
///
/// A step runs one fused pass per bucket (the parameters of a group with the same dtype and
/// step count): every element of p, grad and the states loaded once and stored once, where
/// torch::optim's C++ step launches 8-9 operations per tensor. CPU tensors step on fusedopt's
/// host backend; CUDA tensors on its CUDA backend, on torch's current stream of their device,
/// through the CUDA plans a project compiles in one `.cu` file (`make_cuda_steps()`,
/// fusedopt/libtorch/cuda_steps.cuh) and hands to the optimizer (`cuda_config`). Plans are
/// built at the first step of a bucket and kept; new gradient tensors (`zero_grad()` sets them
/// to none) are rebound, moved parameters or states rebind the plan (a new plan where their
/// geometry changed). A step whose groups are as at the step before but for new gradient
/// tensors takes a cached path that reads each tensor's TensorImpl and allocates nothing.
/// The library's extras beyond torch's options (maximize, fused clipping, bfloat16 parameters
/// with stochastic rounding or Kahan compensation, 8-bit states) come in a side structure,
/// `extras`, the constructors' last argument.
///
/// This header compiles with the C++ compiler alone (no nvcc, no CUDA toolkit): the one
/// torch-CUDA call it makes, c10::cuda::getCurrentCUDAStream, is compiled where
/// FUSEDOPT_LIBTORCH_CUDA_STREAMS is 1 (by default where <c10/cuda/CUDAStream.h> and
/// <cuda_runtime_api.h> are both on the include path: a CUDA build of torch).
#pragma once

#include <fusedopt/fusedopt.hpp>
#include <fusedopt/libtorch/plans.hpp>

#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <torch/arg.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/serialize.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>
#include <torch/utils.h>

#if !defined(FUSEDOPT_LIBTORCH_CUDA_STREAMS)
// A CPU-only torch may ship c10/cuda's headers without the library behind them: the CUDA
// runtime's header on the path too is the sign of a CUDA build (its CMake package puts it there).
#  if __has_include(<c10/cuda/CUDAStream.h>) && __has_include(<cuda_runtime_api.h>)
#    define FUSEDOPT_LIBTORCH_CUDA_STREAMS 1
#  else
#    define FUSEDOPT_LIBTORCH_CUDA_STREAMS 0
#  endif
#endif
#if FUSEDOPT_LIBTORCH_CUDA_STREAMS
#  include <c10/cuda/CUDAStream.h>
#endif

#if !defined(FUSEDOPT_LIBTORCH_HOST_EXTRAS)
// The host plans of the library's extras (extras: clipping, 8-bit states, Kahan, stochastic
// rounding) are compiled where an optimizer is used: minutes of compile time for Adam and AdamW
// each. 0: not compiled, and refused by the constructors (maximize stays).
#  define FUSEDOPT_LIBTORCH_HOST_EXTRAS 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace fusedopt {
namespace libtorch {

/// @brief How an optimizer steps CUDA parameters (the constructors' last argument).
struct cuda_config {
  /// fusedopt's CUDA plans: `make_cuda_steps()`, defined by one `.cu` file of the program that
  /// includes fusedopt/libtorch/cuda_steps.cuh. Null: a group of CUDA parameters is refused
  /// with an error that says this.
  std::shared_ptr<cuda_steps const> steps;
  /// Lets `step()` be captured in a CUDA graph (torch::cuda::CUDAGraph) and replayed, as
  /// torch's Python `capturable=True`: each bucket's step count lives in device memory and is
  /// advanced there by every run, and each group's lr is read from device memory, which
  /// `step()` refreshes from the options outside a capture and `upload_lr()` refreshes before
  /// replays (after an LR scheduler's step). The other options are fixed when captured.
  /// Replays do not advance the host `step()` of the states: `sync_steps()` copies the device
  /// counts back (save() does it). Without it, a step under capture is refused (its step count
  /// and lr would be frozen into the graph).
  bool capturable = false;
};

/// @brief The library's extras beyond torch's options (the constructors' last argument): a
/// side structure, so that the options and state classes stay torch's own (checkpoints and
/// schedulers interchangeable with torch::optim's). Fixed for the optimizer's life; the
/// states they make (8-bit moments, Kahan compensations) are saved and loaded with it.
struct extras {
  /// Ascend: the gradient is negated first (torch's Python `maximize`). Every optimizer but
  /// LAMB, CPU and CUDA.
  bool maximize = false;
  /// Above 0: the gradients of a step scaled to at most this global L2 norm before the update
  /// (torch::nn::utils::clip_grad_norm_ fused into the step, coefficient max / (norm + 1e-6)).
  /// The norm is that of one plan's gradients: the optimizer refuses a step with more than one
  /// bucket (one group, one dtype, every parameter at the same step count). Adam, AdamW, SGD,
  /// Lion; CPU tensors.
  double max_grad_norm = 0;
  /// bfloat16 parameters stored with stochastic rounding (rules::stochastic_round_param, the
  /// random bits from `seed`, the step, the tensor and the element). Adam, AdamW; CPU tensors;
  /// other dtypes are rounded as usual.
  bool stochastic_rounding = false;
  std::uint64_t seed = 0x5eed;
  /// bfloat16 and float16 parameters with a Kahan compensation state of their dtype
  /// (rules::with_kahan: what rounding the parameter dropped, added back at the next step).
  /// Adam, AdamW; CPU tensors; other dtypes step as usual. Not with stochastic_rounding.
  bool kahan = false;
  /// New states' exp_avg (signed) and exp_avg_sq (unsigned) as fusedopt's 8-bit blockwise
  /// states: 1-D uint8 tensors of quantized_state_bytes(numel) bytes in torch's state class
  /// (states loaded in float keep stepping in float, and 8-bit ones without this flag in 8
  /// bits). Adam, AdamW without amsgrad; float, half and bfloat16 parameters; CPU tensors.
  bool states_8bit = false;
};

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

/// Whether rule R has torch's `maximize`.
template <class R, class = void>
struct has_maximize : std::false_type {};
template <class R>
struct has_maximize<R, std::void_t<decltype(std::declval<R&>().maximize)>> : std::true_type {};

/// The plans' element type of `type`; refuses the others.
inline element_type element_type_of(c10::ScalarType type, char const* name)
{
  switch (type) {
    case c10::ScalarType::Float: return element_type::f32;
    case c10::ScalarType::Double: return element_type::f64;
    case c10::ScalarType::Half: return element_type::f16;
    case c10::ScalarType::BFloat16: return element_type::bf16;
    default: break;
  }
  TORCH_CHECK(false, name, ": parameters of dtype ", type, " are not supported (float, double, half, bfloat16)");
  return element_type::f32;
}

/// torch's current stream of CUDA device `device` (a cudaStream_t).
inline void* current_cuda_stream(c10::Device device, char const* name)
{
#if FUSEDOPT_LIBTORCH_CUDA_STREAMS
  static_cast<void>(name);
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
#else
  TORCH_CHECK(false, name, ": parameters on ", device, ", but fusedopt/libtorch/optimizers.hpp was compiled "
              "without torch's CUDA headers (c10/cuda/CUDAStream.h and cuda_runtime_api.h on the include path, "
              "or FUSEDOPT_LIBTORCH_CUDA_STREAMS=1)");
  return nullptr;
#endif
}

/// Where and how a group steps this time: its device (of the parameters with a gradient; none
/// when no parameter has one), for CUDA the stream and whether it is being captured.
struct group_device {
  bool any = false;
  c10::Device device{c10::kCPU};
  void* stream = nullptr;
  bool capturing = false;
};

/// One bucket of a group: its parameters (held, so that their memory is not reused while the
/// plan points at it), the tensors its plan is bound to, its plan, and with
/// cuda_config::capturable on CUDA its step count in device memory (int64, the count before
/// the step: the run advances it).
template <class Rule, class ParamState>
struct bucket {
  std::vector<torch::Tensor> params;
  std::vector<ParamState*> states;
  plan_tensors bound;
  plan_tensors scratch;  // the next step's tensors, gathered without allocating
  std::unique_ptr<plan<Rule>> steps;
  torch::Tensor counter;
  // The cached path (fused_optimizer::step_cached): the layout the plan binds, the members'
  // indices in their group's snapshot (the plan's order), and this step's gradient addresses
  // and step count, gathered while checking.
  std::int64_t layout = 0;
  std::vector<std::uint32_t> members;
  std::vector<void const*> next_grads;
  bool grads_changed = false;
  std::int64_t next_step = 0;
};

/// What a bucket's plan relies on for one tensor, read from its TensorImpl alone (its storage
/// is not dereferenced): the same TensorImpl on the same storage at the same offset, with the
/// same element count, dtype and contiguity. `set_data()`, `set_()` or a resize change it.
struct tensor_mark {
  c10::TensorImpl const* impl = nullptr;
  c10::StorageImpl const* storage = nullptr;
  std::int64_t offset = 0;
  std::int64_t numel = 0;
  caffe2::TypeMeta type;
  bool contiguous = false;

  friend bool operator==(tensor_mark const& a, tensor_mark const& b)
  {
    return a.impl == b.impl && a.storage == b.storage && a.offset == b.offset && a.numel == b.numel &&
           a.type == b.type && a.contiguous == b.contiguous;
  }
  friend bool operator!=(tensor_mark const& a, tensor_mark const& b) { return !(a == b); }
};

/// Asks the cache for the first `bytes` of the object at `address` (null: nothing), ahead of
/// its use: the cached step's checks walk thousands of TensorImpls, states and autograd
/// metadata scattered over the heap, each a cache miss when reached in turn.
inline void prefetch_object(void const* address, int bytes = 192) noexcept
{
#if defined(__GNUC__) || defined(__clang__)
  if (address == nullptr) { return; }
  for (int offset = 0; offset < bytes; offset += 64) { __builtin_prefetch(static_cast<char const*>(address) + offset); }
#else
  static_cast<void>(address);
  static_cast<void>(bytes);
#endif
}

/// The mark of a defined, strided tensor (a sparse one has no storage: check is_sparse first).
inline tensor_mark mark_of(torch::Tensor const& t)
{
  auto const* impl = t.unsafeGetTensorImpl();
  tensor_mark m;
  m.impl = impl;
  m.storage = impl->storage().unsafeGetStorageImpl();
  m.offset = impl->storage_offset();
  m.numel = impl->numel();
  m.type = impl->dtype();
  m.contiguous = impl->is_contiguous();
  return m;
}

}  // namespace detail

/// @brief What the optimizers share: torch::optim::Optimizer with a fused step.
/// `Derived` provides `name`, `state_tensors(p, options, state, out)` (appends the states, in
/// the order `family<Rule>` binds them, created as torch creates them), `layout(options, state)`
/// (which optional slots the plan binds) and `rule(options)`; the step count's hooks
/// `next_step(state)` (the 1-based step the rule takes), `advance(state)` (after the step) and
/// `set_step(state, count)` (sync_steps) default to the state's `step()`.
template <class Derived, class Options, class ParamState, class Rule>
class fused_optimizer : public torch::optim::Optimizer {
 public:
  fused_optimizer(std::vector<torch::optim::OptimizerParamGroup> const& groups, std::unique_ptr<Options> defaults,
                  cuda_config cuda, extras x)
      : torch::optim::Optimizer(groups, std::move(defaults)), cuda_(std::move(cuda)), extras_(x)
  {
    constexpr std::int64_t taken = family<Rule>::extras;
    TORCH_CHECK(!x.maximize || detail::has_maximize<Rule>::value, Derived::name, " takes no maximize");
    TORCH_CHECK(x.max_grad_norm >= 0, "Invalid max_grad_norm value: ", x.max_grad_norm);
    TORCH_CHECK(x.max_grad_norm == 0 || (taken & layout_extras::clip) != 0, Derived::name,
                " takes no max_grad_norm (fused clipping: Adam, AdamW, SGD, Lion)");
    TORCH_CHECK(!x.stochastic_rounding || (taken & layout_extras::stochastic_rounding) != 0, Derived::name,
                " takes no stochastic_rounding (Adam, AdamW)");
    TORCH_CHECK(!x.kahan || (taken & layout_extras::kahan) != 0, Derived::name, " takes no kahan (Adam, AdamW)");
    TORCH_CHECK(!x.states_8bit || (taken & layout_extras::quantized) != 0, Derived::name,
                " takes no states_8bit (Adam, AdamW)");
    TORCH_CHECK(host_extras || (x.max_grad_norm == 0 && !x.kahan && !x.stochastic_rounding && !x.states_8bit),
                Derived::name, ": compiled with FUSEDOPT_LIBTORCH_HOST_EXTRAS=0: no max_grad_norm, kahan, "
                "stochastic_rounding or states_8bit");
    TORCH_CHECK(!(x.kahan && x.stochastic_rounding), Derived::name,
                ": kahan and stochastic_rounding are two ways of rounding the parameters: choose one");
  }

  /// The library's extras this optimizer was made with.
  [[nodiscard]] extras const& extra_options() const noexcept { return extras_; }

  /// One fused step of every parameter with a gradient; returns the closure's loss (or an
  /// undefined tensor). Nothing is written when a parameter is refused (every group is checked
  /// first): sparse, mismatched or non-contiguous gradients, unsupported dtypes, a group whose
  /// parameters are on more than one device, CUDA parameters without cuda_config::steps, or a
  /// capture without cuda_config::capturable.
  torch::Tensor step(LossClosure closure = nullptr) override
  {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    buckets_.resize(param_groups_.size());
    lrs_.resize(param_groups_.size());
    snapshots_.resize(param_groups_.size());
    devices_.resize(param_groups_.size());
    if (!step_cached()) { step_collected(); }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override
  {
    // With capturable steps the device counts are the states' true step counts: the host
    // copies lag by the replays.
    if (cuda_.capturable) { const_cast<fused_optimizer&>(*this).sync_steps(); }
    torch::optim::serialize<ParamState, Options>(archive, *this);
    static_cast<Derived const&>(*this).save_extra_states(archive);
  }

  /// Loads a checkpoint of this optimizer or of torch's own (same keys); the plans are rebuilt.
  void load(torch::serialize::InputArchive& archive) override
  {
    torch::optim::serialize<ParamState, Options>(archive, *this);
    self().load_extra_states(archive);
    buckets_.clear();
    snapshots_.clear();
  }

  // The step-count hooks of the families whose state has torch's `step` (all but SGD's, which
  // hides them).
  static std::int64_t next_step(ParamState const& s) { return s.step() + 1; }
  static void advance(ParamState& s) { s.step(s.step() + 1); }
  static void set_step(ParamState& s, std::int64_t count) { s.step(count); }
  // The states of the extras kept beside torch's (none but Adam's and AdamW's Kahan
  // compensations), saved under keys of their own.
  void save_extra_states(torch::serialize::OutputArchive&) const {}
  void load_extra_states(torch::serialize::InputArchive&) {}
  // Whether a state holds 8-bit moments (layout_extras::quantized).
  static bool holds_8bit_states(ParamState const&) { return false; }

  /// The plan layout of parameter `p`: its family's optional slots and the extras it steps with.
  std::int64_t layout_of(torch::Tensor const& p, Options const& options, ParamState const& state)
  {
    std::int64_t layout = self().layout(options, state);
    if (extras_.max_grad_norm > 0) { layout |= layout_extras::clip; }
    auto const type = p.scalar_type();
    bool const sixteen_bit = type == c10::ScalarType::BFloat16 || type == c10::ScalarType::Half;
    if (extras_.kahan && sixteen_bit) { layout |= layout_extras::kahan; }
    if (extras_.stochastic_rounding && type == c10::ScalarType::BFloat16) { layout |= layout_extras::stochastic_rounding; }
    if (self().holds_8bit_states(state)) { layout |= layout_extras::quantized; }
    TORCH_CHECK((layout & layout_extras::all) == 0 || (layout & ~layout_extras::all & ~family<Rule>::layouts_with_extras) == 0,
                Derived::name, ": amsgrad takes none of the extras but maximize");
    return layout;
  }

  /// How many plans were built (one per bucket, again when its tensors changed geometry).
  [[nodiscard]] std::int64_t plan_builds() const noexcept { return builds_; }
  /// How many times a plan was pointed at moved parameters or states (not counting gradients).
  [[nodiscard]] std::int64_t plan_rebinds() const noexcept { return rebinds_; }
  /// How many steps took the cached path (every group as at the step before, but for new
  /// gradient tensors) rather than collecting every parameter's state again.
  [[nodiscard]] std::int64_t cached_steps() const noexcept { return cached_steps_; }

  /// With cuda_config::capturable: writes each CUDA group's lr (`options().get_lr()`) to the
  /// device memory a captured step reads, in stream order on torch's current stream. Call it
  /// after changing an lr (an LR scheduler's step) and before replaying a captured step; not
  /// during a capture. `step()` does it itself outside a capture.
  void upload_lr()
  {
    for (std::size_t g = 0; g < lrs_.size() && g < param_groups_.size(); ++g) {
      if (lrs_[g].defined()) { lrs_[g].fill_(param_groups_[g].options().get_lr()); }
    }
  }

  /// With cuda_config::capturable: sets the `step()` of every state stepped on CUDA to its
  /// bucket's device count (replays of a captured step advance only that). Synchronises with
  /// each such bucket's device.
  void sync_steps()
  {
    for (auto& group : buckets_) {
      for (auto& [key, b] : group) {
        if (!b.counter.defined()) { continue; }
        std::int64_t const count = b.counter.template item<std::int64_t>();
        for (auto* state : b.states) { self().set_step(*state, count); }
      }
    }
  }

 protected:
  cuda_config const& cuda() const noexcept { return cuda_; }

  /// Appends `group` with its own options (a copy of the defaults where it has none): for the
  /// options types torch does not know (Lion's, LAMB's), whose per-group options torch 2.10+'s
  /// add_param_group replaces with the defaults. torch's checks: leaf tensors, each in one group.
  void add_group_keeping_options(torch::optim::OptimizerParamGroup const& group)
  {
    std::unordered_set<c10::TensorImpl const*> known;
    for (auto const& other : param_groups_) {
      for (auto const& q : other.params()) { known.insert(q.unsafeGetTensorImpl()); }
    }
    for (auto const& p : group.params()) {
      TORCH_CHECK(p.is_leaf(), "can't optimize a non-leaf Tensor");
      TORCH_CHECK(known.insert(p.unsafeGetTensorImpl()).second,
                  "some parameters appear in more than one parameter group");
    }
    param_groups_.emplace_back(group.params(), group.has_options() ? group.options().clone() : defaults_->clone());
  }

 private:
  using state_map = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

  Derived& self() { return static_cast<Derived&>(*this); }
  static constexpr bool host_extras = FUSEDOPT_LIBTORCH_HOST_EXTRAS != 0;

  detail::group_device check_group(std::size_t g)
  {
    detail::group_device out;
    for (auto const& p : param_groups_[g].params()) {
      auto const& grad = p.grad();
      if (!grad.defined()) { continue; }
      TORCH_CHECK(!grad.is_sparse(), Derived::name, " does not support sparse gradients");
      TORCH_CHECK(p.device().is_cpu() || p.device().is_cuda(), Derived::name, ": parameters on ", p.device(),
                  " are not supported (CPU or CUDA)");
      if (!out.any) {
        out.any = true;
        out.device = p.device();
      }
      // One plan runs on one device: a group spread over several would need one per device.
      TORCH_CHECK(p.device() == out.device, Derived::name, ": the parameters of a param group must be on one device; "
                  "group ", g, " has parameters on ", out.device, " and on ", p.device(),
                  " (make a group per device)");
      TORCH_CHECK(grad.device() == p.device() && grad.scalar_type() == p.scalar_type() && grad.sizes() == p.sizes(),
                  Derived::name, ": a gradient of ", grad.sizes(), " ", grad.scalar_type(), " on ", grad.device(),
                  " for a parameter of ", p.sizes(), " ", p.scalar_type(), " on ", p.device());
      TORCH_CHECK(p.is_contiguous() && grad.is_contiguous(), Derived::name,
                  ": parameters and gradients must be contiguous");
      static_cast<void>(detail::element_type_of(p.scalar_type(), Derived::name));
    }
    if (out.any && out.device.is_cuda()) {
      TORCH_CHECK(extras_.max_grad_norm == 0 && !extras_.kahan && !extras_.stochastic_rounding && !extras_.states_8bit,
                  Derived::name, ": the extras max_grad_norm, kahan, stochastic_rounding and states_8bit step CPU "
                  "tensors only (their CUDA plans are not compiled yet); group ", g, " is on ", out.device);
      where_on_cuda(g, out);
    }
    return out;
  }

  /// A CUDA group's stream and capture state this step, with their checks.
  void where_on_cuda(std::size_t g, detail::group_device& out)
  {
    {
      TORCH_CHECK(cuda_.steps != nullptr, Derived::name, ": parameters on ", out.device,
                  " need fusedopt's CUDA plans: include <fusedopt/libtorch/cuda_steps.cuh> in one .cu file of "
                  "the program and pass fusedopt::libtorch::cuda_config{fusedopt::libtorch::make_cuda_steps()} "
                  "to the optimizer's constructor (docs/libtorch.md)");
      out.stream = detail::current_cuda_stream(out.device, Derived::name);
      out.capturing = cuda_.steps->capturing(out.device.index(), out.stream);
      TORCH_CHECK(!out.capturing || cuda_.capturable, Derived::name,
                  ": step() is being captured in a CUDA graph, but its step count and lr would be frozen "
                  "into the graph: construct the optimizer with cuda_config::capturable");
      TORCH_CHECK(!out.capturing || lrs_[g].defined(), Derived::name,
                  ": a captured step() needs a step outside the capture first (its plans and device "
                  "memory are made there)");
    }
  }

  // Buckets: the parameters with a gradient of one dtype and layout (the rule's optional
  // slots), split by step count (a parameter that had no gradient at some step lags); plans are
  // kept by (device, dtype, layout, rank of the step count), so the usual bucket keeps its
  // plan while its step count advances.
  using bucket_key = std::tuple<int, int, std::int64_t, std::size_t>;

  /// A bucket's parameters, their torch states and their state tensors (in slot order, per
  /// parameter), as collected before any step: pointers into the group and the states, which
  /// stay put during the step (no reference count taken per tensor).
  struct members {
    std::vector<torch::Tensor const*> params;
    std::vector<ParamState*> states;
    std::vector<torch::Tensor const*> state_tensors;
  };
  /// A group's buckets by (dtype, layout, step).
  using group_members = std::map<std::tuple<int, std::int64_t, std::int64_t>, members>;

  /// Calls `f(id, key, members)` for each of a group's buckets in order, `id` the key its plan
  /// is kept under (the rank counts the buckets of one dtype and layout: their step counts
  /// differ); stops where `f` returns false.
  template <class F>
  static void for_each_bucket(group_members const& buckets, int device, F&& f)
  {
    std::tuple<int, std::int64_t> previous{-1, -1};
    std::size_t rank = 0;
    for (auto const& [key, m] : buckets) {
      std::tuple<int, std::int64_t> const kind{std::get<0>(key), std::get<1>(key)};
      rank = kind == previous ? rank + 1 : 0;
      previous = kind;
      if (!f(bucket_key{device, std::get<0>(key), std::get<1>(key), rank}, key, m)) { return; }
    }
  }

  group_members collect_group(torch::optim::OptimizerParamGroup& group)
  {
    auto const& options = static_cast<Options const&>(group.options());
    group_members out;
    for (auto const& p : group.params()) {
      if (!p.grad().defined()) { continue; }
      auto& slot = state_[detail::state_key<state_map>(p)];
      if (!slot) { slot = std::make_unique<ParamState>(); }
      auto& state = static_cast<ParamState&>(*slot);
      state_scratch_.clear();
      self().state_tensors(p, options, state, state_scratch_);  // created as torch creates them
      for (auto const* t : state_scratch_) {
        if (t->scalar_type() == c10::ScalarType::Byte) {
          TORCH_CHECK(t->is_contiguous() && t->dim() == 1 && t->numel() == quantized_state_bytes(p.numel()) &&
                        t->device() == p.device(),
                      Derived::name, ": an 8-bit state tensor must be a contiguous 1-D uint8 tensor of "
                      "quantized_state_bytes(numel) bytes on its parameter's device");
          continue;
        }
        TORCH_CHECK(t->is_contiguous() && t->scalar_type() == p.scalar_type() && t->sizes() == p.sizes() &&
                      t->device() == p.device(),
                    Derived::name, ": a state tensor must be contiguous, of its parameter's dtype, shape and device");
      }
      // The key after the states exist: SGD's step depends on whether its buffer is new.
      auto& m = out[{static_cast<int>(p.scalar_type()), layout_of(p, options, state), self().next_step(state)}];
      m.state_tensors.insert(m.state_tensors.end(), state_scratch_.begin(), state_scratch_.end());
      m.params.push_back(&p);
      m.states.push_back(&state);
    }
    return out;
  }

  /// The step of every parameter collected again: each group checked, its states looked up
  /// (created where missing) and checked, its buckets formed, then stepped; the snapshots of
  /// the cached path taken.
  void step_collected()
  {
    // Every group is checked and bucketed (its states created) before any is stepped: a refused
    // parameter or state leaves every tensor as it was.
    for (auto& snapshot : snapshots_) { snapshot.valid = false; }
    for (std::size_t g = 0; g < param_groups_.size(); ++g) { devices_[g] = check_group(g); }
    std::vector<group_members> members;
    for (auto& group : param_groups_) { members.push_back(collect_group(group)); }
    if (extras_.max_grad_norm > 0) {
      std::size_t buckets = 0;
      for (auto const& group : members) { buckets += group.size(); }
      TORCH_CHECK(buckets <= 1, Derived::name, ": max_grad_norm clips the global norm of one fused pass, but this step "
                  "has ", buckets, " (param groups, dtypes, or parameters at different step counts): clip with "
                  "torch::nn::utils::clip_grad_norm_ instead");
    }
    for (std::size_t g = 0; g < param_groups_.size(); ++g) {
      if (devices_[g].any) { step_group(g, members[g], devices_[g]); }
      take_snapshot(g, members[g]);
    }
  }

  /// The lr a capturable step reads: refreshed here outside a capture (a captured fill would
  /// put back the capture's lr at every replay), by upload_lr() before replays.
  void refresh_device_lr(std::size_t g, Options const& options, detail::group_device const& where)
  {
    if (!where.device.is_cuda() || !cuda_.capturable) { return; }
    if (!lrs_[g].defined() || lrs_[g].device() != where.device) {
      lrs_[g] = torch::full({1}, options.lr(), torch::dtype(torch::kDouble).device(where.device));
    } else if (!where.capturing) {
      lrs_[g].fill_(options.lr());
    }
  }

  void step_group(std::size_t g, group_members const& buckets, detail::group_device const& where)
  {
    auto const& options = static_cast<Options const&>(param_groups_[g].options());
    bool const on_cuda = where.device.is_cuda();
    c10::OptionalDeviceGuard guard;
    if (on_cuda) { guard.reset_device(where.device); }
    refresh_device_lr(g, options, where);
    int const device = on_cuda ? where.device.index() : -1;
    auto& kept = buckets_[g];
    std::map<bucket_key, detail::bucket<Rule, ParamState>> next;
    for_each_bucket(buckets, device, [&](bucket_key const& id, auto const& key, members const& m) {
      auto found = kept.find(id);
      detail::bucket<Rule, ParamState> b =
        found != kept.end() ? std::move(found->second) : detail::bucket<Rule, ParamState>{};
      run_bucket(g, b, m, options, std::get<1>(key), std::get<2>(key), where);
      b.layout = std::get<1>(key);
      next.emplace(id, std::move(b));
      return true;
    });
    kept = std::move(next);
  }

  /// Runs bucket `b`'s plan: the rule from the options (the lr and the step count from device
  /// memory with a counter: cuda_config::capturable).
  void run_plan(std::size_t g, detail::bucket<Rule, ParamState>& b, Options const& options, std::int64_t step,
                void* stream)
  {
    Rule rule = self().rule(options);
    if constexpr (detail::has_maximize<Rule>::value) { rule.maximize = extras_.maximize; }
    step_extras const x{extras_.max_grad_norm, extras_.seed};
    ::fusedopt::step_info info{step};
    if (b.counter.defined()) {
      rule.lr = ::fusedopt::scalar<double>::from_pointer(lrs_[g].template data_ptr<double>());
      auto* const count = b.counter.template data_ptr<std::int64_t>();
      info.step = ::fusedopt::scalar<std::int64_t>::from_pointer(count);
      info.advance = count;
    }
    b.steps->run(rule, x, info, stream);
  }

  void run_bucket(std::size_t g, detail::bucket<Rule, ParamState>& b, members const& m, Options const& options,
                  std::int64_t layout, std::int64_t step, detail::group_device const& where)
  {
    // The bucket's tensors as the plan sees them, gathered into the bucket's scratch lists
    // (their storage reused from step to step) and compared with those the plan is bound to.
    std::size_t const n = m.params.size();
    std::size_t const per = m.state_tensors.size() / n;
    plan_tensors& x = b.scratch;
    x.sizes.clear();
    x.params.clear();
    x.grads.clear();
    x.states.resize(per);
    for (auto& s : x.states) { s.clear(); }
    for (std::size_t t = 0; t < n; ++t) {
      auto const& p = *m.params[t];
      x.sizes.push_back(p.numel());
      x.params.push_back(p.data_ptr());
      x.grads.push_back(p.grad().data_ptr());
      for (std::size_t k = 0; k < per; ++k) { x.states[k].push_back(m.state_tensors[t * per + k]->data_ptr()); }
    }
    bool const on_cuda = where.device.is_cuda();
    void* const stream = where.stream;
    bool moved = b.steps == nullptr || x.sizes != b.bound.sizes || x.params != b.bound.params ||
                 x.states != b.bound.states;
    if (!moved && x.grads != b.bound.grads) {
      // Only the gradients moved (the usual step): the plan checks the new addresses alone. One
      // it declines (another alignment class) leaves it unchanged: then the whole lists.
      try {
        b.steps->rebind_grads(x.grads.data(), x.grads.size(), stream);
        std::swap(b.bound.grads, x.grads);
      } catch (::fusedopt::error const&) {
        moved = true;
      }
    }
    if (moved) {
      // Moved parameters or states keep their plan where the geometry allows; else a new plan.
      bool rebound = false;
      if (b.steps != nullptr && x.sizes == b.bound.sizes) {
        rebound = b.steps->rebind(x, stream);
        rebinds_ += rebound ? 1 : 0;
      }
      if (!rebound) {
        TORCH_CHECK(!where.capturing, Derived::name, ": a captured step() cannot build a plan (that allocates and "
                    "synchronises); step once outside the capture with the same tensors first");
        plan_request request;
        request.type = detail::element_type_of(m.params.front()->scalar_type(), Derived::name);
        request.layout = layout;
        request.tensors = &x;
        if (on_cuda) {
          request.device = where.device.index();
          request.stream = stream;
          b.steps = cuda_.steps->make_plan(Rule{}, request);
        } else {
          b.steps = make_plan<Rule, host_extras>([] { return host_backend{at::get_num_threads()}; }, request);
        }
        ++builds_;
        if (on_cuda && cuda_.capturable && !b.counter.defined()) {
          b.counter = torch::full({1}, step - 1, torch::dtype(torch::kLong).device(where.device));
        }
      }
      b.params.clear();
      for (auto const* p : m.params) { b.params.push_back(*p); }
      std::swap(b.bound, x);
    }
    b.states = m.states;
    run_plan(g, b, options, step, stream);
    for (auto* state : m.states) { self().advance(*state); }
    for (auto const* p : m.params) { p->unsafeGetTensorImpl()->bump_version(); }  // written through data_ptr
    for (auto const* t : m.state_tensors) { t->unsafeGetTensorImpl()->bump_version(); }
  }

  // ---- The cached path ---------------------------------------------------------------------
  // After a collected step, each group keeps a snapshot: per parameter (in the group's order)
  // the marks of the parameter, its gradient and its state tensors, its state object, its
  // state key, and its bucket. The next step first checks each group against its snapshot,
  // reading each tensor's TensorImpl (no string keys formatted, no maps built, no tensors or
  // reference counts made, no allocation): where only gradient tensors are new (zero_grad()
  // sets them to none), it checks those as the collected step would, rebinds their plans and
  // steps. Anything else (a parameter added, moved or gaining or losing a gradient, a state
  // replaced, moved or missing, a changed layout, a refused gradient, a load()) sends the step
  // to the collected path, which checks everything again and raises its errors.

  /// One parameter of a group's snapshot.
  struct cached_param {
    detail::tensor_mark param;
    detail::tensor_mark grad;  // impl null: no gradient at the snapshot
    ParamState* state = nullptr;
    typename state_map::key_type key{};
    detail::bucket<Rule, ParamState>* bucket = nullptr;
    std::uint32_t position = 0;  // in the bucket's plan
  };
  struct group_snapshot {
    bool valid = false;
    std::vector<cached_param> params;
    std::size_t states_per_param = 0;
    std::vector<detail::tensor_mark> states;  // params[i]'s at [i * states_per_param, ...)
    // The state tensors marked, held: their TensorImpls stay valid for the prefetches ahead of
    // the checks even where a state was replaced since (the checks then fail).
    std::vector<torch::Tensor> held_states;
    std::vector<detail::bucket<Rule, ParamState>*> buckets;
    c10::Device device{c10::kCPU};
    bool any = false;
  };

  void take_snapshot(std::size_t g, group_members const& buckets)
  {
    auto& snapshot = snapshots_[g];
    auto const& params = param_groups_[g].params();
    snapshot.valid = false;
    snapshot.params.assign(params.size(), cached_param{});
    snapshot.buckets.clear();
    snapshot.states.clear();
    snapshot.held_states.clear();
    snapshot.states_per_param = 0;
    snapshot.any = devices_[g].any;
    snapshot.device = devices_[g].device;
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].defined() && !params[i].is_sparse()) { snapshot.params[i].param = detail::mark_of(params[i]); }
    }
    if (!snapshot.any) {
      snapshot.valid = true;  // no gradient anywhere: a gradient later sends the step to the collected path
      return;
    }
    for (auto const& [key, m] : buckets) {
      snapshot.states_per_param = m.state_tensors.size() / m.params.size();
      break;
    }
    snapshot.states.resize(params.size() * snapshot.states_per_param);
    int const device = snapshot.device.is_cuda() ? snapshot.device.index() : -1;
    bool complete = true;
    for_each_bucket(buckets, device, [&](bucket_key const& id, auto const&, members const& m) {
      auto found = buckets_[g].find(id);  // the bucket step_group kept for these members
      if (found == buckets_[g].end() || m.state_tensors.size() != m.params.size() * snapshot.states_per_param) {
        complete = false;
        return false;
      }
      auto& b = found->second;
      b.members.clear();
      b.next_grads.assign(b.bound.grads.begin(), b.bound.grads.end());
      for (std::size_t t = 0; t < m.params.size(); ++t) {
        auto const index = static_cast<std::size_t>(m.params[t] - params.data());
        auto& c = snapshot.params[index];
        c.grad = detail::mark_of(m.params[t]->grad());
        c.state = m.states[t];
        c.key = detail::state_key<state_map>(*m.params[t]);
        c.bucket = &b;
        c.position = static_cast<std::uint32_t>(t);
        for (std::size_t k = 0; k < snapshot.states_per_param; ++k) {
          auto const& state_tensor = *m.state_tensors[t * snapshot.states_per_param + k];
          snapshot.states[index * snapshot.states_per_param + k] = detail::mark_of(state_tensor);
          snapshot.held_states.push_back(state_tensor);
        }
        b.members.push_back(static_cast<std::uint32_t>(index));
      }
      snapshot.buckets.push_back(&b);
      return true;
    });
    snapshot.valid = complete;
  }

  /// Whether gradient `grad` of parameter `param` (marked `param_mark`) is one the collected
  /// path takes without an error (its checks, from the TensorImpls).
  static bool acceptable_grad(torch::Tensor const& param, torch::Tensor const& grad)
  {
    return !grad.is_sparse() && grad.device() == param.device() && grad.scalar_type() == param.scalar_type() &&
           grad.sizes() == param.sizes() && grad.is_contiguous();
  }

  /// Checks group `g` against its snapshot, gathering new gradient addresses and step counts
  /// into its buckets and rebinding their plans' gradients; false: collect the step again.
  /// Writes no tensor.
  bool check_cached(std::size_t g)
  {
    auto& snapshot = snapshots_[g];
    auto const& group = param_groups_[g];
    auto const& params = group.params();
    if (!snapshot.valid || params.size() != snapshot.params.size()) { return false; }
    auto const& options = static_cast<Options const&>(group.options());
    for (auto* b : snapshot.buckets) {
      b->grads_changed = false;
      b->next_step = -1;
    }
    std::size_t const per = snapshot.states_per_param;
    // Prefetched ahead: the TensorImpls and state objects `ahead` parameters on, then (once
    // those are in) the autograd metadata that holds their gradients and the version counters
    // the step bumps, `ahead / 2` on. Dereferenced there: only TensorImpls the snapshot holds
    // (parameters with a gradient, through their bucket, and the held states).
    constexpr std::size_t ahead = 8;
    auto const prefetch_tensors = [&](std::size_t i) {
      auto const& c = snapshot.params[i];
      detail::prefetch_object(c.param.impl);
      detail::prefetch_object(c.grad.impl);
      detail::prefetch_object(c.state, 128);
      for (std::size_t k = 0; k < per; ++k) { detail::prefetch_object(snapshot.states[i * per + k].impl); }
    };
    auto const prefetch_indirect = [&](std::size_t i) {
      auto const& c = snapshot.params[i];
      if (c.grad.impl == nullptr) { return; }
      detail::prefetch_object(c.param.impl->autograd_meta(), 128);
      std::uint32_t versions = c.param.impl->version_counter().current_version();
      for (std::size_t k = 0; k < per; ++k) {
        versions += snapshot.states[i * per + k].impl->version_counter().current_version();
      }
      version_sink_ = versions;  // loaded for the cache: the bumps after the checks hit it
    };
    for (std::size_t i = 0; i < std::min(ahead, params.size()); ++i) { prefetch_tensors(i); }
    for (std::size_t i = 0; i < std::min(ahead / 2, params.size()); ++i) { prefetch_indirect(i); }
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (i + ahead < params.size()) { prefetch_tensors(i + ahead); }
      if (i + ahead / 2 < params.size()) { prefetch_indirect(i + ahead / 2); }
      auto const& p = params[i];
      auto& c = snapshot.params[i];
      if (!p.defined() || p.unsafeGetTensorImpl() != c.param.impl) { return false; }
      auto const& grad = c.param.impl->grad();  // as p.grad(), without its check for non-leaf tensors
      if (!grad.defined()) {
        if (c.grad.impl != nullptr) { return false; }
        continue;
      }
      if (c.grad.impl == nullptr || grad.is_sparse() || detail::mark_of(p) != c.param) { return false; }
      auto& b = *c.bucket;
      auto const grad_mark = detail::mark_of(grad);
      if (grad_mark != c.grad) {
        // A new gradient tensor (a changed one is collected again): the collected path's checks.
        if (grad_mark.impl == c.grad.impl || !acceptable_grad(p, grad)) { return false; }
        b.next_grads[c.position] = grad.data_ptr();
        b.grads_changed = true;
        c.grad = grad_mark;  // the plan's once rebound below (a failed check retakes the snapshot)
      }
      auto const found = state_.find(c.key);
      if (found == state_.end() || found->second.get() != c.state) { return false; }
      auto& state = *c.state;
      if (layout_of(p, options, state) != b.layout) { return false; }
      std::int64_t const next = self().next_step(state);
      if (b.next_step == -1) {
        b.next_step = next;
      } else if (b.next_step != next) {
        return false;
      }
      state_scratch_.clear();
      self().state_tensors(p, options, state, state_scratch_);
      if (state_scratch_.size() != per) { return false; }
      for (std::size_t k = 0; k < per; ++k) {
        if (detail::mark_of(*state_scratch_[k]) != snapshot.states[i * per + k]) { return false; }
      }
    }
    if (snapshot.any && snapshot.device.is_cuda()) {
      devices_[g] = detail::group_device{};
      devices_[g].any = true;
      devices_[g].device = snapshot.device;
      where_on_cuda(g, devices_[g]);
    } else {
      devices_[g].any = snapshot.any;
      devices_[g].device = snapshot.device;
      devices_[g].stream = nullptr;
      devices_[g].capturing = false;
    }
    // The new gradients' addresses to the plans: what they decline, the collected path rebinds.
    for (auto* b : snapshot.buckets) {
      if (!b->grads_changed) { continue; }
      c10::OptionalDeviceGuard guard;
      if (snapshot.device.is_cuda()) { guard.reset_device(snapshot.device); }
      try {
        b->steps->rebind_grads(b->next_grads.data(), b->next_grads.size(), devices_[g].stream);
      } catch (::fusedopt::error const&) {
        return false;
      }
      b->bound.grads.assign(b->next_grads.begin(), b->next_grads.end());
    }
    return true;
  }

  /// Steps every group through its snapshot's buckets, if every group passes check_cached.
  bool step_cached()
  {
    for (std::size_t g = 0; g < param_groups_.size(); ++g) {
      if (!check_cached(g)) { return false; }
    }
    for (std::size_t g = 0; g < param_groups_.size(); ++g) {
      auto const& snapshot = snapshots_[g];
      if (!snapshot.any) { continue; }
      auto const& where = devices_[g];
      auto const& options = static_cast<Options const&>(param_groups_[g].options());
      c10::OptionalDeviceGuard guard;
      if (where.device.is_cuda()) { guard.reset_device(where.device); }
      refresh_device_lr(g, options, where);
      for (auto* b : snapshot.buckets) {
        run_plan(g, *b, options, b->next_step, where.stream);
        std::size_t const per = snapshot.states_per_param;
        for (auto const index : b->members) {
          auto const& c = snapshot.params[index];
          self().advance(*c.state);
          const_cast<c10::TensorImpl*>(c.param.impl)->bump_version();  // written through data_ptr
          for (std::size_t k = 0; k < per; ++k) {
            const_cast<c10::TensorImpl*>(snapshot.states[index * per + k].impl)->bump_version();
          }
        }
      }
    }
    ++cached_steps_;
    return true;
  }

  cuda_config cuda_;
  extras extras_;
  std::vector<std::map<bucket_key, detail::bucket<Rule, ParamState>>> buckets_;
  std::vector<torch::Tensor const*> state_scratch_;  // one parameter's state tensors, in collect_group
  std::vector<torch::Tensor> lrs_;  // per group, with cuda_config::capturable on CUDA: its lr (double) on the device
  std::vector<group_snapshot> snapshots_;  // per group: the cached path's
  std::vector<detail::group_device> devices_;  // per group: where it steps this time
  std::int64_t builds_ = 0;
  std::int64_t rebinds_ = 0;
  std::int64_t cached_steps_ = 0;
  std::uint32_t version_sink_ = 0;  // check_cached's loads of version counters, kept from the optimiser
};

/// @brief What Adam and AdamW share: the states (exp_avg, exp_avg_sq, and max_exp_avg_sq with
/// amsgrad, created as torch creates them), the rule's options and the step count.
template <class Derived, class Options, class ParamState, class Rule>
class adam_family : public fused_optimizer<Derived, Options, ParamState, Rule> {
 public:
  /// @param cuda fusedopt's CUDA plans for CUDA parameters (cuda_config); none: CPU only.
  /// @param x the library's extras (extras): maximize, clipping, and for Adam/AdamW bfloat16
  /// parameters' rounding and 8-bit states.
  explicit adam_family(std::vector<torch::optim::OptimizerParamGroup> const& groups, Options const& defaults = {},
                       cuda_config cuda = {}, extras x = {})
      : fused_optimizer<Derived, Options, ParamState, Rule>(groups, std::make_unique<Options>(defaults), std::move(cuda),
                                                            x)
  {
    // torch::optim::Adam's and AdamW's constructors' checks.
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.eps() >= 0, "Invalid epsilon value: ", defaults.eps());
    auto const [b1, b2] = defaults.betas();
    TORCH_CHECK(0 <= b1 && b1 < 1, "Invalid beta parameter at index 0: ", b1);
    TORCH_CHECK(0 <= b2 && b2 < 1, "Invalid beta parameter at index 1: ", b2);
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
  }
  explicit adam_family(std::vector<torch::Tensor> params, Options const& defaults = {}, cuda_config cuda = {}, extras x = {})
      : adam_family({torch::optim::OptimizerParamGroup(std::move(params))}, defaults, std::move(cuda), x)
  {
  }

  // The hooks fused_optimizer calls. The states as torch creates them, exp_avg and exp_avg_sq
  // in 8 bits with extras::states_8bit, and with extras::kahan a compensation for 16-bit
  // parameters (kept beside torch's state: its class has no such field).
  void state_tensors(torch::Tensor const& p, Options const& o, ParamState& s, std::vector<torch::Tensor const*>& out)
  {
    auto const& x = this->extra_options();
    if (!s.exp_avg().defined()) {
      s.step(0);
      if (x.states_8bit) {
        TORCH_CHECK(p.scalar_type() != c10::ScalarType::Double, Derived::name,
                    ": 8-bit states are for float, half and bfloat16 parameters (fusedopt computes them in float)");
        auto const bytes = torch::TensorOptions().dtype(torch::kByte).device(p.device());
        s.exp_avg(torch::zeros({quantized_state_bytes(p.numel())}, bytes));  // all zero: every value 0
        s.exp_avg_sq(torch::zeros({quantized_state_bytes(p.numel())}, bytes));
      } else {
        s.exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        s.exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      }
    }
    bool const quantized = holds_8bit_states(s);
    TORCH_CHECK(quantized == (s.exp_avg_sq().scalar_type() == c10::ScalarType::Byte), Derived::name,
                ": exp_avg and exp_avg_sq are both 8-bit states or neither");
    TORCH_CHECK(!quantized || !o.amsgrad(), Derived::name, ": 8-bit states have no amsgrad variant");
    if (o.amsgrad() && !s.max_exp_avg_sq().defined()) {
      s.max_exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
    out.push_back(&s.exp_avg());
    out.push_back(&s.exp_avg_sq());
    if (o.amsgrad()) { out.push_back(&s.max_exp_avg_sq()); }
    auto const type = p.scalar_type();
    if (x.kahan && (type == c10::ScalarType::BFloat16 || type == c10::ScalarType::Half)) {
      auto& compensation = compensations_[p.unsafeGetTensorImpl()];
      if (!compensation.defined()) { compensation = torch::zeros_like(p, torch::MemoryFormat::Contiguous); }
      out.push_back(&compensation);
    }
  }
  static bool holds_8bit_states(ParamState const& s)
  {
    return s.exp_avg().defined() && s.exp_avg().scalar_type() == c10::ScalarType::Byte;
  }

  /// The Kahan compensation of parameter `p` (extras::kahan, 16-bit parameters after their
  /// first step), or an undefined tensor.
  [[nodiscard]] torch::Tensor kahan_compensation(torch::Tensor const& p) const
  {
    auto const found = compensations_.find(p.unsafeGetTensorImpl());
    return found == compensations_.end() ? torch::Tensor() : found->second;
  }

  /// The compensations under "fusedopt_kahan_compensation_<k>", k the parameter's position in
  /// the param groups (as torch's state keys count them).
  void save_extra_states(torch::serialize::OutputArchive& archive) const
  {
    std::size_t k = 0;
    for (auto const& group : this->param_groups()) {
      for (auto const& p : group.params()) {
        auto const found = compensations_.find(p.unsafeGetTensorImpl());
        if (found != compensations_.end()) {
          archive.write(compensation_key(k), found->second, /*is_buffer=*/true);
        }
        ++k;
      }
    }
  }
  void load_extra_states(torch::serialize::InputArchive& archive)
  {
    compensations_.clear();
    std::size_t k = 0;
    for (auto const& group : this->param_groups()) {
      for (auto const& p : group.params()) {
        torch::Tensor compensation;
        if (archive.try_read(compensation_key(k), compensation, /*is_buffer=*/true)) {
          TORCH_CHECK(compensation.sizes() == p.sizes() && compensation.scalar_type() == p.scalar_type(), Derived::name,
                      ": the checkpoint's Kahan compensation ", k, " does not match its parameter");
          compensations_[p.unsafeGetTensorImpl()] = compensation.to(p.device()).contiguous();
        }
        ++k;
      }
    }
  }

  static std::int64_t layout(Options const& o, ParamState const&) { return o.amsgrad() ? 1 : 0; }
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

 private:
  static std::string compensation_key(std::size_t k) { return "fusedopt_kahan_compensation_" + std::to_string(k); }

  std::unordered_map<c10::TensorImpl const*, torch::Tensor> compensations_;  // extras::kahan, by parameter
};

/// @brief torch::optim::AdamW, fused (torch::optim::AdamWOptions, AdamWParamState): decoupled
/// weight decay.
class AdamW : public adam_family<AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState,
                                 ::fusedopt::rules::adamw> {
 public:
  static constexpr char const* name = "AdamW";
  using adam_family::adam_family;  // (groups or tensors, torch::optim::AdamWOptions, cuda_config)
};

/// @brief torch::optim::Adam, fused (torch::optim::AdamOptions, AdamParamState): L2 weight decay
/// added to the gradient, as torch's C++ Adam.
class Adam : public adam_family<Adam, torch::optim::AdamOptions, torch::optim::AdamParamState,
                                ::fusedopt::rules::adam> {
 public:
  static constexpr char const* name = "Adam";
  using adam_family::adam_family;  // (groups or tensors, torch::optim::AdamOptions, cuda_config)
};

/// @brief torch::optim::SGD, fused (torch::optim::SGDOptions, SGDParamState: the momentum buffer,
/// created from the first step's gradient as torch does).
class SGD : public fused_optimizer<SGD, torch::optim::SGDOptions, torch::optim::SGDParamState,
                                   ::fusedopt::rules::sgd> {
 public:
  static constexpr char const* name = "SGD";

  /// @param cuda fusedopt's CUDA plans for CUDA parameters (cuda_config); none: CPU only.
  /// @param x the library's extras (extras): maximize, clipping, and for Adam/AdamW bfloat16
  /// parameters' rounding and 8-bit states.
  explicit SGD(std::vector<torch::optim::OptimizerParamGroup> const& groups, torch::optim::SGDOptions defaults,
               cuda_config cuda = {}, extras x = {})
      : fused_optimizer(groups, std::make_unique<torch::optim::SGDOptions>(defaults), std::move(cuda), x)
  {
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.momentum() >= 0, "Invalid momentum value: ", defaults.momentum());
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
    TORCH_CHECK(!defaults.nesterov() || (defaults.momentum() > 0 && defaults.dampening() == 0),
                "Nesterov momentum requires a momentum and zero dampening");
  }
  explicit SGD(std::vector<torch::Tensor> params, torch::optim::SGDOptions defaults, cuda_config cuda = {}, extras x = {})
      : SGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults), std::move(cuda), x)
  {
  }

  // SGD keeps no step count (torch's SGDParamState has none): a buffer created at this step
  // takes the gradient (step 1 for the rule), an existing one is updated (step 2). Buffers
  // created and not yet stepped are remembered here (a loaded buffer is an existing one).
  void state_tensors(torch::Tensor const& p, torch::optim::SGDOptions const& o, torch::optim::SGDParamState& s,
                     std::vector<torch::Tensor const*>& out)
  {
    if (o.momentum() == 0) { return; }
    if (!s.momentum_buffer().defined()) {
      s.momentum_buffer(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      fresh_.push_back(s.momentum_buffer().unsafeGetTensorImpl());
    }
    out.push_back(&s.momentum_buffer());
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
  void set_step(torch::optim::SGDParamState& s, std::int64_t count)
  {
    if (count >= 1) { advance(s); }
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

/// @brief torch::optim::Adagrad, fused (torch::optim::AdagradOptions, AdagradParamState: `sum`,
/// created for every parameter at construction and filled with `initial_accumulator_value`, as
/// torch does). Dense gradients only (torch's also takes sparse ones).
class Adagrad : public fused_optimizer<Adagrad, torch::optim::AdagradOptions, torch::optim::AdagradParamState,
                                       ::fusedopt::rules::adagrad> {
 public:
  static constexpr char const* name = "Adagrad";

  /// @param cuda fusedopt's CUDA plans for CUDA parameters (cuda_config); none: CPU only.
  /// @param x the library's extras (extras): maximize, clipping, and for Adam/AdamW bfloat16
  /// parameters' rounding and 8-bit states.
  explicit Adagrad(std::vector<torch::optim::OptimizerParamGroup> const& groups,
                   torch::optim::AdagradOptions const& defaults = {}, cuda_config cuda = {}, extras x = {})
      : fused_optimizer(groups, std::make_unique<torch::optim::AdagradOptions>(defaults), std::move(cuda), x)
  {
    // torch::optim::Adagrad's constructor's checks, and its states.
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.lr_decay() >= 0, "Invalid lr_decay value: ", defaults.lr_decay());
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
    TORCH_CHECK(defaults.initial_accumulator_value() >= 0,
                "Invalid initial_accumulator_value value: ", defaults.initial_accumulator_value());
    TORCH_CHECK(defaults.eps() >= 0, "Invalid epsilon value: ", defaults.eps());
    using map = std::decay_t<decltype(state())>;
    for (auto const& group : param_groups_) {
      for (auto const& p : group.params()) {
        auto s = std::make_unique<torch::optim::AdagradParamState>();
        s->step(0);
        s->sum(torch::full_like(p.detach(), defaults.initial_accumulator_value(), torch::MemoryFormat::Preserve));
        state_[detail::state_key<map>(p)] = std::move(s);
      }
    }
  }
  explicit Adagrad(std::vector<torch::Tensor> params, torch::optim::AdagradOptions const& defaults = {},
                   cuda_config cuda = {}, extras x = {})
      : Adagrad({torch::optim::OptimizerParamGroup(std::move(params))}, defaults, std::move(cuda), x)
  {
  }

  // The hooks fused_optimizer calls (a parameter of a group added later gets its state here).
  static void state_tensors(torch::Tensor const& p, torch::optim::AdagradOptions const& o,
                            torch::optim::AdagradParamState& s, std::vector<torch::Tensor const*>& out)
  {
    if (!s.sum().defined()) {
      s.step(0);
      s.sum(torch::full_like(p.detach(), o.initial_accumulator_value(), torch::MemoryFormat::Preserve));
    }
    out.push_back(&s.sum());
  }
  static std::int64_t layout(torch::optim::AdagradOptions const&, torch::optim::AdagradParamState const&) { return 0; }
  static ::fusedopt::rules::adagrad rule(torch::optim::AdagradOptions const& o)
  {
    ::fusedopt::rules::adagrad r;
    r.lr = o.lr();
    r.lr_decay = o.lr_decay();
    r.weight_decay = o.weight_decay();
    r.eps = o.eps();
    return r;
  }
};

/// @brief torch::optim::RMSprop, fused (torch::optim::RMSpropOptions, RMSpropParamState:
/// square_avg, momentum_buffer with momentum, grad_avg when centered, all from zero as torch).
class RMSprop : public fused_optimizer<RMSprop, torch::optim::RMSpropOptions, torch::optim::RMSpropParamState,
                                       ::fusedopt::rules::rmsprop> {
 public:
  static constexpr char const* name = "RMSprop";

  /// @param cuda fusedopt's CUDA plans for CUDA parameters (cuda_config); none: CPU only.
  /// @param x the library's extras (extras): maximize, clipping, and for Adam/AdamW bfloat16
  /// parameters' rounding and 8-bit states.
  explicit RMSprop(std::vector<torch::optim::OptimizerParamGroup> const& groups,
                   torch::optim::RMSpropOptions const& defaults = {}, cuda_config cuda = {}, extras x = {})
      : fused_optimizer(groups, std::make_unique<torch::optim::RMSpropOptions>(defaults), std::move(cuda), x)
  {
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.eps() >= 0, "Invalid epsilon value: ", defaults.eps());
    TORCH_CHECK(defaults.momentum() >= 0, "Invalid momentum value: ", defaults.momentum());
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
    TORCH_CHECK(defaults.alpha() >= 0, "Invalid alpha value: ", defaults.alpha());
  }
  explicit RMSprop(std::vector<torch::Tensor> params, torch::optim::RMSpropOptions const& defaults = {},
                   cuda_config cuda = {}, extras x = {})
      : RMSprop({torch::optim::OptimizerParamGroup(std::move(params))}, defaults, std::move(cuda), x)
  {
  }

  using family_type = family<::fusedopt::rules::rmsprop>;
  static void state_tensors(torch::Tensor const& p, torch::optim::RMSpropOptions const& o,
                            torch::optim::RMSpropParamState& s, std::vector<torch::Tensor const*>& out)
  {
    if (!s.square_avg().defined()) {
      s.step(0);
      s.square_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
    // Created when first needed: torch creates them with the state, from the options then.
    if (o.momentum() > 0 && !s.momentum_buffer().defined()) {
      s.momentum_buffer(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
    if (o.centered() && !s.grad_avg().defined()) { s.grad_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve)); }
    out.push_back(&s.square_avg());
    if (o.momentum() > 0) { out.push_back(&s.momentum_buffer()); }
    if (o.centered()) { out.push_back(&s.grad_avg()); }
  }
  static std::int64_t layout(torch::optim::RMSpropOptions const& o, torch::optim::RMSpropParamState const&)
  {
    return (o.momentum() > 0 ? family_type::momentum_bit : 0) | (o.centered() ? family_type::centered_bit : 0);
  }
  static ::fusedopt::rules::rmsprop rule(torch::optim::RMSpropOptions const& o)
  {
    ::fusedopt::rules::rmsprop r;
    r.lr = o.lr();
    r.alpha = o.alpha();
    r.eps = o.eps();
    r.weight_decay = o.weight_decay();
    r.momentum = o.momentum();
    r.centered = o.centered();
    return r;
  }
};

namespace detail {
inline void write_value(torch::serialize::OutputArchive& archive, char const* key, c10::IValue const& value)
{
  archive.write(key, value);
}
/// Reads `key` into `set` when the archive has it (an absent key keeps the value).
template <class T, class Set>
void read_value(torch::serialize::InputArchive& archive, char const* key, Set&& set)
{
  c10::IValue value;
  if (archive.try_read(key, value)) { set(value.to<T>()); }
}
}  // namespace detail

/// @brief Lion's options (no torch::optim class has them): lr, betas (interpolation for the
/// direction, decay of the momentum) and decoupled weight_decay, with Lion's defaults. Saved
/// under these keys by torch::save.
struct LionOptions : public torch::optim::OptimizerCloneableOptions<LionOptions> {
  using betas_t = std::tuple<double, double>;
  LionOptions(double lr = 1e-4) : lr_(lr) {}  // NOLINT(google-explicit-constructor): torch's options convert from lr
  TORCH_ARG(double, lr) = 1e-4;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.99);
  TORCH_ARG(double, weight_decay) = 0;

 public:
  void serialize(torch::serialize::InputArchive& archive) override
  {
    detail::read_value<double>(archive, "lr", [&](double v) { lr(v); });
    detail::read_value<betas_t>(archive, "betas", [&](betas_t v) { betas(v); });
    detail::read_value<double>(archive, "weight_decay", [&](double v) { weight_decay(v); });
  }
  void serialize(torch::serialize::OutputArchive& archive) const override
  {
    detail::write_value(archive, "lr", lr());
    detail::write_value(archive, "betas", betas());
    detail::write_value(archive, "weight_decay", weight_decay());
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(double const value) override { lr(value); }
};

/// @brief Lion's per-parameter state: its step count and exp_avg (the momentum).
struct LionParamState : public torch::optim::OptimizerCloneableParamState<LionParamState> {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);

 public:
  void serialize(torch::serialize::InputArchive& archive) override
  {
    detail::read_value<std::int64_t>(archive, "step", [&](std::int64_t v) { step(v); });
    detail::read_value<torch::Tensor>(archive, "exp_avg", [&](torch::Tensor v) { exp_avg(std::move(v)); });
  }
  void serialize(torch::serialize::OutputArchive& archive) const override
  {
    detail::write_value(archive, "step", step());
    if (exp_avg().defined()) { detail::write_value(archive, "exp_avg", exp_avg()); }
  }
};

/// @brief Lion (Chen et al. 2023, as lion-pytorch), fused: p *= 1 - lr * weight_decay;
/// p -= lr * sign(beta1 * exp_avg + (1 - beta1) * grad); exp_avg = beta2 * exp_avg + (1 - beta2) * grad.
/// LionOptions is not one of torch's options types: add groups with add_group(), which keeps
/// their options (torch 2.10+'s add_param_group replaces them with the defaults).
class Lion : public fused_optimizer<Lion, LionOptions, LionParamState, ::fusedopt::rules::lion> {
 public:
  static constexpr char const* name = "Lion";

  /// @param cuda fusedopt's CUDA plans for CUDA parameters (cuda_config); none: CPU only.
  /// @param x the library's extras (extras): maximize, clipping, and for Adam/AdamW bfloat16
  /// parameters' rounding and 8-bit states.
  explicit Lion(std::vector<torch::optim::OptimizerParamGroup> const& groups, LionOptions const& defaults = {},
                cuda_config cuda = {}, extras x = {})
      : fused_optimizer({}, std::make_unique<LionOptions>(defaults), std::move(cuda), x)
  {
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    auto const [b1, b2] = defaults.betas();
    TORCH_CHECK(0 <= b1 && b1 <= 1, "Invalid beta parameter at index 0: ", b1);
    TORCH_CHECK(0 <= b2 && b2 <= 1, "Invalid beta parameter at index 1: ", b2);
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
    for (auto const& group : groups) { add_group(group); }
  }
  explicit Lion(std::vector<torch::Tensor> params, LionOptions const& defaults = {}, cuda_config cuda = {}, extras x = {})
      : Lion({torch::optim::OptimizerParamGroup(std::move(params))}, defaults, std::move(cuda), x)
  {
  }

  /// @brief Adds a param group with its own options (the defaults where it has none).
  void add_group(torch::optim::OptimizerParamGroup const& group) { add_group_keeping_options(group); }

  static void state_tensors(torch::Tensor const& p, LionOptions const&, LionParamState& s,
                            std::vector<torch::Tensor const*>& out)
  {
    if (!s.exp_avg().defined()) {
      s.step(0);
      s.exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
    out.push_back(&s.exp_avg());
  }
  static std::int64_t layout(LionOptions const&, LionParamState const&) { return 0; }
  static ::fusedopt::rules::lion rule(LionOptions const& o)
  {
    ::fusedopt::rules::lion r;
    r.lr = o.lr();
    r.beta1 = std::get<0>(o.betas());
    r.beta2 = std::get<1>(o.betas());
    r.weight_decay = o.weight_decay();
    return r;
  }
};

/// @brief LAMB's options (no torch::optim class has them), with apex FusedLAMB's defaults and
/// meaning (fusedopt::rules::lamb): adam_w_mode adds weight_decay * p to the update (else to
/// the gradient), the trust ratio ||p|| / ||update|| per tensor applies while weight_decay is
/// not 0, or always with use_nvlamb, at most max_trust_ratio. Saved under these keys.
struct LAMBOptions : public torch::optim::OptimizerCloneableOptions<LAMBOptions> {
  using betas_t = std::tuple<double, double>;
  LAMBOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT(google-explicit-constructor): torch's options convert from lr
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, grad_averaging) = true;
  TORCH_ARG(bool, adam_w_mode) = true;
  TORCH_ARG(bool, use_nvlamb) = false;
  TORCH_ARG(double, max_trust_ratio) = std::numeric_limits<double>::max();

 public:
  void serialize(torch::serialize::InputArchive& archive) override
  {
    detail::read_value<double>(archive, "lr", [&](double v) { lr(v); });
    detail::read_value<betas_t>(archive, "betas", [&](betas_t v) { betas(v); });
    detail::read_value<double>(archive, "eps", [&](double v) { eps(v); });
    detail::read_value<double>(archive, "weight_decay", [&](double v) { weight_decay(v); });
    detail::read_value<bool>(archive, "bias_correction", [&](bool v) { bias_correction(v); });
    detail::read_value<bool>(archive, "grad_averaging", [&](bool v) { grad_averaging(v); });
    detail::read_value<bool>(archive, "adam_w_mode", [&](bool v) { adam_w_mode(v); });
    detail::read_value<bool>(archive, "use_nvlamb", [&](bool v) { use_nvlamb(v); });
    detail::read_value<double>(archive, "max_trust_ratio", [&](double v) { max_trust_ratio(v); });
  }
  void serialize(torch::serialize::OutputArchive& archive) const override
  {
    detail::write_value(archive, "lr", lr());
    detail::write_value(archive, "betas", betas());
    detail::write_value(archive, "eps", eps());
    detail::write_value(archive, "weight_decay", weight_decay());
    detail::write_value(archive, "bias_correction", bias_correction());
    detail::write_value(archive, "grad_averaging", grad_averaging());
    detail::write_value(archive, "adam_w_mode", adam_w_mode());
    detail::write_value(archive, "use_nvlamb", use_nvlamb());
    detail::write_value(archive, "max_trust_ratio", max_trust_ratio());
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(double const value) override { lr(value); }
};

/// @brief LAMB's per-parameter state: its step count, exp_avg and exp_avg_sq.
struct LAMBParamState : public torch::optim::OptimizerCloneableParamState<LAMBParamState> {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);

 public:
  void serialize(torch::serialize::InputArchive& archive) override
  {
    detail::read_value<std::int64_t>(archive, "step", [&](std::int64_t v) { step(v); });
    detail::read_value<torch::Tensor>(archive, "exp_avg", [&](torch::Tensor v) { exp_avg(std::move(v)); });
    detail::read_value<torch::Tensor>(archive, "exp_avg_sq", [&](torch::Tensor v) { exp_avg_sq(std::move(v)); });
  }
  void serialize(torch::serialize::OutputArchive& archive) const override
  {
    detail::write_value(archive, "step", step());
    if (exp_avg().defined()) { detail::write_value(archive, "exp_avg", exp_avg()); }
    if (exp_avg_sq().defined()) { detail::write_value(archive, "exp_avg_sq", exp_avg_sq()); }
  }
};

/// @brief LAMB (You et al. 2020, as apex's FusedLAMB; fusedopt::rules::lamb), fused: a reduction
/// pass for each tensor's ||p|| and ||update||, then the update pass, in one plan run. As Lion,
/// add groups with add_group().
class LAMB : public fused_optimizer<LAMB, LAMBOptions, LAMBParamState, ::fusedopt::rules::lamb> {
 public:
  static constexpr char const* name = "LAMB";

  /// @param cuda fusedopt's CUDA plans for CUDA parameters (cuda_config); none: CPU only.
  /// @param x the library's extras (extras): maximize, clipping, and for Adam/AdamW bfloat16
  /// parameters' rounding and 8-bit states.
  explicit LAMB(std::vector<torch::optim::OptimizerParamGroup> const& groups, LAMBOptions const& defaults = {},
                cuda_config cuda = {}, extras x = {})
      : fused_optimizer({}, std::make_unique<LAMBOptions>(defaults), std::move(cuda), x)
  {
    TORCH_CHECK(defaults.lr() >= 0, "Invalid learning rate: ", defaults.lr());
    TORCH_CHECK(defaults.eps() >= 0, "Invalid epsilon value: ", defaults.eps());
    auto const [b1, b2] = defaults.betas();
    TORCH_CHECK(0 <= b1 && b1 < 1, "Invalid beta parameter at index 0: ", b1);
    TORCH_CHECK(0 <= b2 && b2 < 1, "Invalid beta parameter at index 1: ", b2);
    TORCH_CHECK(defaults.weight_decay() >= 0, "Invalid weight_decay value: ", defaults.weight_decay());
    TORCH_CHECK(defaults.max_trust_ratio() > 0, "Invalid max_trust_ratio value: ", defaults.max_trust_ratio());
    for (auto const& group : groups) { add_group(group); }
  }
  explicit LAMB(std::vector<torch::Tensor> params, LAMBOptions const& defaults = {}, cuda_config cuda = {}, extras x = {})
      : LAMB({torch::optim::OptimizerParamGroup(std::move(params))}, defaults, std::move(cuda), x)
  {
  }

  /// @brief Adds a param group with its own options (the defaults where it has none).
  void add_group(torch::optim::OptimizerParamGroup const& group) { add_group_keeping_options(group); }

  static void state_tensors(torch::Tensor const& p, LAMBOptions const&, LAMBParamState& s,
                            std::vector<torch::Tensor const*>& out)
  {
    if (!s.exp_avg().defined()) {
      s.step(0);
      s.exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      s.exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    }
    out.push_back(&s.exp_avg());
    out.push_back(&s.exp_avg_sq());
  }
  static std::int64_t layout(LAMBOptions const&, LAMBParamState const&) { return 0; }
  static ::fusedopt::rules::lamb rule(LAMBOptions const& o)
  {
    ::fusedopt::rules::lamb r;
    r.lr = o.lr();
    r.beta1 = std::get<0>(o.betas());
    r.beta2 = std::get<1>(o.betas());
    r.eps = o.eps();
    r.weight_decay = o.weight_decay();
    r.bias_correction = o.bias_correction();
    r.grad_averaging = o.grad_averaging();
    r.adam_w_mode = o.adam_w_mode();
    r.use_nvlamb = o.use_nvlamb();
    r.max_trust_ratio = o.max_trust_ratio();
    return r;
  }
};

}  // namespace libtorch
}  // namespace fusedopt
