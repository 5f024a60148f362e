// Independent double-precision references of the optimizers of issue 42 (Rprop, ASGD,
// Schedule-Free AdamW/SGD, AdEMAMix, Adan, ADOPT, StableAdamW, the cautious mask and cautious
// weight decay, Prodigy), one element at a time, in the rv arithmetic of rv.hpp: each value
// carries a bound on the rounding error of computing it, from which the checkers of
// harness.hpp derive their tolerances.
//
// Each follows its reference implementation statement by statement (named at each struct), with
// the reference's own order of operations, constants and Python-double scalars; none calls
// fusedopt's rules. Per-step scalars are computed with the C library (std::pow, std::log), not
// with fusedopt's math::portable_pow: the library's are a second computation of them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "edge_sizes.hpp"
#include "reference/harness.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test::breadth {

// ---- shared arithmetic ----------------------------------------------------------------------

/// x^y as Python's float power computes it (C's pow), with the error bound of the library's
/// portable_pow (about (1 + |y ln x|) ulp, doubled for safety) in units of double's u.
inline rv real_power(double x, double y)
{
  double const p = std::pow(x, y);
  double const logged = x > 0 ? std::fabs(y * std::log(x)) : 0.0;
  return {p, std::fabs(p) * 4 * (1 + logged)};
}

/// A per-step or per-tensor value the library computes from rv inputs in its arithmetic and
/// rounds once to the arithmetic type: for double the bound stands; for float (half, bfloat16
/// too) the rounding to float is added to the error the value already carries (in float's u).
template <class T>
rv derived(rv c)
{
  if constexpr (std::is_same_v<T, double>) {
    return c;
  } else {
    return {c.v, c.e + std::fabs(c.v)};
  }
}

/// x rounded to the storage type T and back, exactly as a store would (the reference's
/// computations in a tensor's own dtype).
template <class T>
double in_storage(double x)
{
  return to_double(from_double<T>(x));
}

/// torch's lerp with a weight that carries its own error (a per-step value).
template <class T>
rv lerp_rv(rv self, rv end, rv weight)
{
  if (std::fabs(weight.v) < 0.5) { return self + coefficient<T>(weight) * (end - self); }
  return end - (end - self) * coefficient<T>(exact(1) - weight);
}

/// Whether the sign of `x` is decided by the computation: |x| clear of its error bound.
template <class T>
bool sign_certain(rv x)
{
  return std::fabs(x.v) > 2 * slack * precision<T>::op * x.e;
}

/// sign(x) of torch.
inline double sign_of(double x) { return static_cast<double>((x > 0) - (x < 0)); }

/// torch's clamp(x, lo, hi): min(max(x, lo), hi).
inline double clamp(double x, double lo, double hi)
{
  double const low = x < lo ? lo : x;
  return low > hi ? hi : low;
}

/// Runs `run`, which must throw fusedopt::error, and checks that the tensors of `data`
/// (slot_data) are unchanged: bad options are rejected before anything is written.
template <class Run, class... Data>
void expect_rejected(Run&& run, Data const&... data)
{
  auto const before = std::make_tuple(data.snapshot()...);
  REQUIRE_THROWS_AS(run(), fusedopt::error);
  CHECK(before == std::make_tuple(data.snapshot()...));
}

/// The problem of the rejection tests of rules over param, grad, exp_avg and exp_avg_sq: two
/// small tensors, random parameters and gradients, zero states.
template <class T>
struct moments_problem {
  slot_data<T> param{{3, 17}, 0}, grad{{3, 17}, 0}, exp_avg{{3, 17}, 0}, exp_avg_sq{{3, 17}, 0};
  moments_problem()
  {
    random r(3);
    param.randomize(r, -1, 1);
    grad.randomize(r, -1, 1);
  }
  /// Checks that a step of `rule` on the backend of `Executor` throws before writing.
  template <class Executor, class Rule>
  void rejects(Rule const& rule)
  {
    auto const plan =
      Executor::make_plan(0, writes(fusedopt::slot::param, param), reads(fusedopt::slot::grad, grad),
                          writes(fusedopt::slot::exp_avg, exp_avg), writes(fusedopt::slot::exp_avg_sq, exp_avg_sq));
    expect_rejected([&] { plan.run(rule, fusedopt::step_info{2}); }, param, exp_avg, exp_avg_sq);
  }
};

