/// @file rules/nadam.hpp
/// @brief NAdam (torch.optim.NAdam), its core block scale_by_nadam, and nadam_mu_product, the
/// host helper that advances NAdam's running product of momentum coefficients.
#pragma once

#include <cstdint>

#include "../error.hpp"
#include "../reduce.hpp"
#include "../scalar.hpp"
#include "../slots.hpp"
#include "adam.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace rules {

/// @brief NAdam's moments and direction (Dozat 2016, as torch.optim.NAdam computes them):
/// exp_avg and exp_avg_sq as Adam's (detail::update_adam_moments);
/// denom = sqrt(exp_avg_sq / (1 - beta2^t)) + eps;
/// update = ((1 - mu_t) / (1 - mu_1...mu_t)) * grad / denom
///        + (mu_{t+1} / (1 - mu_1...mu_{t+1})) * exp_avg / denom,
/// with mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay)).
///
/// The product mu_1...mu_{t-1} is not recomputed from the step (that would cost O(t) per
/// thread): the caller passes it in `mu_product`, exactly the value torch keeps in
/// `state['mu_product']` between steps, and advances it after each step, most simply with
/// rules::nadam_mu_product. It may be a pointer (a step captured in a CUDA graph reads it
/// from device memory at every replay).
struct scale_by_nadam {
  scalar<double> beta1{0.9};  ///< decay of the first moment (torch's betas[0])
  scalar<double> beta2{0.999};  ///< decay of the second moment (torch's betas[1])
  scalar<double> eps{1e-8};  ///< added to the denominator for numerical stability
  scalar<double> momentum_decay{4e-3};  ///< psi in mu_t = beta1 (1 - 0.5 * 0.96^(t psi))
  /// mu_1 * ... * mu_{t-1} for step t (1 at step 1): torch's state['mu_product'] before the step.
  scalar<double> mu_product{1.0};

  using reads = slots<slot::grad_t, slot::exp_avg_t, slot::exp_avg_sq_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_sq_t>;

  /// @brief The momentum coefficient of step `t`: beta1 * (1 - 0.5 * 0.96^(t * momentum_decay)).
  /// The same bits on host and device (see math::momentum_cache_power).
  FUSEDOPT_HOST_DEVICE static double mu(double beta1, double momentum_decay, std::int64_t t)
  {
    return mu_of_step(beta1, momentum_decay, static_cast<double>(t));
  }

  /// @brief mu for a step given as a double: lets prepare form step t + 1 without the int64
  /// overflow of `t + 1` at INT64_MAX (the same bits as mu(t + 1) wherever that is defined,
  /// since every |t| < 2^53 converts exactly).
  FUSEDOPT_HOST_DEVICE static double mu_of_step(double beta1, double momentum_decay, double t)
  {
    return beta1 * (1.0 - 0.5 * math::momentum_cache_power(t * momentum_decay));
  }

  /// @brief The per-step values, resolved once per thread.
  struct prepared {
    double beta1, beta2, eps, bias_correction2, grad_coefficient, exp_avg_coefficient;

    /// @brief Updates one element.
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      auto const [m, v] = detail::update_adam_moments(e, beta1, beta2);
      // torch divides before the square root here (unlike Adam, which divides after it).
      T const denom = math::sqrt(v / static_cast<T>(bias_correction2)) + static_cast<T>(eps);
      e[slot::update] = (static_cast<T>(grad_coefficient) * g + static_cast<T>(exp_avg_coefficient) * m) / denom;
    }
  };

  /// @brief The per-step values of step `step` (or of any step, where they do not depend on it).
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& step) const
  {
    double const b1 = beta1.get();
    double const b2 = beta2.get();
    double const psi = momentum_decay.get();
    std::int64_t const t = step.step.get();
    double const mu_t = mu(b1, psi, t);
    double const mu_next = mu_of_step(b1, psi, static_cast<double>(t) + 1.0);
    double const product = mu_product.get() * mu_t;  // mu_1 ... mu_t
    double const product_next = product * mu_next;   // mu_1 ... mu_{t+1}
    return prepared{b1,
                    b2,
                    eps.get(),
                    1.0 - math::ipow(b2, t),
                    (1.0 - mu_t) / (1.0 - product),
                    mu_next / (1.0 - product_next)};
  }

  /// @brief Rejects option values torch (or the reference implementation) rejects.
  /// @throws fusedopt::error naming the option.
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("nadam: beta1", beta1, detail::unit_interval);
    detail::expect_range("nadam: beta2", beta2, detail::unit_interval);
    detail::expect_range("nadam: eps", eps, detail::non_negative);
    detail::expect_range("nadam: momentum_decay", momentum_decay, detail::non_negative);
    detail::expect_range("nadam: mu_product", mu_product, detail::half_open_unit_interval,
                         "the product of the mu of the steps already taken; 1 before the first step");
  }
};

