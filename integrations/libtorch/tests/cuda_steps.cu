// fusedopt::libtorch::make_cuda_steps(), defined once for the CUDA tests and the benchmark:
// nvcc compiles fusedopt's CUDA plans here without torch's headers.
#include <fusedopt/libtorch/cuda_steps.cuh>