/// The tensor sizes of the trajectories: every edge of both backends that stays cheap to
/// check element by element (tests/edge_sizes.hpp).
inline std::vector<std::int64_t> trajectory_sizes() { return quick_edge_sizes(); }

// ---- Rprop ----------------------------------------------------------------------------------

/// torch.optim.Rprop, `_single_tensor_rprop`, with every tensor in the element type T: the
/// product grad * prev, the etas and the step sizes are values of T, as torch holds them.
struct rprop_reference {
  double lr, etaminus, etaplus, step_size_min, step_size_max;
  bool maximize;

  /// One element: `prev` and `step_size` are the stored states (exact), updated in place
  /// (step_size with its error bound), `first` the state initialisation of step 1.
  template <class T>
  void step(bool first, rv& param, double grad, double& prev, rv& step_size) const
  {
    double const g = maximize ? -grad : grad;
    double const previous = first ? 0.0 : prev;
    double const size = first ? in_storage<T>(lr) : step_size.v;
    double const product = in_storage<T>(g * previous);  // exact in double, then rounded as torch
    double const minus = in_storage<T>(etaminus);
    double const factor = product > 0 ? in_storage<T>(etaplus) : (product < 0 ? minus : 1.0);
    // The new step size in T (torch holds it there): one rounding, which the reference's slack
    // covers where the backend rounds the product and the bounds before the clamp.
    double const clamped = in_storage<T>(clamp(size * factor, step_size_min, step_size_max));
    step_size = {clamped, std::fabs(clamped)};
    double const direction = factor == minus ? 0.0 : g;
    prev = direction;
    param = param - exact(sign_of(direction)) * step_size;
  }
};

// ---- ASGD -----------------------------------------------------------------------------------

/// torch.optim.ASGD, `_single_tensor_asgd` (not capturable), with torch's float32 eta and mu.
struct asgd_reference {
  double lr, lambd, alpha, t0, weight_decay;
  bool maximize;

  /// eta of step t: set at the end of step t - 1 (lr before the first).
  [[nodiscard]] double eta(std::int64_t t) const
  {
    double const step = static_cast<double>(t - 1);
    double const value = t == 1 ? lr : lr / std::pow(1 + lambd * lr * step, alpha);
    return static_cast<double>(static_cast<float>(value));
  }
  /// mu of step t: set at the end of step t - 1 (1 before the first).
  [[nodiscard]] double mu(std::int64_t t) const
  {
    double const step = static_cast<double>(t - 1);
    double const value = t == 1 ? 1.0 : 1 / std::max(1.0, step - t0);
    return static_cast<double>(static_cast<float>(value));
  }

  template <class T>
  void step(std::int64_t t, rv& param, rv grad, rv& ax) const
  {
    rv g = maximize ? -grad : grad;
    if (weight_decay != 0) { g = g + coefficient<T>(weight_decay) * param; }
    double const e = eta(t);
    // torch's eta is a float32 value the library rounds to as well: one rounding of slack.
    param = param * coefficient<T>(rv{1 - lambd * e, std::fabs(lambd * e)});
    param = param + coefficient<T>(rv{-e, std::fabs(e)}) * g;
    double const m = mu(t);
    ax = m == 1 ? param : ax + (param - ax) * coefficient<T>(m);
  }
};

// ---- Schedule-Free --------------------------------------------------------------------------

/// The reference's group scalars (facebookresearch/schedule_free).
struct schedule_free_sums {
  double lr_max = -1.0, weight_sum = 0.0;
};

/// The per-step values of AdamWScheduleFree / SGDScheduleFree's `step` for group scalars
/// `sums` (advanced in place): the scheduled lr and ckp1.
struct schedule_free_schedule {
  double lr;
  std::int64_t warmup_steps;
  double r, weight_lr_power;

