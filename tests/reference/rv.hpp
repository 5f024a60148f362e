// The arithmetic of the double-precision references (values carrying a bound on their
// rounding error, and the tolerances that follow from it) and the references of SGD, Adam,
// AdamW, NAdam, RAdam and Lion, one element at a time. Split from harness.hpp, which adds
// the Catch2 harness, so that code without Catch2 (the fuzz target, tests/fuzz/) uses the same
// references and tolerances.
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace fusedopt_test {

// ---- tolerances, in one place ---------------------------------------------------------
//
// Every reference value carries a first-order bound `e` on the error that computing it
// with rounding (unit roundoff u) would make, in units of u: running error analysis
// (Higham, "Accuracy and Stability of Numerical Algorithms", 3.3). Each operation adds
// its own rounding, |result|, to the errors its operands bring, weighted as calculus says
// (for a * b: |a| e_b + |b| e_a; for a / b: e_a / |b| + |a| e_b / b^2; ...). Cancellation
// therefore shows up as e >> |value|, and the tolerance follows the conditioning of each
// element's own arithmetic instead of a blanket relative bound.
//
// A stored result `got` of element type T passes when
//     |got - value| <= store * |value| + (1 + store) * slack * op * e + floor
// with
// - op: the unit roundoff of the arithmetic type (float for half, bfloat16 and float;
//   double for double);
// - store: the unit roundoff of T, for the final rounding when the result is stored
//   (|round(x') - x| <= store * |x| + (1 + store) * |x' - x|);
// - floor: half the spacing of T's subnormals (only half has subnormals in range here);
// - slack = 2: the bound is computed for the reference's order of operations, and the
//   library may order them differently (e.g. one division instead of two); and for double
//   the reference itself rounds as much as the library does.
inline constexpr double slack = 2;

template <class T>
struct precision;
template <>
struct precision<float> {
  static constexpr double op = 0x1p-24, store = 0x1p-24, floor = 0;
};
template <>
struct precision<double> {
  static constexpr double op = 0x1p-53, store = 0x1p-53, floor = 0;
};
template <>
struct precision<fusedopt::half> {
  static constexpr double op = 0x1p-24, store = 0x1p-11, floor = 0x1p-25;
};
template <>
struct precision<fusedopt::bfloat16> {
  static constexpr double op = 0x1p-24, store = 0x1p-8, floor = 0x1p-134;
};

// ---- values with their error bound ----------------------------------------------------

/// A reference value `v` and the first-order bound `e` (in units of u) on the error of
/// computing it with rounding (see above).
struct rv {
  double v = 0;
  double e = 0;
};
/// An input known exactly.
inline rv exact(double x) { return {x, 0}; }
/// A result of one rounded operation whose operands brought error `e`.
inline rv rounded(double v, double e) { return {v, e + std::fabs(v)}; }
inline rv operator+(rv a, rv b) { return rounded(a.v + b.v, a.e + b.e); }
inline rv operator-(rv a, rv b) { return rounded(a.v - b.v, a.e + b.e); }
inline rv operator-(rv a) { return {-a.v, a.e}; }
inline rv operator*(rv a, rv b) { return rounded(a.v * b.v, std::fabs(a.v) * b.e + std::fabs(b.v) * a.e); }
inline rv operator/(rv a, rv b)
{
  return rounded(a.v / b.v, a.e / std::fabs(b.v) + std::fabs(a.v) * b.e / (b.v * b.v));
}
inline rv sqrt(rv a)
{
  double const s = std::sqrt(a.v);
  if (a.v > 0) { return rounded(s, a.e / (2 * s)); }
  // sqrt is not Lipschitz at 0: an inexact 0 leaves the result unbounded to first order.
  return {s, a.e > 0 ? HUGE_VAL : 0.0};
}
inline rv maximum(rv a, rv b) { return {std::max(a.v, b.v), std::max(a.e, b.e)}; }
/// base^t as computed by any method of at most t roundings (torch uses pow; fusedopt
/// multiplies by repeated squaring).
inline rv power(double base, std::int64_t t)
{
  double const p = std::pow(base, static_cast<double>(t));
  return {p, std::fabs(p) * static_cast<double>(t)};
}

/// A per-step coefficient, computed in double by the library as by the reference, then
/// rounded once to the arithmetic type: for double arithmetic its error stands as
/// computed; for float arithmetic its double error is negligible and the rounding to float
/// is what counts.
template <class T>
rv coefficient(rv c)
{
  if constexpr (std::is_same_v<T, double>) {
    return c;
  } else {
    return {c.v, std::fabs(c.v)};
  }
}
/// A hyperparameter: exact in double arithmetic, rounded once to float otherwise.
template <class T>
rv coefficient(double c)
{
  return coefficient<T>(exact(c));
}

// ---- the references, one element at a time --------------------------------------------
//
// T is the element type under test; it only selects how per-step coefficients are
// weighed (see coefficient). Every function returns the new values of the element's
// parameter and states.

/// torch.optim.SGD (_single_tensor_sgd). `first_step`: the momentum buffer does not exist
/// yet (torch creates it as a copy of the gradient).
struct sgd_reference {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;

  template <class T>
  void step(bool first_step, rv& param, rv grad, rv& momentum_buffer) const
  {
    rv g = maximize ? -grad : grad;
    if (weight_decay != 0) { g = g + coefficient<T>(weight_decay) * param; }
    if (momentum != 0) {
      if (first_step) {
        momentum_buffer = g;
      } else {
        momentum_buffer = coefficient<T>(momentum) * momentum_buffer + coefficient<T>(1 - dampening) * g;
      }
      g = nesterov ? g + coefficient<T>(momentum) * momentum_buffer : momentum_buffer;
    }
    param = param - coefficient<T>(lr) * g;
  }
};

/// torch's Tensor.lerp_(end, weight) with a scalar weight, which switches formula at 0.5.
template <class T>
rv lerp(rv self, rv end, double weight)
{
  if (weight < 0.5) { return self + coefficient<T>(weight) * (end - self); }
  return end - (end - self) * coefficient<T>(1 - weight);
}

/// What torch's Adam, NAdam and RAdam steps share: maximize, then weight decay (decoupled:
/// param *= 1 - lr * weight_decay; else L2 into the gradient, only when not 0), then the
/// moments (exp_avg by lerp, exp_avg_sq as an EMA of squares). Returns the gradient used
/// (NAdam's update reads it).
struct adam_family_options {
  double lr, beta1, beta2, weight_decay;
  bool decoupled, maximize;
};
template <class T>
rv adam_opening(rv& param, rv grad, rv& exp_avg, rv& exp_avg_sq, adam_family_options const& o)
{
  rv g = o.maximize ? -grad : grad;
  if (o.weight_decay != 0) {
    if (o.decoupled) {
      param = param * coefficient<T>(exact(1) - exact(o.lr) * exact(o.weight_decay));
    } else {
      g = g + coefficient<T>(o.weight_decay) * param;
    }
  }
  exp_avg = lerp<T>(exp_avg, g, 1 - o.beta1);
  exp_avg_sq = exp_avg_sq * coefficient<T>(o.beta2) + coefficient<T>(1 - o.beta2) * g * g;
  return g;
}

/// torch.optim.Adam and torch.optim.AdamW (_single_tensor_adam; AdamW is Adam with decoupled
/// weight decay: param *= 1 - lr * weight_decay).
struct adam_reference {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize, decoupled;

  template <class T>
  void step(std::int64_t t, rv& param, rv grad, rv& exp_avg, rv& exp_avg_sq, rv& max_exp_avg_sq) const
  {
    adam_opening<T>(param, grad, exp_avg, exp_avg_sq, {lr, beta1, beta2, weight_decay, decoupled, maximize});
    rv const bias_correction1 = exact(1) - power(beta1, t);
    rv const bias_correction2 = exact(1) - power(beta2, t);
    rv const step_size = coefficient<T>(exact(lr) / bias_correction1);
    rv const bias_correction2_sqrt = coefficient<T>(sqrt(bias_correction2));
    rv denom;
    if (amsgrad) {
      max_exp_avg_sq = maximum(max_exp_avg_sq, exp_avg_sq);
      denom = sqrt(max_exp_avg_sq) / bias_correction2_sqrt + coefficient<T>(eps);
    } else {
      denom = sqrt(exp_avg_sq) / bias_correction2_sqrt + coefficient<T>(eps);
    }
    param = param - step_size * (exp_avg / denom);
  }
};

/// 0.96^x as torch computes it (Python's float power, i.e. C's pow), with the error bound
/// of a computation by at most 64 roundings (fusedopt's takes up to 64 multiplications).
inline rv momentum_cache(double x)
{
  double const p = std::pow(0.96, x);
  return {p, 64 * p};
}

/// torch.optim.NAdam (_single_tensor_nadam). `mu_product` is torch's state['mu_product'],
/// kept by the caller of the reference and advanced here.
struct nadam_reference {
  double lr, beta1, beta2, eps, weight_decay, momentum_decay;
  bool decoupled_weight_decay, maximize;

  /// mu_t of step t, with its magnitude.
  [[nodiscard]] rv mu(std::int64_t t) const
  {
    return exact(beta1) * (exact(1) - exact(0.5) * momentum_cache(static_cast<double>(t) * momentum_decay));
  }

  /// Advances `mu_product` (shared by all elements) to step t: call once per step before
  /// the elements.
  void begin_step(std::int64_t t, rv& mu_product) const { mu_product = mu_product * mu(t); }

  template <class T>
  void step(std::int64_t t, rv mu_product, rv& param, rv grad, rv& exp_avg, rv& exp_avg_sq) const
  {
    rv const bias_correction2 = exact(1) - power(beta2, t);
    rv const g = adam_opening<T>(param, grad, exp_avg, exp_avg_sq,
                                 {lr, beta1, beta2, weight_decay, decoupled_weight_decay, maximize});
    rv const mu_t = mu(t);
    rv const mu_next = mu(t + 1);
    rv const denom = sqrt(exp_avg_sq / coefficient<T>(bias_correction2)) + coefficient<T>(eps);
    rv const mu_product_next = mu_product * mu_next;
    param = param + coefficient<T>(-exact(lr) * (exact(1) - mu_t) / (exact(1) - mu_product)) * (g / denom);
    param = param + coefficient<T>((-exact(lr) * mu_next) / (exact(1) - mu_product_next)) * (exp_avg / denom);
  }
};

/// torch.optim.RAdam (_single_tensor_radam, not capturable). Also reports whether the
/// rectified branch (rho_t > 5) was taken.
struct radam_reference {
  double lr, beta1, beta2, eps, weight_decay;
  bool decoupled_weight_decay, maximize;

  /// rho_t, the length of the approximated simple moving average.
  [[nodiscard]] rv rho(std::int64_t t) const
  {
    rv const rho_inf = exact(2 / (1 - beta2) - 1);
    rv const bias_correction2 = exact(1) - power(beta2, t);
    return rho_inf - exact(2.0 * static_cast<double>(t)) * power(beta2, t) / bias_correction2;
  }

  template <class T>
  bool step(std::int64_t t, rv& param, rv grad, rv& exp_avg, rv& exp_avg_sq) const
  {
    adam_opening<T>(param, grad, exp_avg, exp_avg_sq,
                    {lr, beta1, beta2, weight_decay, decoupled_weight_decay, maximize});
    rv const bias_correction1 = exact(1) - power(beta1, t);
    rv const bias_correction2 = exact(1) - power(beta2, t);
    rv const bias_corrected_exp_avg = exp_avg / coefficient<T>(bias_correction1);
    rv const rho_inf = exact(2 / (1 - beta2) - 1);
    rv const rho_t = rho(t);
    if (rho_t.v > 5.0) {
      rv const rect = sqrt((rho_t - exact(4)) * (rho_t - exact(2)) * rho_inf /
                           ((rho_inf - exact(4)) * (rho_inf - exact(2)) * rho_t));
      rv const adaptive_lr = coefficient<T>(sqrt(bias_correction2)) / (sqrt(exp_avg_sq) + coefficient<T>(eps));
      param = param - bias_corrected_exp_avg * coefficient<T>(lr) * adaptive_lr * coefficient<T>(rect);
      return true;
    }
    param = param - bias_corrected_exp_avg * coefficient<T>(lr);
    return false;
  }
};

/// Lion as in lion-pytorch's update_fn, with maximize negating the gradient first.
/// Returns the candidates for the new parameter: one, except where the sign of
/// c = beta1 * exp_avg + (1 - beta1) * grad is ill-conditioned (|c| within rounding error of
/// 0), where any of the directions -1, 0, +1 is a correct result.
struct lion_reference {
  double lr, beta1, beta2, weight_decay;
  bool maximize;

  template <class T>
  std::vector<rv> step(rv param, rv grad, rv& exp_avg) const
  {
    rv const g = maximize ? -grad : grad;
    param = param * coefficient<T>(exact(1) - exact(lr) * exact(weight_decay));
    rv const c = coefficient<T>(beta1) * exp_avg + coefficient<T>(1 - beta1) * g;
    exp_avg = coefficient<T>(beta2) * exp_avg + coefficient<T>(1 - beta2) * g;
    std::vector<double> directions{static_cast<double>((c.v > 0) - (c.v < 0))};
    if (std::fabs(c.v) <= 2 * slack * precision<T>::op * c.e) { directions = {-1.0, 0.0, 1.0}; }
    std::vector<rv> candidates;
    for (double d : directions) { candidates.push_back(param - coefficient<T>(lr) * exact(d)); }
    return candidates;
  }
};

}  // namespace fusedopt_test
