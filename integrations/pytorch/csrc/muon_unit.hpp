/// @file muon_unit.hpp
/// @brief fusedopt_torch.Muon's unit: a C interface to the library's muon plans
/// (fusedopt/cuda/muon.cuh over cuBLAS, fusedopt/host/muon.hpp), loaded with ctypes by
/// fusedopt_torch/muon.py. Unlike the engine's units it is not loaded by the core: a muon plan
/// needs the matrices' shapes and runs a matrix stage, and nothing of the core's buckets,
/// proxies or GradScaler protocol applies to it (torch.optim.Muon has none of them either).
///
/// A unit's source defines FUSEDOPT_MUON_UNIT_CUDA (1: the CUDA plan, 0: the host plan),
/// FUSEDOPT_MUON_UNIT_T (the element type of the parameters, gradients and buffers: torch's
/// buffer has the gradient's dtype, the gradient the parameter's) and FUSEDOPT_MUON_UNIT_NS
/// (fusedopt::bfloat16 or float: the Newton-Schulz iteration's type), then includes this file.
/// Every entry point returns 0 (or a plan) on success; on failure it returns non-zero (or
/// null) and writes the library's message into `error`: nothing is thrown across the boundary.
#pragma once

#if FUSEDOPT_MUON_UNIT_CUDA
#include <fusedopt/cuda/muon.cuh>
#include <fusedopt/fusedopt.cuh>
#else
#include <fusedopt/fusedopt.hpp>
#include <fusedopt/host/muon.hpp>
#endif

#include "c_unit.hpp"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

/// @brief One step's options, mirrored by fusedopt_torch/muon.py's ctypes structure (keep both
/// in the same order). A non-null pointer replaces its value: a double in device memory (CUDA)
/// or host memory, read when the step runs, so a captured CUDA graph sees a scheduler's lr.
struct fusedopt_muon_hyper {
  double lr;
  double weight_decay;
  double momentum;
  double eps;
  double const* lr_pointer;
  double const* weight_decay_pointer;
  double const* momentum_pointer;
  /// `ns_steps` triples (a, b, c) of host memory, one per iteration, or 3 doubles used by every
  /// iteration when `per_iteration` is 0.
  double const* coefficients;
  std::int32_t per_iteration;
  std::int32_t ns_steps;
  std::int32_t nesterov;
  std::int32_t match_rms_adamw;  ///< adjust_lr_fn "match_rms_adamw" (else "original")
};

namespace fusedopt_muon_unit {

namespace fo = ::fusedopt;
using ::fusedopt_torch::c_unit::guarded;
using ::fusedopt_torch::c_unit::list_of;
using element = FUSEDOPT_MUON_UNIT_T;
using ns_type = FUSEDOPT_MUON_UNIT_NS;

inline auto bind_lists(void* const* params, void const* const* grads, void* const* buffers, std::int64_t const* sizes,
                       std::int64_t n)
{
  return fo::bind(fo::slot::param = list_of<element>(params, sizes, n),
                  fo::slot::grad = list_of<element const>(grads, sizes, n),
                  fo::slot::momentum_buffer = list_of<element>(buffers, sizes, n));
}

using lists_type = decltype(bind_lists(nullptr, nullptr, nullptr, nullptr, 0));
#if FUSEDOPT_MUON_UNIT_CUDA
using plan_type = decltype(fo::cuda::make_muon_plan<ns_type>(std::declval<lists_type>(), {}));
using stream_type = cudaStream_t;  // c_unit::on_stream
#else
using plan_type = decltype(fo::host::make_muon_plan<ns_type>(std::declval<lists_type>(), {}));
using stream_type = void;
#endif
using grad_pointer = typename plan_type::input_plan::template slot_pointer_t<fo::slot::grad_t>;

/// A plan and the per-iteration coefficients its last step was given (kept here, so that a step
/// allocates nothing once the schedule's length is known).
struct holder {
  plan_type plan;
  std::vector<fo::rules::ns_coefficients> schedule;
  std::vector<grad_pointer> grads;
};

}  // namespace fusedopt_muon_unit

