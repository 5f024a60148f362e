// Definitions of cuda/backend.cuh (included at its end).
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "../../detail/access.hpp"
#include "../../detail/phases.hpp"
#include "../../rule.hpp"
#include "kernel.cuh"
#include "tuning.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

inline bool param_32k_available(int device)
{
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
  int driver = 0;
  FUSEDOPT_CUDA_TRY(cudaDriverGetVersion(&driver));
  int major = 0;
  FUSEDOPT_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return driver >= 12010 && major >= 7;
#else
  (void)device;
  return false;
#endif
}

namespace detail {

inline int current_device()
{
  int device = 0;
  FUSEDOPT_CUDA_TRY(cudaGetDevice(&device));
  return device;
}

/// Chunk length after the policy default and rounding up to a vector multiple.
template <class Bound>
std::int64_t chunk_length(options const& opts)
{
  constexpr std::int64_t width = vector_width<Bound>::value;
  FUSEDOPT_EXPECTS(opts.chunk_elements >= 0, "cuda::options::chunk_elements must not be negative");
  FUSEDOPT_EXPECTS(opts.max_blocks >= 0, "cuda::options::max_blocks must not be negative");
  std::int64_t const chunk = opts.chunk_elements > 0 ? opts.chunk_elements : tuning::chunk_elements;
  FUSEDOPT_EXPECTS(chunk <= (std::int64_t{1} << 30), "cuda::options::chunk_elements must be at most 2^30");
  return (chunk + width - 1) / width * width;
}

/// Rejects pageable host memory, which kernels cannot read. One query per slot (its first
/// non-empty tensor) catches the usual mistake without a query per tensor.
template <class... B, std::size_t... K>
void check_device_memory(bound_lists<B...> const& lists, std::index_sequence<K...>)
{
  static constexpr char const* names[] = {B::slot_type::name...};
  for (std::size_t t = 0; t < lists.num_tensors(); ++t) {
    if (lists.tensor_size(t) == 0) { continue; }
    void* const bases[] = {lists.template address<K>(t)...};
    for (std::size_t k = 0; k < sizeof...(B); ++k) {
      cudaPointerAttributes attributes{};
      FUSEDOPT_CUDA_TRY(cudaPointerGetAttributes(&attributes, bases[k]));
      FUSEDOPT_EXPECTS(attributes.type != cudaMemoryTypeUnregistered,
                       "tensor " + std::to_string(t) + " of slot '" + names[k] +
                         "' is pageable host memory; the CUDA backend needs device, managed or mapped memory");
    }
    return;
  }
}

template <class... B>
void check_device_memory(bound_lists<B...> const& lists)
{
  if (lists.num_tensors() > 0) { check_device_memory(lists, std::index_sequence_for<B...>{}); }
}

/// Kernel parameters of a launch: the rule, the step and the table, with room for alignment.
template <class Rule, class Table>
inline constexpr std::size_t param_bytes = sizeof(Rule) + sizeof(step_info) + sizeof(Table) + 32;

template <class Table>
inline constexpr std::size_t param_limit = param_limit_4k;
template <std::size_t S>
inline constexpr std::size_t param_limit<table_32k<S>> = param_limit_32k;

/// Enqueues the kernel over one table.
template <class Policy, class Rule, class Bound, class Table>
void launch(Rule const& rule, step_info const& step, Table const& table, std::int64_t max_blocks, cudaStream_t stream)
{
  static_assert(sizeof(Rule) + sizeof(step_info) + sizeof(global_table<Bound::num_slots>) + 32 <= param_limit_4k,
                "fusedopt: this rule is larger than a kernel's 4 KB of parameters; keep large data in device "
                "memory and give the rule a pointer to it");
  if constexpr (param_bytes<Rule, Table> <= param_limit<Table>) {
    std::int64_t blocks = table.num_chunks;
    if (max_blocks > 0) { blocks = std::min(blocks, max_blocks); }
    blocks = std::min<std::int64_t>(blocks, std::numeric_limits<std::int32_t>::max());
    void* args[] = {const_cast<Rule*>(&rule), const_cast<step_info*>(&step), const_cast<Table*>(&table)};
    FUSEDOPT_CUDA_TRY(cudaLaunchKernel(&multi_tensor_kernel<Policy, Rule, Bound, Table>,
                                       dim3(static_cast<unsigned>(blocks)), dim3(Policy::block_threads), args, 0,
                                       stream));
  } else {
    (void)step, (void)max_blocks, (void)stream;
    FUSEDOPT_FAIL("rule of " + std::to_string(sizeof(Rule)) +
                    " bytes is too large to travel next to a by-value launch table; use "
                    "transport::device_table (a plan)");
  }
}

/// Whether a rule's kernels (its passes' and its update's) can take it next to a by-value
/// table of type `Table`.
template <class Rule, class Bound, class Table>
inline constexpr bool fits_by_value =
  param_bytes<Rule, Table> +
    (::fusedopt::detail::pass_count_v<Rule> > 0
       ? sizeof(pass_results<::fusedopt::detail::pass_count_v<Rule>>) + 16
       : 0) <=
  param_limit<Table>;

/// What every step checks before it enqueues anything. A step given as a pointer is device
/// memory: not checked (reading it would synchronise).
template <class Rule, class Bound>
void check_rule(Rule const& rule, step_info const& step)
{
  static_assert(is_rule_v<Rule>, "fusedopt: a rule must be trivially copyable (it is passed to kernels by value)");
  ::fusedopt::detail::validate_rule(rule, typename Bound::memory_slots{});
  ::fusedopt::detail::validate_step(step, false);
}

/// The results of a rule's passes in a workspace of `rows` rows: pass J's rows
/// (`rows x N_J` doubles) then its totals (`N_J`), after those of the passes before it.
template <class Rule, int... J>
pass_results<static_cast<int>(sizeof...(J))> make_pass_results(double const* base, std::int64_t rows,
                                                                std::integer_sequence<int, J...>)
{
  pass_results<static_cast<int>(sizeof...(J))> results{};
  std::int64_t offset = 0;
  (((results.r[J] = reduced{base + offset, base + offset + rows * ::fusedopt::detail::pass_traits<Rule, J>::reduction::size,
                             ::fusedopt::detail::pass_traits<Rule, J>::reduction::size, rows}),
    (offset += (rows + 1) * ::fusedopt::detail::pass_traits<Rule, J>::reduction::size)),
   ...);
  (void)base, (void)rows, (void)offset;
  return results;
}

/// Enqueues `kernel` with arguments of exactly the kernel's parameter types.
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args)
{
  static_assert(sizeof...(Params) == sizeof...(Args), "fusedopt: wrong number of kernel arguments");
  static_assert((std::is_same_v<std::remove_const_t<Params>, Args> && ...), "fusedopt: kernel argument types");
  void* pointers[] = {static_cast<void*>(&args)...};
  FUSEDOPT_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<void const*>(kernel), grid, block, pointers, 0, stream));
}

