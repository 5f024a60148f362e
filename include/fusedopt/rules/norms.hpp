/// @file rules/norms.hpp
/// @brief Per-tensor and global norms (L2 and max-abs) of a slot, or of a chain's
/// intermediate `update` register, computed in a deterministic reduction pass.
#pragma once

#include <cfloat>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../config.hpp"
#include "../error.hpp"
#include "../numeric/math.hpp"
#include "../reduce.hpp"
#include "../rule.hpp"
#include "../slots.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief Which norm.
enum class norm_kind {
  l2,   ///< sqrt of the sum of squares
  inf,  ///< largest absolute value
};

namespace detail {
/// Accumulator 0: sum of squares; accumulator 1: largest absolute value.
using norm_reduction = reduction<reduce_op::sum, reduce_op::max>;

template <class Slot>
struct accumulate_norm {
  template <class E, class Acc>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
  {
    // In the accumulator's type: float as a rule (the same bits as squaring the element),
    // double where the backend re-accumulates a unit whose float sum overflowed (a float
    // square is exact in double and below its largest value).
    using A = std::remove_reference_t<decltype(acc[0])>;
    auto const x = static_cast<A>(e[Slot{}]);
    acc[0] += x * x;
    acc[1] = math::maximum(acc[1], math::abs(x));
  }
};

/// Accumulator 0: the sum of squares of slot `First`; accumulator 1: of slot `Second` (the
/// per-tensor norms behind LAMB's and LARS's trust ratios). In the accumulator's type, as
/// accumulate_norm.
template <class First, class Second>
struct accumulate_squares {
  template <class E, class Acc>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
  {
    using A = std::remove_reference_t<decltype(acc[0])>;
    auto const a = static_cast<A>(e[First{}]);
    auto const b = static_cast<A>(e[Second{}]);
    acc[0] += a * a;
    acc[1] += b * b;
  }
};

/// The norm of one tensor (t >= 0) or of all tensors (t < 0) from a norm_reduction's results;
/// the norm of no elements is 0, as torch's.
FUSEDOPT_HOST_DEVICE double norm_from(reduced const& r, std::int64_t t, norm_kind kind)
{
  if (kind == norm_kind::l2) { return math::sqrt(t >= 0 ? r.tensor(t, 0) : r.total(0)); }
  double const m = t >= 0 ? r.tensor(t, 1) : r.total(1);
  // Only -infinity is below -DBL_MAX (a macro: numeric_limits' members are host-only for nvcc).
  return m < -DBL_MAX ? 0.0 : m;
}

struct identity_body {
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E&) const
  {
  }
};
}  // namespace detail

namespace rules {

/// @brief Measures the norm of `Slot` (as the element holds it at this point of a chain) per
/// tensor and over all tensors, and writes them after the step: `per_tensor[t]` for every
/// tensor t (if not null) and `*total` (if not null). The pointers are host memory for the
/// host backend and device memory for the CUDA backend. Changes nothing: run alone, it is
/// its reduction pass and after-step hook, with no update pass (`updates = false`); chained
/// in front of an update, it measures the elements on the way (one pass).
template <class Slot>
struct norm_of {
  norm_kind kind = norm_kind::l2;
  double* per_tensor = nullptr;
  double* total = nullptr;

  using reduction = detail::norm_reduction;
  using reads = slots<Slot>;
  using writes = slots<>;
  static constexpr bool updates = false;

  FUSEDOPT_HOST_DEVICE detail::accumulate_norm<Slot> prepare_reduce(step_info const&) const { return {}; }
  FUSEDOPT_HOST_DEVICE detail::identity_body prepare(step_info const&, reduced const&) const { return {}; }

  /// Runs once per step (a single thread on the GPU).
  FUSEDOPT_HOST_DEVICE void after_step(reduced const& r, step_info const&) const
  {
    if (total != nullptr) { *total = detail::norm_from(r, -1, kind); }
    if (per_tensor != nullptr) {
      // The results hold one row per tensor of the bound lists.
      for (std::int64_t t = 0; t < r.num_tensors; ++t) { per_tensor[t] = detail::norm_from(r, t, kind); }
    }
  }
};

/// @brief torch.nn.utils.clip_grad_norm_ as a building block: scales the gradient register by
/// min(1, max_norm / (total_norm + 1e-6)), where total_norm is the L2 (or max-abs) norm of the
/// gradient over every element of every tensor. With `error_if_nonfinite` and a non-finite
/// total norm, the gradient is left unscaled and `*nonfinite` (device/host memory, if not null)
/// is set to 1 (it is set to 0 otherwise); chain a skip on that flag to drop the step. `*total_norm`
/// (if not null) receives the norm, as torch returns it.
struct clip_by_global_norm {
  scalar<double> max_norm{1.0};
  norm_kind kind = norm_kind::l2;
  bool error_if_nonfinite = false;
  int* nonfinite = nullptr;
  double* total_norm = nullptr;

  using reduction = detail::norm_reduction;
  using reads = slots<slot::grad_t>;
  using writes = slots<>;

  FUSEDOPT_HOST_DEVICE detail::accumulate_norm<slot::grad_t> prepare_reduce(step_info const&) const { return {}; }

  /// grad *= the clipping coefficient.
  FUSEDOPT_HOST_DEVICE detail::scale_slot<slot::grad_t> prepare(step_info const&, reduced const& r) const
  {
    double const norm = detail::norm_from(r, -1, kind);
    bool const finite = norm - norm == 0.0;
    if (error_if_nonfinite && !finite) { return {1.0}; }
    double const coefficient = max_norm.get() / (norm + 1e-6);
    // torch.clamp(max=1) keeps a NaN coefficient (a NaN norm), and so does this.
    return {coefficient > 1.0 ? 1.0 : coefficient};
  }

  FUSEDOPT_HOST_DEVICE void after_step(reduced const& r, step_info const&) const
  {
    double const norm = detail::norm_from(r, -1, kind);
    if (total_norm != nullptr) { *total_norm = norm; }
    if (nonfinite != nullptr) { *nonfinite = norm - norm == 0.0 ? 0 : 1; }
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("clip_by_global_norm: max_norm", max_norm, detail::non_negative);
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
