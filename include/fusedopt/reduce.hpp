/// @file reduce.hpp
/// @brief Rules that need a reduction over all elements (global-norm clipping, LAMB/LARS trust
/// ratios, non-finite checks) before they can update anything.
///
/// A *reducing rule* declares what it accumulates and has two per-step bodies:
/// @code
/// struct my_clip {
///   using reduction = fusedopt::reduction<fusedopt::reduce_op::sum>;   // one accumulator
///   // pass 1: accumulate (nothing is stored in this pass)
///   FUSEDOPT_HOST_DEVICE auto prepare_reduce(fusedopt::step_info const&) const {
///     return [](auto& e, auto& acc) {
///       auto const g = static_cast<typename std::decay_t<decltype(acc)>::value_type>(e[slot::grad]);
///       acc[0] += g * g;   // in the accumulator's type: see accumulator
///     };
///   }
///   // pass 2: update, knowing the results (per tensor and over all tensors, in double)
///   FUSEDOPT_HOST_DEVICE auto prepare(fusedopt::step_info const&, fusedopt::reduced const& r) const;
///   // optional, once per step after the update (flags, loss-scale bookkeeping):
///   FUSEDOPT_HOST_DEVICE void after_step(fusedopt::reduced const& r, fusedopt::step_info const&) const;
///   // optional, per tensor once its results are complete, before the update: F doubles the
///   // update body reads as r.finished_of(t, k) instead of deriving them per chunk
///   static constexpr int finished_size = 1;   // F
///   FUSEDOPT_HOST_DEVICE auto prepare_finish(fusedopt::step_info const&) const {
///     return [](std::int64_t tensor, double const* sums, double* finished) { finished[0] = ...; };
///   }
/// };
/// @endcode
/// A rule that only measures (it writes no slot and its update body does nothing, like
/// rules::norm_of) declares `static constexpr bool updates = false;`: run on its own by a host
/// or CUDA plan, its update pass is skipped, which would read every element once more for
/// nothing (sharded plans still run it: correct, one read more).
/// In a chain, each reducing part adds one reduction pass; the pass runs the parts before it
/// (with their final bodies) so it sees the element exactly as it will be when the part runs
/// in the update pass. Results are deterministic: each chunk is reduced in a fixed order, chunk
/// results are combined per tensor in chunk order, and tensors in tensor order, in double.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "config.hpp"
#include "numeric/math.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief How the values put into one accumulator combine.
enum class reduce_op {
  sum,  ///< added (identity 0)
  max,  ///< largest, NaN if any is NaN (identity -infinity)
};

/// @brief The accumulators a reducing rule declares, one reduce_op each.
template <reduce_op... Ops>
struct reduction {
  static_assert(sizeof...(Ops) > 0, "a reduction needs at least one accumulator");
  static constexpr int size = static_cast<int>(sizeof...(Ops));

  FUSEDOPT_HOST_DEVICE static constexpr reduce_op op(int k)
  {
    constexpr reduce_op ops[] = {Ops...};
    return ops[k];
  }
  /// The identity of accumulator k's operation.
  template <class T>
  FUSEDOPT_HOST_DEVICE static constexpr T identity(int k)
  {
    // HUGE_VAL, not numeric_limits<T>::infinity(): numeric_limits' members are host-only for
    // nvcc (warning 20013 in device code, an error under --Werror=all-warnings).
    return op(k) == reduce_op::sum ? T(0) : static_cast<T>(-HUGE_VAL);
  }
  /// Folds `value` into `into` with accumulator k's operation.
  template <class T>
  FUSEDOPT_HOST_DEVICE static T combine(int k, T into, T value)
  {
    return op(k) == reduce_op::sum ? into + value : math::maximum(into, value);
  }
};

/// @brief A thread's accumulators for one pass: `acc[k] += x` for a sum,
/// `acc[k] = math::maximum(acc[k], x)` for a max.
///
/// `T` is the element's arithmetic type, except where a backend re-accumulates a unit of work
/// in double because a float sum came out non-finite (see detail::sums_finite): an
/// accumulating body is called with both, so it should compute in `value_type` (as
/// accumulate_norm does: float squares are exact in double, and cannot overflow there).
template <class T, int N>
struct accumulator {
  /// The type the accumulators hold.
  using value_type = T;
  T values[N];
  FUSEDOPT_HOST_DEVICE T& operator[](int k) { return values[k]; }
  FUSEDOPT_HOST_DEVICE T const& operator[](int k) const { return values[k]; }
};

namespace detail {

/// True when `Reduction` has a sum: only sums can overflow to infinity from finite inputs.
template <class Reduction>
FUSEDOPT_HOST_DEVICE constexpr bool has_sum()
{
  for (int k = 0; k < Reduction::size; ++k) {
    if (Reduction::op(k) == reduce_op::sum) { return true; }
  }
  return false;
}

/// False when a sum accumulator of `a` is infinite or NaN. The backends accumulate a unit of
/// work (the host: a chunk; CUDA: one thread's share of a chunk) in the arithmetic type first
/// and, when this is false in float, accumulate the unit again in double: a float sum of
/// squares overflows for |x| > 1.8e19 where the double sum of the same (exact) squares does
/// not. A non-finite input gives the same non-finite result both times; finite sums, the
/// common case, cost one test per unit and keep their bits.
template <class Reduction, class T, int N>
FUSEDOPT_HOST_DEVICE bool sums_finite(accumulator<T, N> const& a)
{
  bool finite = true;
  for (int k = 0; k < N; ++k) {
    if (Reduction::op(k) == reduce_op::sum) { finite = finite && a[k] - a[k] == T(0); }
  }
  return finite;
}

/// Whether a backend re-accumulates in double (see sums_finite): arithmetic narrower than
/// double, and a reduction with a sum.
template <class Reduction, class T>
inline constexpr bool widens_overflowing_sums_v = !std::is_same_v<T, double> && has_sum<Reduction>();

}  // namespace detail

/// @brief The results of one reduction pass, kept by the backend (device memory for the CUDA
/// backend): per tensor and over all tensors, in double.
struct reduced {
  double const* per_tensor = nullptr;  ///< [tensor * size + k]
  double const* all = nullptr;         ///< [k]
  int size = 0;
  std::int64_t num_tensors = 0;  ///< rows of per_tensor: the length of the bound lists
  double const* finished = nullptr;  ///< [tensor * finished_size + k]: the rule's prepare_finish
  int finished_size = 0;

  /// Accumulator k over the elements of tensor t.
  FUSEDOPT_HOST_DEVICE double tensor(std::int64_t t, int k) const { return per_tensor[t * size + k]; }
  /// Accumulator k over every element of every tensor.
  FUSEDOPT_HOST_DEVICE double total(int k) const { return all[k]; }
  /// Value k the rule's finish computed for tensor t from its results (once per step).
  FUSEDOPT_HOST_DEVICE double finished_of(std::int64_t t, int k) const { return finished[t * finished_size + k]; }
};

FUSEDOPT_NAMESPACE_END
