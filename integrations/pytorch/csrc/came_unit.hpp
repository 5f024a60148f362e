/// @file came_unit.hpp
/// @brief fusedopt_torch.CAME's unit: a C interface to a library plan of
/// `fusedopt::rules::basic_came` (fusedopt/rules/came.hpp) over caller-owned factored statistics
/// (fusedopt/factored.hpp), loaded with ctypes by fusedopt_torch/came.py. Built as the adafactor
/// unit is (adafactor_unit.hpp), with two tables: the second moment's (exp_avg_sq_row and
/// exp_avg_sq_col, or exp_avg_sq below two dimensions) and the confidence's (exp_avg_res_row
/// and exp_avg_res_col; below two dimensions a row statistic per element that the confidence
/// pass needs to visit the tensor and no step reads, kept in the table's workspace: CAME.py has
/// none there, so the caller gives none).
///
/// A unit's source defines FUSEDOPT_CAME_UNIT_CUDA (1: the CUDA plan, 0: the host plan) and
/// FUSEDOPT_CAME_UNIT_T (the element type of the parameters and gradients), then includes this
/// file. exp_avg and the statistics are of the arithmetic type of T (float for float, half and
/// bfloat16, double for double): yangluo7/CAME's CAME.py upcasts 16-bit gradients to float and
/// creates its state from them. The plan owns the statistics' tables and the factored passes'
/// workspaces (device memory for CUDA, allocated on the device current at make); the
/// statistics and exp_avg are the caller's tensors. Every entry point returns 0 (or a plan) on
/// success; on failure it returns non-zero (or null) and writes the library's message into
/// `error`: nothing is thrown across the boundary.
#pragma once

#if FUSEDOPT_CAME_UNIT_CUDA
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

/// @brief One step's options, mirrored by fusedopt_torch/_came_unit.py's ctypes structure
/// (keep both in the same order): CAME.py's group options, betas and eps unpacked. A non-null
/// lr_pointer (a double in the plan's backend memory, read when the step runs) replaces lr, and
/// is not checked (the library refuses an lr that is not positive given as a value; CAME.py
/// checks lr > 0 in its constructor only).
struct fusedopt_came_hyper {
  double lr;
  double eps1;  ///< CAME.py's eps[0], added to grad^2
  double eps2;  ///< eps[1], added to the instability
  double clip_threshold;
  double beta1;
  double beta2;
  double beta3;
  double weight_decay;
  double const* lr_pointer;
};

namespace fusedopt_came_unit {

namespace fo = ::fusedopt;
using ::fusedopt_torch::c_unit::guarded;
using ::fusedopt_torch::c_unit::list_of;
using element = FUSEDOPT_CAME_UNIT_T;
using state = fo::opmath_t<element>;  ///< exp_avg's and the statistics' type

inline auto bind_lists(void* const* params, void const* const* grads, void* const* exp_avgs,
                       std::int64_t const* sizes, std::int64_t n)
{
  return fo::bind(fo::slot::param = list_of<element>(params, sizes, n),
                  fo::slot::grad = list_of<element const>(grads, sizes, n),
                  fo::slot::exp_avg = list_of<state>(exp_avgs, sizes, n));
}

using lists_type = decltype(bind_lists(nullptr, nullptr, nullptr, nullptr, 0));
#if FUSEDOPT_CAME_UNIT_CUDA
using plan_type = decltype(fo::cuda::make_plan(std::declval<lists_type>(), {}));
using stream_type = cudaStream_t;  // c_unit::on_stream

using ::fusedopt_torch::c_unit::device_array;
using ::fusedopt_torch::c_unit::device_free;
using workspace_type = std::unique_ptr<double, device_free>;
using entries_type = std::unique_ptr<fo::factored_tensor<state>, device_free>;
inline double* data_of(workspace_type const& w) { return w.get(); }
#else
using plan_type = decltype(fo::host::make_plan(std::declval<lists_type>(), {}));
using stream_type = void;
using workspace_type = std::vector<double>;
using entries_type = std::vector<fo::factored_tensor<state>>;
inline double* data_of(workspace_type& w) { return w.data(); }
#endif
using grad_pointer = typename plan_type::template slot_pointer_t<fo::slot::grad_t>;

/// One of the two tables: its entries where the backend reads them, the factored pass's
/// workspace, and the table a rule carries (pointing into both).
struct statistics {
  workspace_type workspace;
  entries_type entries;
  fo::factored_table<state> table{};
};

/// A plan and its two tables: everything a step reads besides the caller's tensors, so that a
/// step allocates nothing.
struct holder {
  statistics second_moment;
  statistics confidence;
  plan_type plan;
  std::vector<grad_pointer> grads;
};

/// CAME.py's factoring of the n tensors: shape t is dims[offset .. offset + ndims[t]); each must
/// hold sizes[t] elements (checked here, as the CUDA backend cannot check its table). Both
/// tables factor alike: a tensor of fewer than two dimensions has a statistic per element.
inline fo::factored_layout layout_of(std::int64_t const* sizes, std::int64_t const* dims, std::int64_t const* ndims,
                                     std::int64_t n)
{
  fo::factored_layout layout;
  std::int64_t offset = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    FUSEDOPT_EXPECTS(ndims[t] >= 0, "came: tensor " + std::to_string(t) + " has a negative number of dimensions");
    std::vector<std::int64_t> const shape(dims + offset, dims + offset + ndims[t]);
    offset += ndims[t];
    layout.add_torch_shape(shape);
    std::int64_t elements = 1;
    for (auto d : shape) { elements *= d; }
    FUSEDOPT_EXPECTS(elements == sizes[t], "came: tensor " + std::to_string(t) + " has " + std::to_string(sizes[t]) +
                                             " elements, not the product of its shape's dimensions");
  }
  return layout;
}

