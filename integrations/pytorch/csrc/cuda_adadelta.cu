/// @file cuda_adadelta.cu
/// @brief CUDA plans of the adadelta family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(adadelta)
