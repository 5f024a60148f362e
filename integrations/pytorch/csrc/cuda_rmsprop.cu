/// @file cuda_rmsprop.cu
/// @brief CUDA plans of the rmsprop family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(rmsprop)