  struct values {
    double lr, ckp1;
  };
  values advance(std::int64_t t, schedule_free_sums& sums) const
  {
    auto const k = static_cast<double>(t - 1);
    double const sched = k < static_cast<double>(warmup_steps) ? (k + 1) / static_cast<double>(warmup_steps) : 1.0;
    double const lr_t = lr * sched;
    sums.lr_max = std::max(lr_t, sums.lr_max);
    double const weight = std::pow(k + 1, r) * std::pow(sums.lr_max, weight_lr_power);
    sums.weight_sum += weight;
    return {lr_t, sums.weight_sum != 0 ? weight / sums.weight_sum : 0.0};
  }
};

/// The y and z updates both optimizers share, from the normalised gradient `gn` (the decay
/// at y included), with `first` the state initialisation z = clone(p).
template <class T>
void schedule_free_update(bool first, rv& y, rv& z, rv gn, double lr, double ckp1, double beta1)
{
  rv const z0 = first ? y : z;
  y = lerp<T>(y, z0, ckp1);
  y = y + coefficient<T>(lr * (beta1 * (1 - ckp1) - 1)) * gn;
  z = z0 - coefficient<T>(lr) * gn;
}

/// AdamWScheduleFree's `step` (loop path) for one element.
struct schedule_free_adamw_reference {
  double beta1, beta2, eps, weight_decay, inner_momentum;
  bool maximize;

  template <class T>
  void step(std::int64_t t, double lr, double ckp1, rv& y, rv grad, rv& z, rv& exp_avg_sq, rv& exp_avg) const
  {
    rv const g = maximize ? -grad : grad;
    rv const bias_correction2 = exact(1) - power(beta2, t);
    exp_avg_sq = exp_avg_sq * coefficient<T>(beta2) + coefficient<T>(1 - beta2) * g * g;
    rv const denom = sqrt(exp_avg_sq / coefficient<T>(bias_correction2)) + coefficient<T>(eps);
    rv gn;
    if (inner_momentum != 0) {
      rv const bias_correction1 = exact(1) - power(inner_momentum, t);
      exp_avg = exp_avg * coefficient<T>(inner_momentum) + coefficient<T>(1 - inner_momentum) * g;
      gn = exp_avg / coefficient<T>(bias_correction1) / denom;
    } else {
      gn = g / denom;
    }
    if (weight_decay != 0) { gn = gn + coefficient<T>(weight_decay) * y; }
    schedule_free_update<T>(t == 1, y, z, gn, lr, ckp1, beta1);
  }
};

/// SGDScheduleFree's `step` (loop path) for one element.
struct schedule_free_sgd_reference {
  double momentum, weight_decay;
  bool maximize;

  template <class T>
  void step(std::int64_t t, double lr, double ckp1, rv& y, rv grad, rv& z) const
  {
    rv g = maximize ? -grad : grad;
    if (weight_decay != 0) { g = g + coefficient<T>(weight_decay) * y; }
    schedule_free_update<T>(t == 1, y, z, g, lr, ckp1, momentum);
  }
};

// ---- AdEMAMix -------------------------------------------------------------------------------

/// apple/ml-ademamix's AdEMAMix.step for one element (a warmup of 0 is the reference's None).
struct ademamix_reference {
  double lr, beta1, beta2, beta3, alpha, eps, weight_decay;
  std::int64_t alpha_warmup, beta3_warmup;
  bool maximize;

  [[nodiscard]] double alpha_at(std::int64_t t) const
  {
    if (alpha_warmup == 0 || t >= alpha_warmup) { return alpha; }
    double const a = static_cast<double>(t) / static_cast<double>(alpha_warmup);
    return (1.0 - a) * 0.0 + a * alpha;
  }
  [[nodiscard]] rv beta3_at(std::int64_t t) const
  {
    if (beta3_warmup == 0 || t >= beta3_warmup) { return exact(beta3); }
    auto const f = [](double b) { return std::log(0.5) / std::log(b + 1e-8) - 1; };
    double const a = static_cast<double>(t) / static_cast<double>(beta3_warmup);
    double const x = (1.0 - a) * f(beta1) + a * f(beta3);
    return real_power(0.5, 1 / (x + 1));
  }

