/// @file host/muon.hpp
/// @brief Muon on the host backend: a plan with a matrix stage between two fused passes.
///
/// @code
/// auto lists = fo::bind(fo::slot::param = params, fo::slot::grad = grads, fo::slot::momentum_buffer = bufs);
/// std::vector<fo::matrix_shape> shapes = {{768, 768}, {3072, 768}, ...};   // one per tensor
/// auto plan = fo::host::make_muon_plan(lists, shapes);   // Newton-Schulz in bfloat16, as torch
/// fo::rules::muon opt;   // torch.optim.Muon's defaults
/// for (std::int64_t t = 1; t <= steps; ++t) plan.run(opt, fo::step_info{t});
/// @endcode
///
/// A step: pass 1 (rules::muon_momentum, one reduction pass and one update pass over every
/// matrix) writes the normalised Newton-Schulz inputs into the plan's workspace; the matrices
/// of each shape go through host::newton_schulz; pass 2 (rules::muon_apply) decays the
/// parameters and applies the orthogonalised update. No allocation in a step.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../bind.hpp"
#include "../config.hpp"
#include "../detail/muon_lists.hpp"
#include "../detail/rebind.hpp"
#include "../error.hpp"
#include "../rules/muon.hpp"
#include "../scalar.hpp"
#include "backend.hpp"
#include "newton_schulz.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace host {

/// @brief Muon's steps over bound lists of 2-D parameters (slots param, grad, momentum_buffer,
/// bound in any order), the Newton-Schulz iteration in `NS` (fusedopt::bfloat16, torch's
/// choice, or float). Owns its workspace (every matrix in NS, scratch, the per-matrix learning
/// rate ratios); move-only.
template <class NS, class... B>
class muon_plan {
 private:
  using traits = ::fusedopt::detail::muon_lists<NS, B...>;

 public:
  using lists_type = typename traits::lists_type;
  /// Pass 1's lists and plan: gradients and buffers in, Newton-Schulz inputs out.
  using input_lists_type = typename traits::input_lists_type;
  using input_plan = typename traits::template input_plan<plan>;
  /// Pass 2's lists and plan: the orthogonalised matrices into the parameters.
  using output_lists_type = typename traits::output_lists_type;
  using output_plan = typename traits::template output_plan<plan>;

  /// @brief Groups the tensors by shape, allocates the workspace and plans both passes.
  /// @param shapes one per tensor, row-major (torch's `p.shape`): rows x cols must be the
  /// tensor's size.
  /// @param opts the host options of both passes (threads, chunks) and of Newton-Schulz
  /// (threads); pass 1 keeps room for its one accumulator.
  /// @throws fusedopt::error on a shape that does not fit its tensor, on options host::plan
  /// rejects, or when the workspace cannot be allocated.
  muon_plan(lists_type lists, std::vector<matrix_shape> const& shapes, options opts = {})
      : layout_(shapes, lists.num_tensors(), [&lists](std::size_t t) { return lists.tensor_size(t); }),
        matrices_(allocate<NS>(layout_.matrix_elements)),
        threads_(resolve_threads(opts.threads)),
        scratch_(allocate<float>(scratch_floats(layout_, threads_))),
        ratios_(layout_.ratio_tables()),
        lists_(lists),
        input_(input_lists(lists), input_options(opts)),
        output_(output_lists(lists), opts)
  {
  }

  muon_plan(muon_plan&&) noexcept = default;
  muon_plan& operator=(muon_plan&&) noexcept = default;
  muon_plan(muon_plan const&) = delete;  // the passes point into this plan's workspace
  muon_plan& operator=(muon_plan const&) = delete;
  ~muon_plan() = default;

  /// @brief One Muon step: pass 1, Newton-Schulz over every group of same-shaped matrices,
  /// pass 2. Synchronous; no allocation. Not to be called concurrently on one plan.
  /// @throws fusedopt::error, before anything is written, on invalid options (muon::validate)
  /// or a step below 1 (host::plan::run's checks).
  void run(rules::muon const& opt, step_info const& step = {}) const
  {
    opt.validate();
    auto const first = rules::make_muon_momentum<NS>(opt);
    auto const second = rules::make_muon_apply(opt, ratios(opt.adjust_lr));
    ::fusedopt::detail::validate_rule(second, typename output_lists_type::memory_slots{});
    input_.run(first, step);
    for (auto const& g : layout_.groups) {
      newton_schulz<NS>(matrices_.data() + g.offset, g.count, g.stride, g.shape, opt, scratch_.data(), threads_);
    }
    step_info after = step;
    after.advance = nullptr;  // pass 1 counted the step
    output_.run(second, after);
  }

