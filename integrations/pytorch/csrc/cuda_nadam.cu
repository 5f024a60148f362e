/// @file cuda_nadam.cu
/// @brief CUDA plans of the nadam family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(nadam)
