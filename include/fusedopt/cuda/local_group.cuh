/// @file cuda/local_group.cuh
/// @brief A communicator (cuda/sharded.cuh) that simulates N ranks in one process on one GPU:
/// each rank is a host thread with its own buffers and stream; a collective waits until every
/// rank has called it, then moves the data with deterministic kernels and copies. It exists to
/// test sharded plans on one GPU (N ranks against the unsharded plan, bit for bit), where NCCL
/// cannot run two ranks.
///
/// @code
/// fo::cuda::local_group group(4);
/// // thread r: auto plan = fo::cuda::make_sharded_plan(layout, group.member(r), lists_r, buffers_r);
/// //           plan.run(rule, step, stream_r);
/// // a thread that fails calls group.abort(what) so that the others stop waiting
/// @endcode
///
/// Reductions are fixed: reduce_scatter adds the ranks' elements in rank order in the
/// element's arithmetic type (float for half, bfloat16 and float), divides by the rank count
/// for an average, and rounds once. (NCCL's order and rounding are its own.) Not capturable
/// across ranks: each collective synchronises the ranks' host threads.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../error.hpp"
#include "../numeric/dtypes.hpp"
#include "detail/kernels.cuh"
#include "error.cuh"
#include "sharded.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

/// The most ranks a local group simulates (the reduce-scatter kernel takes every rank's
/// pointers by value).
inline constexpr int local_group_max_ranks = 64;

template <class T>
struct rank_pointers {
  T const* send[local_group_max_ranks];
  T* recv[local_group_max_ranks];
};

/// Rank blockIdx.y's shard: element i is the sum over ranks 0, 1, ... in that order of their
/// element (blockIdx.y x count + i), in T's arithmetic type, divided by `ranks` for an average.
template <class T>
FUSEDOPT_KERNEL void local_reduce_scatter(rank_pointers<T> const pointers, int ranks, std::int64_t count, int average)
{
  using O = opmath_t<T>;
  std::int64_t const base = std::int64_t{blockIdx.y} * count;
  for (std::int64_t i = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    O sum = to_opmath<O>(pointers.send[0][base + i]);
    for (int q = 1; q < ranks; ++q) { sum += to_opmath<O>(pointers.send[q][base + i]); }
    if (average != 0) { sum /= static_cast<O>(ranks); }
    pointers.recv[blockIdx.y][i] = from_opmath<T>(sum);
  }
}

/// A distinct address per type: the group checks that every rank passed the same element type.
template <class T>
inline constexpr char type_tag = 0;

}  // namespace detail

/// @brief N ranks in one process (see the file's description). Copies share the group.
class local_group {
 public:
  class member;

  /// @brief A group of `ranks` ranks on the current device. A rank that waits longer than
  /// `timeout` for the others at a collective throws (and so do the others): a test that gets
  /// the collectives wrong fails instead of hanging.
  /// @throws fusedopt::error if ranks is not in [1, 64], or a CUDA call fails.
  explicit local_group(int ranks, std::chrono::milliseconds timeout = std::chrono::seconds(120));

  [[nodiscard]] int size() const;
  /// @brief The communicator of rank `rank`, to give to that rank's sharded plan.
  [[nodiscard]] member rank(int rank) const;
  /// @brief Every rank waiting at a collective, and every later collective, throws with `why`.
  void abort(std::string const& why) const;

 private:
  struct state;
  std::shared_ptr<state> state_;
};

/// @brief One rank of a local_group: a communicator for cuda::sharded_plan.
class local_group::member {
 public:
  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const;
  template <class T>
  void reduce_scatter(T const* send, T* recv, std::size_t count, gradient_reduction reduction, cudaStream_t stream);
  template <class T>
  void all_gather(T* buffer, std::size_t count, cudaStream_t stream);
  void all_gather_v(double* buffer, std::int64_t const* counts, cudaStream_t stream);

 private:
  friend class local_group;
  member(std::shared_ptr<state> s, int rank) : state_(std::move(s)), rank_(rank) {}
  std::shared_ptr<state> state_;
  int rank_ = 0;
};

