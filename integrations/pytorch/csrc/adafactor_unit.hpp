/// @file adafactor_unit.hpp
/// @brief fusedopt_torch.Adafactor's unit: a C interface to a library plan of
/// `fusedopt::rules::basic_adafactor` (fusedopt/rules/adafactor.hpp) over caller-owned factored
/// statistics (fusedopt/factored.hpp), loaded with ctypes by fusedopt_torch/adafactor.py. Like
/// the muon unit it is not loaded by the core: its statistics are tensors of another shape than
/// the parameter (torch's row_var and col_var), described by a table the plan keeps, which
/// nothing of the core's buckets or proxies can carry.
///
/// A unit's source defines FUSEDOPT_ADAFACTOR_UNIT_CUDA (1: the CUDA plan, 0: the host plan) and
/// FUSEDOPT_ADAFACTOR_UNIT_T (the element type of the parameters, gradients and statistics:
/// torch keeps row_var, col_var and variance in the gradient's dtype, the gradient has the
/// parameter's), then includes this file. The plan owns the statistics' table and the factored
/// pass's workspace (device memory for CUDA, allocated on the device current at make); the
/// statistics themselves are the caller's tensors. Every entry point returns 0 (or a plan) on
/// success; on failure it returns non-zero (or null) and writes the library's message into
/// `error`: nothing is thrown across the boundary.
#pragma once

#if FUSEDOPT_ADAFACTOR_UNIT_CUDA
#include <fusedopt/fusedopt.cuh>
#else
#include <fusedopt/fusedopt.hpp>
#endif

#include "c_unit.hpp"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

/// @brief One step's options, mirrored by fusedopt_torch/_adafactor_unit.py's ctypes structure
/// (keep both in the same order). A non-null pointer replaces its value: memory of the plan's
/// backend (device memory for CUDA), read when the step runs, so a captured CUDA graph sees a
/// scheduler's lr and its own step count.
struct fusedopt_adafactor_hyper {
  double lr;
  double beta2_decay;
  double eps1;  ///< negative: torch's None (finfo(T).eps)
  double eps2;
  double d;
  double weight_decay;
  double const* lr_pointer;
  std::int64_t step;  ///< 1-based: torch's state['step'] after its increment
  std::int64_t const* step_pointer;
  std::int32_t maximize;
};

namespace fusedopt_adafactor_unit {

namespace fo = ::fusedopt;
using ::fusedopt_torch::c_unit::guarded;
using ::fusedopt_torch::c_unit::list_of;
using element = FUSEDOPT_ADAFACTOR_UNIT_T;

inline auto bind_lists(void* const* params, void const* const* grads, std::int64_t const* sizes, std::int64_t n)
{
  return fo::bind(fo::slot::param = list_of<element>(params, sizes, n),
                  fo::slot::grad = list_of<element const>(grads, sizes, n));
}

using lists_type = decltype(bind_lists(nullptr, nullptr, nullptr, 0));
#if FUSEDOPT_ADAFACTOR_UNIT_CUDA
using plan_type = decltype(fo::cuda::make_plan(std::declval<lists_type>(), {}));
using stream_type = cudaStream_t;  // c_unit::on_stream

using ::fusedopt_torch::c_unit::device_array;
using ::fusedopt_torch::c_unit::device_free;
using workspace_type = std::unique_ptr<double, device_free>;
using entries_type = std::unique_ptr<fo::factored_tensor<element>, device_free>;
#else
using plan_type = decltype(fo::host::make_plan(std::declval<lists_type>(), {}));
using stream_type = void;
using workspace_type = std::vector<double>;
using entries_type = std::vector<fo::factored_tensor<element>>;
#endif
using grad_pointer = typename plan_type::template slot_pointer_t<fo::slot::grad_t>;

/// A plan, the table of its tensors' statistics and the factored pass's workspace: everything a
/// step reads besides the caller's tensors, so that a step allocates nothing.
struct holder {
  workspace_type workspace;
  entries_type entries;
  fo::factored_table<element> table;
  plan_type plan;
  std::vector<grad_pointer> grads;
};

/// torch's factoring of the n tensors: shape t is dims[offset .. offset + ndims[t]); each must
/// hold sizes[t] elements (checked here, as the CUDA backend cannot check its table).
inline fo::factored_layout layout_of(std::int64_t const* sizes, std::int64_t const* dims, std::int64_t const* ndims,
                                     std::int64_t n)
{
  fo::factored_layout layout;
  std::int64_t offset = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    FUSEDOPT_EXPECTS(ndims[t] >= 0, "adafactor: tensor " + std::to_string(t) + " has a negative number of dimensions");
    layout.add_torch_shape(std::vector<std::int64_t>(dims + offset, dims + offset + ndims[t]));
    offset += ndims[t];
    FUSEDOPT_EXPECTS(layout.elements(static_cast<std::size_t>(t)) == sizes[t],
                     "adafactor: tensor " + std::to_string(t) + " has " + std::to_string(sizes[t]) +
                       " elements, not the product of its shape's dimensions");
  }
  return layout;
}

}  // namespace fusedopt_adafactor_unit

