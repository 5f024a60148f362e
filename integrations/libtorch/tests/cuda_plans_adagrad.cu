// The CUDA plans of fusedopt::rules::adagrad for make_cuda_steps() (cuda_steps.cu).
#include <fusedopt/libtorch/cuda_plans.cuh>

FUSEDOPT_LIBTORCH_CUDA_PLANS(fusedopt::rules::adagrad);
