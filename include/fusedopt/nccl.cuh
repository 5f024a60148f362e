/// @file nccl.cuh
/// @brief The NCCL communicator of sharded plans (cuda/sharded.cuh): one process (or thread)
/// per GPU, an `ncclComm_t` per rank. Needs NCCL (`nccl.h`, link `libnccl`); the rest of
/// fusedopt does not.
///
/// @code
/// ncclComm_t comm;  // ncclCommInitRank(&comm, world, id, rank) with an id shared out of band
/// fo::cuda::sharded_layout layout(sizes, world);
/// auto plan = fo::cuda::make_sharded_plan(layout, fo::nccl::communicator(comm), lists, buffers);
/// plan.run(fo::rules::adamw{}, {t}, stream);
/// @endcode
///
/// Every call is checked (`FUSEDOPT_NCCL_TRY`). A collective is enqueued and returns: a rank
/// that never calls its part leaves the others' streams waiting on the device, not the host;
/// `ncclCommAbort` (the caller's) ends that. Collectives are capturable in CUDA graphs (NCCL
/// 2.9 and newer).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "config.hpp"
#include "cuda/sharded.cuh"
#include "error.hpp"
#include "numeric/dtypes.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace nccl {

/// @brief A failed NCCL call: a fusedopt::error carrying NCCL's result.
class nccl_error : public error {
 public:
  nccl_error(ncclResult_t status, std::string const& message) : error(message), status_(status) {}
  [[nodiscard]] ncclResult_t status() const { return status_; }

 private:
  ncclResult_t status_;
};

namespace detail {

[[noreturn]] inline void throw_nccl_error(ncclResult_t status, char const* call, char const* file, int line)
{
  std::string message = std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                        ncclGetErrorString(status);
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
  char const* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') { message += std::string(" (") + last + ")"; }
#endif
  throw nccl_error(status, message);
}

/// NCCL's name of an element type.
template <class T>
constexpr ncclDataType_t data_type()
{
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, half> ||
                  std::is_same_v<T, bfloat16>,
                "fusedopt: NCCL exchanges float, double, half or bfloat16 elements");
  if constexpr (std::is_same_v<T, float>) { return ncclFloat32; }
  if constexpr (std::is_same_v<T, double>) { return ncclFloat64; }
  if constexpr (std::is_same_v<T, half>) { return ncclFloat16; }
  return ncclBfloat16;
}

}  // namespace detail

/// Throws fusedopt::nccl::nccl_error naming the call, file:line and NCCL's message when `call`
/// does not return ncclSuccess.
#define FUSEDOPT_NCCL_TRY(call)                                                                 \
  do {                                                                                          \
    ncclResult_t const fusedopt_nccl_status_ = (call);                                          \
    if (fusedopt_nccl_status_ != ncclSuccess) {                                                 \
      ::fusedopt::nccl::detail::throw_nccl_error(fusedopt_nccl_status_, #call, __FILE__, __LINE__); \
    }                                                                                           \
  } while (0)

/// @brief A sharded plan's communicator over an `ncclComm_t` the caller made and owns (it must
/// outlive the plans using it).
class communicator {
 public:
  /// @throws nccl_error if NCCL cannot tell the communicator's rank or size.
  explicit communicator(ncclComm_t comm) : comm_(comm)
  {
    FUSEDOPT_EXPECTS(comm != nullptr, "nccl::communicator: null ncclComm_t");
    FUSEDOPT_NCCL_TRY(ncclCommUserRank(comm_, &rank_));
    FUSEDOPT_NCCL_TRY(ncclCommCount(comm_, &size_));
  }

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return size_; }
  [[nodiscard]] ncclComm_t get() const { return comm_; }

  /// @brief ncclReduceScatter: ncclSum, or ncclAvg (NCCL 2.10 and newer) for an average.
  template <class T>
  void reduce_scatter(T const* send, T* recv, std::size_t count, cuda::gradient_reduction reduction,
                      cudaStream_t stream)
  {
    FUSEDOPT_NCCL_TRY(ncclReduceScatter(send, recv, count, detail::data_type<T>(), op_of(reduction), comm_, stream));
  }

  /// @brief ncclAllGather in place (this rank's part at rank() x count of `buffer`).
  template <class T>
  void all_gather(T* buffer, std::size_t count, cudaStream_t stream)
  {
    FUSEDOPT_NCCL_TRY(ncclAllGather(buffer + static_cast<std::size_t>(rank_) * count, buffer, count,
                                    detail::data_type<T>(), comm_, stream));
  }

  /// @brief One ncclBroadcast per rank's segment (rank q the root of its own), in one group:
  /// segments of different lengths, which ncclAllGather does not take.
  void all_gather_v(double* buffer, std::int64_t const* counts, cudaStream_t stream)
  {
    FUSEDOPT_NCCL_TRY(ncclGroupStart());
    std::int64_t first = 0;
    ncclResult_t status = ncclSuccess;
    for (int q = 0; q < size_ && status == ncclSuccess; ++q) {
      if (counts[q] > 0) {
        status = ncclBroadcast(buffer + first, buffer + first, static_cast<std::size_t>(counts[q]), ncclFloat64, q,
                               comm_, stream);
      }
      first += counts[q];
    }
    ncclResult_t const ended = ncclGroupEnd();  // always closed, also after a failed broadcast
    FUSEDOPT_NCCL_TRY(status);
    FUSEDOPT_NCCL_TRY(ended);
  }

 private:
  static ncclRedOp_t op_of(cuda::gradient_reduction reduction)
  {
    if (reduction == cuda::gradient_reduction::sum) { return ncclSum; }
#if defined(NCCL_VERSION_CODE) && NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
    return ncclAvg;
#else
    FUSEDOPT_FAIL("nccl::communicator: gradient_reduction::average needs NCCL 2.10 (ncclAvg)");
#endif
  }

  ncclComm_t comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace nccl
FUSEDOPT_NAMESPACE_END