/// @brief torch.optim.NAdam, with all its options (decoupled_weight_decay gives NAdamW).
/// Slots: param, grad, exp_avg, exp_avg_sq.
///
/// The chain: negate_gradient_if(maximize) -> decoupled_weight_decay (when
/// decoupled_weight_decay) -> add_weight_decay (otherwise) -> scale_by_nadam -> scale_by_lr
/// -> apply_update. The block of the weight decay not chosen gets weight_decay 0 and does
/// nothing.
///
/// `mu_product` must be advanced by the caller after every step (see scale_by_nadam):
/// @code
/// fusedopt::rules::nadam opt;                  // torch's defaults
/// fusedopt::rules::nadam_mu_product mu;        // host helper, starts at 1
/// for (std::int64_t t = 1; t <= steps; ++t) {
///   opt.mu_product = mu.value();               // torch's state['mu_product'] before step t
///   plan.run(opt, fusedopt::step_info{t});
///   mu.advance(opt);                           // multiplies in mu_t
/// }
/// @endcode
struct nadam : chained<nadam, chain_rule<negate_gradient_if, decoupled_weight_decay, add_weight_decay, scale_by_nadam,
                                         scale_by_lr, apply_update>> {
  scalar<double> lr{2e-3};  ///< learning rate
  scalar<double> beta1{0.9};  ///< decay of the first moment (torch's betas[0])
  scalar<double> beta2{0.999};  ///< decay of the second moment (torch's betas[1])
  scalar<double> eps{1e-8};  ///< added to the denominator for numerical stability
  scalar<double> weight_decay{0.0};  ///< weight decay: L2 penalty on the gradient, or decoupled (see decoupled_weight_decay)
  scalar<double> momentum_decay{4e-3};  ///< psi in mu_t = beta1 (1 - 0.5 * 0.96^(t psi))
  bool decoupled_weight_decay = false;  ///< param *= 1 - lr * weight_decay instead of the L2 penalty
  bool maximize = false;  ///< maximize the objective (negate the gradient)
  /// mu_1 * ... * mu_{t-1} for step t: torch's state['mu_product'] before the step (1 at step 1).
  scalar<double> mu_product{1.0};

  /// @brief The building blocks this optimizer is made of, with its hyperparameters.
  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    scalar<double> const none{0.0};
    return chain(negate_gradient_if{maximize},
                 rules::decoupled_weight_decay{lr, decoupled_weight_decay ? weight_decay : none},
                 add_weight_decay{decoupled_weight_decay ? none : weight_decay},
                 scale_by_nadam{beta1, beta2, eps, momentum_decay, mu_product}, scale_by_lr{lr}, apply_update{});
  }

  /// @throws fusedopt::error for a negative weight_decay, and for whatever the chain's blocks reject.
  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("nadam: weight_decay", weight_decay, detail::non_negative);
    chained::validate(bound);
  }
};

/// @brief Host helper that keeps NAdam's running product mu_1 * ... * mu_t step by step, as
/// torch keeps `state['mu_product']`, so that nadam::mu_product costs O(1) per step.
///
/// It uses scale_by_nadam::mu, so its product has the same bits as the one the rule forms.
class nadam_mu_product {
 public:
  /// @brief mu_1 * ... * mu_t after t calls to advance (1 before the first): the value of
  /// nadam::mu_product for the next step.
  [[nodiscard]] double value() const noexcept { return value_; }

  /// @brief Number of steps recorded so far.
  [[nodiscard]] std::int64_t steps() const noexcept { return steps_; }

  /// @brief Records one more step taken with these hyperparameters (multiplies in its mu).
  void advance(double beta1, double momentum_decay)
  {
    ++steps_;
    value_ *= scale_by_nadam::mu(beta1, momentum_decay, steps_);
  }

  /// @brief Records one more step taken by `rule`.
  /// @note Reads rule.beta1 and rule.momentum_decay on the host: they must be values, or
  /// pointers to host memory.
  void advance(nadam const& rule) { advance(rule.beta1.get(), rule.momentum_decay.get()); }

 private:
  double value_ = 1.0;
  std::int64_t steps_ = 0;
};

/// @brief Keeps NAdam's running product in memory that the step itself advances: after each
/// step (in stream order, one thread on the GPU) `*product` becomes `*product * mu_t` for the
/// step's t, so that a step captured in a CUDA graph keeps torch's `state['mu_product']` at
/// every replay (torch's NAdam with `capturable=True`). Chain it after a nadam whose
/// mu_product reads the same memory:
/// @code
/// double* product = ...;               // device memory holding 1.0 (host memory on the host backend)
/// fusedopt::rules::nadam opt;
/// opt.mu_product = fusedopt::scalar<double>::from_pointer(product);
/// plan.run(fusedopt::chain(opt, fusedopt::rules::advance_mu_product{product, opt.beta1, opt.momentum_decay}), step);
/// @endcode
/// Give it nadam's beta1 and momentum_decay (values or the same pointers). With
/// `single_precision` the product is rounded to float after each step, as torch keeps
/// `state['mu_product']` in float32 unless the default dtype is float64.
struct advance_mu_product {
  double* product = nullptr;            ///< mu_1 ... mu_{t-1} before step t; advanced after it
  scalar<double> beta1{0.9};            ///< nadam's beta1
  scalar<double> momentum_decay{4e-3};  ///< nadam's momentum_decay
  bool single_precision = false;        ///< round the product to float after each step

  using reads = slots<>;
  using writes = slots<>;

  struct prepared {
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E&) const
    {
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {}; }

  /// @brief `product * mu`, rounded to float when `single_precision` (torch's float32
  /// `mu_product *= mu`: float * float is exact in double, so rounding the double product
  /// once gives the float product's bits).
  FUSEDOPT_HOST_DEVICE static double advanced(double product, double mu, bool single_precision)
  {
    if (!single_precision) { return product * mu; }
    return static_cast<double>(static_cast<float>(static_cast<double>(static_cast<float>(product)) *
                                                  static_cast<double>(static_cast<float>(mu))));
  }

  /// Runs once per step, after the update (which read the product before this step's mu).
  FUSEDOPT_HOST_DEVICE void after_step(reduced const&, step_info const& step) const
  {
    *product = advanced(*product, scale_by_nadam::mu(beta1.get(), momentum_decay.get(), step.step.get()),
                        single_precision);
  }

  /// @throws fusedopt::error when `product` is null.
  template <class Bound>
  void validate(Bound) const
  {
    FUSEDOPT_EXPECTS(product != nullptr, "advance_mu_product: product must not be null");
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
