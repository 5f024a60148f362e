/// @file unit.cc
/// @brief The fused step of one optimizer kind (FUSEDOPT_JAX_KIND, 0-5 as `kind`), one form
/// (FUSEDOPT_JAX_INPLACE: 1 the fused step, 0 Optax's form) and one combination of element types
/// (FUSEDOPT_JAX_PARAM, FUSEDOPT_JAX_STATE1, FUSEDOPT_JAX_STATE2: `dtype`'s values; a state the
/// kind does not have takes the parameter's type), on one backend: compiled by nvcc with
/// FUSEDOPT_JAX_CUDA=1 (fusedopt's CUDA plans) or by the C++ compiler (its host plans) into a
/// shared library of its own, a "unit", which the handler's library loads (FusedoptJaxAddUnit)
/// when a traced step needs it: a first step compiles the one combination it uses, not all 46
/// (fusedopt_jax/_build.py, `all_units`).
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "runner.hpp"

#if FUSEDOPT_JAX_CUDA
#include <fusedopt/fusedopt.cuh>
#else
#include <fusedopt/fusedopt.hpp>
#endif

#include "optax_rules.hpp"

#if !defined(FUSEDOPT_JAX_KIND) || !defined(FUSEDOPT_JAX_INPLACE) || !defined(FUSEDOPT_JAX_PARAM) || \
    !defined(FUSEDOPT_JAX_STATE1) || !defined(FUSEDOPT_JAX_STATE2)
#error "compile unit.cc with -DFUSEDOPT_JAX_KIND=<0..5> -DFUSEDOPT_JAX_INPLACE=<0|1> -DFUSEDOPT_JAX_PARAM=<0|1> -DFUSEDOPT_JAX_STATE1=<0|1> -DFUSEDOPT_JAX_STATE2=<0|1>"
#endif

