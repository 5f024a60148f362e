/// @file cuda_adam_f16.cu
/// @brief CUDA plans of Adam over f16 parameters (every layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS_OF_DTYPE(adam, f16)
