// fusedopt's CUDA plans for the optimizer's CUDA parameters: make_cuda_steps(), compiled here by
// nvcc without torch's headers (the one .cu file of the program that includes this header).
#include <fusedopt/libtorch/cuda_steps.cuh>