/// @brief A plan over n matrices of sizes[t] elements, rows[t] x cols[t] (torch's p.shape; the
/// library checks that they agree), or null with the message in `error`. CUDA: built on the
/// current device and `stream`, which it synchronises.
FUSEDOPT_TORCH_C_EXPORT void* fusedopt_muon_make(void* const* params, void const* const* grads, void* const* buffers,
                                              std::int64_t const* sizes, std::int64_t const* rows,
                                              std::int64_t const* cols, std::int64_t n,
                                              std::int64_t threads, void* stream, char* error, std::size_t error_size)
{
  using namespace fusedopt_muon_unit;
  std::unique_ptr<holder> made;
  int const status = guarded(error, error_size, [&] {
    std::vector<fo::matrix_shape> shapes;
    for (std::int64_t t = 0; t < n; ++t) { shapes.push_back(fo::matrix_shape{rows[t], cols[t]}); }
    auto lists = bind_lists(params, grads, buffers, sizes, n);
#if FUSEDOPT_MUON_UNIT_CUDA
    (void)threads;
    made.reset(new holder{
      fo::cuda::make_muon_plan<ns_type>(lists, shapes, fo::cuda::muon_options{}, static_cast<cudaStream_t>(stream)),
      {}, std::vector<grad_pointer>(static_cast<std::size_t>(n))});
#else
    (void)stream;
    fo::host::options opts;
    opts.threads = static_cast<int>(threads);
    made.reset(new holder{fo::host::make_muon_plan<ns_type>(lists, shapes, opts), {},
                          std::vector<grad_pointer>(static_cast<std::size_t>(n))});
#endif
  });
  return status == 0 ? made.release() : nullptr;
}

/// @brief One step on `stream` (CUDA; the host runs it at once): nothing is written when the
/// options are refused.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_muon_run(void* plan, fusedopt_muon_hyper const* h, void* stream, char* error,
                                           std::size_t error_size)
{
  using namespace fusedopt_muon_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    fo::rules::muon opt;
    opt.lr = h->lr_pointer != nullptr ? fo::scalar<double>::from_pointer(h->lr_pointer) : fo::scalar<double>(h->lr);
    opt.weight_decay = h->weight_decay_pointer != nullptr ? fo::scalar<double>::from_pointer(h->weight_decay_pointer)
                                                          : fo::scalar<double>(h->weight_decay);
    opt.momentum = h->momentum_pointer != nullptr ? fo::scalar<double>::from_pointer(h->momentum_pointer)
                                                  : fo::scalar<double>(h->momentum);
    opt.eps = h->eps;
    opt.nesterov = h->nesterov != 0;
    opt.ns_steps = h->ns_steps;
    opt.adjust_lr = h->match_rms_adamw != 0 ? fo::rules::muon_lr_adjustment::match_rms_adamw
                                            : fo::rules::muon_lr_adjustment::original;
    FUSEDOPT_EXPECTS(h->coefficients != nullptr, "muon: no Newton-Schulz coefficients");
    auto const triple = [&](int i) { return fo::rules::ns_coefficients{h->coefficients[3 * i], h->coefficients[3 * i + 1], h->coefficients[3 * i + 2]}; };
    if (h->per_iteration != 0 && h->ns_steps > 0 && h->ns_steps <= fo::rules::muon::max_ns_steps) {
      self.schedule.resize(static_cast<std::size_t>(h->ns_steps));
      for (int i = 0; i < h->ns_steps; ++i) { self.schedule[static_cast<std::size_t>(i)] = triple(i); }
      opt.ns_schedule = self.schedule.data();
    } else {
      opt.coefficients = triple(0);
    }
    ::fusedopt_torch::c_unit::on_stream<stream_type>(stream,
                                                     [&](auto... on) { self.plan.run(opt, fo::step_info{1}, on...); });
  });
}

/// @brief Points the plan's gradients at `grads` (one per matrix, as made): torch's
/// zero_grad(set_to_none=True) gives new gradient tensors every step.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_muon_rebind_grads(void* plan, void const* const* grads, std::int64_t n, void* stream,
                                                    char* error, std::size_t error_size)
{
  using namespace fusedopt_muon_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    ::fusedopt_torch::c_unit::rebind_grads<stream_type>(
        self.plan, self.grads, grads, n, stream,
        "muon: rebind_grads was given another number of gradients than the plan has matrices");
  });
}

/// @brief Matrix t of the plan's workspace (after a step, the orthogonalised update it applied,
/// in NS, row-major like the parameter): device memory for CUDA.
FUSEDOPT_TORCH_C_EXPORT void const* fusedopt_muon_matrix(void* plan, std::int64_t t)
{
  return static_cast<fusedopt_muon_unit::holder*>(plan)->plan.matrix(static_cast<std::size_t>(t));
}

FUSEDOPT_TORCH_C_EXPORT void fusedopt_muon_destroy(void* plan) { delete static_cast<fusedopt_muon_unit::holder*>(plan); }
