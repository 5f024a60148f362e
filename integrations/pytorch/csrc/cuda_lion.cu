/// @file cuda_lion.cu
/// @brief CUDA plans of the lion family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(lion)
