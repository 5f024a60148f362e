/// @file cuda_timing.hpp
/// @brief Timing of CUDA steps for libtorch_step, without torch or CUDA headers (defined in
/// cuda_timing.cu, compiled by nvcc): the torch code passes its current stream as a void*.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace fusedopt_libtorch_bench {

/// @brief Medians over the repeats of one way of stepping, in seconds.
struct step_times {
  double wall = 0;    ///< the call and its device work: from the call to the end of a stream synchronisation
  double host = 0;    ///< the call alone (what the host spends enqueueing)
  double device = 0;  ///< the device work alone: events around the call, the stream held by a
                      ///< spin kernel longer than the call's host time so everything is queued first
};

/// @brief Times `step` (which enqueues its work on `stream`, a cudaStream_t) after `warmup`
/// calls, `repeats` times per measure.
step_times time_steps(void* stream, std::function<void()> const& step, int warmup, int repeats);

/// @brief The same for a step of fusedopt's own CUDA plan (fusedopt::cuda::make_plan, rules::adamw
/// with torch::optim::AdamW's defaults and lr 1e-3), float32, over the tensors at these addresses:
/// the adapter's reference (it should add no device work).
step_times time_fused_plan(void* stream, std::vector<void*> const& params, std::vector<void const*> const& grads,
                           std::vector<void*> const& exp_avgs, std::vector<void*> const& exp_avg_sqs,
                           std::vector<std::int64_t> const& sizes, int warmup, int repeats);

}  // namespace fusedopt_libtorch_bench