struct local_group::state {
  enum class operation { reduce_scatter, all_gather, all_gather_v };
  static constexpr char const* names[] = {"reduce_scatter", "all_gather", "all_gather_v"};
  struct call {
    operation kind = operation::reduce_scatter;
    char const* type = nullptr;
    void const* send = nullptr;
    void* recv = nullptr;
    std::size_t count = 0;
    gradient_reduction reduction = gradient_reduction::sum;
    std::int64_t const* counts = nullptr;
    cudaStream_t stream = nullptr;
  };

  int ranks = 1;
  std::chrono::milliseconds timeout{};
  std::mutex mutex;
  std::condition_variable arrived_all;
  std::vector<call> calls;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::uint64_t collectives = 0;
  std::string failure;              // sticky: once set, every collective throws it
  std::vector<cudaEvent_t> ready;   // per rank: its stream reached the collective
  cudaEvent_t done = nullptr;       // the data moved

  ~state()
  {
    for (cudaEvent_t e : ready) { (void)cudaEventDestroy(e); }  // a destructor must not throw
    if (done != nullptr) { (void)cudaEventDestroy(done); }
  }

  // Why the calls of one collective do not match, or empty.
  std::string mismatch() const
  {
    for (int q = 1; q < ranks; ++q) {
      call const& a = calls[0];
      call const& b = calls[static_cast<std::size_t>(q)];
      std::string const ranks_named = "rank 0 and rank " + std::to_string(q) + " called ";
      if (a.kind != b.kind) {
        return ranks_named + names[static_cast<int>(a.kind)] + " and " + names[static_cast<int>(b.kind)];
      }
      if (a.type != b.type || a.count != b.count || a.reduction != b.reduction) {
        return ranks_named + names[static_cast<int>(a.kind)] + " with other element types, counts or reductions";
      }
      if (a.kind == operation::all_gather_v && !std::equal(a.counts, a.counts + ranks, b.counts)) {
        return ranks_named + "all_gather_v with other counts";
      }
    }
    return {};
  }

  /// Rank `rank` arrives with `c`; the last to arrive checks the calls and enqueues `move`
  /// (every call, its stream) after every rank's stream reached the collective; then every
  /// rank's stream waits for the move.
  template <class Move>
  void exchange(int rank, call const& c, Move&& move)
  {
    FUSEDOPT_CUDA_TRY(cudaEventRecord(ready[static_cast<std::size_t>(rank)], c.stream));
    std::unique_lock<std::mutex> lock(mutex);
    FUSEDOPT_EXPECTS(failure.empty(), "cuda::local_group: " + failure);
    calls[static_cast<std::size_t>(rank)] = c;
    std::uint64_t const seen = generation;
    if (++arrived == ranks) {
      arrived = 0;
      ++collectives;
      failure = mismatch();
      if (failure.empty()) {
        try {
          for (cudaEvent_t e : ready) { FUSEDOPT_CUDA_TRY(cudaStreamWaitEvent(c.stream, e, 0)); }
          move(calls, c.stream);
          FUSEDOPT_CUDA_TRY(cudaEventRecord(done, c.stream));
        } catch (std::exception const& e) {
          failure = e.what();
        }
      }
      ++generation;
      arrived_all.notify_all();
    } else if (!arrived_all.wait_for(lock, timeout, [&] { return generation != seen || !failure.empty(); })) {
      failure = "rank " + std::to_string(rank) + " waited " + std::to_string(timeout.count()) + " ms at collective " +
                std::to_string(collectives + 1) + " (" + names[static_cast<int>(c.kind)] +
                ") for the other ranks: a rank failed or called other collectives";
      arrived_all.notify_all();
    }
    FUSEDOPT_EXPECTS(failure.empty(), "cuda::local_group: " + failure);
    lock.unlock();
    // `done` cannot be recorded again before this wait: the next collective needs this rank.
    FUSEDOPT_CUDA_TRY(cudaStreamWaitEvent(c.stream, done, 0));
  }
};

