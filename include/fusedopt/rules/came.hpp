/// @file rules/came.hpp
/// @brief CAME (Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient
/// Optimization"; yangluo7/CAME's `came_pytorch/CAME.py`) and its blocks.
///
/// A step is two factored passes and one reduction pass before the update, in chain order
/// (factored.hpp): the factored second moment of grad^2 + eps1 (its row and column statistics,
/// a full exp_avg_sq for a tensor of fewer than two dimensions), the RMS of the update it gives
/// (a reduction pass, for the clipping), the factored confidence statistics of
/// (U - m)^2 + eps2 (m the new exp_avg, from the clipped U; that pass stores m), then the
/// update, which reads only the parameter and m. The reference loops over tensors with a norm
/// per tensor; here nothing is read back, and the step can be captured in a CUDA graph.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../factored.hpp"
#include "../numeric/dtypes.hpp"
#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {
/// CAME's moving average of a factored statistic: stat.mul_(beta).add_(mean, alpha=1 - beta).
template <class O>
FUSEDOPT_HOST_DEVICE O came_average(O old, O value, double beta)
{
  return old * static_cast<O>(beta) + static_cast<O>(1.0 - beta) * value;
}

/// The fold of CAME's factored statistics (both): the moving average towards the mean of the
/// pass's sums over a row (or column) of `count` elements, with retention `beta`.
struct came_fold {
  double beta;
  template <class O>
  FUSEDOPT_HOST_DEVICE O operator()(O old, double sum, std::int64_t count) const
  {
    return came_average(old, static_cast<O>(sum / static_cast<double>(count)), beta);
  }
};

/// CAME's _approx_sq_grad as line factors (detail/factored.hpp): rsqrt(row / mean(row)) per
/// row, rsqrt(col) per column; an element's is their product (factored_lookup::factor_of), the
/// bits of the reference's product of its two factors. A vector's, rsqrt(exp_avg_sq) per
/// element (times its column factor 1, exact).
struct came_line_factors {
  template <class O>
  FUSEDOPT_HOST_DEVICE O row(O stat, double mean) const
  {
    return O(1) / math::sqrt(stat / static_cast<O>(mean));
  }
  template <class O>
  FUSEDOPT_HOST_DEVICE O col(O stat) const
  {
    return O(1) / math::sqrt(stat);
  }
  template <class O>
  FUSEDOPT_HOST_DEVICE O vector(O stat) const
  {
    return O(1) / math::sqrt(stat);
  }
};

}  // namespace detail

namespace rules {

/// @brief CAME's first direction: update = approx(row, col) grad for a matrix (the factored
/// statistics of grad^2 + eps1, averaged with beta2), rsqrt(exp_avg_sq) grad for a tensor of
/// fewer than two dimensions (its row statistic). Factoring part (factored.hpp).
template <class T>
struct scale_by_came_second_moment {
  scalar<double> beta2{0.999};
  scalar<double> eps1{1e-30};
  factored_table<T> statistics{};
  using reads = slots<slot::grad_t>;
  using writes = slots<>;

  FUSEDOPT_HOST_DEVICE factored_table<T> factors() const { return statistics; }

  /// The reference's `grad**2 + eps[0]`, in the arithmetic type.
  struct square {
    double eps1;
    template <class E>
    FUSEDOPT_HOST_DEVICE double operator()(E& e) const
    {
      using O = typename E::value_type;
      O const g = e[slot::grad];
      return static_cast<double>(g * g + static_cast<O>(eps1));
    }
  };
  FUSEDOPT_HOST_DEVICE square prepare_factor(step_info const&) const { return {eps1.get()}; }

  using fold = detail::came_fold;
  FUSEDOPT_HOST_DEVICE fold prepare_fold(step_info const&) const { return {beta2.get()}; }
  FUSEDOPT_HOST_DEVICE detail::came_line_factors prepare_line_factors(step_info const&) const { return {}; }