/// The table of `layout` over the statistics rows[t] and cols[t] (either may be null where the
/// layout keeps none). With `own_vectors`, a vector's row statistics (the confidence's, which
/// no step reads) are the workspace's, after the pass's doubles, zeros. CUDA: the entries are
/// copied on `on`, which the plan's make then synchronises; `host_entries` keeps their source
/// until then.
#if FUSEDOPT_CAME_UNIT_CUDA
inline statistics statistics_of(fo::factored_layout const& layout, void* const* rows, void* const* cols,
                                bool own_vectors, std::vector<fo::factored_tensor<state>>& host_entries,
                                cudaStream_t on)
#else
inline statistics statistics_of(fo::factored_layout const& layout, void* const* rows, void* const* cols,
                                bool own_vectors)
#endif
{
  std::int64_t const pass_doubles = layout.workspace_doubles();
  std::int64_t owned = 0;  // a double per owned statistic: room for float and double
  for (std::size_t t = 0; own_vectors && t < layout.num_tensors(); ++t) {
    if (layout.col_elements(t) == 0) { owned += layout.row_elements(t); }
  }
  statistics s;
#if FUSEDOPT_CAME_UNIT_CUDA
  s.workspace = device_array<double>(static_cast<std::size_t>(pass_doubles + owned));
  if (owned > 0) {
    FUSEDOPT_CUDA_TRY(cudaMemsetAsync(data_of(s.workspace) + pass_doubles, 0,
                                      static_cast<std::size_t>(owned) * sizeof(double), on));
  }
#else
  s.workspace.resize(static_cast<std::size_t>(pass_doubles + owned));
#endif
  std::vector<state*> row_pointers, col_pointers;
  std::int64_t next = pass_doubles;
  for (std::size_t t = 0; t < layout.num_tensors(); ++t) {
    if (own_vectors && layout.col_elements(t) == 0) {
      row_pointers.push_back(reinterpret_cast<state*>(data_of(s.workspace) + next));
      next += layout.row_elements(t);
    } else {
      row_pointers.push_back(static_cast<state*>(rows[t]));
    }
    col_pointers.push_back(static_cast<state*>(cols[t]));
  }
#if FUSEDOPT_CAME_UNIT_CUDA
  host_entries = layout.entries<state>(row_pointers, col_pointers, data_of(s.workspace));
  s.entries = device_array<fo::factored_tensor<state>>(host_entries.size());
  if (!host_entries.empty()) {
    FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(s.entries.get(), host_entries.data(), host_entries.size() * sizeof(host_entries[0]),
                                      cudaMemcpyHostToDevice, on));
  }
  s.table = layout.table<state>(s.entries.get());
#else
  s.entries = layout.entries<state>(row_pointers, col_pointers, data_of(s.workspace));
  // The table points into `entries`' and `workspace`'s heap memory, which moves keep.
  s.table = layout.table<state>(s.entries.data());
#endif
  return s;
}

}  // namespace fusedopt_came_unit

