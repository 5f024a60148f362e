/// @file prodigy_unit.hpp
/// @brief fusedopt_torch.Prodigy's unit: a C interface to a library plan of
/// `fusedopt::rules::prodigy` (fusedopt/rules/prodigy.hpp), loaded with ctypes by
/// fusedopt_torch/prodigy.py. Like the muon and adafactor units it is not loaded by the core:
/// the rule's state, d, d_max and d_numerator (a `prodigy_state`), lives in memory the plan owns
/// and the step reads and writes it, which nothing of the core's buckets carries.
///
/// A unit's source defines FUSEDOPT_PRODIGY_UNIT_CUDA (1: the CUDA plan, 0: the host plan),
/// FUSEDOPT_PRODIGY_UNIT_T (the element type of the parameters, gradients and their state: the
/// reference keeps s, p0, exp_avg and exp_avg_sq in the parameter's dtype) and
/// FUSEDOPT_PRODIGY_UNIT_EXP_AVG (1: exp_avg is bound, for beta1 > 0; 0: it is not, as the
/// reference creates none with beta1 = 0), then includes this file. The plan owns its
/// prodigy_state (device memory for CUDA, allocated on the device current at make); the
/// tensors are the caller's. Every entry point returns 0 (or a plan) on success; on failure it
/// returns non-zero (or null) and writes the library's message into `error`: nothing is thrown
/// across the boundary.
#pragma once

#if FUSEDOPT_PRODIGY_UNIT_CUDA
#include <fusedopt/fusedopt.cuh>
#else
#include <fusedopt/fusedopt.hpp>
#endif

#include "c_unit.hpp"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

/// @brief One step's options, mirrored by fusedopt_torch/_prodigy_unit.py's ctypes structure
/// (keep both in the same order): the reference's group options, and its k + 1 as the step.
struct fusedopt_prodigy_hyper {
  double lr;
  double beta1;
  double beta2;
  double beta3;  ///< negative: sqrt(beta2) (the reference's None)
  double eps;
  double weight_decay;
  double d0;
  double d_coef;
  double growth_rate;
  std::int64_t step;  ///< 1-based: the reference's group['k'] + 1
  std::int32_t decouple;
  std::int32_t use_bias_correction;
  std::int32_t safeguard_warmup;
  /// Non-null: the 1-based step is read here (backend memory: device memory for CUDA) when the
  /// step runs, instead of `step` (a CUDA graph's replays advance it; fusedopt_torch's
  /// capturable=True).
  std::int64_t const* step_pointer;
};

namespace fusedopt_prodigy_unit {

namespace fo = ::fusedopt;
using ::fusedopt_torch::c_unit::guarded;
using ::fusedopt_torch::c_unit::list_of;
using element = FUSEDOPT_PRODIGY_UNIT_T;

inline auto bind_lists(void* const* params, void const* const* grads, void* const* p0s, void* const* ss,
                       void* const* exp_avgs, void* const* exp_avg_sqs, std::int64_t const* sizes, std::int64_t n)
{
#if FUSEDOPT_PRODIGY_UNIT_EXP_AVG
  return fo::bind(fo::slot::param = list_of<element>(params, sizes, n),
                  fo::slot::grad = list_of<element const>(grads, sizes, n), fo::slot::p0 = list_of<element>(p0s, sizes, n),
                  fo::slot::s = list_of<element>(ss, sizes, n), fo::slot::exp_avg = list_of<element>(exp_avgs, sizes, n),
                  fo::slot::exp_avg_sq = list_of<element>(exp_avg_sqs, sizes, n));
#else
  (void)exp_avgs;
  return fo::bind(fo::slot::param = list_of<element>(params, sizes, n),
                  fo::slot::grad = list_of<element const>(grads, sizes, n), fo::slot::p0 = list_of<element>(p0s, sizes, n),
                  fo::slot::s = list_of<element>(ss, sizes, n),
                  fo::slot::exp_avg_sq = list_of<element>(exp_avg_sqs, sizes, n));
#endif
}

using lists_type = decltype(bind_lists(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0));
#if FUSEDOPT_PRODIGY_UNIT_CUDA
using plan_type = decltype(fo::cuda::make_plan(std::declval<lists_type>(), {}));
using stream_type = cudaStream_t;  // c_unit::on_stream

using state_memory = std::unique_ptr<fo::rules::prodigy_state, ::fusedopt_torch::c_unit::device_free>;

inline state_memory make_state_memory() { return ::fusedopt_torch::c_unit::device_array<fo::rules::prodigy_state>(1); }
#else
using plan_type = decltype(fo::host::make_plan(std::declval<lists_type>(), {}));
using stream_type = void;
using state_memory = std::unique_ptr<fo::rules::prodigy_state>;

inline state_memory make_state_memory() { return std::make_unique<fo::rules::prodigy_state>(); }
#endif
using grad_pointer = typename plan_type::template slot_pointer_t<fo::slot::grad_t>;

/// A plan and the prodigy_state its steps read and write (the reference's group['d'],
/// ['d_max'] and ['d_numerator']), so that a step allocates nothing and reads nothing back.
struct holder {
  state_memory state;
  plan_type plan;
  std::vector<grad_pointer> grads;
};

}  // namespace fusedopt_prodigy_unit

