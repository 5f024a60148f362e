/// @file rules/amp.hpp
/// @brief Automatic mixed precision as building blocks: unscale the gradients by a device
/// `inv_scale`, skip the whole step when any gradient is not finite (every parameter and
/// state left bit for bit as it was, a flag set), and update the loss scale as
/// torch.amp.GradScaler does, all on the device, with no host synchronisation.
///
/// A complete AMP step, one reduction pass (the non-finite check, which reads the gradients)
/// and one update pass:
/// @code
/// float scale = 65536.f;             // device memory on the CUDA backend
/// std::int32_t growth_tracker = 0;
/// float found_inf = 0.f;
/// double inv_scale = 1.0 / 65536;    // float(1 / scale), kept up to date by grad_scaler_update
/// namespace r = fusedopt::rules;
/// r::adamw opt;  opt.lr = 1e-3;
/// auto step = fusedopt::chain(
///     r::unscale_gradients{fusedopt::scalar<double>::from_pointer(&inv_scale)},
///     r::skip_if_nonfinite(opt, &found_inf),
///     r::grad_scaler_update{&scale, &growth_tracker, &found_inf, 2.0, 0.5, 2000, &inv_scale});
/// plan.run(step, step_info);         // every step: the same call, capturable in a graph
/// @endcode
/// Global-norm clipping goes between unscaling and the skip, as with torch (unscale_, then
/// clip_grad_norm_, then scaler.step): `chain(unscale, clip_by_global_norm{...},
/// skip_if_nonfinite(opt, ...), grad_scaler_update{...})`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../chain.hpp"
#include "../config.hpp"
#include "../detail/factored.hpp"
#include "../detail/phases.hpp"
#include "../detail/rule_traits.hpp"
#include "../error.hpp"
#include "../meta.hpp"
#include "../reduce.hpp"
#include "../rule.hpp"
#include "../scalar.hpp"
#include "../slots.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace slot {
/// Register slot: 1 while the step is being skipped (set by count_nonfinite_gradients), else 0.
FUSEDOPT_REGISTER_SLOT(skip_step);
}  // namespace slot

/// @brief A one-element flag in memory, float (torch's `found_inf` tensor) or int32: 1 when
/// set, 0 when clear; any non-zero value (NaN included) reads as set, as in torch.
struct flag_pointer {
  float* as_float = nullptr;
  std::int32_t* as_int = nullptr;

  constexpr flag_pointer() = default;
  FUSEDOPT_HOST_DEVICE constexpr flag_pointer(decltype(nullptr)) {}  // NOLINT(google-explicit-constructor)
  FUSEDOPT_HOST_DEVICE constexpr flag_pointer(float* p) : as_float(p) {}  // NOLINT(google-explicit-constructor)
  FUSEDOPT_HOST_DEVICE constexpr flag_pointer(std::int32_t* p) : as_int(p) {}  // NOLINT(google-explicit-constructor)

  [[nodiscard]] FUSEDOPT_HOST_DEVICE bool is_null() const { return as_float == nullptr && as_int == nullptr; }
  /// Writes 1 or 0 (nothing when null).
  FUSEDOPT_HOST_DEVICE void set(bool value) const
  {
    if (as_float != nullptr) { *as_float = value ? 1.f : 0.f; }
    if (as_int != nullptr) { *as_int = value ? 1 : 0; }
  }
  /// True when the flag holds a non-zero value (false when null).
  [[nodiscard]] FUSEDOPT_HOST_DEVICE bool get() const
  {
    if (as_float != nullptr) { return *as_float != 0.f; }
    if (as_int != nullptr) { return *as_int != 0; }
    return false;
  }
};

namespace detail {

/// The body of a guarded part: the part's own, unless the step is being skipped.
template <class Body>
struct guarded_body {
  Body body;
  template <class E, class... Args>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, Args&... args) const
  {
    if (e[slot::skip_step] == typename E::value_type(0)) { body(e, args...); }
  }

  template <bool Hooked = has_tensor_hook_v<Body>, std::enable_if_t<Hooked, int> = 0>
  FUSEDOPT_HOST_DEVICE auto for_tensor(std::int64_t tensor) const
  {
    return guarded_body<tensor_body_t<Body>>{::fusedopt::detail::body_for_tensor(body, tensor)};
  }
};

/// Gives a guarded part its rule's after-step hook, where the rule has one (CRTP, so rules
/// without a hook do not make the backends schedule one).
template <class Derived, class R, bool = has_after_step<R>::value>
struct guarded_hook {};
template <class Derived, class R>
struct guarded_hook<Derived, R, true> {
  FUSEDOPT_HOST_DEVICE void after_step(reduced const& r, step_info const& step) const
  {
    static_cast<Derived const&>(*this).rule.after_step(r, step);
  }
};

