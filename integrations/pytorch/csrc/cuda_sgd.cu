/// @file cuda_sgd.cu
/// @brief CUDA plans of the sgd family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"
#include "cuda_families.hpp"

namespace fusedopt_torch {
namespace detail {

std::unique_ptr<plan> cuda_sgd(family, dtype t, layout const& l, lists const& x, void* stream)
{
  return sgd_plan<cuda_backend>(t, l, x, stream);
}

}  // namespace detail
}  // namespace fusedopt_torch
