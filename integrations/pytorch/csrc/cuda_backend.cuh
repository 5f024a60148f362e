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

/// The CUDA backend compiling plans of one dtype only (families.hpp's compiles_dtype).
template <dtype Only>
struct cuda_backend_of : cuda_backend {
  static constexpr dtype only_dtype = Only;
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

/// The largest families (Adam, AdamW: their JIT build took minutes in one source) are compiled
/// one dtype per source: cuda_<plans>.cu defines cuda_<plans> as a dispatch to
/// cuda_<plans>_<dtype>, each the whole of cuda_<plans>_<dtype>.cu, so ninja compiles the four
/// in parallel.
#define FUSEDOPT_TORCH_CUDA_PLANS_DECLARE_ONE(plans, dt) \
  std::unique_ptr<plan> cuda_##plans##_##dt(family, dtype, layout const&, lists const&, void*);
#define FUSEDOPT_TORCH_CUDA_PLANS_BY_DTYPE(plans)                                                         \
  namespace fusedopt_torch::detail {                                                                      \
  FUSEDOPT_TORCH_CUDA_PLANS_DECLARE_ONE(plans, f32)                                                       \
  FUSEDOPT_TORCH_CUDA_PLANS_DECLARE_ONE(plans, f64)                                                       \
  FUSEDOPT_TORCH_CUDA_PLANS_DECLARE_ONE(plans, f16)                                                       \
  FUSEDOPT_TORCH_CUDA_PLANS_DECLARE_ONE(plans, bf16)                                                      \
  std::unique_ptr<plan> cuda_##plans(family f, dtype t, layout const& l, lists const& x, void* stream)    \
  {                                                                                                       \
    switch (t) {                                                                                          \
      case dtype::f32: return cuda_##plans##_f32(f, t, l, x, stream);                                     \
      case dtype::f64: return cuda_##plans##_f64(f, t, l, x, stream);                                     \
      case dtype::f16: return cuda_##plans##_f16(f, t, l, x, stream);                                     \
      case dtype::bf16: return cuda_##plans##_bf16(f, t, l, x, stream);                                   \
    }                                                                                                     \
    throw fusedopt::error("fusedopt_torch: unknown dtype");                                               \
  }                                                                                                       \
  }
#define FUSEDOPT_TORCH_CUDA_PLANS_OF_DTYPE(plans, dt)                                                     \
  namespace fusedopt_torch::detail {                                                                      \
  FUSEDOPT_TORCH_CUDA_PLANS_DECLARE_ONE(plans, dt)                                                        \
  std::unique_ptr<plan> cuda_##plans##_##dt(family f, dtype t, layout const& l, lists const& x, void* stream) \
  {                                                                                                       \
    return plans##_plan<cuda_backend_of<dtype::dt>>(f, t, l, x, stream);                                 \
  }                                                                                                       \
  }