/// Blocks of a launch over `table`: one per chunk, at most `max_blocks` when set.
template <class Table>
unsigned grid_of(Table const& table, std::int64_t max_blocks)
{
  std::int64_t blocks = table.num_chunks;
  if (max_blocks > 0) { blocks = std::min(blocks, max_blocks); }
  return static_cast<unsigned>(std::min<std::int64_t>(blocks, std::numeric_limits<std::int32_t>::max()));
}

/// Enqueues reduction pass J over one table; its chunks are chunks chunk_base... of the plan.
template <class Policy, class Rule, class Bound, int J, int P, class Table>
void launch_pass(Rule const& rule, step_info const& step, Table const& table, pass_results<P> const& results,
                 double* partials, std::int64_t chunk_base, std::int64_t max_blocks, cudaStream_t stream)
{
  if (table.num_chunks == 0) { return; }
  if constexpr (param_bytes<Rule, Table> + sizeof(pass_results<P>) + 16 <= param_limit<Table>) {
    launch_kernel(&reduce_kernel<Policy, Rule, Bound, Table, J, P>, dim3(grid_of(table, max_blocks)),
                  dim3(Policy::block_threads), stream, rule, step, table, results, partials, chunk_base);
  } else {
    (void)rule, (void)step, (void)results, (void)partials, (void)chunk_base, (void)max_blocks, (void)stream;
    FUSEDOPT_FAIL("rule of " + std::to_string(sizeof(Rule)) +
                    " bytes is too large to travel next to a by-value launch table and its "
                    "reduction results; use transport::device_table");
  }
}

