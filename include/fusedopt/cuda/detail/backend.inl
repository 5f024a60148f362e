/// @file cuda/detail/backend.inl
/// @brief Definitions of cuda/backend.cuh (included at its end, as cuco does): the plan's
/// construction, its steps (through the launch functions of dispatch.cuh, over the tables
/// for_each_table visits) and its rebinding, and `apply`.
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../detail/phases.hpp"
#include "../../detail/rebind.hpp"
#include "../../rule.hpp"
#include "dispatch.cuh"
#include "factored.cuh"
#include "policy.cuh"
#include "tables.cuh"
#include "workspace.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

inline bool param_32k_available(int device)
{
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
  int driver = 0;
  FUSEDOPT_CUDA_TRY(cudaDriverGetVersion(&driver));
  return driver >= 12010 && detail::device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 7;
#else
  (void)device;
  return false;
#endif
}

template <class Policy, class... B>
void basic_plan<Policy, B...>::device_free::operator()(void* p) const noexcept
{
  // A destructor must not throw; freeing only fails when the context is already gone.
  (void)cudaFree(p);
}

template <class Policy, class... B>
basic_plan<Policy, B...>::basic_plan(lists_type lists, options opts, cudaStream_t stream) : lists_(std::move(lists))
{
  device_ = detail::current_device();
  programmatic_ = detail::programmatic_launch_for(opts, device_);
  max_blocks_ = detail::max_blocks_of<Policy>(opts);
  if constexpr ((::fusedopt::is_blockwise_v<typename B::element_type> || ...)) {
    persistent_ = detail::persistent_grid_of<Policy>(opts, device_);
    void* queue = nullptr;
    FUSEDOPT_CUDA_TRY(cudaMalloc(&queue, sizeof(detail::work_queue)));
    queue_memory_.reset(queue);
    FUSEDOPT_CUDA_TRY(cudaMemsetAsync(queue, 0, sizeof(detail::work_queue), stream));
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));  // zero before a run on any stream
    persistent_.queue = static_cast<detail::work_queue*>(queue);
  }
  std::int64_t const chunk = detail::chunk_length<Policy, lists_type>(opts);
  switch (opts.metadata) {
    case transport::automatic:
    case transport::device_table: transport_ = transport::device_table; break;
    case transport::param_4k: transport_ = transport::param_4k; break;
    case transport::param_32k:
      FUSEDOPT_EXPECTS(param_32k_available(device_),
                       "transport::param_32k needs CUDA 12.1 (runtime and driver) and an sm_70 or newer GPU");
      transport_ = transport::param_32k;
      break;
  }
  FUSEDOPT_EXPECTS(opts.address_tables >= 1, "cuda::options::address_tables must be at least 1");
  detail::check_device_memory(lists_);
  for (std::size_t t = 0; t < lists_.num_tensors(); ++t) { elements_ += lists_.tensor_size(t); }
  written_.assign(lists_);
  auto const layout = detail::make_layout(lists_, chunk, std::index_sequence_for<B...>{});
  tensors_ = layout.tensors;
  persistent_.plain_fast_shape = detail::plain_fast_shape_for<Policy>(opts, device_, layout);
  bool const evict_first = detail::evict_first_for<Policy>(layout.bytes, opts, device_);
  if (transport_ == transport::param_4k) {
    tables_4k_ = detail::pack_tables<detail::table_4k<num_slots>>(layout, evict_first);
  } else if (transport_ == transport::param_32k) {
    tables_32k_ = detail::pack_tables<detail::table_32k<num_slots>>(layout, evict_first);
  } else if (!layout.chunks.empty()) {
    // The chunk entries once; the address table in the first of its device copies.
    std::size_t const chunk_bytes = layout.chunks.size() * sizeof(detail::chunk_entry);
    void* memory = nullptr;
    FUSEDOPT_CUDA_TRY(cudaMalloc(&memory, chunk_bytes));
    memory_.reset(memory);
    FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(memory, layout.chunks.data(), chunk_bytes, cudaMemcpyHostToDevice, stream));
    tables_ = detail::address_tables<detail::tensor_entry<num_slots>>(tensors_.size(), opts.address_tables);
    tables_.publish(tensors_, stream);
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));
    global_.chunks = static_cast<detail::chunk_entry const*>(memory);
    global_.num_chunks = static_cast<std::int64_t>(layout.chunks.size());
    global_.evict_first = evict_first ? 1 : 0;
    // One tensor: the update computes its chunks, one block iteration each, unless the
    // chunk length or a block loop (max_blocks) was asked for. Not where states are quantized
    // (their chunks hold whole quantization blocks and their launch is a persistent grid).
    if constexpr (!(::fusedopt::is_blockwise_v<typename B::element_type> || ...)) {
      if (tensors_.size() == 1 && opts.chunk_elements == 0 && max_blocks_ == 0) {
        auto const table = detail::one_tensor_table<num_slots>(
          lists_.tensor_size(static_cast<std::size_t>(tensors_[0].index)), tensors_[0].head,
          detail::update_iteration_elements<Policy, lists_type>(persistent_.plain_fast_shape), evict_first);
        // A block for every chunk (grid_of's cap is never reached below 2^40 elements).
        if (table.num_chunks <= std::numeric_limits<std::int32_t>::max()) { one_tensor_ = table; }
      }
    }
  }
  std::vector<detail::chunk_range> ranges;
  if (opts.reduction_capacity > 0) {
    // Every row (empty tensors too) gets its chunk range; chunks are numbered in layout order,
    // which the by-value tables keep (pack_tables appends in order).
    ranges.assign(lists_.num_tensors(), detail::chunk_range{0, 0});
    for (std::size_t c = 0; c < layout.chunks.size(); ++c) {
      auto const row = static_cast<std::size_t>(layout.tensors[static_cast<std::size_t>(layout.chunks[c].tensor)].index);
      if (ranges[row].count == 0) { ranges[row].first = static_cast<std::int64_t>(c); }
      ++ranges[row].count;
    }
  }
  workspace_ = detail::reduction_workspace(opts.reduction_capacity, ranges,
                                           static_cast<std::int64_t>(layout.chunks.size()), stream);
}