namespace fusedopt_jax {
namespace FUSEDOPT_JAX_BACKEND {
namespace {

constexpr kind this_kind = static_cast<kind>(FUSEDOPT_JAX_KIND);
constexpr bool this_inplace = FUSEDOPT_JAX_INPLACE != 0;
constexpr dtype this_param = static_cast<dtype>(FUSEDOPT_JAX_PARAM);
constexpr dtype this_state1 = static_cast<dtype>(FUSEDOPT_JAX_STATE1);
constexpr dtype this_state2 = static_cast<dtype>(FUSEDOPT_JAX_STATE2);

template <kind K>
inline constexpr bool has_state1 = states_of(K) >= 1;
template <kind K>
inline constexpr bool has_state2 = states_of(K) >= 2;

template <class T>
T* typed(void* p)
{
  return static_cast<T*>(p);
}
template <class T>
T const* typed(void const* p)
{
  return static_cast<T const*>(p);
}

/// The bound lists of one group, typed: param (read only in Optax's form), grad, the states,
/// the update (Optax's form).
template <bool InPlace, class P, class S1, class S2, class U>
auto make_lists(std::vector<leaf> const& leaves)
{
  namespace slot = fo::slot;
  fo::tensor_list<P const> param_in;
  fo::tensor_list<P> param;
  fo::tensor_list<P const> grad;
  fo::tensor_list<S1> state1;
  fo::tensor_list<S2> state2;
  fo::tensor_list<U> update;
  for (leaf const& l : leaves) {
    if constexpr (InPlace) {
      param.push_back(typed<P>(l.param), l.size);
    } else {
      param_in.push_back(typed<P>(l.param_in), l.size);
      update.push_back(typed<U>(l.update), l.size);
    }
    grad.push_back(typed<P>(l.grad), l.size);
    if constexpr (has_state1<this_kind>) { state1.push_back(typed<S1>(l.state1), l.size); }
    if constexpr (has_state2<this_kind>) { state2.push_back(typed<S2>(l.state2), l.size); }
  }
  // The first state is momentum_buffer for SGD, exp_avg otherwise.
  auto first_state = [&] {
    if constexpr (this_kind == kind::sgd_momentum) {
      return slot::momentum_buffer = std::move(state1);
    } else {
      return slot::exp_avg = std::move(state1);
    }
  };
  if constexpr (InPlace) {
    if constexpr (this_kind == kind::sgd) {
      return fo::bind(slot::param = std::move(param), slot::grad = std::move(grad));
    } else if constexpr (!has_state2<this_kind>) {
      return fo::bind(slot::param = std::move(param), slot::grad = std::move(grad), first_state());
    } else {
      return fo::bind(slot::param = std::move(param), slot::grad = std::move(grad), first_state(),
                      slot::exp_avg_sq = std::move(state2));
    }
  } else {
    if constexpr (this_kind == kind::sgd) {
      return fo::bind(slot::param = std::move(param_in), slot::grad = std::move(grad), update_out = std::move(update));
    } else if constexpr (!has_state2<this_kind>) {
      return fo::bind(slot::param = std::move(param_in), slot::grad = std::move(grad), first_state(),
                      update_out = std::move(update));
    } else {
      return fo::bind(slot::param = std::move(param_in), slot::grad = std::move(grad), first_state(),
                      slot::exp_avg_sq = std::move(state2), update_out = std::move(update));
    }
  }
}

template <bool InPlace>
auto make_rule(float const* h)
{
  if constexpr (this_kind == kind::sgd) {
    return optax_sgd<InPlace, false>{h};
  } else if constexpr (this_kind == kind::sgd_momentum) {
    return optax_sgd<InPlace, true>{h};
  } else if constexpr (this_kind == kind::adam) {
    return make_adam<InPlace>(h);
  } else if constexpr (this_kind == kind::lion) {
    return optax_lion<InPlace>{h};
  } else if constexpr (this_kind == kind::lamb) {
    return make_lamb<InPlace>(h);
  } else {
    return make_clip_adam<InPlace>(h);
  }
}

#if FUSEDOPT_JAX_CUDA
template <class Lists>
auto new_plan(Lists const& lists, void* stream)
{
  return fo::cuda::make_plan(lists, {}, static_cast<cudaStream_t>(stream));
}
template <class Plan, class Lists>
void rebind(Plan& plan, Lists const& lists, void* stream)
{
  plan.rebind(lists, static_cast<cudaStream_t>(stream));
}
template <class Plan, class Rule>
void run_plan(Plan const& plan, Rule const& rule, void* stream)
{
  plan.run(rule, fo::step_info{}, static_cast<cudaStream_t>(stream));
}
#else
template <class Lists>
auto new_plan(Lists const& lists, void*)
{
  return fo::host::make_plan(lists);
}
template <class Plan, class Lists>
void rebind(Plan& plan, Lists const& lists, void*)
{
  plan.rebind(lists);
}
template <class Plan, class Rule>
void run_plan(Plan const& plan, Rule const& rule, void*)
{
  plan.run(rule, fo::step_info{});
}
#endif

template <bool InPlace, class P, class S1, class S2, class U>
class runner_impl final : public runner {
  using lists_type = decltype(make_lists<InPlace, P, S1, S2, U>(std::declval<std::vector<leaf> const&>()));
  using plan_type = decltype(new_plan(std::declval<lists_type const&>(), nullptr));

 public:
  bool run(std::vector<leaf> const& leaves, float const* hyper, void* stream) override
  {
#if FUSEDOPT_JAX_CUDA
    if (capturing(stream)) { return run_captured(leaves, hyper, stream); }
#endif
    // A compiled program gives its buffers the same addresses at every execution (and a
    // donated step keeps its parameters and states where they are): the leaves the plan is
    // bound to come back, and the step runs without building lists (bind's checks are
    // O(n log n) with allocations: a large part of a 2000-leaf call's host time).
    if (plan_ && same_leaves(leaves, bound_)) {
      run_plan(*plan_, make_rule<InPlace>(hyper), stream);
      return false;
    }
    auto const lists = make_lists<InPlace, P, S1, S2, U>(leaves);
    // Geometry (sizes, types, alignment) decides the plan; addresses only rebind it.
    if (!plan_ || !plan_->can_rebind(lists)) {
      plan_.reset();
      bound_.clear();
      plan_.emplace(new_plan(lists, stream));
    } else {
      rebind(*plan_, lists, stream);
    }
    bound_ = leaves;
    run_plan(*plan_, make_rule<InPlace>(hyper), stream);
    return true;
  }

