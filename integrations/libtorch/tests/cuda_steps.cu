// fusedopt::libtorch::make_cuda_steps(), defined once for the CUDA tests, the benchmark and the
// in-tree example: nvcc compiles fusedopt's CUDA plans without torch's headers. Each rule's
// plans are compiled in a file of its own (cuda_plans_<rule>.cu), in parallel.
#define FUSEDOPT_LIBTORCH_CUDA_PLANS_EXTERN
#include <fusedopt/libtorch/cuda_steps.cuh>
