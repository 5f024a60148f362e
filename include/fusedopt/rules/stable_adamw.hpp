/// @file rules/stable_adamw.hpp
/// @brief StableAdamW (Wortsman et al. 2023; warner-benjamin/optimi's StableAdamW, which
/// transformers' `optim="stable_adamw"` imports) and its blocks: AdamW with debiased betas and
/// a learning rate clipped per tensor by the RMS of grad^2 / max(exp_avg_sq, eps^2).
///
/// One step is a reduction pass (grad and exp_avg_sq read, nothing stored: the new exp_avg_sq
/// is formed in registers) and the update pass: 8 + 28 = 36 bytes per fp32 element, where
/// optimi's loop and foreach paths call `.item()` once per tensor.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../numeric/torch_ops.hpp"
#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {
/// optimi's debias_beta: beta (1 - beta^(t-1)) / (1 - beta^t), as (beta^t - beta) / (beta^t - 1)
/// (0 at step 1, so that the first moments are the gradient and its square).
FUSEDOPT_HOST_DEVICE double debiased_beta(double beta, std::int64_t t)
{
  double const power = math::ipow(beta, t);
  return (power - beta) / (power - 1.0);
}

/// StableAdamW's new second moment: beta2_hat v + (1 - beta2_hat) g^2.
template <class T>
FUSEDOPT_HOST_DEVICE T stable_second_moment(T v, T g, double beta2_hat)
{
  return v * static_cast<T>(beta2_hat) + static_cast<T>(1.0 - beta2_hat) * g * g;
}
}  // namespace detail

namespace rules {

/// @brief The learning rate of each tensor, clipped by its update RMS: the register
/// `tensor_lr` = lr / max(1, sqrt(mean(grad^2 / max(v, eps^2)))), v the second moment this step
/// will store (formed here from exp_avg_sq and the debiased beta2, not stored). Reducing
/// (per-tensor sums); reads grad and exp_avg_sq. Blocks after it read the register
/// (scale_by_tensor_lr).
struct clip_lr_by_rms {
  scalar<double> lr{1e-3};
  scalar<double> beta2{0.99};
  scalar<double> eps{1e-6};

  /// Accumulator 0: sum of grad^2 / max(v, eps^2); accumulator 1: elements (per tensor).
  using reduction = fusedopt::reduction<reduce_op::sum, reduce_op::sum>;
  using reads = slots<slot::grad_t, slot::exp_avg_sq_t>;
  using writes = slots<>;
  using registers = slots<slot::tensor_lr_t>;

  struct accumulate {
    double beta2_hat, eps_sq;
    template <class E, class Acc>
    FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
    {
      using T = typename E::value_type;
      using A = std::remove_reference_t<decltype(acc[0])>;
      T const g = e[slot::grad];
      T const v = detail::stable_second_moment(e[slot::exp_avg_sq], g, beta2_hat);
      // optimi: grad.pow(2).div_(exp_avg_sq.maximum(eps_sq)), eps_sq held in the param's type; in
      // the accumulator's type (double where a float sum overflowed: reduce.hpp).
      auto const ga = static_cast<A>(g);
      acc[0] += ga * ga / math::maximum(static_cast<A>(v), static_cast<A>(static_cast<T>(eps_sq)));
      acc[1] += A(1);
    }
  };

  struct set_lr {
    double lr;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::tensor_lr] = static_cast<typename E::value_type>(lr);
    }
  };

  struct prepared {
    reduced sums;
    double lr;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    FUSEDOPT_HOST_DEVICE set_lr for_tensor(std::int64_t tensor) const
    {
      double const elements = sums.tensor(tensor, 1);
      double const rms = math::sqrt(elements > 0 ? sums.tensor(tensor, 0) / elements : 0.0);
      return {lr / (rms > 1.0 ? rms : 1.0)};  // Python's max(1, rms): a NaN rms gives lr
    }
  };

  FUSEDOPT_HOST_DEVICE accumulate prepare_reduce(step_info const& s) const
  {
    double const e = eps.get();
    return {detail::debiased_beta(beta2.get(), s.step.get()), e * e};
  }
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const { return {r, lr.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("stable_adamw: lr", lr, detail::non_negative);
    detail::expect_range("stable_adamw: beta2", beta2, detail::unit_interval);
    detail::expect_range("stable_adamw: eps", eps, detail::non_negative);
  }
};