namespace detail {

/// The pieces of a plan's step, in the order `run` enqueues them: `check` (before anything is
/// enqueued), `begin`, `pass` for each reduction pass (with a finalize after each), `update`,
/// the after-step hooks. The sharded plan (cuda/sharded.cuh) runs a plan over one rank's shard
/// through them, with its exchanges between the pieces and its own workspace.
struct plan_steps {
  /// run's checks of the rule and the plan (not of its workspace's capacity).
  template <class Plan, class Rule>
  static void check(Plan const& plan, Rule const& rule, step_info const& step)
  {
    constexpr std::size_t S = Plan::num_slots;
    using lists_type = typename Plan::lists_type;
    check_rule<Rule, lists_type>(rule, step);
    FUSEDOPT_EXPECTS(current_device() == plan.device_,
                     "cuda::plan::run: the current device is not the one the plan was built on (device " +
                       std::to_string(plan.device_) + ")");
    FUSEDOPT_EXPECTS(plan.transport_ == transport::device_table ||
                       (plan.transport_ == transport::param_4k ? fits_by_value<Rule, lists_type, table_4k<S>>
                                                               : fits_by_value<Rule, lists_type, table_32k<S>>),
                     "rule of " + std::to_string(sizeof(Rule)) +
                       " bytes is too large to travel next to a by-value launch table; use transport::device_table");
  }

  /// The first work of a step: the address table published again after a rebind under
  /// capture, and step_info::advance.
  template <class Plan>
  static void begin(Plan const& plan, step_info const& step, cudaStream_t stream)
  {
    if (plan.tables_.current_from_capture()) { plan.tables_.publish(plan.tensors_, stream); }
    advance_step(step, stream, plan.programmatic_);
  }

  /// Reduction pass J over every table of the plan: the partial of the plan's chunk c goes to
  /// partials[(first_chunk + c) * N + k].
  template <int J, class Plan, class Rule, int P>
  static void pass(Plan const& plan, Rule const& rule, step_info const& step, pass_results<P> const& results,
                   double* partials, std::int64_t first_chunk, cudaStream_t stream)
  {
    std::int64_t base = first_chunk;
    plan.for_each_table([&](auto const& table) {
      launch_pass<typename Plan::policy_type, Rule, typename Plan::lists_type, J>(
        rule, step, table, results, partials, base, plan.max_blocks_, stream, plan.programmatic_);
      base += table.num_chunks;
    });
  }