  template <class T>
  void step(std::int64_t t, rv& param, rv grad, rv& fast, rv& slow, rv& exp_avg_sq) const
  {
    rv const g = maximize ? -grad : grad;
    rv const bias_correction1 = exact(1) - power(beta1, t);
    rv const bias_correction2 = exact(1) - power(beta2, t);
    rv const b3 = beta3_at(t);
    rv m1 = g;
    if (beta1 != 0) {
      fast = fast * coefficient<T>(beta1) + coefficient<T>(1 - beta1) * g;
      m1 = fast;
    }
    slow = slow * coefficient<T>(b3) + coefficient<T>(exact(1) - b3) * g;
    exp_avg_sq = exp_avg_sq * coefficient<T>(beta2) + coefficient<T>(1 - beta2) * g * g;
    rv const denom = sqrt(exp_avg_sq) / coefficient<T>(sqrt(bias_correction2)) + coefficient<T>(eps);
    rv update = (m1 / coefficient<T>(bias_correction1) + coefficient<T>(alpha_at(t)) * slow) / denom;
    update = update + coefficient<T>(weight_decay) * param;
    param = param + coefficient<T>(-lr) * update;
  }
};

// ---- Adan -----------------------------------------------------------------------------------

/// sail-sg/Adan's `_single_tensor_adan` for one element (max_grad_norm 0).
struct adan_reference {
  double lr, beta1, beta2, beta3, eps, weight_decay;
  bool no_prox, maximize;

  template <class T>
  void step(std::int64_t t, rv& param, rv grad, rv& exp_avg, rv& exp_avg_diff, rv& exp_avg_sq, rv& neg_pre_grad) const
  {
    rv const g = maximize ? -grad : grad;
    rv const bias_correction1 = exact(1) - power(beta1, t);
    rv const bias_correction2 = exact(1) - power(beta2, t);
    rv const bias_correction3_sqrt = sqrt(exact(1) - power(beta3, t));
    if (t == 1) { neg_pre_grad = -g; }
    rv diff = neg_pre_grad + g;
    exp_avg = exp_avg * coefficient<T>(beta1) + coefficient<T>(1 - beta1) * g;
    exp_avg_diff = exp_avg_diff * coefficient<T>(beta2) + coefficient<T>(1 - beta2) * diff;
    diff = diff * coefficient<T>(beta2) + g;
    exp_avg_sq = exp_avg_sq * coefficient<T>(beta3) + coefficient<T>(1 - beta3) * diff * diff;
    rv const denom = sqrt(exp_avg_sq) / coefficient<T>(bias_correction3_sqrt) + coefficient<T>(eps);
    rv const step_size_diff = coefficient<T>(exact(lr * beta2) / bias_correction2);
    rv const step_size = coefficient<T>(exact(lr) / bias_correction1);
    if (no_prox) { param = param * coefficient<T>(1 - lr * weight_decay); }
    param = param - step_size * (exp_avg / denom);
    param = param - step_size_diff * (exp_avg_diff / denom);
    if (!no_prox) { param = param / coefficient<T>(1 + lr * weight_decay); }
    neg_pre_grad = -g;
  }
};

// ---- ADOPT ----------------------------------------------------------------------------------

/// iShohei220/adopt's `_single_tensor_adopt` for one element (clip_lambda = step ** clip_exp,
/// or None without `clip`).
struct adopt_reference {
  double lr, beta1, beta2, eps, clip_exp, weight_decay;
  bool clip, decouple, maximize;

  template <class T>
  void step(std::int64_t t, rv& param, rv grad, rv& exp_avg, rv& exp_avg_sq) const
  {
    rv g = maximize ? -grad : grad;
    if (weight_decay != 0 && !decouple) { g = g + coefficient<T>(weight_decay) * param; }
    std::int64_t const step = t - 1;  // the reference's state step, before its increment
    if (step == 0) {
      exp_avg_sq = exp_avg_sq + g * g;
      return;
    }
    if (weight_decay != 0 && decouple) { param = param + coefficient<T>(-lr * weight_decay) * param; }
    rv const denom = maximum(sqrt(exp_avg_sq), coefficient<T>(eps));
    rv normed = g / denom;
    if (clip) {
      rv const bound = coefficient<T>(real_power(static_cast<double>(step), clip_exp));
      if (normed.v > bound.v) { normed = bound; }
      if (normed.v < -bound.v) { normed = -bound; }
    }
    exp_avg = lerp<T>(exp_avg, normed, 1 - beta1);
    param = param + coefficient<T>(-lr) * exp_avg;
    exp_avg_sq = exp_avg_sq * coefficient<T>(beta2) + coefficient<T>(1 - beta2) * g * g;
  }
};

