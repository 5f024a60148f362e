/// @file cuda/detail/upload_ring.cuh
/// @brief Pinned staging buffers for the asynchronous uploads of a plan's tensor table when
/// its addresses move (plan::rebind).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstring>
#include <utility>

#include "../../config.hpp"
#include "../error.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Puts the calling thread in cudaStreamCaptureModeRelaxed for its lifetime (restoring the mode
/// it had), so that a query the runtime counts as unsafe does not invalidate a capture in progress.
class relaxed_capture_mode {
 public:
  relaxed_capture_mode() { FUSEDOPT_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&previous_)); }
  ~relaxed_capture_mode() { (void)cudaThreadExchangeStreamCaptureMode(&previous_); }
  relaxed_capture_mode(relaxed_capture_mode const&) = delete;
  relaxed_capture_mode& operator=(relaxed_capture_mode const&) = delete;

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
};

/// A ring of `slots` pinned host buffers of `bytes` each, with an event per slot. An upload
/// copies host data into the next slot and enqueues one cudaMemcpyAsync from it, so the call
/// returns at once; the slot is written again only after its event says the copy consumed
/// it. The host therefore waits only when it runs `slots` uploads ahead of the stream
/// (a stream that far behind the host bounds how far the host may run ahead).
class upload_ring {
 public:
  static constexpr int default_slots = 4;

  upload_ring() = default;
  upload_ring(std::size_t bytes, int slots = default_slots) : bytes_(bytes), slots_(slots)
  {
    if (bytes_ == 0) { return; }
    FUSEDOPT_CUDA_TRY(cudaMallocHost(&memory_, bytes_ * static_cast<std::size_t>(slots_)));
    events_ = new cudaEvent_t[static_cast<std::size_t>(slots_)]();
    for (int k = 0; k < slots_; ++k) {
      cudaError_t const status = cudaEventCreateWithFlags(&events_[k], cudaEventDisableTiming);
      if (status != cudaSuccess) {
        release();
        FUSEDOPT_CUDA_TRY(status);
      }
    }
  }
  upload_ring(upload_ring&& other) noexcept { swap(other); }
  upload_ring& operator=(upload_ring&& other) noexcept
  {
    upload_ring moved(std::move(other));
    swap(moved);
    return *this;
  }
  upload_ring(upload_ring const&) = delete;
  upload_ring& operator=(upload_ring const&) = delete;
  ~upload_ring() { release(); }

  /// Enqueues a copy of `bytes` (at most the ring's) from `source` to `device` on `stream`.
  void upload(void* device, void const* source, std::size_t bytes, cudaStream_t stream)
  {
    FUSEDOPT_EXPECTS(bytes <= bytes_, "upload_ring: upload larger than its slots");
    int const k = next_;
    next_ = (next_ + 1) % slots_;
    FUSEDOPT_CUDA_TRY(cudaEventSynchronize(events_[k]));  // done long ago unless the host is far ahead
    auto* const slot = static_cast<unsigned char*>(memory_) + static_cast<std::size_t>(k) * bytes_;
    std::memcpy(slot, source, bytes);
    FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(device, slot, bytes, cudaMemcpyHostToDevice, stream));
    FUSEDOPT_CUDA_TRY(cudaEventRecord(events_[k], stream));
  }

 private:
  void swap(upload_ring& other) noexcept
  {
    std::swap(memory_, other.memory_);
    std::swap(events_, other.events_);
    std::swap(bytes_, other.bytes_);
    std::swap(slots_, other.slots_);
    std::swap(next_, other.next_);
  }
  void release() noexcept
  {
    // Destruction must not throw; these calls fail only when the context is already gone.
    if (events_ != nullptr) {
      for (int k = 0; k < slots_; ++k) {
        if (events_[k] != nullptr) {
          (void)cudaEventSynchronize(events_[k]);  // a pending copy still reads the slot
          (void)cudaEventDestroy(events_[k]);
        }
      }
      delete[] events_;
      events_ = nullptr;
    }
    if (memory_ != nullptr) {
      (void)cudaFreeHost(memory_);
      memory_ = nullptr;
    }
  }

  void* memory_ = nullptr;
  cudaEvent_t* events_ = nullptr;
  std::size_t bytes_ = 0;
  int slots_ = default_slots;
  int next_ = 0;
};

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
