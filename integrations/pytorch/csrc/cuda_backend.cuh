/// @file cuda_backend.cuh
/// @brief The CUDA backend for families.hpp, and the per-family entry points of the .cu files.
#pragma once

#include <fusedopt/cuda/backend.cuh>

#include <cuda_runtime.h>

#include "cuda_families.hpp"
#include "families.hpp"

namespace fusedopt_torch {
namespace detail {

struct cuda_backend {
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

/// Defines cuda_<plans> (cuda_families.hpp) with the CUDA backend: the whole of cuda_<plans>.cu.
#define FUSEDOPT_TORCH_CUDA_PLANS(plans)                                                                  \
  namespace fusedopt_torch::detail {                                                                      \
  std::unique_ptr<plan> cuda_##plans(family f, dtype t, layout const& l, lists const& x, void* stream)    \
  {                                                                                                       \
    return plans##_plan<cuda_backend>(f, t, l, x, stream);                                                \
  }                                                                                                       \
  }
