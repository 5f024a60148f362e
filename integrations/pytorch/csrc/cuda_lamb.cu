/// @file cuda_lamb.cu
/// @brief CUDA plans of the lamb family (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(lamb)