/// Enqueues the update of a rule with reduction passes over one table.
template <class Policy, class Rule, class Bound, int P, class Table>
void launch_reduced_update(Rule const& rule, step_info const& step, Table const& table,
                           pass_results<P> const& results, std::int64_t max_blocks, cudaStream_t stream)
{
  static_assert(sizeof(Rule) + sizeof(step_info) + sizeof(global_table<Bound::num_slots>) + sizeof(pass_results<P>) +
                    32 <=
                  param_limit_4k,
                "fusedopt: this rule is larger than a kernel's 4 KB of parameters; keep large data in device "
                "memory and give the rule a pointer to it");
  if (table.num_chunks == 0) { return; }
  if constexpr (param_bytes<Rule, Table> + sizeof(pass_results<P>) <= param_limit<Table>) {
    launch_kernel(&reduced_update_kernel<Policy, Rule, Bound, Table, P>, dim3(grid_of(table, max_blocks)),
                  dim3(Policy::block_threads), stream, rule, step, table, results);
  } else {
    (void)rule, (void)step, (void)results, (void)max_blocks, (void)stream;
    FUSEDOPT_FAIL("rule of " + std::to_string(sizeof(Rule)) +
                    " bytes is too large to travel next to a by-value launch table and its "
                    "reduction results; use transport::device_table");
  }
}

/// Enqueues the rule's after-step hooks (one thread), if it has any.
template <class Rule, int P>
void launch_after_step(Rule const& rule, step_info const& step, pass_results<P> const& results, cudaStream_t stream)
{
  if constexpr (::fusedopt::detail::needs_after_step<Rule>::value) {
    launch_kernel(&after_step_kernel<Rule, P>, dim3(1), dim3(1), stream, rule, step, results);
  } else {
    (void)rule, (void)step, (void)results, (void)stream;
  }
}

/// step_info::advance: the counter (device memory) gains 1 in stream order before the step.
inline void advance_step(step_info const& step, cudaStream_t stream)
{
  if (step.advance == nullptr) { return; }
  std::int64_t* counter = step.advance;
  void* args[] = {&counter};
  FUSEDOPT_CUDA_TRY(cudaLaunchKernel(&advance_counter<std::int64_t>, dim3(1), dim3(1), args, 0, stream));
}

template <class Policy, class Rule, class Bound, class Table>
void launch_all(Rule const& rule, step_info const& step, std::vector<Table> const& tables, std::int64_t max_blocks,
                cudaStream_t stream)
{
  for (Table const& table : tables) { launch<Policy, Rule, Bound>(rule, step, table, max_blocks, stream); }
}

}  // namespace detail

template <class... B>
void plan<B...>::device_free::operator()(void* p) const noexcept
{
  // A destructor must not throw; freeing only fails when the context is already gone.
  (void)cudaFree(p);
}

