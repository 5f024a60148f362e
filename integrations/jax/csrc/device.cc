/// @file device.cc
/// @brief The device helpers runner.hpp declares: CUDA runtime calls (compiled by nvcc with
/// FUSEDOPT_JAX_CUDA=1), no-ops for the CPU library.
#include <cstddef>
#include <cstring>
#include <memory>

#include "runner.hpp"

#if FUSEDOPT_JAX_CUDA
#include <cuda_runtime.h>

#include <fusedopt/cuda/detail/upload_ring.cuh>
#include <fusedopt/cuda/error.cuh>
#endif

namespace fusedopt_jax {
namespace FUSEDOPT_JAX_BACKEND {

#if FUSEDOPT_JAX_CUDA
// Both run while XLA may be capturing the stream (a command buffer's recording), where the
// runtime can refuse a query it counts as unsafe in the thread's capture mode: relaxed mode.
int device_of(void const* pointer)
{
  fusedopt::cuda::detail::relaxed_capture_mode const relaxed;
  cudaPointerAttributes attributes{};
  FUSEDOPT_CUDA_TRY(cudaPointerGetAttributes(&attributes, pointer));
  return attributes.device;
}

int set_device(int device)
{
  fusedopt::cuda::detail::relaxed_capture_mode const relaxed;
  int previous = 0;
  FUSEDOPT_CUDA_TRY(cudaGetDevice(&previous));
  if (previous != device) { FUSEDOPT_CUDA_TRY(cudaSetDevice(device)); }
  return previous;
}

void copy_async(void* destination, void const* source, std::size_t bytes, void* stream)
{
  FUSEDOPT_CUDA_TRY(
      cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
}
#else
int device_of(void const*) { return 0; }
int set_device(int) { return 0; }
void copy_async(void* destination, void const* source, std::size_t bytes, void*)
{
  std::memmove(destination, source, bytes);
}
#endif

}  // namespace FUSEDOPT_JAX_BACKEND
}  // namespace fusedopt_jax
