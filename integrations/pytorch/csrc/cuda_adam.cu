/// @file cuda_adam.cu
/// @brief CUDA plans of Adam and AdamW (every dtype, with and without amsgrad): fusedopt headers only.
#include "cuda_backend.cuh"
#include "cuda_families.hpp"

namespace fusedopt_torch {
namespace detail {

std::unique_ptr<plan> cuda_adam(family f, dtype t, layout const& l, lists const& x, void* stream)
{
  return adam_plan<cuda_backend>(f, t, l, x, stream);
}

}  // namespace detail
}  // namespace fusedopt_torch