 private:
  static bool same_leaves(std::vector<leaf> const& a, std::vector<leaf> const& b)
  {
    if (a.size() != b.size()) { return false; }
    for (std::size_t i = 0; i < a.size(); ++i) {
      leaf const& x = a[i];
      leaf const& y = b[i];
      if (x.size != y.size || x.param_in != y.param_in || x.param != y.param || x.grad != y.grad ||
          x.state1 != y.state1 || x.state2 != y.state2 || x.update != y.update) {
        return false;
      }
    }
    return true;
  }

#if FUSEDOPT_JAX_CUDA
  static bool capturing(void* stream)
  {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    FUSEDOPT_CUDA_TRY(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
    return status != cudaStreamCaptureStatusNone;
  }

  /// Under stream capture (XLA recording the call into a command buffer, the handler being
  /// registered command-buffer compatible): a graph replays the launch without this code, and
  /// XLA keeps one recording per set of addresses and may replay any of them later. So each
  /// set of leaves gets a plan of its own, built once (on a private stream: building allocates
  /// and synchronises, which a capture forbids) and never rebound or freed, whose device tables
  /// hold that set's addresses whenever one of its recordings replays. Returns whether a plan
  /// was built.
  bool run_captured(std::vector<leaf> const& leaves, float const* hyper, void* stream)
  {
    for (auto const& c : captured_) {
      if (same_leaves(leaves, c->leaves)) {
        run_plan(c->plan, make_rule<InPlace>(hyper), stream);
        return false;
      }
    }
    {
      fo::cuda::detail::relaxed_capture_mode const relaxed;  // malloc, pinned staging, a sync
      if (private_stream_ == nullptr) { FUSEDOPT_CUDA_TRY(cudaStreamCreateWithFlags(&private_stream_, cudaStreamNonBlocking)); }
      auto const lists = make_lists<InPlace, P, S1, S2, U>(leaves);
      captured_.push_back(std::make_unique<captured_plan>(captured_plan{leaves, new_plan(lists, private_stream_)}));
    }
    run_plan(captured_.back()->plan, make_rule<InPlace>(hyper), stream);
    return true;
  }

  struct captured_plan {
    std::vector<leaf> leaves;
    plan_type plan;
  };
  std::vector<std::unique_ptr<captured_plan>> captured_;  ///< kept for the life of the process
  cudaStream_t private_stream_ = nullptr;                  ///< where captured_ plans are built
#endif

  std::optional<plan_type> plan_;
  std::vector<leaf> bound_;  ///< the leaves plan_ is bound to (empty: none yet)
};

template <dtype D>
using type_of = std::conditional_t<D == dtype::f32, float, fo::bfloat16>;

static_assert(has_state1<this_kind> || this_state1 == this_param, "a kind without a first state compiles it as the parameter's type");
static_assert(has_state2<this_kind> || this_state2 == this_param, "a kind without a second state compiles it as the parameter's type");
static_assert(this_param == dtype::bf16 || (this_state1 == dtype::f32 && this_state2 == dtype::f32),
              "a float32 parameter has float32 states (fusedopt_jax/_core.py refuses others)");

/// The runner of this unit's combination, or null for another group (the types of states a
/// kind does not bind are the parameter's; Optax's form writes the promoted type).
std::unique_ptr<runner> make(group_key const& key)
{
  dtype const s1 = has_state1<this_kind> ? key.state1 : key.param;
  dtype const s2 = has_state2<this_kind> ? key.state2 : key.param;
  if (key.kind != static_cast<int>(this_kind) || key.inplace != this_inplace || key.param != this_param ||
      s1 != this_state1 || s2 != this_state2) {
    return nullptr;
  }
  using P = type_of<this_param>;
  using S1 = type_of<this_state1>;
  using S2 = type_of<this_state2>;
  // Optax's update type: bfloat16 where every list is, float otherwise (jnp's promotion).
  constexpr bool bf16_only = this_param == dtype::bf16 && this_state1 == dtype::bf16 && this_state2 == dtype::bf16;
  using U = std::conditional_t<bf16_only, fo::bfloat16, float>;
  if (!this_inplace && key.update != (bf16_only ? dtype::bf16 : dtype::f32)) { return nullptr; }
  return std::make_unique<runner_impl<this_inplace, P, S1, S2, U>>();
}

}  // namespace

}  // namespace FUSEDOPT_JAX_BACKEND
}  // namespace fusedopt_jax

// The unit's one export (the library is built with -fvisibility=hidden): a new runner for `key`,
// or null where the group is another unit's. C++ exceptions (allocation) reach the handler,
// which calls through this pointer inside its own try.
extern "C" __attribute__((visibility("default"))) fusedopt_jax::runner* FUSEDOPT_JAX_UNIT_MAKER(
    fusedopt_jax::group_key const* key)
{
  return fusedopt_jax::FUSEDOPT_JAX_BACKEND::make(*key).release();
}