template <class... B>
plan<B...>::plan(lists_type lists, options opts, cudaStream_t stream) : lists_(std::move(lists))
{
  device_ = detail::current_device();
  max_blocks_ = opts.max_blocks > 0 ? opts.max_blocks : detail::tuning::max_blocks;
  std::int64_t const chunk = detail::chunk_length<lists_type>(opts);
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
  written_.assign(lists_);
  auto const layout = detail::make_layout(lists_, chunk, std::index_sequence_for<B...>{});
  tensors_ = layout.tensors;
  if (transport_ == transport::param_4k) {
    tables_4k_ = detail::pack_tables<detail::table_4k<num_slots>>(layout);
  } else if (transport_ == transport::param_32k) {
    tables_32k_ = detail::pack_tables<detail::table_32k<num_slots>>(layout);
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
  }
  FUSEDOPT_EXPECTS(opts.reduction_capacity >= 0, "cuda::options::reduction_capacity must not be negative");
  reduction_capacity_ = opts.reduction_capacity;
  rows_ = static_cast<std::int64_t>(lists_.num_tensors());
  if (reduction_capacity_ > 0) {
    // Every row (empty tensors too) gets its chunk range; chunks are numbered in layout order,
    // which the by-value tables keep (pack_tables appends in order).
    std::vector<detail::chunk_range> ranges(static_cast<std::size_t>(rows_), detail::chunk_range{0, 0});
    for (std::size_t c = 0; c < layout.chunks.size(); ++c) {
      auto const row = static_cast<std::size_t>(layout.tensors[static_cast<std::size_t>(layout.chunks[c].tensor)].index);
      if (ranges[row].count == 0) { ranges[row].first = static_cast<std::int64_t>(c); }
      longest_row_ = std::max(longest_row_, ++ranges[row].count);
    }
    auto const capacity = static_cast<std::size_t>(reduction_capacity_);
    std::size_t const result_bytes = capacity * (static_cast<std::size_t>(rows_) + 1) * sizeof(double);
    std::size_t const partial_bytes = capacity * layout.chunks.size() * sizeof(double);
    std::size_t const range_bytes = ranges.size() * sizeof(detail::chunk_range);
    std::size_t const bytes = result_bytes + partial_bytes + range_bytes + 16;
    void* memory = nullptr;
    FUSEDOPT_CUDA_TRY(cudaMalloc(&memory, bytes));
    workspace_.reset(memory);
    auto* base = static_cast<unsigned char*>(memory);
    results_ = reinterpret_cast<double*>(base);
    partials_ = reinterpret_cast<double*>(base + result_bytes);
    ranges_ = reinterpret_cast<detail::chunk_range*>(base + result_bytes + partial_bytes);
    counter_ = reinterpret_cast<unsigned int*>(base + result_bytes + partial_bytes + range_bytes);
    FUSEDOPT_CUDA_TRY(cudaMemsetAsync(memory, 0, bytes, stream));
    if (!ranges.empty()) {
      FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(ranges_, ranges.data(), range_bytes, cudaMemcpyHostToDevice, stream));
    }
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));
  }
}

template <class... B>
template <class Rule, int P, int... J>
void plan<B...>::run_passes(Rule const& rule, step_info const& step, detail::pass_results<P> const& results,
                            cudaStream_t stream, std::integer_sequence<int, J...>) const
{
  (run_pass<Rule, J>(rule, step, results, stream), ...);
}

template <class... B>
template <class Rule, int J, int P>
void plan<B...>::run_pass(Rule const& rule, step_info const& step, detail::pass_results<P> const& results,
                          cudaStream_t stream) const
{
  using policy = detail::tuning;
  using reduction = typename ::fusedopt::detail::pass_traits<Rule, J>::reduction;
  // Chunk partials of every pass share one area: pass J's are consumed by its finalize
  // kernel before pass J + 1 runs (stream order).
  std::int64_t base = 0;
  switch (transport_) {
    case transport::param_4k:
      for (auto const& table : tables_4k_) {
        detail::launch_pass<policy, Rule, lists_type, J>(rule, step, table, results, partials_, base, max_blocks_, stream);
        base += table.num_chunks;
      }
      break;
    case transport::param_32k:
      for (auto const& table : tables_32k_) {
        detail::launch_pass<policy, Rule, lists_type, J>(rule, step, table, results, partials_, base, max_blocks_, stream);
        base += table.num_chunks;
      }
      break;
    default:
      detail::launch_pass<policy, Rule, lists_type, J>(rule, step, device_table(), results, partials_, base, max_blocks_,
                                                       stream);
      break;
  }
  auto* const per_tensor = const_cast<double*>(results.r[J].per_tensor);
  auto* const all = const_cast<double*>(results.r[J].all);
  // Wide blocks only where a row is long: the choice depends on the plan alone, so the fold
  // order (and the bits) is the same at every run.
  bool const wide = longest_row_ > policy::finalize_wide_after;
  detail::launch_kernel(wide ? &detail::finalize_kernel<policy::finalize_threads_wide, reduction>
                             : &detail::finalize_kernel<policy::finalize_threads, reduction>,
                        dim3(static_cast<unsigned>(std::max<std::int64_t>(rows_, 1))),
                        dim3(wide ? policy::finalize_threads_wide : policy::finalize_threads),
                        stream, static_cast<double const*>(partials_), static_cast<detail::chunk_range const*>(ranges_),
                        rows_, per_tensor, all, counter_);
}