inline local_group::local_group(int ranks, std::chrono::milliseconds timeout) : state_(std::make_shared<state>())
{
  FUSEDOPT_EXPECTS(ranks >= 1 && ranks <= detail::local_group_max_ranks,
                   "cuda::local_group: ranks must be in [1, " + std::to_string(detail::local_group_max_ranks) + "]");
  state_->ranks = ranks;
  state_->timeout = timeout;
  state_->calls.resize(static_cast<std::size_t>(ranks));
  state_->ready.reserve(static_cast<std::size_t>(ranks));
  for (int q = 0; q < ranks; ++q) {
    cudaEvent_t e = nullptr;
    FUSEDOPT_CUDA_TRY(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    state_->ready.push_back(e);
  }
  FUSEDOPT_CUDA_TRY(cudaEventCreateWithFlags(&state_->done, cudaEventDisableTiming));
}

inline int local_group::size() const { return state_->ranks; }

inline local_group::member local_group::rank(int rank) const
{
  FUSEDOPT_EXPECTS(rank >= 0 && rank < state_->ranks, "cuda::local_group::rank: rank out of range");
  return member(state_, rank);
}

inline void local_group::abort(std::string const& why) const
{
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->failure.empty()) { state_->failure = "aborted: " + why; }
  state_->arrived_all.notify_all();
}

inline int local_group::member::size() const { return state_->ranks; }

template <class T>
void local_group::member::reduce_scatter(T const* send, T* recv, std::size_t count, gradient_reduction reduction,
                                         cudaStream_t stream)
{
  state::call const c{state::operation::reduce_scatter, &detail::type_tag<T>, send, recv, count, reduction, nullptr, stream};
  state_->exchange(rank_, c, [](std::vector<state::call> const& calls, cudaStream_t s) {
    if (calls[0].count == 0) { return; }
    detail::rank_pointers<T> pointers{};
    for (std::size_t q = 0; q < calls.size(); ++q) {
      pointers.send[q] = static_cast<T const*>(calls[q].send);
      pointers.recv[q] = static_cast<T*>(calls[q].recv);
    }
    auto const count = static_cast<std::int64_t>(calls[0].count);
    constexpr unsigned threads = 256;
    auto const blocks = static_cast<unsigned>(std::min<std::int64_t>((count + threads - 1) / threads, 1024));
    detail::local_reduce_scatter<T><<<dim3(blocks, static_cast<unsigned>(calls.size())), threads, 0, s>>>(
      pointers, static_cast<int>(calls.size()), count, calls[0].reduction == gradient_reduction::average ? 1 : 0);
    FUSEDOPT_CUDA_TRY(cudaGetLastError());
  });
}

template <class T>
void local_group::member::all_gather(T* buffer, std::size_t count, cudaStream_t stream)
{
  state::call const c{state::operation::all_gather, &detail::type_tag<T>, buffer, buffer, count,
                      gradient_reduction::sum, nullptr, stream};
  state_->exchange(rank_, c, [](std::vector<state::call> const& calls, cudaStream_t s) {
    std::size_t const count = calls[0].count;
    for (std::size_t r = 0; r < calls.size(); ++r) {
      for (std::size_t q = 0; q < calls.size(); ++q) {
        if (q == r || count == 0) { continue; }
        FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(static_cast<T*>(calls[r].recv) + q * count,
                                          static_cast<T const*>(calls[q].send) + q * count, count * sizeof(T),
                                          cudaMemcpyDeviceToDevice, s));
      }
    }
  });
}

inline void local_group::member::all_gather_v(double* buffer, std::int64_t const* counts, cudaStream_t stream)
{
  state::call const c{state::operation::all_gather_v, &detail::type_tag<double>, buffer, buffer, 0,
                      gradient_reduction::sum, counts, stream};
  state_->exchange(rank_, c, [](std::vector<state::call> const& calls, cudaStream_t s) {
    std::int64_t const* counts = calls[0].counts;
    std::int64_t first = 0;
    for (std::size_t q = 0; q < calls.size(); ++q) {
      auto const bytes = static_cast<std::size_t>(counts[q]) * sizeof(double);
      for (std::size_t r = 0; r < calls.size() && bytes > 0; ++r) {
        if (r == q) { continue; }
        FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(static_cast<double*>(calls[r].recv) + first,
                                          static_cast<double const*>(calls[q].send) + first, bytes,
                                          cudaMemcpyDeviceToDevice, s));
      }
      first += counts[q];
    }
  });
}

}  // namespace cuda
FUSEDOPT_NAMESPACE_END