// ---- references over whole tensors (per-tensor and global reductions) ----------------------

/// One tensor's values in the references below: one rv per element.
using tensor_values = std::vector<rv>;

/// One tensor of a snapshot (slot_data::snapshot), as exact reference inputs.
inline tensor_values exact_values(std::vector<double> const& values)
{
  tensor_values out;
  for (double x : values) { out.push_back(exact(x)); }
  return out;
}

/// An rv sum of terms in order: the error bound of a sequential sum, which bounds any order
/// of summation the backends take (their chunked float sums and double combines).
inline rv sum_of(tensor_values const& terms)
{
  rv total = exact(0);
  for (rv const& x : terms) { total = total + x; }
  return total;
}
inline rv abs_of(rv x) { return {std::fabs(x.v), x.e}; }

/// optimi's StableAdamW (`_single_param_stableadamw`, no Kahan summation) over one tensor:
/// debiased betas, the RMS of grad^2 / max(exp_avg_sq, eps^2) per tensor, lr_t = lr / max(1,
/// rms), decay at lr_t (or lr_t / max_lr).
struct stable_adamw_reference {
  double lr, beta1, beta2, weight_decay, eps, max_lr;
  bool decouple_lr, maximize;

  static rv debias(double beta, std::int64_t t)
  {
    rv const p = power(beta, t);
    return (p - exact(beta)) / (p - exact(1));
  }

  template <class T>
  void step(std::int64_t t, tensor_values& param, std::vector<double> const& grad, tensor_values& exp_avg,
            tensor_values& exp_avg_sq) const
  {
    rv const beta1_hat = debias(beta1, t);
    rv const beta2_hat = debias(beta2, t);
    tensor_values ratios;
    for (std::size_t i = 0; i < param.size(); ++i) {
      rv const g = exact(maximize ? -grad[i] : grad[i]);
      exp_avg[i] = lerp_rv<T>(exp_avg[i], g, exact(1) - beta1_hat);
      exp_avg_sq[i] = exp_avg_sq[i] * coefficient<T>(beta2_hat) + coefficient<T>(exact(1) - beta2_hat) * g * g;
      // The second moment as computed, before its store rounds it to T (optimi's rounds first,
      // and holds eps^2 in T: the same for float and double, docs/rules.md).
      ratios.push_back(g * g / maximum(exp_avg_sq[i], coefficient<T>(eps * eps)));
    }
    if (param.empty()) { return; }
    rv const rms = sqrt(sum_of(ratios) / exact(static_cast<double>(param.size())));
    rv const lr_t = derived<T>(exact(lr) / (rms.v > 1 ? rms : exact(1)));
    rv const rate = decouple_lr ? derived<T>(lr_t / coefficient<T>(max_lr)) : lr_t;
    rv const decay = exact(1) - rate * coefficient<T>(weight_decay);
    for (std::size_t i = 0; i < param.size(); ++i) {
      if (weight_decay != 0) { param[i] = param[i] * decay; }
      param[i] = param[i] + (-lr_t) * (exp_avg[i] / (sqrt(exp_avg_sq[i]) + coefficient<T>(eps)));
    }
  }
};

/// Counts of a cautious mask over one tensor: elements kept, and elements whose sign test the
/// reference cannot decide (the product is within rounding of 0): a backend may decide them
/// either way, which also moves the scale of the tensor's kept elements.
struct mask_counts {
  std::size_t kept = 0, undecided = 0;
};

/// The scale a cautious mask gives the kept elements: 1 / max(kept / n, min_mean).
inline double mask_scale(std::size_t kept, std::size_t n, double min_mean = 1e-3)
{
  double const mean = n > 0 ? static_cast<double>(kept) / static_cast<double>(n) : 0.0;
  return 1 / std::max(mean, min_mean);
}

