/// @file cuda_nadam.cu
/// @brief CUDA plans of the nadam family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"
#include "cuda_families.hpp"

namespace fusedopt_torch {
namespace detail {

std::unique_ptr<plan> cuda_nadam(family, dtype t, layout const& l, lists const& x, void* stream)
{
  return nadam_plan<cuda_backend>(t, l, x, stream);
}

}  // namespace detail
}  // namespace fusedopt_torch
