/// @file numeric/torch_ops.hpp
/// @brief Elementwise operations with torch's exact semantics: lerp (its switch of formula at
/// |weight| = 0.5) and clamp (NaN kept, the upper bound applied last).
#pragma once

#include "../config.hpp"
#include "math.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace math {

/// @brief self + weight (end - self), as torch's `lerp` computes it (ATen's Lerp.h): for
/// |weight| < 0.5 `self + weight * (end - self)`, else `end - (end - self) * (1 - weight)`, so
/// that weight 1 gives `end` exactly. `weight` is the same for every element of a step (a
/// rule's per-step value), so both forms are computed and one selected (math::select).
template <class T>
FUSEDOPT_HOST_DEVICE T lerp(T self, T end, T weight)
{
  T const difference = end - self;
  return select(abs(weight) < T(0.5), self + weight * difference, end - difference * (T(1) - weight));
}

/// @brief torch.clamp(x, low, high): min(max(x, low), high), so NaN stays NaN and a low bound
/// above the high one gives the high one.
template <class T>
FUSEDOPT_HOST_DEVICE T clamp(T x, T low, T high)
{
  T const raised = x < low ? low : x;
  return raised > high ? high : raised;
}

}  // namespace math
FUSEDOPT_NAMESPACE_END
