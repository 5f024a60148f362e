/// @file cuda_adamw_f64.cu
/// @brief CUDA plans of AdamW over f64 parameters (every layout): fusedopt headers only.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS_OF_DTYPE(adamw, f64)
