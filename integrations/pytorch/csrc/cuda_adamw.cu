/// @file cuda_adamw.cu
/// @brief CUDA plans of AdamW (every dtype and layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS(adamw)
