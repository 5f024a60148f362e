/// @file cuda_lion8bit.cu
/// @brief CUDA plans of Lion with an 8-bit exp_avg (layout::quantized; every dtype but float64): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(lion8bit)
