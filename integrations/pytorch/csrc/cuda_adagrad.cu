/// @file cuda_adagrad.cu
/// @brief CUDA plans of the adagrad family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(adagrad)
