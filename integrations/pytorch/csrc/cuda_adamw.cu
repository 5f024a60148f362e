/// @file cuda_adamw.cu
/// @brief CUDA plans of AdamW: the dispatch by dtype to cuda_adamw_<dtype>.cu, each compiled apart.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS_BY_DTYPE(adamw)
