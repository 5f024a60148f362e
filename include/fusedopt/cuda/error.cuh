/// @file cuda/error.cuh
/// @brief FUSEDOPT_CUDA_TRY: turns a failed CUDA runtime call into a fusedopt::error.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "../error.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

/// @brief A failed CUDA runtime call (FUSEDOPT_CUDA_TRY): a fusedopt::error that also carries
/// the runtime's status, so a caller can tell an out-of-memory or a sticky device error from
/// bad input.
class cuda_error : public error {
 public:
  cuda_error(cudaError_t status, std::string const& message) : error(message), status_(status) {}
  [[nodiscard]] cudaError_t status() const noexcept { return status_; }

 private:
  cudaError_t status_;
};

namespace detail {
/// Builds the message of a failed CUDA call: the call as written, the error's name and text.
[[noreturn]] inline void throw_cuda_error(cudaError_t status, char const* call, char const* file, int line)
{
  throw cuda_error(status, std::string("CUDA call '") + call + "' failed: " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status) + " (" + file + ":" + std::to_string(line) + ")");
}
}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END

/// Evaluates a CUDA runtime call once; throws fusedopt::cuda::cuda_error (a fusedopt::error)
/// naming the call, the file and line, and cudaGetErrorString's text when it does not return
/// cudaSuccess.
#define FUSEDOPT_CUDA_TRY(call)                                                                 \
  do {                                                                                          \
    ::cudaError_t const fusedopt_cuda_status_ = (call);                                         \
    if (fusedopt_cuda_status_ != ::cudaSuccess) {                                               \
      ::fusedopt::cuda::detail::throw_cuda_error(fusedopt_cuda_status_, #call, __FILE__, __LINE__); \
    }                                                                                           \
  } while (0)