template <class... B>
template <class Rule>
void plan<B...>::run(Rule const& rule, step_info const& step, cudaStream_t stream) const
{
  constexpr int passes = ::fusedopt::detail::pass_count_v<Rule>;
  detail::check_rule<Rule, lists_type>(rule, step);
  if constexpr (passes > 0) {
    constexpr int needed = ::fusedopt::detail::accumulators_v<Rule>;
    FUSEDOPT_EXPECTS(needed <= reduction_capacity_,
                     "the rule needs " + std::to_string(needed) +
                       " reduction accumulators but the plan was built with cuda::options::reduction_capacity " +
                       std::to_string(reduction_capacity_));
  }
  FUSEDOPT_EXPECTS(detail::current_device() == device_,
                   "cuda::plan::run: the current device is not the one the plan was built on (device " +
                     std::to_string(device_) + ")");
  FUSEDOPT_EXPECTS(transport_ == transport::device_table ||
                     (transport_ == transport::param_4k ? detail::fits_by_value<Rule, lists_type, detail::table_4k<num_slots>>
                                                        : detail::fits_by_value<Rule, lists_type, detail::table_32k<num_slots>>),
                   "rule of " + std::to_string(sizeof(Rule)) +
                     " bytes is too large to travel next to a by-value launch table; use transport::device_table");
  // Every check is done: from here on work is enqueued.
  if (tables_.current_from_capture()) { tables_.publish(tensors_, stream); }
  detail::advance_step(step, stream);
  using policy = detail::tuning;
  auto const results = detail::make_pass_results<Rule>(results_, rows_, std::make_integer_sequence<int, passes>{});
  if constexpr (passes > 0) {
    run_passes(rule, step, results, stream, std::make_integer_sequence<int, passes>{});
    switch (transport_) {
      case transport::param_4k:
        for (auto const& table : tables_4k_) {
          detail::launch_reduced_update<policy, Rule, lists_type>(rule, step, table, results, max_blocks_, stream);
        }
        break;
      case transport::param_32k:
        for (auto const& table : tables_32k_) {
          detail::launch_reduced_update<policy, Rule, lists_type>(rule, step, table, results, max_blocks_, stream);
        }
        break;
      default:
        detail::launch_reduced_update<policy, Rule, lists_type>(rule, step, device_table(), results, max_blocks_, stream);
        break;
    }
  } else {
    // Rules without passes: the kernel of the elementwise path, unchanged.
    switch (transport_) {
      case transport::param_4k:
        detail::launch_all<policy, Rule, lists_type>(rule, step, tables_4k_, max_blocks_, stream);
        break;
      case transport::param_32k:
        detail::launch_all<policy, Rule, lists_type>(rule, step, tables_32k_, max_blocks_, stream);
        break;
      default:
        if (global_.num_chunks > 0) {
          detail::launch<policy, Rule, lists_type>(rule, step, device_table(), max_blocks_, stream);
        }
        break;
    }
  }
  detail::launch_after_step(rule, step, results, stream);
}

template <class... B>
std::string plan<B...>::geometry_mismatch(lists_type const& lists) const
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
  constexpr int width = detail::vector_width<lists_type>::value;
  std::size_t const sizes[num_slots] = {sizeof(std::remove_const_t<typename B::element_type>)...};
  for (auto const& e : tensors_) {
    auto const t = static_cast<std::size_t>(e.index);
    void* bases[num_slots];
    detail::tensor_bases(lists, t, bases);
    int const misaligned = detail::misaligned_slot(bases, sizes);
    if (misaligned >= 0) {
      return "tensor " + std::to_string(t) + " of slot '" + names[misaligned] + "' is not aligned to its element size";
    }
    if (detail::vector_head(bases, sizes, width) != e.head) {
      return "tensor " + std::to_string(t) +
             " has another alignment class (the offset of its first 16-byte-aligned element) than the plan's";
    }
  }
  return {};
}

template <class... B>
bool plan<B...>::can_rebind(lists_type const& lists) const
{
  return geometry_mismatch(lists).empty();
}

template <class... B>
void plan<B...>::rebind(lists_type const& lists, cudaStream_t stream)
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