/// @brief A plan over n tensors of sizes[t] elements and torch's shapes (ndims[t] dimensions
/// each, flattened into `dims`), whose statistics are rows[t] (row_var, or the variance of a
/// tensor of fewer than two dimensions) and cols[t] (col_var; ignored, may be null, below two
/// dimensions), contiguous, of the element type; or null with the message in `error`. CUDA:
/// built on the current device and `stream`, which it synchronises. `threads`: the host's
/// (0: OpenMP's default).
FUSEDOPT_TORCH_C_EXPORT void* fusedopt_adafactor_make(void* const* params, void const* const* grads,
                                                        std::int64_t const* sizes, std::int64_t const* dims,
                                                        std::int64_t const* ndims, void* const* rows,
                                                        void* const* cols, std::int64_t n, std::int64_t threads,
                                                        void* stream, char* error, std::size_t error_size)
{
  using namespace fusedopt_adafactor_unit;
  std::unique_ptr<holder> made;
  int const status = guarded(error, error_size, [&] {
    auto const layout = layout_of(sizes, dims, ndims, n);
    std::vector<element*> row_pointers, col_pointers;
    for (std::int64_t t = 0; t < n; ++t) {
      row_pointers.push_back(static_cast<element*>(rows[t]));
      col_pointers.push_back(static_cast<element*>(cols[t]));
    }
    auto lists = bind_lists(params, grads, sizes, n);
    auto const count = layout.num_tensors();
#if FUSEDOPT_ADAFACTOR_UNIT_CUDA
    (void)threads;
    auto const on = static_cast<cudaStream_t>(stream);
    auto workspace = device_array<double>(static_cast<std::size_t>(layout.workspace_doubles()));
    auto const entries = layout.entries<element>(row_pointers, col_pointers, workspace.get());
    auto device_entries = device_array<fo::factored_tensor<element>>(count);
    if (count > 0) {
      FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(device_entries.get(), entries.data(), count * sizeof(entries[0]),
                                        cudaMemcpyHostToDevice, on));
    }
    // synchronises `on`: the table has landed
    // The update in the shape for slow memory (128 threads, four vectors of four floats a
    // thread) on every device: Adafactor's update runs each vector through its factored lookup,
    // and with the fast-memory shape's one vector a thread the next loads waited on it. H200,
    // GPT-2 small: 880.0 us with one vector a thread, 815.5 with four (CAME's update was slower
    // with more: its unit keeps the automatic choice; docs/decisions.md, session 61).
    auto opts = ::fusedopt_torch::c_unit::factored_rule_options();
    opts.memory = fo::cuda::memory_speed::slow;
    auto plan = fo::cuda::make_plan(lists, opts, on);
    auto const table = layout.table<element>(device_entries.get());
    made.reset(new holder{std::move(workspace), std::move(device_entries), table, std::move(plan),
                          std::vector<grad_pointer>(count)});
#else
    (void)stream;
    workspace_type workspace(static_cast<std::size_t>(layout.workspace_doubles()));
    auto entries = layout.entries<element>(row_pointers, col_pointers, workspace.data());
    fo::host::options opts;
    opts.threads = static_cast<int>(threads);
    auto plan = fo::host::make_plan(lists, opts);
    // The table points into `entries`' and `workspace`'s heap memory, which the moves keep.
    auto const table = layout.table<element>(entries.data());
    made.reset(new holder{std::move(workspace), std::move(entries), table, std::move(plan),
                          std::vector<grad_pointer>(count)});
#endif
  });
  return status == 0 ? made.release() : nullptr;
}

/// @brief One step of torch.optim.Adafactor on `stream` (CUDA; the host runs it at once):
/// nothing is written when the options are refused.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_adafactor_run(void* plan, fusedopt_adafactor_hyper const* h, void* stream,
                                                     char* error, std::size_t error_size)
{
  using namespace fusedopt_adafactor_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    fo::rules::basic_adafactor<element> opt;
    opt.lr = h->lr_pointer != nullptr ? fo::scalar<double>::from_pointer(h->lr_pointer) : fo::scalar<double>(h->lr);
    opt.beta2_decay = h->beta2_decay;
    opt.eps1 = h->eps1;
    opt.eps2 = h->eps2;
    opt.d = h->d;
    opt.weight_decay = h->weight_decay;
    opt.maximize = h->maximize != 0;
    opt.statistics = self.table;
    fo::step_info step;
    step.step = h->step_pointer != nullptr ? fo::scalar<std::int64_t>::from_pointer(h->step_pointer)
                                           : fo::scalar<std::int64_t>(h->step);
    ::fusedopt_torch::c_unit::on_stream<stream_type>(stream, [&](auto... on) { self.plan.run(opt, step, on...); });
  });
}

/// @brief Points the plan's gradients at `grads` (one per tensor, as made): torch's
/// zero_grad(set_to_none=True) gives new gradient tensors every step.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_adafactor_rebind_grads(void* plan, void const* const* grads, std::int64_t n,
                                                              void* stream, char* error, std::size_t error_size)
{
  using namespace fusedopt_adafactor_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    ::fusedopt_torch::c_unit::rebind_grads<stream_type>(
        self.plan, self.grads, grads, n, stream,
        "adafactor: rebind_grads was given another number of gradients than the plan has tensors");
  });
}

FUSEDOPT_TORCH_C_EXPORT void fusedopt_adafactor_destroy(void* plan)
{
  delete static_cast<fusedopt_adafactor_unit::holder*>(plan);
}