  struct tensor_direction {
    factored_lookup<T> stats;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using O = typename E::value_type;
      O const g = e[slot::grad];
      // A vector's factors are computed in opmath_t<T>: the element's bits where that is its
      // arithmetic, and then no branch per element on the tensor's kind (as Adafactor's).
      constexpr bool vector_factors = std::is_same_v<O, opmath_t<T>>;
      if (vector_factors || stats.factored()) {
        e[slot::update] = static_cast<O>(stats.factor_of(e)) * g;  // CAME's _approx_sq_grad
      } else {
        e[slot::update] = O(1) / math::sqrt(static_cast<O>(to_opmath<opmath_t<T>>(stats.row[e.index()]))) * g;
      }
    }
  };
  struct prepared {
    factored_table<T> statistics;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    FUSEDOPT_HOST_DEVICE tensor_direction for_tensor(std::int64_t tensor) const
    {
      return {factored_lookup<T>::of(statistics, tensor)};
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {statistics}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("came: beta2", beta2, detail::closed_unit_interval);
    FUSEDOPT_EXPECTS(statistics.tensors != nullptr || statistics.num_tensors == 0,
                     "came: the second-moment statistics (second_moment) are required");
  }
};

/// @brief update /= max(RMS(update) / threshold, 1) per tensor (CAME's and Adafactor's update
/// clipping; torch's clamp: a NaN RMS gives NaN). Reducing: per-tensor sums of update^2 and
/// the elements; the divisor of each tensor is the pass's finished value (reduce.hpp,
/// prepare_finish), computed once per tensor and step, not per chunk of every pass after it.
struct clip_update_by_rms {
  scalar<double> threshold{1.0};
  using reduction = fusedopt::reduction<reduce_op::sum, reduce_op::sum>;
  using reads = slots<>;
  using writes = slots<>;

  struct accumulate {
    template <class E, class Acc>
    FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
    {
      using A = std::remove_reference_t<decltype(acc[0])>;
      auto const u = static_cast<A>(e[slot::update]);
      acc[0] += u * u;
      acc[1] += A(1);
    }
  };
  FUSEDOPT_HOST_DEVICE accumulate prepare_reduce(step_info const&) const { return {}; }

  static constexpr int finished_size = 1;
  struct finish {
    double threshold;
    FUSEDOPT_HOST_DEVICE void operator()(std::int64_t, double const* sums, double* finished) const
    {
      double const ratio = math::sqrt(sums[0]) / math::sqrt(sums[1]) / threshold;
      finished[0] = ratio < 1.0 ? 1.0 : ratio;
    }
  };
  FUSEDOPT_HOST_DEVICE finish prepare_finish(step_info const&) const { return {threshold.get()}; }

  struct divide {
    double divisor;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::update] /= static_cast<typename E::value_type>(divisor);
    }
  };
  struct prepared {
    reduced results;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    FUSEDOPT_HOST_DEVICE divide for_tensor(std::int64_t tensor) const { return {results.finished_of(tensor, 0)}; }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const { return {r}; }
};

/// @brief CAME's confidence: exp_avg = beta1 exp_avg + (1 - beta1) update, formed and stored by
/// its factored pass (stored_by_pass), with the factored statistics of the instability
/// (update - exp_avg)^2 + eps2 averaged with beta3; then, in the update pass (which resumes
/// here: the parts before it ran in that pass, and the gradient is not read again), for a
/// matrix update = approx(res_row, res_col) exp_avg, for a tensor of fewer than two dimensions
/// update = exp_avg. The pass visits every element, so a vector has statistics here too
/// (add_torch_shape(dims), a row statistic per element), which no step reads: the reference
/// keeps none. Bytes (float): the pass reads grad and exp_avg and stores exp_avg, the update
/// reads exp_avg and param and stores param: 12 + 12 (8 + 20 when the update formed exp_avg).
template <class T>
struct came_confidence {
  scalar<double> beta1{0.9};
  scalar<double> beta3{0.9999};
  scalar<double> eps2{1e-16};
  factored_table<T> statistics{};
  using reads = slots<slot::exp_avg_t>;
  using writes = slots<>;
  using stored_by_pass = slots<slot::exp_avg_t>;

  FUSEDOPT_HOST_DEVICE factored_table<T> factors() const { return statistics; }

  template <class O>
  FUSEDOPT_HOST_DEVICE static O momentum(O m, O u, double beta1)
  {
    return m * static_cast<O>(beta1) + static_cast<O>(1.0 - beta1) * u;
  }

  /// The new exp_avg (left in the element, which the pass stores), and the reference's
  /// `(update - exp_avg)**2 + eps[1]` with it.
  struct instability {
    double beta1, eps2;
    template <class E>
    FUSEDOPT_HOST_DEVICE double operator()(E& e) const
    {
      using O = typename E::value_type;
      O const u = e[slot::update];
      O& m = e[slot::exp_avg];
      m = momentum(m, u, beta1);
      O const d = u - m;
      return static_cast<double>(d * d + static_cast<O>(eps2));
    }
  };
  FUSEDOPT_HOST_DEVICE instability prepare_factor(step_info const&) const { return {beta1.get(), eps2.get()}; }

