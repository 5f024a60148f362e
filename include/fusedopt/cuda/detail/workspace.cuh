/// @file cuda/detail/workspace.cuh
/// @brief The device workspace of reduction passes, shared by cuda::plan and the sharded plan
/// (cuda/sharded.cuh): pass results, chunk partials, the chunk range of every row and the
/// finalize kernel's counter, in one allocation made when the plan is built.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "../../config.hpp"
#include "../../error.hpp"
#include "../error.cuh"
#include "tables.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// One allocation holding what a step's reduction passes need: `capacity x (rows + 1)` doubles
/// of results (make_pass_results cuts them per pass), `capacity x chunks` doubles of chunk
/// partials (every pass reuses them: pass J's finalize consumes them before pass J + 1 runs),
/// the chunk range of each row and the finalize counter. Empty when capacity is 0.
class reduction_workspace {
 public:
  reduction_workspace() = default;

  /// `ranges`: the chunks of every row (empty rows included), in the order chunk partials
  /// are numbered. Uploads them on `stream` and synchronises it (plan construction).
  reduction_workspace(int capacity, std::vector<chunk_range> const& ranges, std::int64_t chunks, cudaStream_t stream)
      : capacity_(capacity), rows_(static_cast<std::int64_t>(ranges.size()))
  {
    FUSEDOPT_EXPECTS(capacity >= 0, "cuda::options::reduction_capacity must not be negative");
    for (auto const& r : ranges) { longest_row_ = std::max(longest_row_, r.count); }
    if (capacity == 0) { return; }
    auto const c = static_cast<std::size_t>(capacity);
    std::size_t const result_bytes = c * (static_cast<std::size_t>(rows_) + 1) * sizeof(double);
    std::size_t const partial_bytes = c * static_cast<std::size_t>(chunks) * sizeof(double);
    std::size_t const range_bytes = ranges.size() * sizeof(chunk_range);
    std::size_t const bytes = result_bytes + partial_bytes + range_bytes + 16;
    void* memory = nullptr;
    FUSEDOPT_CUDA_TRY(cudaMalloc(&memory, bytes));
    memory_.reset(memory);
    auto* base = static_cast<unsigned char*>(memory);
    results = reinterpret_cast<double*>(base);
    partials = reinterpret_cast<double*>(base + result_bytes);
    this->ranges = reinterpret_cast<chunk_range*>(base + result_bytes + partial_bytes);
    counter = reinterpret_cast<unsigned int*>(base + result_bytes + partial_bytes + range_bytes);
    FUSEDOPT_CUDA_TRY(cudaMemsetAsync(memory, 0, bytes, stream));
    if (!ranges.empty()) {
      FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(this->ranges, ranges.data(), range_bytes, cudaMemcpyHostToDevice, stream));
    }
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));
  }

  [[nodiscard]] int capacity() const { return capacity_; }
  [[nodiscard]] std::int64_t rows() const { return rows_; }
  /// Chunks of the row with the most (picks the finalize's block size).
  [[nodiscard]] std::int64_t longest_row() const { return longest_row_; }

  double* results = nullptr;
  double* partials = nullptr;
  chunk_range* ranges = nullptr;
  unsigned int* counter = nullptr;

 private:
  struct device_free {
    void operator()(void* p) const noexcept { (void)cudaFree(p); }  // fails only when the context is gone
  };
  std::unique_ptr<void, device_free> memory_;
  int capacity_ = 0;
  std::int64_t rows_ = 0;
  std::int64_t longest_row_ = 0;
};

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
