/// @file cuda_sgd8bit.cu
/// @brief CUDA plans of SGD with an 8-bit momentum buffer (layout::quantized; every dtype but float64): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(sgd8bit)