/// The candidates for a parameter after a masked step: the step if the element is kept (or may
/// be), with the scale of any count of kept elements the undecided ones allow (kept .. kept +
/// undecided: one rv whose bound spans them), and the parameter unchanged if it is dropped (or
/// may be). `step(scale)` gives the kept parameter for a scale.
template <class T, class Step>
std::vector<rv> masked_candidates(mask_counts const& counts, std::size_t n, bool keep, bool certain, rv unchanged,
                                  Step&& step)
{
  std::vector<rv> out;
  if (keep || !certain) {
    double const high = mask_scale(counts.kept, n), low = mask_scale(counts.kept + counts.undecided, n);
    rv const scale = coefficient<T>((high + low) / 2);
    out.push_back(step(rv{scale.v, scale.e + (high - low) / 2 / precision<T>::op}));
  }
  if (!keep || !certain) { out.push_back(unchanged); }
  return out;
}

/// torch.optim.AdamW (`_single_tensor_adam`, decoupled) over one tensor with C-Optim's / timm's
/// cautious mask on exp_avg (`mask`: exp_avg * grad > 0, scaled by 1 / max(mean(mask), 1e-3)),
/// or with Cautious Weight Decay (`cautious_decay`: decay only where exp_avg * param >= 0).
/// Updates the moments and fills the candidates for each parameter; returns the mask counts.
struct cautious_adamw_reference {
  double lr, beta1, beta2, eps, weight_decay;
  bool maximize, mask, cautious_decay;

  template <class T>
  mask_counts step(std::int64_t t, tensor_values const& param, std::vector<double> const& grad,
                   tensor_values& exp_avg, tensor_values& exp_avg_sq, std::vector<std::vector<rv>>& candidates) const
  {
    rv const step_size = coefficient<T>(exact(lr) / (exact(1) - power(beta1, t)));
    rv const bias_correction2_sqrt = coefficient<T>(sqrt(exact(1) - power(beta2, t)));
    rv const decay = coefficient<T>(exact(1) - exact(lr) * exact(weight_decay));
    std::size_t const n = param.size();
    mask_counts counts;
    std::vector<bool> keep(n), certain(n);
    tensor_values decayed(n);
    for (std::size_t i = 0; i < n; ++i) {
      rv const g = exact(maximize ? -grad[i] : grad[i]);
      decayed[i] = weight_decay != 0 && !cautious_decay ? param[i] * decay : param[i];
      exp_avg[i] = lerp<T>(exp_avg[i], g, 1 - beta1);
      exp_avg_sq[i] = exp_avg_sq[i] * coefficient<T>(beta2) + coefficient<T>(1 - beta2) * g * g;
      double const against = cautious_decay ? param[i].v : g.v;
      certain[i] = sign_certain<T>(exp_avg[i]);
      keep[i] = cautious_decay ? exp_avg[i].v * against >= 0 : exp_avg[i].v * against > 0;
      counts.kept += keep[i] && certain[i] ? 1 : 0;
      counts.undecided += certain[i] ? 0 : 1;
    }
    candidates.assign(n, {});
    for (std::size_t i = 0; i < n; ++i) {
      rv const denom = sqrt(exp_avg_sq[i]) / bias_correction2_sqrt + coefficient<T>(eps);
      if (cautious_decay) {
        rv const stepped = param[i] - step_size * (exp_avg[i] / denom);
        candidates[i] = {keep[i] ? param[i] * decay - step_size * (exp_avg[i] / denom) : stepped};
        if (!certain[i]) { candidates[i].push_back(param[i] * decay - step_size * (exp_avg[i] / denom)); }
        if (!certain[i]) { candidates[i].push_back(stepped); }
      } else if (mask) {
        candidates[i] = masked_candidates<T>(counts, n, keep[i], certain[i], decayed[i], [&](rv scale) {
          return decayed[i] - step_size * ((exp_avg[i] * scale) / denom);
        });
      } else {
        candidates[i] = {decayed[i] - step_size * (exp_avg[i] / denom)};
      }
    }
    return counts;
  }
};

