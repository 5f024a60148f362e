// Double-precision references for Adagrad, RMSprop, Adadelta and Adamax, written from the
// algorithms in the torch.optim documentation (torch 2.x, the `_single_tensor_*` code path),
// one element at a time. They use nothing from fusedopt, so a mistake in a rule cannot be
// repeated here: each function is the published algorithm, step by step, in plain doubles.
//
// Conventions shared by all of them: `grad` is the raw gradient of this step; `maximize`
// negates it first; L2 weight decay (grad += weight_decay * param) comes next and only when
// weight_decay != 0; `step` is torch's state['step'] after its increment (1 on the first call).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fusedopt_test::ref_a {

/// The gradient after maximize and L2 weight decay, as every optimizer here starts.
inline double effective_grad(double grad, double param, double weight_decay, bool maximize)
{
  double g = maximize ? -grad : grad;
  if (weight_decay != 0) { g = g + weight_decay * param; }
  return g;
}

// ---- Adagrad --------------------------------------------------------------------------------
struct adagrad_options {
  double lr = 1e-2;
  double lr_decay = 0;
  double weight_decay = 0;
  double eps = 1e-10;
  bool maximize = false;
};

/// clr = lr / (1 + (t - 1) * lr_decay); sum += g^2; param -= clr * g / (sqrt(sum) + eps).
/// `sum` starts at initial_accumulator_value.
inline void adagrad_step(double& param, double grad, double& sum, std::int64_t step, adagrad_options const& o)
{
  double const g = effective_grad(grad, param, o.weight_decay, o.maximize);
  double const clr = o.lr / (1.0 + static_cast<double>(step - 1) * o.lr_decay);
  sum = sum + g * g;
  double const denominator = std::sqrt(sum) + o.eps;
  param = param - clr * (g / denominator);
}

// ---- RMSprop --------------------------------------------------------------------------------
struct rmsprop_options {
  double lr = 1e-2;
  double alpha = 0.99;
  double eps = 1e-8;
  double weight_decay = 0;
  double momentum = 0;
  bool centered = false;
  bool maximize = false;
};

/// v = alpha v + (1 - alpha) g^2; centered: g_ave = alpha g_ave + (1 - alpha) g and the
/// denominator uses v - g_ave^2; with momentum b = mu b + g / (sqrt(.) + eps) (b starts at 0)
/// and param -= lr b; else param -= lr g / (sqrt(.) + eps).
inline void rmsprop_step(double& param, double grad, double& square_avg, double& grad_avg, double& buffer,
                         rmsprop_options const& o)
{
  double const g = effective_grad(grad, param, o.weight_decay, o.maximize);
  square_avg = o.alpha * square_avg + (1.0 - o.alpha) * g * g;
  double v = square_avg;
  if (o.centered) {
    grad_avg = o.alpha * grad_avg + (1.0 - o.alpha) * g;
    v = v - grad_avg * grad_avg;
  }
  double const denominator = std::sqrt(v) + o.eps;
  if (o.momentum > 0) {
    buffer = o.momentum * buffer + g / denominator;
    param = param - o.lr * buffer;
  } else {
    param = param - o.lr * (g / denominator);
  }
}

// ---- Adadelta -------------------------------------------------------------------------------
struct adadelta_options {
  double lr = 1.0;
  double rho = 0.9;
  double eps = 1e-6;
  double weight_decay = 0;
  bool maximize = false;
};

/// v = rho v + (1 - rho) g^2; delta = sqrt(u + eps) / sqrt(v + eps) * g;
/// u = rho u + (1 - rho) delta^2; param -= lr delta.
inline void adadelta_step(double& param, double grad, double& square_avg, double& acc_delta,
                          adadelta_options const& o)
{
  double const g = effective_grad(grad, param, o.weight_decay, o.maximize);
  square_avg = o.rho * square_avg + (1.0 - o.rho) * g * g;
  double const delta = std::sqrt(acc_delta + o.eps) / std::sqrt(square_avg + o.eps) * g;
  acc_delta = o.rho * acc_delta + (1.0 - o.rho) * delta * delta;
  param = param - o.lr * delta;
}

// ---- Adamax ---------------------------------------------------------------------------------
struct adamax_options {
  double lr = 2e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0;
  bool maximize = false;
};

/// m = beta1 m + (1 - beta1) g; u = max(beta2 u, |g| + eps);
/// param -= lr / (1 - beta1^t) * m / u.
inline void adamax_step(double& param, double grad, double& exp_avg, double& exp_inf, std::int64_t step,
                        adamax_options const& o)
{
  double const g = effective_grad(grad, param, o.weight_decay, o.maximize);
  exp_avg = o.beta1 * exp_avg + (1.0 - o.beta1) * g;
  exp_inf = std::max(o.beta2 * exp_inf, std::abs(g) + o.eps);
  double const clr = o.lr / (1.0 - std::pow(o.beta1, static_cast<double>(step)));
  param = param - clr * (exp_avg / exp_inf);
}

}  // namespace fusedopt_test::ref_a