  /// The update over every table of the plan, with the results of the rule's passes.
  template <class Plan, class Rule, int P>
  static void update(Plan const& plan, Rule const& rule, step_info const& step, pass_results<P> const& results,
                     cudaStream_t stream)
  {
    using lists_type = typename Plan::lists_type;
    // A plan of one tensor launches without chunk entries (one_tensor_table; never made
    // where 8-bit states are bound), but for rules with factored passes, whose tiles follow the
    // plan's chunks.
    if constexpr (::fusedopt::detail::factor_count_v<Rule> == 0) {
      if (plan.one_tensor_.num_chunks > 0) {
        auto table = plan.one_tensor_;
        table.tensors = plan.tables_.current();  // the copy of the address table that is current now
        launch_update<typename Plan::policy_type, Rule, lists_type>(rule, step, table, results, plan.max_blocks_,
                                                                     plan.persistent_, stream, plan.programmatic_);
        return;
      }
    }
    plan.for_each_table([&](auto const& table) {
      launch_update<typename Plan::policy_type, Rule, lists_type>(rule, step, table, results, plan.max_blocks_,
                                                                   plan.persistent_, stream, plan.programmatic_);
    });
  }

  /// The rule's after-step hooks, launched as the plan launches.
  template <class Plan, class Rule, int P>
  static void after_step(Plan const& plan, Rule const& rule, step_info const& step, pass_results<P> const& results,
                         cudaStream_t stream)
  {
    launch_after_step(rule, step, results, stream, plan.programmatic_);
  }

  /// The rows, totals and finalize of pass J of `Rule` over a workspace, launched as `plan`
  /// launches.
  template <int J, class Plan, class Rule, int P>
  static void finalize(Plan const& plan, Rule const& rule, step_info const& step, reduction_workspace const& workspace,
                       pass_results<P> const& results, cudaStream_t stream)
  {
    launch_finalize<typename Plan::policy_type, Rule, J>(rule, step, workspace.partials, workspace.ranges,
                                                         workspace.rows(), workspace.longest_row(), results.r[J],
                                                         workspace.counter, stream, plan.programmatic_);
  }

  /// Refuses a factored pass's statistics table that does not cover the plan's tensors: its count
  /// and its pointer are host values (the entries themselves are in device memory, which the host
  /// backend reads and this one cannot), and a default or short table would send the kernels
  /// reading entries that are not there. A pass that stores (stored_by_pass) must visit every
  /// element: its table's statistics must cover all `elements` (factored_table::elements).
  template <class Rule, int... J>
  static void check_factored_tables(Rule const& rule, std::size_t tensors, std::int64_t elements,
                                    std::integer_sequence<int, J...>)
  {
    auto const check = [tensors, elements](auto const& table, bool stores) {
      FUSEDOPT_EXPECTS(table.num_tensors == static_cast<std::int64_t>(tensors) &&
                         (table.num_tensors == 0 || table.tensors != nullptr),
                       "factored statistics: the table has " + std::to_string(table.num_tensors) +
                         " entries for lists of " + std::to_string(tensors) + " tensors");
      FUSEDOPT_EXPECTS(!stores || table.elements == elements,
                       "factored statistics: the pass stores every element, but the table's statistics cover " +
                         std::to_string(table.elements) + " of the lists' " + std::to_string(elements) +
                         " (a vector needs its row statistics: factored_layout::add_torch_shape(dims, true))");
    };
    (check(::fusedopt::detail::factor_owner<J>(rule).factors(), ::fusedopt::detail::factor_stores_v<Rule, J>), ...);
    (void)check;
  }