/// Prodigy's scalars between steps (the reference's group['d'], ['d_max'], ['d_numerator']).
struct prodigy_scalars {
  rv d, d_max, d_numerator;
};

/// konstmish/prodigy's Prodigy.step (one group, slice_p = 1) over all tensors: `state` holds
/// the scalars before the step (d0, d0, 0 before the first) and is advanced.
struct prodigy_reference {
  double lr, beta1, beta2, beta3, eps, weight_decay, d0, d_coef, growth_rate;
  bool decouple, use_bias_correction, safeguard_warmup, maximize;

  template <class T>
  void step(std::int64_t t, prodigy_scalars& state, std::vector<tensor_values>& param,
            std::vector<std::vector<double>> const& grad, std::vector<std::vector<double>> const& p0,
            std::vector<tensor_values>& s, std::vector<tensor_values>& exp_avg, std::vector<tensor_values>& exp_avg_sq) const
  {
    double const b3 = beta3 < 0 ? std::sqrt(beta2) : beta3;
    rv const bias_correction =
      use_bias_correction ? sqrt(exact(1) - power(beta2, t)) / (exact(1) - power(beta1, t)) : exact(1);
    double const d = state.d.v;  // read from memory: exact
    rv const dlr = exact(d) * exact(lr) * bias_correction;
    rv const ratio = exact(d) / exact(d0);
    rv const d_numerator = exact(state.d_numerator.v) * exact(b3);
    tensor_values dots, magnitudes;
    std::vector<tensor_values> grads(param.size());
    for (std::size_t k = 0; k < param.size(); ++k) {
      for (std::size_t i = 0; i < param[k].size(); ++i) {
        rv g = exact(maximize ? -grad[k][i] : grad[k][i]);
        if (weight_decay != 0 && !decouple) { g = g + coefficient<T>(weight_decay) * param[k][i]; }
        grads[k].push_back(g);
        dots.push_back(g * (exact(p0[k][i]) - param[k][i]));
        if (beta1 > 0) { exp_avg[k][i] = exp_avg[k][i] * coefficient<T>(beta1) + coefficient<T>(d * (1 - beta1)) * g; }
        exp_avg_sq[k][i] = exp_avg_sq[k][i] * coefficient<T>(beta2) + coefficient<T>(d * d * (1 - beta2)) * g * g;
        rv const s_coefficient = ratio * (safeguard_warmup ? exact(d) : dlr);
        s[k][i] = s[k][i] * coefficient<T>(b3) + coefficient<T>(s_coefficient) * g;
        magnitudes.push_back(abs_of(s[k][i]));
      }
    }
    rv const d_denom = sum_of(magnitudes);
    if (d_denom.v == 0) { return; }
    rv const numerator = d_numerator + ratio * dlr * sum_of(dots);
    rv const d_hat = exact(d_coef) * numerator / d_denom;
    rv d_new = state.d;
    if (d == d0) { d_new = maximum(d_new, d_hat); }
    rv const d_max = maximum(state.d_max, d_hat);
    // Python's min(d_max, d * growth_rate), the rv of the value chosen (an infinite growth rate
    // gives d_max, where an rv product with infinity would carry no bound).
    if (d_new.v * growth_rate < d_max.v) {
      d_new = d_new * exact(growth_rate);
    } else {
      d_new = d_max;
    }
    state = {d_new, d_max, numerator};
    for (std::size_t k = 0; k < param.size(); ++k) {
      for (std::size_t i = 0; i < param[k].size(); ++i) {
        rv const denom = sqrt(exp_avg_sq[k][i]) + derived<T>(d_new * exact(eps));
        if (weight_decay != 0 && decouple) {
          param[k][i] = param[k][i] + coefficient<T>(exact(-weight_decay) * dlr) * param[k][i];
        }
        if (beta1 > 0) {
          param[k][i] = param[k][i] + coefficient<T>(-dlr) * (exp_avg[k][i] / denom);
        } else {
          param[k][i] = param[k][i] + derived<T>(-dlr * d_new) * (grads[k][i] / denom);
        }
      }
    }
  }
};

}  // namespace fusedopt_test::breadth