/// A part without reduction passes that does nothing while `slot::skip_step` is set.
template <class R>
struct guarded : guarded_hook<guarded<R>, R> {
  R rule;
  using reads = rule_reads_t<R>;
  using writes = rule_writes_t<R>;
  using registers = set_union_t<rule_registers_t<R>, slots<slot::skip_step_t>>;

  FUSEDOPT_HOST_DEVICE auto prepare(step_info const& step) const
  {
    using body = decltype(prepare_rule(rule, step));
    return guarded_body<body>{prepare_rule(rule, step)};
  }
};

/// A reducing part whose update body does nothing while `slot::skip_step` is set (its
/// reduction still runs: its results are not used by a skipped update).
template <class R>
struct guarded_reducing : guarded_hook<guarded_reducing<R>, R> {
  R rule;
  using reduction = typename R::reduction;
  using reads = rule_reads_t<R>;
  using writes = rule_writes_t<R>;
  using registers = set_union_t<rule_registers_t<R>, slots<slot::skip_step_t>>;

  FUSEDOPT_HOST_DEVICE auto prepare_reduce(step_info const& step) const { return rule.prepare_reduce(step); }
  FUSEDOPT_HOST_DEVICE auto prepare(step_info const& step, reduced const& r) const
  {
    using body = decltype(rule.prepare(step, r));
    return guarded_body<body>{rule.prepare(step, r)};
  }
};

template <class R>
FUSEDOPT_HOST_DEVICE auto guard(R const& rule);

template <class... Parts, std::size_t... K>
FUSEDOPT_HOST_DEVICE auto guard_parts(chain_rule<Parts...> const& c, std::index_sequence<K...>)
{
  return fusedopt::chain(guard(c.template get<K>())...);
}

/// The rule as a chain of guarded parts. A rule without reduction passes is guarded whole; one
/// with passes is taken apart (chains into their parts, named optimizers into their chains) so
/// that the pass structure is kept and only update bodies are guarded.
template <class R>
FUSEDOPT_HOST_DEVICE auto guard(R const& rule)
{
  if constexpr (pass_count_v<R> == 0) {
    guarded<R> g{};
    g.rule = rule;
    return g;
  } else if constexpr (is_reducing<R>::value) {
    guarded_reducing<R> g{};
    g.rule = rule;
    return g;
  } else if constexpr (is_chain<R>::value) {
    return guard_parts(rule, typename R::part_indices{});
  } else {
    return guard(rule.as_chain());
  }
}

template <class R>
using guard_t = decltype(guard(std::declval<R const&>()));

}  // namespace detail

namespace rules {

/// @brief grad *= inv_scale, in registers (the stored gradients are not changed). Typically
/// `inv_scale` points to float(1 / scale), as torch.amp.GradScaler's unscale_ computes it
/// (grad_scaler_update can keep it current). Unlike torch, a half or bfloat16 gradient is not
/// rounded back to its type after unscaling: the optimizer sees the unscaled value in float.
struct unscale_gradients {
  scalar<double> inv_scale{1.0};

  using reads = slots<slot::grad_t>;
  using writes = slots<>;

  FUSEDOPT_HOST_DEVICE detail::scale_slot<slot::grad_t> prepare(step_info const&) const { return {inv_scale.get()}; }
};

/// @brief The reducing block behind skip_if_nonfinite: counts the gradients (as the chain holds
/// them at this point, e.g. after unscale_gradients) that are infinite or NaN, over every
/// element of every tensor. In the update pass it sets the register `slot::skip_step` to 1 when
/// the count is not 0, which the guarded parts that follow obey. After the step it writes
/// `found_inf` (1 or 0, every step: no zeroing needed between steps or graph replays) and,
/// when the step was skipped and `step_info::advance` is set, takes back the backend's
/// increment of the step count: a skipped step does not count, as in torch's fused Adam
/// (which subtracts found_inf from its step tensors) and torch's GradScaler (which does not
/// call optimizer.step()).
struct count_nonfinite_gradients {
  flag_pointer found_inf{};

  /// Accumulator 0: the number of non-finite gradients.
  using reduction = fusedopt::reduction<reduce_op::sum>;
  using reads = slots<slot::grad_t>;
  using writes = slots<>;
  using registers = slots<slot::skip_step_t>;

  struct accumulate {
    template <class E, class Acc>
    FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      // g - g is 0 exactly when g is finite (inf - inf and NaN - NaN are NaN).
      acc[0] += (g - g == T(0)) ? T(0) : T(1);
    }
  };

