/// @file numeric/lerp.hpp
/// @brief torch's linear interpolation, with its switch of formula at |weight| = 0.5.
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

}  // namespace math
FUSEDOPT_NAMESPACE_END
