/// @file families.hpp
/// @brief Plans of the built-in optimizer families, generic over the backend (host or CUDA).
///
/// A unit (unit_host.hpp or unit_cuda.cuh; _codegen.py writes its source) instantiates
/// `family_plan<B>` for one family, or every family, with a backend B whose filter says which
/// dtypes and layouts it compiles: the plan function of a family branches on the layout
/// (amsgrad, momentum, 8-bit states, ...) and the dtype at run time, and instantiates kernels
/// only in the branches B compiles.
#pragma once

#include <fusedopt/rules/adadelta.hpp>
#include <fusedopt/rules/adagrad.hpp>
#include <fusedopt/rules/adam.hpp>
#include <fusedopt/rules/adamax.hpp>
#include <fusedopt/rules/kahan.hpp>
#include <fusedopt/rules/lamb.hpp>
#include <fusedopt/rules/lion.hpp>
#include <fusedopt/rules/mixed_precision.hpp>
#include <fusedopt/rules/nadam.hpp>
#include <fusedopt/rules/radam.hpp>
#include <fusedopt/rules/rmsprop.hpp>
#include <fusedopt/rules/sgd.hpp>

#include "unit_plans.hpp"

namespace fusedopt_torch {
namespace detail {

// ---- rules from hyperparameters -----------------------------------------------------------

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

template <class Build, bool Compensated, class T>
struct builder_for<low_precision_of<Build, Compensated>, T> {
  using type = low_precision<Build, T, Compensated>;
  // A compensation state only for 16-bit parameters: no kernels for the others.
  static constexpr bool enabled = !Compensated || std::is_same_v<T, fo::bfloat16> || std::is_same_v<T, fo::half>;
};

/// 16-bit parameters with a float32 master copy (layout::master): the family's rule runs on the
/// master (rules::with_master: the master loaded and stored exactly, the parameter stored as its
/// rounding to nearest even and never loaded).
template <class Build>
struct on_master : Build {
  template <class F>
  void run_with(hyper const& h, F&& f) const
  {
    Build::run_with(h, [&](auto const& rule) { f(rules::with_master<std::decay_t<decltype(rule)>>{rule}); });
  }
};

template <class Build, class T>
struct builder_for<on_master<Build>, T> {
  using type = on_master<Build>;
  // A master only for 16-bit parameters: no kernels for the others.
  static constexpr bool enabled = std::is_same_v<T, fo::bfloat16> || std::is_same_v<T, fo::half>;
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

// ---- plans per family ------------------------------------------------------------------------

// Layout bits (plans.hpp's layout::bits), for in_layout's branches.
constexpr std::uint32_t amsgrad_bit = layout::amsgrad_bit, momentum_bit = layout::momentum_bit,
                        centered_bit = layout::centered_bit, clip_bit = layout::clip_bit, kahan_bit = layout::kahan_bit,
                        quantized_bit = layout::quantized_bit, master_bit = layout::master_bit;

template <class B>
std::unique_ptr<plan> sgd_plan(dtype t, layout const& l, lists const& x, void* s)
{
  if (l.quantized) {
    // A bucket without momentum has no states, so it never has quantized ones.
    FUSEDOPT_EXPECTS(l.momentum, "fusedopt_torch: 8-bit SGD states need momentum");
    return in_layout<B, momentum_bit | quantized_bit>(
      [&](auto) { return plan_of<B, build_sgd, q8<slot::momentum_buffer_t>>(t, x, s); });
  }
  if (l.momentum) {
    return in_layout<B, momentum_bit>([&](auto) { return plan_of<B, build_sgd, slot::momentum_buffer_t>(t, x, s); });
  }
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_sgd>(t, x, s); });
}

/// Adam and AdamW (`Build`), full-precision or 8-bit (`Quantized`) moments.
template <class B, class Build, bool Quantized>
std::unique_ptr<plan> adam_plan_of(dtype t, layout const& l, lists const& x, void* s)
{
  // States: exp_avg, exp_avg_sq, [max_exp_avg_sq: amsgrad], [kahan_comp: kahan | master: master].
  using namespace slot;
  using m = moment<Quantized, exp_avg_t>;
  using v = moment<Quantized, exp_avg_sq_t>;
  using plain = low_precision_of<Build, false>;
  using compensated = low_precision_of<Build, true>;
  constexpr std::uint32_t q = Quantized ? quantized_bit : 0;
  if (l.master) {
    // Python refuses master_weights with 8-bit states and with kahan: no kernels for them.
    if constexpr (Quantized) {
      throw fo::error("fusedopt_torch: master_weights takes full-precision states, not 8-bit ones");
    } else {
      FUSEDOPT_EXPECTS(!l.kahan, "fusedopt_torch: master_weights and kahan are two ways to keep low-precision "
                                 "updates: choose one");
      using mastered = on_master<Build>;
      if (l.amsgrad) {
        return in_layout<B, amsgrad_bit | master_bit>([&](auto) {
          return plan_of<B, mastered, as_float<m>, as_float<v>, as_float<max_exp_avg_sq_t>, as_float<master_t>>(t, x,
                                                                                                                  s);
        });
      }
      return in_layout<B, master_bit>(
        [&](auto) { return plan_of<B, mastered, as_float<m>, as_float<v>, as_float<master_t>>(t, x, s); });
    }
  }
  if (l.amsgrad) {
    if constexpr (Quantized) {
      // No AMSGrad with 8-bit moments: Python refuses it, and no kernels are built for it.
      throw fo::error("fusedopt_torch: 8-bit Adam states have no AMSGrad variant");
    } else if (l.kahan) {
      return in_layout<B, amsgrad_bit | kahan_bit>(
        [&](auto) { return plan_of<B, compensated, m, v, max_exp_avg_sq_t, compensation_t>(t, x, s); });
    } else {
      return in_layout<B, amsgrad_bit>([&](auto) { return plan_of<B, plain, m, v, max_exp_avg_sq_t>(t, x, s); });
    }
  }
  if (l.kahan) {
    return in_layout<B, kahan_bit | q>([&](auto) { return plan_of<B, compensated, m, v, compensation_t>(t, x, s); });
  }
  return in_layout<B, q>([&](auto) { return plan_of<B, plain, m, v>(t, x, s); });
}

template <class B, class Build>
std::unique_ptr<plan> adam_family_plan(dtype t, layout const& l, lists const& x, void* s)
{
  return l.quantized ? adam_plan_of<B, Build, true>(t, l, x, s) : adam_plan_of<B, Build, false>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adam_plan(dtype t, layout const& l, lists const& x, void* s)
{
  return adam_family_plan<B, build_adam>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adamw_plan(dtype t, layout const& l, lists const& x, void* s)
{
  return adam_family_plan<B, build_adamw>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adagrad_plan(dtype t, layout const&, lists const& x, void* s)
{
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_adagrad, slot::sum_sq_t>(t, x, s); });
}

template <class B>
std::unique_ptr<plan> rmsprop_plan(dtype t, layout const& l, lists const& x, void* s)
{
  // State order: square_avg, then momentum_buffer (with momentum), then grad_avg (centered).
  using namespace slot;
  if (l.momentum && l.centered) {
    return in_layout<B, momentum_bit | centered_bit>(
      [&](auto) { return plan_of<B, build_rmsprop, square_avg_t, momentum_buffer_t, grad_avg_t>(t, x, s); });
  }
  if (l.momentum) {
    return in_layout<B, momentum_bit>(
      [&](auto) { return plan_of<B, build_rmsprop, square_avg_t, momentum_buffer_t>(t, x, s); });
  }
  if (l.centered) {
    return in_layout<B, centered_bit>(
      [&](auto) { return plan_of<B, build_rmsprop, square_avg_t, grad_avg_t>(t, x, s); });
  }
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_rmsprop, square_avg_t>(t, x, s); });
}

