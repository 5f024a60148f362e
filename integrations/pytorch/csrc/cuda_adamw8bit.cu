/// @file cuda_adamw8bit.cu
/// @brief CUDA plans of AdamW with 8-bit states (layout::quantized; every dtype but float64): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(adamw8bit)
