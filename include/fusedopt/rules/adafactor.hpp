/// @file rules/adafactor.hpp
/// @brief Adafactor (Shazeer and Stern 2018) as torch.optim.Adafactor computes it (torch 2.11,
/// `_single_tensor_adafactor`), and its blocks.
///
/// A step is one factored pass (factored.hpp: the row and column sums of grad^2 of every
/// tensor seen as matrices of its last two dimensions, folded into the caller's row_var and
/// col_var; a tensor of fewer than two dimensions keeps a full `variance` instead, its row
/// statistic), one reduction pass (per tensor, the sums of param^2 and update^2 for torch's
/// RMS(param) and RMS(update)) and the update. torch's loop calls `.item()` three times per
/// tensor; here nothing is read back, and the step can be captured in a CUDA graph.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../factored.hpp"
#include "../numeric/dtypes.hpp"
#include "../numeric/real_power.hpp"
#include "../numeric/torch_ops.hpp"
#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {
/// torch.finfo(T).eps: what Adafactor's eps1 is when it is None.
template <class T>
FUSEDOPT_HOST_DEVICE constexpr double finfo_eps()
{
  if constexpr (std::is_same_v<T, double>) {
    return 0x1p-52;
  } else if constexpr (std::is_same_v<T, half>) {
    return 0x1p-10;
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return 0x1p-7;
  } else {
    return 0x1p-23;
  }
}
inline constexpr value_range non_positive{-HUGE_VAL, 0, true, true, "must not be positive"};
inline constexpr value_range at_least_one{1, HUGE_VAL, true, true, "must be at least 1"};

/// Python's max(a, b): b only when b > a (a NaN b gives a).
FUSEDOPT_HOST_DEVICE double python_max(double a, double b) { return b > a ? b : a; }
}  // namespace detail

namespace rules {

/// @brief Adafactor's direction: update = grad / sqrt(max(v, eps1^2)), v the second-moment
/// estimate of the element. Factoring part (factored.hpp): its factored pass sums grad^2 per
/// row and per column, and folds row_var = lerp(row_var, row sum / C, 1 - beta2_t) (likewise
/// col_var with the column sums / R), with 1 - beta2_t = t^beta2_decay; then v = row_var[r]
/// col_var[c] / max(mean of the matrix's row_var, eps1) for a matrix, v = variance (the row
/// statistic of a vector: its sum is grad^2) for a tensor of fewer than two dimensions.
/// `T` is the type of the statistics (torch: the gradient's dtype), whose finfo eps is eps1's
/// default.
template <class T>
struct scale_by_factored_rms {
  scalar<double> beta2_decay{-0.8};
  scalar<double> eps1{-1.0};  ///< negative: torch's None, finfo(T).eps
  factored_table<T> statistics{};
  using reads = slots<slot::grad_t>;
  using writes = slots<>;

  FUSEDOPT_HOST_DEVICE factored_table<T> factors() const { return statistics; }

  /// The factored pass's value: grad^2, in double (exact for float gradients).
  struct square {
    template <class E>
    FUSEDOPT_HOST_DEVICE double operator()(E& e) const
    {
      auto const g = static_cast<double>(e[slot::grad]);
      return g * g;
    }
  };
  FUSEDOPT_HOST_DEVICE square prepare_factor(step_info const&) const { return {}; }

  /// torch: stat.lerp_(sum / count, 1 - beta2_t), the mean (torch's norm^2 / size) rounded
  /// once to the arithmetic type.
  struct fold {
    double weight;
    template <class O>
    FUSEDOPT_HOST_DEVICE O operator()(O old, double sum, std::int64_t count) const
    {
      auto const mean = static_cast<O>(sum / static_cast<double>(count));
      return math::lerp(old, mean, static_cast<O>(weight));
    }
  };
  FUSEDOPT_HOST_DEVICE fold prepare_fold(step_info const& s) const
  {
    return {math::portable_pow(static_cast<double>(s.step.get()), beta2_decay.get())};
  }

  /// The line factors (detail/factored.hpp): torch's v = (row_var col_var) / max(mean of the
  /// matrix's row_var, eps1) and rsqrt(max(v, eps1^2)), factored as rsqrt(row_var / max(mean,
  /// eps1)) per row and rsqrt(col_var) per column, their product capped at rsqrt(eps1^2) per
  /// element: the same value, rounded in other places (within a few roundings of torch's).
  struct line_factors {
    double eps1;
    template <class O>
    FUSEDOPT_HOST_DEVICE O row(O stat, double mean) const
    {
      auto const m = static_cast<O>(mean);
      O const denominator = m < static_cast<O>(eps1) ? static_cast<O>(eps1) : m;
      return O(1) / math::sqrt(stat / denominator);
    }
    template <class O>
    FUSEDOPT_HOST_DEVICE O col(O stat) const
    {
      return O(1) / math::sqrt(stat);
    }
    /// A vector's factor per element, torch's var_estimate.clamp_(min=eps1 * eps1).rsqrt_():
    /// at most rsqrt(eps1^2), so the direction's cap leaves it as it is.
    template <class O>
    FUSEDOPT_HOST_DEVICE O vector(O stat) const
    {
      return O(1) / math::sqrt(clamp_variance(stat, eps1 * eps1));
    }
  };
  FUSEDOPT_HOST_DEVICE line_factors prepare_line_factors(step_info const&) const { return {resolved_eps1()}; }

