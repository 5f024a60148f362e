/// @file cuda_sgd.cu
/// @brief CUDA plans of the sgd family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(sgd)