  struct prepared {
    bool skip;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::skip_step] = skip ? typename E::value_type(1) : typename E::value_type(0);
    }
  };

  FUSEDOPT_HOST_DEVICE accumulate prepare_reduce(step_info const&) const { return {}; }
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const { return {r.total(0) != 0.0}; }

  /// Runs once per step (a single thread on the GPU).
  FUSEDOPT_HOST_DEVICE void after_step(reduced const& r, step_info const& step) const
  {
    bool const skipped = r.total(0) != 0.0;
    found_inf.set(skipped);
    if (skipped && step.advance != nullptr) { --*step.advance; }
  }
};


/// @brief Runs `inner` unless `Decide`, the part in front (count_nonfinite_gradients or
/// read_skip_flag, built from `found_inf`), sets the register `slot::skip_step`; a skipped step
/// leaves every parameter and state bit for bit unchanged. Used as skip_step_if_nonfinite
/// (skip_if_nonfinite: the step is skipped when a gradient is infinite or NaN, and `found_inf`
/// says so; see count_nonfinite_gradients for the flag and the step count) and
/// skip_step_if_set (skip_if_set: the step is skipped when `found_inf` is set as it starts).
///
/// How nothing changes: in a skipped step no part of `inner` touches the element's registers,
/// so each stored slot is written back with the value loaded from it (to make sure of that,
/// the wrapper reads every slot `inner` writes). A load-store round trip keeps the bits of
/// every finite and infinite value of every element type; a NaN keeps its bits in float and
/// double lists (float lists computed in double keep a quiet NaN's, not a signalling NaN's),
/// and in bfloat16 lists when quiet; a half NaN is stored back as 0x7fff. Gradients are
/// checked, not parameters and states: those are finite in any run worth skipping a step for.
///
/// skip_if_nonfinite's check costs one read of the gradients (one reduction pass). Parts of `inner` with
/// reduction passes keep them (a skipped update ignores their results); after-step hooks of
/// `inner` still run on skipped steps (e.g. clip_by_global_norm reports the infinite norm).
/// Parts chained before the wrapper run on every step and must not write memory.
template <class Decide, class Inner>
struct skip_step_when : chained<skip_step_when<Decide, Inner>, chain_rule<Decide, detail::guard_t<Inner>>> {
  static_assert(fusedopt::detail::factor_count_v<Inner> == 0,
                "fusedopt: skip_if_nonfinite and skip_if_set cannot wrap a rule with factored passes (Adafactor, "
                "CAME: factored.hpp) yet: a skipped step would still fold its factored statistics");
  using base = chained<skip_step_when<Decide, Inner>, chain_rule<Decide, detail::guard_t<Inner>>>;
  using typename base::chain_type;
  /// What the chain reads, and every slot it writes: a skipped step stores loaded values.
  using reads = typename fusedopt::detail::merge_declared<typename chain_type::reads, typename chain_type::writes>::type;

  Inner inner{};
  flag_pointer found_inf{};  ///< written by count_nonfinite_gradients, read by read_skip_flag

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const { return fusedopt::chain(Decide{found_inf}, detail::guard(inner)); }

  /// @brief Checks `inner`'s options (with its own validate, if it has one).
  template <class Bound>
  void validate(Bound bound) const
  {
    fusedopt::detail::validate_rule(inner, bound);
  }
};

template <class Inner>
using skip_step_if_nonfinite = skip_step_when<count_nonfinite_gradients, Inner>;

/// @brief `inner`, skipped (every parameter and state unchanged) in any step where a gradient is
/// infinite or NaN; `found_inf` (float* or int32*, or nullptr) receives 1 or 0 after each step.
template <class Inner>
FUSEDOPT_HOST_DEVICE skip_step_if_nonfinite<Inner> skip_if_nonfinite(Inner const& inner, flag_pointer found_inf)
{
  return {{}, inner, found_inf};
}

/// @brief grad /= *grad_scale, in registers, as torch's fused optimizers unscale under
/// GradScaler's fused protocol (`optimizer.grad_scale`, the scaler's float scale tensor), with
/// torch's bits: torch takes the quotient in double and rounds it to float; a float compute type
/// here takes the correctly rounded float quotient, which is the same number (a double quotient
/// of floats rounded to float is never off by the double rounding: 53 >= 2 x 24 + 2 bits) at a
/// fraction of the cost (the double division made fusedopt_torch's AMP step 23% slower on the
/// H200: docs/decisions.md, "GradScaler's division in float"). A double compute type divides in
/// double. A null `grad_scale` leaves the gradients as they are (x / 1 is exact). The stored
/// gradients are not changed (torch's fused kernels write the unscaled gradient back; bind
/// nothing for that here).
struct divide_gradients {
  float const* grad_scale = nullptr;

  using reads = slots<slot::grad_t>;
  using writes = slots<>;