  /// A vector's variance clamped at eps1^2 (torch's clamp_(min=eps1 * eps1)).
  template <class O>
  FUSEDOPT_HOST_DEVICE static O clamp_variance(O v, double eps1_squared)
  {
    return v < static_cast<O>(eps1_squared) ? static_cast<O>(eps1_squared) : v;
  }

  /// One tensor's direction.
  struct tensor_direction {
    factored_lookup<T> stats;
    double eps1_squared;
    float cap_float;  ///< rsqrt(eps1^2) in float (the arithmetic of float, half and bfloat16)
    double cap_double;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using O = typename E::value_type;
      using S = opmath_t<T>;
      // A vector's factors (line_factors::vector) are computed in S: where the element's
      // arithmetic is S too they are its bits, and every tensor takes the factor's code, with
      // no branch per element on the tensor's kind.
      constexpr bool vector_factors = std::is_same_v<O, S>;
      if (vector_factors || stats.factored()) {
        auto const f = static_cast<O>(stats.factor_of(e));
        auto const cap = std::is_same_v<O, double> ? static_cast<O>(cap_double) : static_cast<O>(cap_float);
        e[slot::update] = (f > cap ? cap : f) * e[slot::grad];
      } else {
        // torch: var_estimate.clamp_(min=eps1 * eps1).rsqrt_().mul_(grad).
        O const clamped = clamp_variance(static_cast<O>(to_opmath<S>(stats.row[e.index()])), eps1_squared);
        e[slot::update] = O(1) / math::sqrt(clamped) * e[slot::grad];
      }
    }
  };
  /// The step's constants, made once per prepare() (a block on CUDA), not per tensor or chunk.
  struct prepared {
    factored_table<T> statistics;
    double eps1_squared;
    float cap_float;
    double cap_double;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    FUSEDOPT_HOST_DEVICE tensor_direction for_tensor(std::int64_t tensor) const
    {
      return {factored_lookup<T>::of(statistics, tensor), eps1_squared, cap_float, cap_double};
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const
  {
    double const e1 = resolved_eps1();
    double const squared = e1 * e1;
    return {statistics, squared, 1.0f / math::sqrt(static_cast<float>(squared)), 1.0 / math::sqrt(squared)};
  }

  /// eps1, None (negative) read as finfo(T).eps.
  FUSEDOPT_HOST_DEVICE double resolved_eps1() const
  {
    double const e1 = eps1.get();
    return e1 < 0 ? detail::finfo_eps<T>() : e1;
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("adafactor: beta2_decay", beta2_decay, detail::non_positive);
    FUSEDOPT_EXPECTS(statistics.tensors != nullptr || statistics.num_tensors == 0,
                     "adafactor: the factored statistics (statistics) are required");
  }
};

/// @brief Adafactor's step size, weight decay and update clipping, per tensor: alpha =
/// max(eps2, RMS(param)) rho_t with rho_t = min(lr, 1 / sqrt(t)), RMS(param) of the parameter
/// before the decay; param *= 1 - lr weight_decay; param -= alpha / max(1, RMS(update) / d)
/// update. Reducing: per tensor sums of param^2 and update^2; the number of elements, the
/// RMS's divisor, is the tensor's entry in `statistics` (Adafactor's table, which describes
/// every tensor), not a third sum: an exact integer either way, one addition per element less.
/// The step -alpha / max(1, RMS(update) / d) of each tensor is the pass's finished value
/// (reduce.hpp, prepare_finish): computed once per tensor and step, not by every thread of
/// every chunk of the update (three roots and three divisions in double).
template <class T>
struct scale_by_relative_step {
  scalar<double> lr{1e-2};
  scalar<double> eps2{1e-3};
  scalar<double> d{1.0};
  scalar<double> weight_decay{0.0};
  factored_table<T> statistics{};

  using reduction = fusedopt::reduction<reduce_op::sum, reduce_op::sum>;
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;

