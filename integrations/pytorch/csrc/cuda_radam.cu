/// @file cuda_radam.cu
/// @brief CUDA plans of the radam family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(radam)