  /// The rule's factored passes (factored.hpp), in chain order between its reduction passes: they need the
  /// tensor table in device memory (transport::device_table, checked by run).
  /// Those that come after `before` reduction passes in the chain (factor_before_v).
  template <class Plan, class Rule, int P>
  static void factored(Plan const& plan, Rule const& rule, step_info const& step, pass_results<P> const& results,
                       int before, cudaStream_t stream)
  {
    if constexpr (::fusedopt::detail::factor_count_v<Rule> > 0) {  // nothing at all for other rules
      factored(plan, rule, step, results, before, stream,
               std::make_integer_sequence<int, ::fusedopt::detail::factor_count_v<Rule>>{});
    } else {
      (void)plan, (void)rule, (void)step, (void)results, (void)before, (void)stream;
    }
  }
  template <class Plan, class Rule, int P, int... J>
  static void factored(Plan const& plan, Rule const& rule, step_info const& step, pass_results<P> const& results,
                       int before, cudaStream_t stream, std::integer_sequence<int, J...>)
  {
    auto const* entries = plan.tables_.current();
    auto const count = static_cast<std::int32_t>(plan.tensors_.size());
    ((::fusedopt::detail::factor_before_v<Rule, J> == before
        ? launch_factored_pass<Rule, typename Plan::lists_type, J>(rule, step, results, entries, count,
                                                                   plan.max_blocks_, stream, plan.programmatic_)
        : void()),
     ...);
    (void)entries, (void)count, (void)before;
  }

  /// run's check that the rule's accumulators fit a workspace.
  template <class Rule>
  static void check_capacity(reduction_workspace const& workspace)
  {
    if constexpr (::fusedopt::detail::pass_count_v<Rule> > 0) {
      constexpr int needed = ::fusedopt::detail::accumulators_v<Rule>;
      FUSEDOPT_EXPECTS(needed <= workspace.capacity(),
                       "the rule needs " + std::to_string(needed) +
                         " reduction accumulators but the plan was built with cuda::options::reduction_capacity " +
                         std::to_string(workspace.capacity()));
    }
  }
};

}  // namespace detail

template <class Policy, class... B>
template <class Rule, int P, int... J>
void basic_plan<Policy, B...>::run_passes(Rule const& rule, step_info const& step, detail::pass_results<P> const& results,
                                          cudaStream_t stream, std::integer_sequence<int, J...>) const
{
  // Chunk partials of every pass share one area: pass J's are consumed by its finalize
  // kernel before pass J + 1 runs (stream order).
  // Factored passes (if any) in chain order between them.
  ((detail::plan_steps::factored(*this, rule, step, results, J, stream),
    detail::plan_steps::pass<J>(*this, rule, step, results, workspace_.partials, 0, stream),
    detail::plan_steps::finalize<J>(*this, rule, step, workspace_, results, stream)),
   ...);
}

template <class Policy, class... B>
template <class Rule>
void basic_plan<Policy, B...>::run(Rule const& rule, step_info const& step, cudaStream_t stream) const
{
  constexpr int passes = ::fusedopt::detail::pass_count_v<Rule>;
  constexpr int factored = ::fusedopt::detail::factor_count_v<Rule>;
  detail::plan_steps::check_capacity<Rule>(workspace_);
  detail::plan_steps::check(*this, rule, step);
  if constexpr (factored > 0) {
    FUSEDOPT_EXPECTS(transport_ == transport::device_table,
                     "a rule with a factored pass (factored.hpp: Adafactor, ...) needs the plan's tables in device "
                     "memory: transport::device_table (the default)");
    detail::plan_steps::check_factored_tables(rule, lists_.num_tensors(), elements_,
                                              std::make_integer_sequence<int, factored>{});
  }
  // Every check is done: from here on work is enqueued.
  detail::plan_steps::begin(*this, step, stream);
  auto const results = detail::make_pass_results<Rule>(workspace_.results, workspace_.rows(), std::make_integer_sequence<int, passes>{});
  if constexpr (passes > 0) { run_passes(rule, step, results, stream, std::make_integer_sequence<int, passes>{}); }
  if constexpr (factored > 0) { detail::plan_steps::factored(*this, rule, step, results, passes, stream); }
  if constexpr (!::fusedopt::detail::skips_update_v<Rule>) {
    detail::plan_steps::update(*this, rule, step, results, stream);
  }
  detail::plan_steps::after_step(*this, rule, step, results, stream);
}

template <class Policy, class... B>
template <class Self, class F>
void basic_plan<Policy, B...>::visit_tables(Self& self, F&& f)
{
  switch (self.transport_) {
    case transport::param_4k:
      for (auto& table : self.tables_4k_) { f(table); }
      break;
    case transport::param_32k:
      for (auto& table : self.tables_32k_) { f(table); }
      break;
    default:
      if (self.global_.num_chunks > 0) {
        // The chunks, and the copy of the address table that is current now.
        detail::global_table<num_slots> table = self.global_;
        table.tensors = self.tables_.current();
        f(table);
      }
      break;
  }
}

