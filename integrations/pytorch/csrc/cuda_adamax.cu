/// @file cuda_adamax.cu
/// @brief CUDA plans of the adamax family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(adamax)
