/// @file scalar.hpp
/// @brief Hyperparameters that are either a value or read from memory at every step.
#pragma once

#include <cstdint>
#include <type_traits>

#include "config.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief A hyperparameter holding either a value fixed when the rule is built, or a pointer
/// read at every step (device memory for the CUDA backend, host memory for the host backend).
///
/// The pointer form lets a step be captured once in a CUDA graph and replayed with a new
/// learning rate: write the new value to the memory, replay the graph.
template <class T>
struct scalar {
  static_assert(std::is_arithmetic_v<T>, "scalar<T>: T must be an arithmetic type");

  T value{};
  T const* pointer = nullptr;

  constexpr scalar() = default;
  /// @brief A fixed value (implicit, so `rule.lr = 1e-3;` reads naturally).
  FUSEDOPT_HOST_DEVICE constexpr scalar(T v) : value(v) {}  // NOLINT(google-explicit-constructor)
  /// @brief A value read from `*p` at every step; `p` must stay valid while the rule is used.
  FUSEDOPT_HOST_DEVICE static constexpr scalar from_pointer(T const* p)
  {
    scalar s;
    s.pointer = p;
    return s;
  }

  /// @brief The current value.
  FUSEDOPT_HOST_DEVICE T get() const { return pointer != nullptr ? *pointer : value; }
  [[nodiscard]] FUSEDOPT_HOST_DEVICE constexpr bool is_pointer() const { return pointer != nullptr; }
};

static_assert(std::is_trivially_copyable_v<scalar<double>>);

/// @brief What a rule knows about the step being taken.
struct step_info {
  /// 1-based number of this step (torch's `state['step']` after its increment). Backends
  /// reject a step below 1 with fusedopt::error before writing anything, where they can see
  /// it: always on the host backend; on the CUDA backend when it is a value (a device pointer
  /// is not read on the host: that would synchronise).
  scalar<std::int64_t> step{1};
  /// When not null, the backend adds 1 to `*advance` before the step runs (on the GPU: in
  /// stream order, on the device), so a step captured in a CUDA graph advances its own count.
  /// Point `step` at the same counter (scalar::from_pointer) to read the new value.
  std::int64_t* advance = nullptr;
};

FUSEDOPT_NAMESPACE_END