template <class B>
std::unique_ptr<plan> lamb_plan(dtype t, layout const& l, lists const& x, void* s)
{
  // The trust ratio needs two accumulators, the clip one more in its own pass.
  constexpr int capacity = 4;
  using namespace slot;
  if (l.clip) {
    return in_layout<B, clip_bit>(
      [&](auto) { return plan_of<B, build_clipped_lamb, exp_avg_t, exp_avg_sq_t>(t, x, s, capacity); });
  }
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_lamb, exp_avg_t, exp_avg_sq_t>(t, x, s, capacity); });
}

template <class B>
std::unique_ptr<plan> lion_plan(dtype t, layout const& l, lists const& x, void* s)
{
  if (l.quantized) {
    return in_layout<B, quantized_bit>([&](auto) { return plan_of<B, build_lion, q8<slot::exp_avg_t>>(t, x, s); });
  }
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_lion, slot::exp_avg_t>(t, x, s); });
}

template <class B>
std::unique_ptr<plan> radam_plan(dtype t, layout const&, lists const& x, void* s)
{
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_radam, slot::exp_avg_t, slot::exp_avg_sq_t>(t, x, s); });
}

template <class B>
std::unique_ptr<plan> adamax_plan(dtype t, layout const&, lists const& x, void* s)
{
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_adamax, slot::exp_avg_t, slot::exp_inf_t>(t, x, s); });
}

template <class B>
std::unique_ptr<plan> adadelta_plan(dtype t, layout const&, lists const& x, void* s)
{
  return in_layout<B, 0>(
    [&](auto) { return plan_of<B, build_adadelta, slot::square_avg_t, slot::acc_delta_t>(t, x, s); });
}

template <class B>
std::unique_ptr<plan> nadam_plan(dtype t, layout const&, lists const& x, void* s)
{
  // torch's mu_product is a scalar per bucket (hyper::mu_product), not a slot.
  return in_layout<B, 0>([&](auto) { return plan_of<B, build_nadam, slot::exp_avg_t, slot::exp_avg_sq_t>(t, x, s); });
}

/// The plan of family `f`: one of `Families`, or any built-in family where the list is empty
/// (a unit compiles the families it names).
template <class B, family... Families>
std::unique_ptr<plan> family_plan(family f, dtype t, layout const& l, lists const& x, void* s)
{
  switch (f) {
#define FUSEDOPT_TORCH_CASE(name, plans)                                                 \
  case family::name:                                                                     \
    if constexpr (sizeof...(Families) == 0 || ((family::name == Families) || ...)) {     \
      return plans##_plan<B>(t, l, x, s);                                                \
    }                                                                                    \
    break;
    FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_CASE)
#undef FUSEDOPT_TORCH_CASE
    default: break;
  }
  not_in_unit("optimizer family");
}

}  // namespace detail
}  // namespace fusedopt_torch
