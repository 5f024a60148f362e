/// @file cuda/detail/address_tables.cuh
/// @brief The device copies of a plan's tensor table (the addresses of every tensor in every
/// slot), one per address set seen recently, so that a plan rebound to addresses it has seen
/// before switches tables instead of uploading one.
///
/// Why: PyTorch's `zero_grad(set_to_none=True)` hands out new gradient buffers every step, but
/// its caching allocator cycles through a few address sets (4 distinct sets over 30 steps of a
/// GPT-2-small training loop on the H100 machine, 2 with GradScaler). Each upload costs a
/// staging copy, a cudaMemcpyAsync and an event on the host, just before the launch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "../../config.hpp"
#include "../../error.hpp"
#include "../error.cuh"
#include "dispatch.cuh"
#include "upload_ring.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// `count` trivially copyable entries per table, `tables` tables in one device allocation, with
/// a host copy of what each holds. A table written under stream capture holds its entries only
/// when the graph replays (and again at every replay), so it is never matched nor overwritten
/// by later uploads while another table is free: the graph keeps it.
template <class Entry>
class address_tables {
 public:
  address_tables() = default;

  /// @throws fusedopt::error if `tables` < 1 or an allocation fails.
  address_tables(std::size_t count, int tables) : count_(count), slots_(static_cast<std::size_t>(tables))
  {
    FUSEDOPT_EXPECTS(tables >= 1, "cuda::options::address_tables must be at least 1");
    if (count_ == 0) { return; }
    void* memory = nullptr;
    FUSEDOPT_CUDA_TRY(cudaMalloc(&memory, bytes() * slots_.size()));
    memory_.reset(memory);
    uploads_ = upload_ring(bytes());
  }

  /// Makes a table holding `entries` (one table's worth) current, in stream order, and returns
  /// it. Outside stream capture a table an upload left them in is reused with nothing enqueued;
  /// else one upload goes into the table used least recently (not the current one, nor one a
  /// graph keeps, while another is free). Under capture, launches that carry the entries write
  /// a table the graph then keeps (write_table_by_value: a copy from a host buffer would replay
  /// whatever the buffer holds then): the current one if a graph keeps it already, else another.
  Entry const* publish(std::vector<Entry> const& entries, cudaStream_t stream)
  {
    if (count_ == 0) { return nullptr; }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FUSEDOPT_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone) {
      if (Entry const* found = select(entries)) { return found; }
      std::size_t const k = victim();
      uploads_.upload(device(k), entries.data(), bytes(), stream);
      ++upload_count_;
      slots_[k].held = entries;  // equal lengths after the first time: no allocation
      slots_[k].valid = true;
      slots_[k].captured = false;
      make_current(k);
      return device(k);
    }
    std::size_t const k = slots_[current_].captured ? current_ : victim();
    write_table_by_value(device(k), entries, stream);
    slots_[k].valid = false;
    slots_[k].captured = true;
    make_current(k);
    return device(k);
  }

  /// The table an upload left `entries` in, made current with nothing enqueued; null when none
  /// holds them. Host work only (not for use under stream capture: see publish).
  Entry const* select(std::vector<Entry> const& entries)
  {
    if (count_ == 0) { return nullptr; }
    for (std::size_t k = 0; k < slots_.size(); ++k) {
      slot const& s = slots_[k];
      if (s.valid && std::memcmp(s.held.data(), entries.data(), bytes()) == 0) {
        make_current(k);
        return device(k);
      }
    }
    return nullptr;
  }

  /// Whether the current table was written under stream capture (then it holds its entries only
  /// when the graph replays: a run publishes the entries again first).
  [[nodiscard]] bool current_from_capture() const { return count_ > 0 && slots_[current_].captured; }

  [[nodiscard]] Entry const* current() const { return count_ == 0 ? nullptr : device(current_); }

  /// Uploads so far (by-value writes under capture not counted).
  [[nodiscard]] std::uint64_t uploads() const { return upload_count_; }

 private:
  struct slot {
    std::vector<Entry> held;  // what an upload left in the table
    bool valid = false;       // `held` is what the table holds
    bool captured = false;    // written under capture: a graph may rewrite it at every replay
    std::uint64_t used = 0;   // when it was last made current
  };
  struct device_free {
    void operator()(void* p) const noexcept { (void)cudaFree(p); }
  };

  [[nodiscard]] std::size_t bytes() const { return count_ * sizeof(Entry); }
  [[nodiscard]] Entry* device(std::size_t k) const { return static_cast<Entry*>(memory_.get()) + k * count_; }

  void make_current(std::size_t k)
  {
    current_ = k;
    slots_[k].used = ++clock_;
  }

  // Least recently used among the tables no graph keeps, not the current one where another is
  // free; when graphs keep every table, the least recently used of all (a graph that captured
  // this plan must then not be replayed after the rebind: see plan's contract).
  [[nodiscard]] std::size_t victim() const
  {
    std::size_t best = slots_.size();
    for (int pass = 0; pass < 3 && best == slots_.size(); ++pass) {
      for (std::size_t k = 0; k < slots_.size(); ++k) {
        slot const& s = slots_[k];
        if ((pass < 2 && s.captured) || (pass == 0 && k == current_ && slots_.size() > 1)) { continue; }
        if (best == slots_.size() || s.used < slots_[best].used) { best = k; }
      }
    }
    return best;
  }

  std::size_t count_ = 0;
  std::vector<slot> slots_;
  std::size_t current_ = 0;
  std::uint64_t clock_ = 0;
  std::uint64_t upload_count_ = 0;
  std::unique_ptr<void, device_free> memory_;
  upload_ring uploads_;
};

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