/// @brief StableAdamW's moments with debiased betas (optimi's debias_beta) and its direction:
/// exp_avg = lerp(exp_avg, grad, 1 - beta1_hat), exp_avg_sq = beta2_hat exp_avg_sq +
/// (1 - beta2_hat) grad^2, update = exp_avg / (sqrt(exp_avg_sq) + eps). No bias correction:
/// the debiased betas replace it.
struct scale_by_stable_adam {
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.99};
  scalar<double> eps{1e-6};
  using reads = slots<slot::grad_t, slot::exp_avg_t, slot::exp_avg_sq_t>;
  using writes = slots<slot::exp_avg_t, slot::exp_avg_sq_t>;

  struct prepared {
    double beta1_comp, beta2_hat, eps;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[slot::grad];
      T& m = e[slot::exp_avg];
      T& v = e[slot::exp_avg_sq];
      m = math::lerp(m, g, static_cast<T>(beta1_comp));
      v = detail::stable_second_moment(v, g, beta2_hat);
      e[slot::update] = m / (math::sqrt(v) + static_cast<T>(eps));
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    std::int64_t const t = s.step.get();
    return {1.0 - detail::debiased_beta(beta1.get(), t), detail::debiased_beta(beta2.get(), t), eps.get()};
  }
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("stable_adamw: beta1", beta1, detail::unit_interval);
  }
};

/// @brief The step at the per-tensor learning rate of the register `tensor_lr` (lr_t), with
/// decoupled weight decay at that rate: param *= 1 - lr_t weight_decay (optimi's decouple_lr:
/// 1 - (lr_t / max_lr) weight_decay, for max_lr > 0), then update *= -lr_t.
struct scale_by_tensor_lr {
  scalar<double> weight_decay{0.0};
  scalar<double> max_lr{0.0};  ///< 0: decay at lr_t; > 0: at lr_t / max_lr (optimi's decouple_lr)
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;
  using registers = slots<slot::tensor_lr_t>;

  struct prepared {
    double weight_decay, max_lr;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const lr = e[slot::tensor_lr];
      T const rate = math::select(max_lr > 0.0, lr / static_cast<T>(max_lr), lr);
      T const factor = T(1) - rate * static_cast<T>(weight_decay);
      e[slot::param] = math::select(weight_decay != 0.0, e[slot::param] * factor, e[slot::param]);
      e[slot::update] *= -lr;
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {weight_decay.get(), max_lr.get()}; }
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("stable_adamw: weight_decay", weight_decay, detail::non_negative);
    detail::expect_range("stable_adamw: max_lr", max_lr, detail::non_negative);
  }
};

/// @brief StableAdamW as optimi computes it (its defaults; lr has none there). Slots: param,
/// grad, exp_avg, exp_avg_sq. The chain: negate_gradient_if(maximize) -> clip_lr_by_rms
/// (reducing) -> scale_by_stable_adam -> scale_by_tensor_lr -> apply_update. optimi's Kahan
/// summation for 16-bit parameters is `with_kahan{stable_adamw{...}}` (rules/kahan.hpp).
struct stable_adamw : chained<stable_adamw, chain_rule<negate_gradient_if, clip_lr_by_rms, scale_by_stable_adam,
                                                       scale_by_tensor_lr, apply_update>> {
  scalar<double> lr{1e-3};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.99};
  scalar<double> weight_decay{1e-2};
  scalar<double> eps{1e-6};
  bool decouple_lr = false;    ///< decay at lr_t / max_lr (fully decoupled)
  scalar<double> max_lr{0.0};  ///< with decouple_lr; 0 (the reference's None): lr
  bool maximize = false;       ///< ascend: the gradient is negated first (not in the reference)

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    bool const unset = !max_lr.is_pointer() && max_lr.value == 0.0;
    scalar<double> const divisor = decouple_lr ? (unset ? lr : max_lr) : scalar<double>{0.0};
    return chain(negate_gradient_if{maximize}, clip_lr_by_rms{lr, beta2, eps}, scale_by_stable_adam{beta1, beta2, eps},
                 scale_by_tensor_lr{weight_decay, divisor}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