/// @brief A plan over n tensors of sizes[t] elements and torch's shapes (ndims[t] dimensions
/// each, flattened into `dims`): params and grads of the element type, exp_avgs and the
/// statistics of its arithmetic type, contiguous. sq_rows[t] and sq_cols[t] are
/// exp_avg_sq_row and exp_avg_sq_col (of shapes shape[:-1] and shape[:-2] + shape[-1:]), or,
/// below two dimensions, sq_rows[t] is exp_avg_sq (sq_cols[t] ignored, may be null);
/// res_rows[t] and res_cols[t] are exp_avg_res_row and exp_avg_res_col (ignored, may be null,
/// below two dimensions: the plan keeps those tensors' unread confidence statistics itself). Or null with the message in `error`. CUDA: built on the current
/// device and `stream`, which it synchronises. `threads`: the host's (0: OpenMP's default).
FUSEDOPT_TORCH_C_EXPORT void* fusedopt_came_make(void* const* params, void const* const* grads, void* const* exp_avgs,
                                                   std::int64_t const* sizes, std::int64_t const* dims,
                                                   std::int64_t const* ndims, void* const* sq_rows,
                                                   void* const* sq_cols, void* const* res_rows, void* const* res_cols,
                                                   std::int64_t n, std::int64_t threads, void* stream, char* error,
                                                   std::size_t error_size)
{
  using namespace fusedopt_came_unit;
  std::unique_ptr<holder> made;
  int const status = guarded(error, error_size, [&] {
    auto const layout = layout_of(sizes, dims, ndims, n);
    auto lists = bind_lists(params, grads, exp_avgs, sizes, n);
    auto const count = static_cast<std::size_t>(n);
#if FUSEDOPT_CAME_UNIT_CUDA
    (void)threads;
    auto const on = static_cast<cudaStream_t>(stream);
    std::vector<fo::factored_tensor<state>> second_entries, confidence_entries;
    auto second = statistics_of(layout, sq_rows, sq_cols, false, second_entries, on);
    auto confidence = statistics_of(layout, res_rows, res_cols, true, confidence_entries, on);
    // synchronises `on`: the tables have landed
    auto plan = fo::cuda::make_plan(lists, ::fusedopt_torch::c_unit::factored_rule_options(), on);
#else
    (void)stream;
    auto second = statistics_of(layout, sq_rows, sq_cols, false);
    auto confidence = statistics_of(layout, res_rows, res_cols, true);
    fo::host::options opts;
    opts.threads = static_cast<int>(threads);
    auto plan = fo::host::make_plan(lists, opts);
#endif
    made.reset(new holder{std::move(second), std::move(confidence), std::move(plan), std::vector<grad_pointer>(count)});
  });
  return status == 0 ? made.release() : nullptr;
}

/// @brief One step of CAME.py's CAME.step on `stream` (CUDA; the host runs it at once):
/// nothing is written when the options are refused.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_came_run(void* plan, fusedopt_came_hyper const* h, void* stream, char* error,
                                                std::size_t error_size)
{
  using namespace fusedopt_came_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    fo::rules::basic_came<state> opt;
    opt.lr = h->lr_pointer != nullptr ? fo::scalar<double>::from_pointer(h->lr_pointer) : fo::scalar<double>(h->lr);
    opt.eps1 = h->eps1;
    opt.eps2 = h->eps2;
    opt.clip_threshold = h->clip_threshold;
    opt.beta1 = h->beta1;
    opt.beta2 = h->beta2;
    opt.beta3 = h->beta3;
    opt.weight_decay = h->weight_decay;
    opt.second_moment = self.second_moment.table;
    opt.confidence = self.confidence.table;
    fo::step_info const step{1};  // CAME reads no step count (CAME.py's state['step'] only counts)
    ::fusedopt_torch::c_unit::on_stream<stream_type>(stream, [&](auto... on) { self.plan.run(opt, step, on...); });
  });
}

/// @brief Points the plan's gradients at `grads` (one per tensor, as made): torch's
/// zero_grad(set_to_none=True) gives new gradient tensors every step.
FUSEDOPT_TORCH_C_EXPORT int fusedopt_came_rebind_grads(void* plan, void const* const* grads, std::int64_t n,
                                                         void* stream, char* error, std::size_t error_size)
{
  using namespace fusedopt_came_unit;
  return guarded(error, error_size, [&] {
    auto& self = *static_cast<holder*>(plan);
    ::fusedopt_torch::c_unit::rebind_grads<stream_type>(
        self.plan, self.grads, grads, n, stream,
        "came: rebind_grads was given another number of gradients than the plan has tensors");
  });
}

FUSEDOPT_TORCH_C_EXPORT void fusedopt_came_destroy(void* plan) { delete static_cast<fusedopt_came_unit::holder*>(plan); }
