/// @file cuda_adam.cu
/// @brief CUDA plans of Adam and AdamW (every dtype, with and without amsgrad): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(adam)