  struct accumulate {
    template <class E, class Acc>
    FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
    {
      using A = std::remove_reference_t<decltype(acc[0])>;
      auto const p = static_cast<A>(e[slot::param]);
      auto const u = static_cast<A>(e[slot::update]);
      acc[0] += p * p;
      acc[1] += u * u;
    }
  };
  FUSEDOPT_HOST_DEVICE accumulate prepare_reduce(step_info const&) const { return {}; }

  /// The step's -alpha / denom of each tensor, from the tensor's sums (RMS(param), RMS(update)).
  static constexpr int finished_size = 1;
  struct finish {
    double rho, eps2, d;
    factored_table<T> statistics;
    FUSEDOPT_HOST_DEVICE void operator()(std::int64_t tensor, double const* sums, double* finished) const
    {
      factored_tensor<T> const& entry = statistics.tensors[tensor];
      double const root_n = math::sqrt(static_cast<double>(entry.matrices * entry.rows * entry.cols));
      double const alpha = detail::python_max(eps2, math::sqrt(sums[0]) / root_n) * rho;
      double const denom = detail::python_max(1.0, math::sqrt(sums[1]) / (root_n * d));
      finished[0] = -alpha / denom;
    }
  };
  FUSEDOPT_HOST_DEVICE finish prepare_finish(step_info const& s) const
  {
    double const l = lr.get();
    double const inverse_root = 1.0 / math::sqrt(static_cast<double>(s.step.get()));
    return {l < inverse_root ? l : inverse_root, eps2.get(), d.get(), statistics};
  }

  struct apply {
    double decay, step;  ///< 1 - lr weight_decay (1 when weight_decay is 0); -alpha / denom
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using O = typename E::value_type;
      O& p = e[slot::param];
      p = math::select(decay != 1.0, p * static_cast<O>(decay), p);
      p += static_cast<O>(step) * e[slot::update];
    }
  };
  struct prepared {
    reduced results;
    double decay;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    FUSEDOPT_HOST_DEVICE apply for_tensor(std::int64_t tensor) const { return {decay, results.finished_of(tensor, 0)}; }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const
  {
    double const wd = weight_decay.get();
    return {r, wd != 0 ? 1.0 - lr.get() * wd : 1.0};
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("adafactor: lr", lr, detail::non_negative);
    detail::expect_range("adafactor: eps2", eps2, detail::non_negative);
    detail::expect_range("adafactor: d", d, detail::at_least_one);
    detail::expect_range("adafactor: weight_decay", weight_decay, detail::non_negative);
  }
};

/// @brief torch.optim.Adafactor (torch 2.11; its defaults). `T` is the type of the statistics
/// (torch keeps them in the gradient's dtype), and eps1's None is finfo(T).eps: torch takes it
/// from the group's first parameter, so set `eps1` yourself for a group of mixed dtypes.
/// Slots: param, grad. The statistics (row_var and col_var of each tensor of two or more
/// dimensions, variance of the others) are the caller's: `statistics` is their table
/// (factored.hpp, factored_layout::add_torch_shape). The chain: negate_gradient_if(maximize) ->
/// scale_by_factored_rms (factored pass) -> scale_by_relative_step (reducing) -> the update.
/// fp32: 4 (factored pass) + 8 (reduction) + 12 (update) = 24 bytes per element, plus the
/// pass's tile partials (factored.hpp) and the statistics.
template <class T>
struct basic_adafactor
  : chained<basic_adafactor<T>, chain_rule<negate_gradient_if, scale_by_factored_rms<T>, scale_by_relative_step<T>>> {
  scalar<double> lr{1e-2};
  scalar<double> beta2_decay{-0.8};
  scalar<double> eps1{-1.0};  ///< negative: torch's None, finfo(T).eps
  scalar<double> eps2{1e-3};
  scalar<double> d{1.0};
  scalar<double> weight_decay{0.0};
  bool maximize = false;
  factored_table<T> statistics{};  ///< required

  FUSEDOPT_HOST_DEVICE auto as_chain() const
  {
    return chain(negate_gradient_if{maximize}, scale_by_factored_rms<T>{beta2_decay, eps1, statistics},
                 scale_by_relative_step<T>{lr, eps2, d, weight_decay, statistics});
  }

  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("adafactor: eps1", eps1, value_range_eps1());
    basic_adafactor::chained::validate(bound);
  }

 private:
  // Any value but NaN: a negative one is None.
  static constexpr detail::value_range value_range_eps1() { return {-HUGE_VAL, HUGE_VAL, true, true, "must be a number"}; }
};

/// @brief Adafactor over float statistics (float or bfloat16/half parameters whose
/// statistics are float; eps1's None is float32's eps).
using adafactor = basic_adafactor<float>;

}  // namespace rules
FUSEDOPT_NAMESPACE_END
