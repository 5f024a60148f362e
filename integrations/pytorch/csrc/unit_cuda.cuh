/// @file unit_cuda.cuh
/// @brief The CUDA backend of a unit (CUDA tensors): fusedopt::cuda plans on the current device,
/// run on the stream the context is (the core passes torch's current stream).
#pragma once

#include <fusedopt/cuda/backend.cuh>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "unit_export.hpp"

namespace fusedopt_torch {
namespace detail {

struct unit_backend {
  template <class Lists>
  static auto make(Lists lists, void* stream, int reduction_capacity)
  {
    fusedopt::cuda::options o;
    // Rules without reduction passes need no workspace: allocate none.
    o.reduction_capacity = reduction_capacity;
    return fusedopt::cuda::make_plan(std::move(lists), o, static_cast<cudaStream_t>(stream));
  }
  template <class Plan, class Rule>
  static void run(Plan const& p, Rule const& r, fusedopt::step_info const& step, void* stream)
  {
    p.run(r, step, static_cast<cudaStream_t>(stream));
  }
  template <class Plan, class Lists>
  static void rebind(Plan& p, Lists const& lists, void* stream)
  {
    p.rebind(lists, static_cast<cudaStream_t>(stream));
  }
  template <class Plan, class Slot, class Pointer>
  static void rebind_slot(Plan& p, Slot s, Pointer const* addresses, std::size_t n, void* stream)
  {
    p.rebind(s, addresses, n, static_cast<cudaStream_t>(stream));
  }
  template <class Plan>
  static std::uint64_t table_uploads(Plan const& p)
  {
    return p.table_uploads();
  }
};

}  // namespace detail
}  // namespace fusedopt_torch
