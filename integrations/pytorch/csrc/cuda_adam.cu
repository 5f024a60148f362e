/// @file cuda_adam.cu
/// @brief CUDA plans of Adam: the dispatch by dtype to cuda_adam_<dtype>.cu, each compiled apart.
#include "cuda_backend.cuh"

FUSEDOPT_TORCH_CUDA_PLANS_BY_DTYPE(adam)
