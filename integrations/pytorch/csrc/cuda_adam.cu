/// @file cuda_adam.cu
/// @brief CUDA plans of Adam (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(adam)
