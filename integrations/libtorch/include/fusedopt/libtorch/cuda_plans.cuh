/// @file libtorch/cuda_plans.cuh
/// @brief The CUDA plans of fusedopt::libtorch's optimizers, per rule:
/// `detail::make_cuda_plan<Rule>(request)`, a fusedopt::cuda plan built once per bucket on the
/// device of its tensors and on torch's current stream of that device. cuda_steps.cuh gathers
/// them behind `make_cuda_steps()`; a project that wants its kernels compiled in parallel
/// includes this header in more `.cu` files, each instantiating some rules
/// (FUSEDOPT_LIBTORCH_CUDA_PLANS), and defines FUSEDOPT_LIBTORCH_CUDA_PLANS_EXTERN where it
/// includes cuda_steps.cuh (nvcc spends minutes on every dtype and layout of a family).
///
/// A step enqueues one launch on the current stream, and new gradient addresses are rebound in
/// stream order with no allocation and no synchronisation (fusedopt::cuda::basic_plan::rebind).
/// When the current stream changes between two uses of a plan (outside a capture), the new
/// stream waits for the old one's work on the plan's tables through an event the plan owns.
#pragma once

#include <fusedopt/fusedopt.cuh>

#include <cuda_runtime.h>

#include <memory>
#include <utility>

#include "plans.hpp"

namespace fusedopt {
namespace libtorch {
namespace detail {

/// Makes `device` current for a scope, as it was afterwards.
class device_scope {
 public:
  explicit device_scope(int device)
  {
    FUSEDOPT_CUDA_TRY(cudaGetDevice(&previous_));
    if (previous_ != device) { FUSEDOPT_CUDA_TRY(cudaSetDevice(device)); }
    changed_ = previous_ != device;
  }
  ~device_scope()
  {
    if (changed_) { static_cast<void>(cudaSetDevice(previous_)); }  // a destructor does not throw
  }
  device_scope(device_scope const&) = delete;
  device_scope& operator=(device_scope const&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

inline bool stream_capturing(void* stream)
{
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FUSEDOPT_CUDA_TRY(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

/// The CUDA backend's per-plan object (plans.hpp's make_plan): the plan's device, the stream
/// it was last used on and the event that orders a new stream after it.
class cuda_backend {
 public:
  explicit cuda_backend(int device) : device_(device)
  {
    device_scope const scope(device_);
    FUSEDOPT_CUDA_TRY(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  cuda_backend(cuda_backend&& other) noexcept
      : device_(other.device_), event_(std::exchange(other.event_, nullptr)), last_(other.last_)
  {
  }
  cuda_backend& operator=(cuda_backend&&) = delete;
  cuda_backend(cuda_backend const&) = delete;
  cuda_backend& operator=(cuda_backend const&) = delete;
  ~cuda_backend()
  {
    if (event_ != nullptr) { static_cast<void>(cudaEventDestroy(event_)); }  // a destructor does not throw
  }

  template <class Lists>
  auto make(Lists lists, int reduction_capacity, void* stream)
  {
    device_scope const scope(device_);
    ::fusedopt::cuda::options o;
    o.reduction_capacity = reduction_capacity;  // rules without reduction passes: no workspace
    auto p = ::fusedopt::cuda::make_plan(std::move(lists), o, static_cast<cudaStream_t>(stream));
    last_ = stream;
    return p;
  }
  template <class Plan, class Rule>
  void run(Plan const& p, Rule const& rule, step_info const& step, void* stream)
  {
    device_scope const scope(device_);
    follow(stream);
    p.run(rule, step, static_cast<cudaStream_t>(stream));
  }
  template <class Plan, class Lists>
  void rebind(Plan& p, Lists const& lists, void* stream)
  {
    device_scope const scope(device_);
    follow(stream);
    p.rebind(lists, static_cast<cudaStream_t>(stream));
  }
  template <class Plan, class Slot, class Pointer>
  void rebind_slot(Plan& p, Slot s, Pointer const* addresses, std::size_t count, void* stream)
  {
    device_scope const scope(device_);
    follow(stream);
    p.rebind(s, addresses, count, static_cast<cudaStream_t>(stream));
  }

 private:
  // The plan's tables and workspace are used by one stream at a time: work on a new stream
  // waits for the old one's. Not under capture: a captured stream cannot wait on an event
  // recorded outside it (torch synchronises before a capture begins).
  void follow(void* stream)
  {
    if (stream == last_) { return; }
    if (!stream_capturing(stream)) {
      FUSEDOPT_CUDA_TRY(cudaEventRecord(event_, static_cast<cudaStream_t>(last_)));
      FUSEDOPT_CUDA_TRY(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), event_, 0));
    }
    last_ = stream;
  }

  int device_;
  cudaEvent_t event_ = nullptr;
  void* last_ = nullptr;
};

/// fusedopt's CUDA plan of rule `Rule` that `request` asks for.
template <class Rule>
std::unique_ptr<plan<Rule>> make_cuda_plan(plan_request const& request)
{
  // The extras (layout_extras) are host plans only: their kernels are not compiled here.
  return ::fusedopt::libtorch::make_plan<Rule, false>([&] { return cuda_backend(request.device); }, request);
}

}  // namespace detail
}  // namespace libtorch
}  // namespace fusedopt

/// Instantiates the CUDA plans of rule `Rule` (e.g. fusedopt::rules::adamw) in this `.cu` file,
/// for a program whose cuda_steps.cuh is included with FUSEDOPT_LIBTORCH_CUDA_PLANS_EXTERN.
#define FUSEDOPT_LIBTORCH_CUDA_PLANS(Rule)                                         \
  namespace fusedopt {                                                              \
  namespace libtorch {                                                              \
  namespace detail {                                                                \
  template std::unique_ptr<plan<Rule>> make_cuda_plan<Rule>(plan_request const&);  \
  }                                                                                 \
  }                                                                                 \
  }                                                                                 \
  static_assert(true, "a semicolon follows")
