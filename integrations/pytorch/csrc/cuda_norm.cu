/// @file cuda_norm.cu
/// @brief make_cuda_norm_plan: the CUDA norm plans of clip_grad_norm_ (every dtype).
#include "cuda_backend.cuh"

namespace fusedopt_torch {

std::unique_ptr<norm_plan> make_cuda_norm_plan(dtype t, std::vector<void const*> const& grads,
                                               std::vector<std::int64_t> const& sizes, void* stream)
{
  return detail::norm_plan_of<detail::cuda_backend>(t, grads, sizes, stream);
}

}  // namespace fusedopt_torch