  struct prepared {
    double scale;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      if constexpr (std::is_same_v<T, float>) {
        e[slot::grad] = e[slot::grad] / static_cast<float>(scale);  // scale holds a float: exact
      } else {
        e[slot::grad] = static_cast<T>(static_cast<double>(e[slot::grad]) / scale);
      }
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const
  {
    return {grad_scale != nullptr ? static_cast<double>(*grad_scale) : 1.0};
  }
};

/// @brief The block behind skip_if_set: sets the register `slot::skip_step` from a flag that is
/// already known when the step starts (torch's `found_inf` under GradScaler's fused protocol,
/// written by the scaler's own non-finite check), so no reduction pass is needed. After a
/// skipped step with `step_info::advance` set, it takes back the backend's increment of the
/// step count, as torch's fused Adam subtracts found_inf from its step tensors.
struct read_skip_flag {
  flag_pointer flag{};

  using reads = slots<>;
  using writes = slots<>;
  using registers = slots<slot::skip_step_t>;

  struct prepared {
    bool skip;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::skip_step] = skip ? typename E::value_type(1) : typename E::value_type(0);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {flag.get()}; }

  /// Runs once per step (a single thread on the GPU), after every element was updated.
  FUSEDOPT_HOST_DEVICE void after_step(reduced const&, step_info const& step) const
  {
    if (flag.get() && step.advance != nullptr) { --*step.advance; }
  }
};

/// @brief `inner`, skipped (every parameter and state unchanged, as skip_step_if_nonfinite
/// describes) in a step where `*flag` is set when the step starts; unlike
/// skip_step_if_nonfinite it reads no gradient to decide: the flag comes from elsewhere (torch's
/// GradScaler computes `found_inf` before `optimizer.step`). Build it with skip_if_set(inner, flag).
template <class Inner>
using skip_step_if_set = skip_step_when<read_skip_flag, Inner>;

/// @brief `inner`, skipped in any step that starts with `*flag` set (float* or int32*; a null
/// flag never skips). The flag is only read: nothing clears it.
template <class Inner>
FUSEDOPT_HOST_DEVICE skip_step_if_set<Inner> skip_if_set(Inner const& inner, flag_pointer flag)
{
  return {{}, inner, flag};
}

/// @brief torch.amp.GradScaler.update() on the device, once per step after the update:
/// with `*found_inf` set, scale *= backoff_factor and growth_tracker = 0; otherwise
/// growth_tracker + 1 consecutive good steps, and when that reaches growth_interval,
/// scale *= growth_factor (kept only if finite) and growth_tracker = 0.
/// `scale` (float), `growth_tracker` (int32) and `found_inf` are the scaler's tensors (device
/// memory on the CUDA backend); `inv_scale`, when not null, receives float(1 / scale) for the
/// next step's unscale_gradients (as a double holding that float, so unscaling multiplies by
/// exactly torch's value). No per-element work: it only has an after-step hook.
struct grad_scaler_update {
  float* scale = nullptr;
  std::int32_t* growth_tracker = nullptr;
  flag_pointer found_inf{};
  scalar<double> growth_factor{2.0};
  scalar<double> backoff_factor{0.5};
  std::int32_t growth_interval = 2000;
  double* inv_scale = nullptr;

  using reads = slots<>;
  using writes = slots<>;

  struct prepared {
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E&) const
    {
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {}; }

  /// Runs once per step (a single thread on the GPU), after the parts before it.
  FUSEDOPT_HOST_DEVICE void after_step(reduced const&, step_info const&) const
  {
    if (found_inf.get()) {
      *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor.get());
      *growth_tracker = 0;
    } else {
      std::int32_t const successful = *growth_tracker + 1;
      if (successful == growth_interval) {
        float const grown = static_cast<float>(static_cast<double>(*scale) * growth_factor.get());
        if (grown - grown == 0.f) { *scale = grown; }  // never grow to infinity
        *growth_tracker = 0;
      } else {
        *growth_tracker = successful;
      }
    }
    if (inv_scale != nullptr) { *inv_scale = static_cast<float>(1.0 / static_cast<double>(*scale)); }
  }

  template <class Bound>
  void validate(Bound) const
  {
    FUSEDOPT_EXPECTS(scale != nullptr && growth_tracker != nullptr,
                     "grad_scaler_update: scale and growth_tracker must not be null");
    FUSEDOPT_EXPECTS(!found_inf.is_null(), "grad_scaler_update: found_inf must not be null");
    detail::expect_range("grad_scaler_update: growth_factor", growth_factor, detail::above_one);
    detail::expect_range("grad_scaler_update: backoff_factor", backoff_factor, detail::open_unit_interval);
    FUSEDOPT_EXPECTS(growth_interval > 0, "grad_scaler_update: growth_interval must be positive");
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