  /// @brief True when `lists` have this plan's geometry (tensor count and sizes).
  [[nodiscard]] bool can_rebind(lists_type const& lists) const noexcept
  {
    if (lists.num_tensors() != lists_.num_tensors()) { return false; }
    for (std::size_t t = 0; t < lists.num_tensors(); ++t) {
      if (lists.tensor_size(t) != lists_.tensor_size(t)) { return false; }
    }
    return true;
  }

  /// @brief Points the plan at `lists`, the same geometry at new addresses: O(tensors), no
  /// allocation. @throws fusedopt::error if the geometry differs or an address is misaligned.
  void rebind(lists_type const& lists)
  {
    FUSEDOPT_EXPECTS(can_rebind(lists), "muon_plan::rebind: the lists do not have the plan's tensor count and sizes; "
                                        "make a new plan when the geometry changes");
    auto in = input_lists(lists);
    auto out = output_lists(lists);
    input_.rebind(in);
    output_.rebind(out);
    lists_ = lists;
  }

  /// @brief Points the gradients at `addresses`, one per tensor (new gradient buffers every
  /// step), checked as host::plan::rebind(slot, ...) checks them.
  void rebind(slot::grad_t, typename input_plan::template slot_pointer_t<slot::grad_t> const* addresses,
              std::size_t count)
  {
    input_.rebind(slot::grad, addresses, count);
    for (std::size_t t = 0; t < count; ++t) {
      ::fusedopt::detail::bound_lists_access::repoint<traits::grad_at>(lists_, t, addresses[t]);
    }
  }

  /// @brief Tensor `t`'s matrix in the workspace, row-major like the parameter: after `run`,
  /// the orthogonalised update O that pass 2 applied (in NS).
  [[nodiscard]] NS const* matrix(std::size_t t) const { return matrices_.data() + layout_.offsets[t]; }
  /// @brief The groups of same-shaped matrices and where the workspace keeps them.
  [[nodiscard]] ::fusedopt::detail::muon_layout const& layout() const { return layout_; }
  [[nodiscard]] lists_type const& lists() const { return lists_; }

 private:
  template <class T>
  static std::vector<T> allocate(std::int64_t elements)
  {
    try {
      return std::vector<T>(static_cast<std::size_t>(elements));
    } catch (std::bad_alloc const&) {
      throw error("muon plan: the workspace of " + std::to_string(elements) + " elements cannot be allocated");
    }
  }

  static int resolve_threads(int threads)
  {
#if defined(_OPENMP)
    return threads > 0 ? threads : omp_get_max_threads();
#else
    (void)threads;
    return 1;
#endif
  }

  static std::int64_t scratch_floats(::fusedopt::detail::muon_layout const& layout, int threads)
  {
    std::int64_t floats = 0;
    for (auto const& g : layout.groups) {
      floats = std::max(floats, newton_schulz_scratch(g.small, g.large, g.count, threads));
    }
    return floats;
  }

  static options input_options(options opts)
  {
    opts.reduction_capacity = std::max(opts.reduction_capacity, 1);
    return opts;
  }

  [[nodiscard]] double const* ratios(rules::muon_lr_adjustment adjustment) const
  {
    return ratios_.data() + (adjustment == rules::muon_lr_adjustment::original ? 0 : layout_.shapes.size());
  }

  template <class T>
  tensor_list<T> workspace_list() const
  {
    tensor_list<T> list;
    list.reserve(layout_.offsets.size());
    for (std::size_t t = 0; t < layout_.offsets.size(); ++t) {
      list.push_back(const_cast<NS*>(matrices_.data()) + layout_.offsets[t], lists_.tensor_size(t));
    }
    return list;
  }

  input_lists_type input_lists(lists_type const& lists) const { return traits::input_lists(lists, workspace_list<NS>()); }
  output_lists_type output_lists(lists_type const& lists) const { return traits::output_lists(lists, workspace_list<NS const>()); }

  ::fusedopt::detail::muon_layout layout_;
  mutable std::vector<NS> matrices_;  // written by a step, which is const as host::plan::run is
  int threads_ = 1;                   // Newton-Schulz's, resolved when the plan is made
  mutable std::vector<float> scratch_;
  std::vector<double> ratios_;
  lists_type lists_;
  input_plan input_;
  output_plan output_;
};

/// @brief Makes a host muon plan (see muon_plan); `NS` is the Newton-Schulz type
/// (`make_muon_plan<float>(...)` for a float iteration).
template <class NS = bfloat16, class... B>
[[nodiscard]] muon_plan<NS, B...> make_muon_plan(bound_lists<B...> lists, std::vector<matrix_shape> const& shapes,
                                                 options opts = {})
{
  return muon_plan<NS, B...>(std::move(lists), shapes, opts);
}

}  // namespace host
FUSEDOPT_NAMESPACE_END