template <class Policy, class... B>
template <class F>
void basic_plan<Policy, B...>::for_each_table(F&& f) const
{
  visit_tables(*this, f);
}

template <class Policy, class... B>
template <class F>
void basic_plan<Policy, B...>::for_each_table(F&& f)
{
  visit_tables(*this, f);
}

template <class Policy, class... B>
std::string basic_plan<Policy, B...>::geometry_mismatch(lists_type const& lists) const
{
  static constexpr char const* names[] = {B::slot_type::name...};
  std::size_t const n = lists.num_tensors();
  if (n != lists_.num_tensors()) {
    return "the lists hold " + std::to_string(n) + " tensors but the plan was made for " +
           std::to_string(lists_.num_tensors());
  }
  for (std::size_t t = 0; t < n; ++t) {
    if (lists.tensor_size(t) != lists_.tensor_size(t)) {
      return "tensor " + std::to_string(t) + " has " + std::to_string(lists.tensor_size(t)) +
             " elements but the plan was made for " + std::to_string(lists_.tensor_size(t));
    }
  }
  using geometry = detail::slot_geometry<lists_type>;
  for (auto const& e : tensors_) {
    auto const t = static_cast<std::size_t>(e.index);
    void* bases[num_slots];
    detail::tensor_bases(lists, t, bases);
    int const misaligned = geometry::misaligned(bases);
    if (misaligned >= 0) {
      return "tensor " + std::to_string(t) + " of slot '" + names[misaligned] + "' is not aligned to its element size";
    }
    if (geometry::head(bases) != e.head) {
      return "tensor " + std::to_string(t) +
             " has another alignment class (the offset of its first 16-byte-aligned element) than the plan's";
    }
  }
  return {};
}

template <class Policy, class... B>
bool basic_plan<Policy, B...>::can_rebind(lists_type const& lists) const
{
  return geometry_mismatch(lists).empty();
}

template <class Policy, class... B>
void basic_plan<Policy, B...>::rebind(lists_type const& lists, cudaStream_t stream)
{
  std::string const mismatch = geometry_mismatch(lists);
  FUSEDOPT_EXPECTS(mismatch.empty(), "cuda::plan::rebind: " + mismatch + "; make a new plan when the geometry changes");
  // One pointer query per slot that moved (its first moved tensor) catches pageable memory
  // as plan construction does, without a query per tensor.
  static constexpr char const* names[] = {B::slot_type::name...};
  bool moved = false;
  bool queried[num_slots] = {};
  for (auto const& e : tensors_) {
    auto const t = static_cast<std::size_t>(e.index);
    void* bases[num_slots];
    detail::tensor_bases(lists, t, bases);
    for (std::size_t k = 0; k < num_slots; ++k) {
      if (bases[k] == e.bases[k] || queried[k]) { continue; }
      moved = queried[k] = true;
      cudaPointerAttributes attributes{};
      {
        // A host-side lookup, but under a global or thread-local stream capture the runtime may
        // refuse it as a potentially unsafe call: query in relaxed mode (only when a slot moved).
        detail::relaxed_capture_mode const relaxed;
        FUSEDOPT_CUDA_TRY(cudaPointerGetAttributes(&attributes, bases[k]));
      }
      FUSEDOPT_EXPECTS(attributes.type != cudaMemoryTypeUnregistered,
                       "cuda::plan::rebind: tensor " + std::to_string(t) + " of slot '" + names[k] +
                         "' is pageable host memory; the CUDA backend needs device, managed or mapped memory");
    }
  }
  if (!moved) {
    lists_ = lists;  // empty tensors may still have moved; equal lengths: no allocation
    return;
  }
  // Checks done: from here the plan changes.
  lists_ = lists;
  written_.assign(lists_);  // same geometry: the spans' storage is reused
  for (auto& e : tensors_) {
    auto const t = static_cast<std::size_t>(e.index);
    detail::tensor_bases(lists_, t, e.bases);
  }
  publish_bases(stream);
}

