// Shared main of the CUDA test executables: without a usable GPU (or with fewer than
// FUSEDOPT_TEST_MIN_GPUS, an environment variable CTest sets for tests that need several) the
// executable exits with FUSEDOPT_TEST_SKIP_CODE, which CTest reports as skipped (never as passed).
#if !defined(FUSEDOPT_CATCH2_V3)
#  define CATCH_CONFIG_RUNNER
#endif
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "catch.hpp"

int main(int argc, char* argv[])
{
  int devices = 0;
  cudaError_t const status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s)\n", status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
    return FUSEDOPT_TEST_SKIP_CODE;
  }
  char const* min_gpus = std::getenv("FUSEDOPT_TEST_MIN_GPUS");
  if (min_gpus != nullptr && devices < std::atoi(min_gpus)) {
    std::printf("SKIPPED: %s GPUs needed, %d visible\n", min_gpus, devices);
    return FUSEDOPT_TEST_SKIP_CODE;
  }
  return Catch::Session().run(argc, argv);
}