template <class... B>
template <class Slot>
void plan<B...>::rebind(Slot, slot_pointer_t<Slot> const* addresses, std::size_t count, cudaStream_t stream)
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
  constexpr int width = detail::vector_width<lists_type>::value;
  std::size_t const sizes[num_slots] = {sizeof(std::remove_const_t<typename B::element_type>)...};
  bool moved = false;
  for (auto const& e : tensors_) {
    void* const address = const_cast<void*>(static_cast<void const*>(addresses[static_cast<std::size_t>(e.index)]));
    if (address == e.bases[K]) { continue; }
    void* bases[num_slots];
    std::copy(std::begin(e.bases), std::end(e.bases), bases);
    bases[K] = address;
    FUSEDOPT_EXPECTS(detail::vector_head(bases, sizes, width) == e.head,
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

template <class... B>
void plan<B...>::publish_bases(cudaStream_t stream)
{
  switch (transport_) {
    case transport::param_4k: detail::rebase_tables(tables_4k_, tensors_); break;
    case transport::param_32k: detail::rebase_tables(tables_32k_, tensors_); break;
    default: tables_.publish(tensors_, stream); break;
  }
}

template <class... B>
auto plan<B...>::device_table() const -> detail::global_table<num_slots>
{
  detail::global_table<num_slots> table = global_;
  table.tensors = tables_.current();
  return table;
}

template <class... B>
std::size_t plan<B...>::launches_per_run() const
{
  switch (transport_) {
    case transport::param_4k: return tables_4k_.size();
    case transport::param_32k: return tables_32k_.size();
    default: return global_.num_chunks > 0 ? 1 : 0;
  }
}

template <class... B>
template <class Rule>
std::size_t plan<B...>::launches_per_run(Rule const&, bool with_advance) const
{
  constexpr int passes = ::fusedopt::detail::pass_count_v<Rule>;
  std::size_t const update = launches_per_run();
  std::size_t const pass = update + 1;  // a pass kernel per update launch, then finalize
  return update + static_cast<std::size_t>(passes) * pass +
         (::fusedopt::detail::needs_after_step<Rule>::value ? 1 : 0) + (with_advance ? 1 : 0);
}

template <class... B>
plan<B...> make_plan(bound_lists<B...> lists, options opts, cudaStream_t stream)
{
  return plan<B...>(std::move(lists), opts, stream);
}

template <class Rule, class... B>
void apply(Rule const& rule, bound_lists<B...> const& lists, step_info const& step, options opts, cudaStream_t stream)
{
  using lists_type = bound_lists<B...>;
  constexpr std::size_t S = sizeof...(B);
  static_assert(::fusedopt::detail::pass_count_v<Rule> == 0,
                "fusedopt: cuda::apply cannot run rules with reduction passes (clip_by_global_norm, LAMB, LARS, "
                "skip_if_nonfinite, norm_of, ...): their results need a device workspace, and apply allocates no "
                "device memory. Make a plan (cuda::make_plan) and call plan.run.");
  detail::check_rule<Rule, lists_type>(rule, step);
  FUSEDOPT_EXPECTS(opts.metadata != transport::device_table,
                   "cuda::apply carries its tables by value and owns no device memory; use a plan for "
                   "transport::device_table");
  int const device = detail::current_device();
  bool const large = param_32k_available(device);
  FUSEDOPT_EXPECTS(opts.metadata != transport::param_32k || large,
                   "transport::param_32k needs CUDA 12.1 (runtime and driver) and an sm_70 or newer GPU");
  std::int64_t const chunk = detail::chunk_length<lists_type>(opts);
  std::int64_t const max_blocks = opts.max_blocks > 0 ? opts.max_blocks : detail::tuning::max_blocks;
  detail::check_device_memory(lists);
  auto const layout = detail::make_layout(lists, chunk, std::index_sequence_for<B...>{});
  detail::advance_step(step, stream);
  using policy = detail::tuning;
  bool const use_32k = opts.metadata == transport::param_32k || (opts.metadata == transport::automatic && large);
  // A rule too large for a 32 KB table cannot fit a 4 KB one either; launch() reports it.
  if (use_32k) {
    detail::launch_all<policy, Rule, lists_type>(rule, step, detail::pack_tables<detail::table_32k<S>>(layout),
                                                 max_blocks, stream);
  } else {
    detail::launch_all<policy, Rule, lists_type>(rule, step, detail::pack_tables<detail::table_4k<S>>(layout),
                                                 max_blocks, stream);
  }
  detail::launch_after_step(rule, step, detail::pass_results<0>{}, stream);
}

}  // namespace cuda
FUSEDOPT_NAMESPACE_END