template <class Policy, class... B>
template <class Slot>
void basic_plan<Policy, B...>::rebind(Slot, slot_pointer_t<Slot> const* addresses, std::size_t count, cudaStream_t stream)
{
  constexpr std::size_t K = ::fusedopt::detail::bound_position_v<lists_type, Slot>;
  FUSEDOPT_EXPECTS(count == lists_.num_tensors(), "cuda::plan::rebind: " + std::to_string(count) +
                                                    " addresses for a plan of " +
                                                    std::to_string(lists_.num_tensors()) + " tensors");
  if (transport_ == transport::device_table && !tensors_.empty()) {
    // Addresses a device copy holds passed every check when they were bound (its entries hold
    // the written tensors' addresses too, so those are where they were then): switch to it.
    // Not under capture: the graph must write a copy of its own.
    candidate_ = tensors_;  // equal lengths after the first time: no allocation
    for (auto& e : candidate_) {
      e.bases[K] = const_cast<void*>(static_cast<void const*>(addresses[static_cast<std::size_t>(e.index)]));
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FUSEDOPT_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
    if (capture == cudaStreamCaptureStatusNone && tables_.select(candidate_) != nullptr) {
      tensors_.swap(candidate_);
      for (std::size_t t = 0; t < count; ++t) {
        ::fusedopt::detail::bound_lists_access::repoint<K>(lists_, t, addresses[t]);
      }
      return;
    }
  }
  ::fusedopt::detail::check_rebound_addresses<K>(lists_, written_, addresses, count, "cuda::plan::rebind");
  bool moved = false;
  for (auto const& e : tensors_) {
    void* const address = const_cast<void*>(static_cast<void const*>(addresses[static_cast<std::size_t>(e.index)]));
    if (address == e.bases[K]) { continue; }
    void* bases[num_slots];
    std::copy(std::begin(e.bases), std::end(e.bases), bases);
    bases[K] = address;
    FUSEDOPT_EXPECTS(detail::slot_geometry<lists_type>::head(bases) == e.head,
                     "cuda::plan::rebind: tensor " + std::to_string(e.index) +
                       " has another alignment class (the offset of its first 16-byte-aligned element) than the "
                       "plan's; make a new plan");
    if (!moved) {
      moved = true;
      cudaPointerAttributes attributes{};
      {
        detail::relaxed_capture_mode const relaxed;  // as in rebind(lists)
        FUSEDOPT_CUDA_TRY(cudaPointerGetAttributes(&attributes, address));
      }
      FUSEDOPT_EXPECTS(attributes.type != cudaMemoryTypeUnregistered,
                       "cuda::plan::rebind: tensor " + std::to_string(e.index) + " of slot '" +
                         lists_type::template slot_name<K>() +
                         "' is pageable host memory; the CUDA backend needs device, managed or mapped memory");
    }
  }
  // Checks done: from here the plan changes.
  for (std::size_t t = 0; t < count; ++t) { ::fusedopt::detail::bound_lists_access::repoint<K>(lists_, t, addresses[t]); }
  if (!moved) { return; }
  for (auto& e : tensors_) {
    e.bases[K] = const_cast<void*>(static_cast<void const*>(addresses[static_cast<std::size_t>(e.index)]));
  }
  publish_bases(stream);
}

template <class Policy, class... B>
void basic_plan<Policy, B...>::publish_bases(cudaStream_t stream)
{
  std::size_t cursor = 0;  // by-value tables hold the tensors in list order, split ones twice
  for_each_table([&](auto& table) {
    if constexpr (std::is_same_v<std::decay_t<decltype(table)>, detail::global_table<num_slots>>) {
      tables_.publish(tensors_, stream);  // a switch to a copy that holds them, or one upload
    } else {
      detail::rebase_table(table, tensors_, cursor);
    }
  });
}

namespace detail {
/// f(table) for the table of each factored pass of `rule`.
template <class Rule, class F, int... J>
void count_factored(Rule const& rule, F const& f, std::integer_sequence<int, J...>)
{
  (f(::fusedopt::detail::factor_owner<J>(rule).factors()), ...);
  (void)rule, (void)f;
}
}  // namespace detail

template <class Policy, class... B>
std::size_t basic_plan<Policy, B...>::launches_per_run() const
{
  std::size_t launches = 0;
  for_each_table([&](auto const&) { ++launches; });
  return launches;
}

template <class Policy, class... B>
template <class Rule>
std::size_t basic_plan<Policy, B...>::launches_per_run(Rule const& rule, bool with_advance) const
{
  constexpr int passes = ::fusedopt::detail::pass_count_v<Rule>;
  std::size_t const tables = launches_per_run();
  std::size_t const pass = tables + 1;  // a pass kernel per table, then finalize
  std::size_t const update = ::fusedopt::detail::skips_update_v<Rule> ? 0 : tables;
  std::size_t factored = 0;  // per factored pass: tiles, fold and totals, where it has them
  auto const count = [&](auto const& table) {
    factored += (table.tiles > 0 ? 1 : 0) + (table.lines > 0 ? 1 : 0) + (table.matrices > 0 ? 1 : 0);
  };
  detail::count_factored(rule, count, std::make_integer_sequence<int, ::fusedopt::detail::factor_count_v<Rule>>{});
  return update + static_cast<std::size_t>(passes) * pass + factored +
         (::fusedopt::detail::needs_after_step<Rule>::value ? 1 : 0) + (with_advance ? 1 : 0);
}

template <class Policy, class... B>
basic_plan<Policy, B...> make_plan(bound_lists<B...> lists, options opts, cudaStream_t stream)
{
  return basic_plan<Policy, B...>(std::move(lists), opts, stream);
}

template <class Policy, class Rule, class... B>
void apply(Rule const& rule, bound_lists<B...> const& lists, step_info const& step, options opts, cudaStream_t stream)
{
  using lists_type = bound_lists<B...>;
  constexpr std::size_t S = sizeof...(B);
  static_assert(::fusedopt::detail::factor_count_v<Rule> == 0,
                "fusedopt: cuda::apply cannot run rules with factored passes (Adafactor, ...): make a plan "
                "(cuda::make_plan) and call plan.run.");
  static_assert(::fusedopt::detail::pass_count_v<Rule> == 0,
                "fusedopt: cuda::apply cannot run rules with reduction passes (clip_by_global_norm, LAMB, LARS, "
                "skip_if_nonfinite, norm_of, ...): their results need a device workspace, and apply allocates no "
                "device memory. Make a plan (cuda::make_plan) and call plan.run.");
  detail::check_rule<Rule, lists_type>(rule, step);
  FUSEDOPT_EXPECTS(opts.metadata != transport::device_table,
                   "cuda::apply carries its tables by value and owns no device memory; use a plan for "
                   "transport::device_table");
  int const device = detail::current_device();
  bool const programmatic = detail::programmatic_launch_for(opts, device);
  bool const large = param_32k_available(device);
  FUSEDOPT_EXPECTS(opts.metadata != transport::param_32k || large,
                   "transport::param_32k needs CUDA 12.1 (runtime and driver) and an sm_70 or newer GPU");
  std::int64_t const chunk = detail::chunk_length<Policy, lists_type>(opts);
  std::int64_t const max_blocks = detail::max_blocks_of<Policy>(opts);
  detail::persistent_grid persistent;
  if constexpr (::fusedopt::detail::access<Rule, lists_type>::stores_quantized) {
    persistent = detail::persistent_grid_of<Policy>(opts, device);
  }
  detail::check_device_memory(lists);
  auto const layout = detail::make_layout(lists, chunk, std::index_sequence_for<B...>{});
  if constexpr (!::fusedopt::detail::access<Rule, lists_type>::stores_quantized) {
    persistent.plain_fast_shape = detail::plain_fast_shape_for<Policy>(opts, device, layout);
  }
  bool const evict_first = detail::evict_first_for<Policy>(layout.bytes, opts, device);
  detail::advance_step(step, stream, programmatic);
  detail::pass_results<0> const none{};
  auto const launch_all = [&](auto const& tables) {
    // A rule too large for a 32 KB table cannot fit a 4 KB one either; launch_update reports it.
    for (auto const& table : tables) {
      detail::launch_update<Policy, Rule, lists_type>(rule, step, table, none, max_blocks, persistent, stream,
                                                      programmatic);
    }
  };
  if (opts.metadata == transport::param_32k || (opts.metadata == transport::automatic && large)) {
    launch_all(detail::pack_tables<detail::table_32k<S>>(layout, evict_first));
  } else {
    launch_all(detail::pack_tables<detail::table_4k<S>>(layout, evict_first));
  }
  detail::launch_after_step(rule, step, none, stream, programmatic);
}

}  // namespace cuda
FUSEDOPT_NAMESPACE_END
