/// @file cuda_adamw_bf16.cu
/// @brief CUDA plans of AdamW over bf16 parameters (every layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS_OF_DTYPE(adamw, bf16)