  using fold = detail::came_fold;
  FUSEDOPT_HOST_DEVICE fold prepare_fold(step_info const&) const { return {beta3.get()}; }
  FUSEDOPT_HOST_DEVICE detail::came_line_factors prepare_line_factors(step_info const&) const { return {}; }

  /// The update pass's part: exp_avg is the pass's (loaded).
  struct tensor_direction {
    factored_lookup<T> stats;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using O = typename E::value_type;
      O const m = e[slot::exp_avg];
      e[slot::update] = stats.factored() ? static_cast<O>(stats.factor_of(e)) * m : m;
    }
  };
  struct prepared {
    factored_table<T> statistics;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    FUSEDOPT_HOST_DEVICE tensor_direction for_tensor(std::int64_t tensor) const
    {
      return {factored_lookup<T>::of(statistics, tensor)};
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {statistics}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("came: beta1", beta1, detail::closed_unit_interval);
    detail::expect_range("came: beta3", beta3, detail::closed_unit_interval);
    FUSEDOPT_EXPECTS(statistics.tensors != nullptr || statistics.num_tensors == 0,
                     "came: the confidence statistics (confidence) are required");
  }
};

/// @brief CAME's step: param += -weight_decay lr param (when weight_decay != 0), then
/// param -= lr update (the reference's `update.mul_(lr)`, `p.add_(-update)`).
struct came_step {
  scalar<double> lr{2e-4};
  scalar<double> weight_decay{0.0};
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;

  struct prepared {
    double lr, weight_decay;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using O = typename E::value_type;
      O& p = e[slot::param];
      p = math::select(weight_decay != 0.0, p + static_cast<O>(-weight_decay * lr) * p, p);
      p -= e[slot::update] * static_cast<O>(lr);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {lr.get(), weight_decay.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("came: lr", lr, detail::positive);
  }
};

/// @brief CAME as yangluo7/CAME's `CAME.py` computes it (its defaults; lr has none there: 2e-4
/// here, its README's). `T` is the type of the statistics: the reference keeps them in the
/// gradient's type after it upcasts half and bfloat16 gradients to float, so `came`
/// (`basic_came<float>`) serves float, half and bfloat16 parameters and `basic_came<double>`
/// double ones. Slots: param, grad, exp_avg (float for half/bfloat16 parameters, as the
/// reference's). The statistics are the caller's: `second_moment` (exp_avg_sq_row and _col of
/// each tensor of two or more dimensions, exp_avg_sq of the others;
/// factored_layout::add_torch_shape) and `confidence` (exp_avg_res_row and _col; for the others
/// a row statistic per element that no step reads: add_torch_shape(dims) too, as the
/// confidence pass visits every element; both backends refuse a table without them). The
/// chain: scale_by_came_second_moment (factored pass) -> clip_update_by_rms (reducing) ->
/// came_confidence (factored pass, which stores exp_avg) -> came_step; the update pass runs the
/// last two. fp32: 4 + 4 + 12 (the passes) + 12 (update) = 32 bytes per element, plus the two
/// factored passes' tile partials and the statistics (factored.hpp).
template <class T>
struct basic_came : chained<basic_came<T>, chain_rule<scale_by_came_second_moment<T>, clip_update_by_rms,
                                                      came_confidence<T>, came_step>> {
  scalar<double> lr{2e-4};
  scalar<double> eps1{1e-30};  ///< the reference's eps[0], added to grad^2
  scalar<double> eps2{1e-16};  ///< eps[1], added to the instability
  scalar<double> clip_threshold{1.0};
  scalar<double> beta1{0.9};
  scalar<double> beta2{0.999};
  scalar<double> beta3{0.9999};
  scalar<double> weight_decay{0.0};
  factored_table<T> second_moment{};  ///< required
  factored_table<T> confidence{};     ///< required

  FUSEDOPT_HOST_DEVICE auto as_chain() const
  {
    return chain(scale_by_came_second_moment<T>{beta2, eps1, second_moment}, clip_update_by_rms{clip_threshold},
                 came_confidence<T>{beta1, beta3, eps2, confidence}, came_step{lr, weight_decay});
  }
};

/// @brief CAME over float statistics (float, half and bfloat16 parameters).
using came = basic_came<float>;

}  // namespace rules
FUSEDOPT_NAMESPACE_END