/// @brief A plan over n contiguous tensors of sizes[t] elements each: params, grads and their
/// state p0s, ss, exp_avgs (ignored, may be null, without FUSEDOPT_PRODIGY_UNIT_EXP_AVG) and
/// exp_avg_sqs, of the element type; or null with the message in `error`. Its prodigy_state
/// is not set: the first step does not read it (d = d_max = d0, d_numerator = 0), a later one
/// needs fusedopt_prodigy_set_state first. CUDA: built on the current device and `stream`,
/// which it synchronises. `threads`: the host's (0: OpenMP's default).
FUSEDOPT_TORCH_C_EXPORT void* fusedopt_prodigy_make(void* const* params, void const* const* grads, void* const* p0s,
                                                      void* const* ss, void* const* exp_avgs,
                                                      void* const* exp_avg_sqs, std::int64_t const* sizes,
                                                      std::int64_t n, std::int64_t threads, void* stream, char* error,
                                                      std::size_t error_size)
{
  using namespace fusedopt_prodigy_unit;
  std::unique_ptr<holder> made;
  int const status = guarded(error, error_size, [&] {
    auto lists = bind_lists(params, grads, p0s, ss, exp_avgs, exp_avg_sqs, sizes, n);
    auto const count = static_cast<std::size_t>(n);
#if FUSEDOPT_PRODIGY_UNIT_CUDA
    (void)threads;
    auto state = make_state_memory();
    auto plan = fo::cuda::make_plan(lists, fo::cuda::options{}, static_cast<cudaStream_t>(stream));
    made.reset(new holder{std::move(state), std::move(plan), std::vector<grad_pointer>(count)});
#else
    (void)stream;
    fo::host::options opts;
    opts.threads = static_cast<int>(threads);
    auto plan = fo::host::make_plan(lists, opts);
    made.reset(new holder{make_state_memory(), std::move(plan), std::vector<grad_pointer>(count)});
#endif
  });
  return status == 0 ? made.release() : nullptr;
}

/// @brief One step of the reference's Prodigy.step over the plan's tensors on `stream` (CUDA;
/// the host runs it at once): the sums, the new d and the update, the plan's prodigy_state
/// read and written in stream order. Nothing is written when the options are refused.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_prodigy_run(void* plan, fusedopt_prodigy_hyper const* h, void* stream,
                                                   char* error, std::size_t error_size)
{
  using namespace fusedopt_prodigy_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    fo::rules::prodigy opt;
    opt.lr = h->lr;
    opt.beta1 = h->beta1;
    opt.beta2 = h->beta2;
    opt.beta3 = h->beta3;
    opt.eps = h->eps;
    opt.weight_decay = h->weight_decay;
    opt.decouple = h->decouple != 0;
    opt.use_bias_correction = h->use_bias_correction != 0;
    opt.safeguard_warmup = h->safeguard_warmup != 0;
    opt.d0 = h->d0;
    opt.d_coef = h->d_coef;
    opt.growth_rate = h->growth_rate;
    opt.state = self.state.get();
    fo::step_info step{h->step};
    if (h->step_pointer != nullptr) { step.step = fo::scalar<std::int64_t>::from_pointer(h->step_pointer); }
    ::fusedopt_torch::c_unit::on_stream<stream_type>(stream, [&](auto... on) { self.plan.run(opt, step, on...); });
  });
}

/// @brief Copies the plan's prodigy_state (d, d_max, d_numerator) into out[0..3) after the
/// steps enqueued on `stream`: CUDA synchronises the stream.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_prodigy_state(void* plan, double* out, void* stream, char* error,
                                                     std::size_t error_size)
{
  using namespace fusedopt_prodigy_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    fo::rules::prodigy_state state;
#if FUSEDOPT_PRODIGY_UNIT_CUDA
    auto const on = static_cast<cudaStream_t>(stream);
    FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(&state, self.state.get(), sizeof(state), cudaMemcpyDeviceToHost, on));
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(on));
#else
    (void)stream;
    state = *self.state;
#endif
    out[0] = state.d;
    out[1] = state.d_max;
    out[2] = state.d_numerator;
  });
}

/// @brief Sets the plan's prodigy_state to in[0..3) (d, d_max, d_numerator), in stream order
/// before the steps enqueued after it: where a loaded or carried-over state resumes.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_prodigy_set_state(void* plan, double const* in, void* stream, char* error,
                                                         std::size_t error_size)
{
  using namespace fusedopt_prodigy_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    fo::rules::prodigy_state const state{in[0], in[1], in[2]};
#if FUSEDOPT_PRODIGY_UNIT_CUDA
    auto const on = static_cast<cudaStream_t>(stream);
    FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(self.state.get(), &state, sizeof(state), cudaMemcpyHostToDevice, on));
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(on));  // `state` is on this frame
#else
    (void)stream;
    *self.state = state;
#endif
  });
}

/// @brief Points the plan's gradients at `grads` (one per tensor, as made): torch's
/// zero_grad(set_to_none=True) gives new gradient tensors every step.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_prodigy_rebind_grads(void* plan, void const* const* grads, std::int64_t n,
                                                            void* stream, char* error, std::size_t error_size)
{
  using namespace fusedopt_prodigy_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    ::fusedopt_torch::c_unit::rebind_grads<stream_type>(
        self.plan, self.grads, grads, n, stream,
        "prodigy: rebind_grads was given another number of gradients than the plan has tensors");
  });
}

FUSEDOPT_TORCH_C_EXPORT void fusedopt_prodigy_destroy(void* plan)
{
  delete static_cast<fusedopt_prodigy_unit::holder*>(plan);
}
