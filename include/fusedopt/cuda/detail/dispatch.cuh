/// @file cuda/detail/dispatch.cuh
/// @brief Host launch logic of the CUDA backend (CUB's "dispatch"): the checks every step makes
/// before it enqueues anything, the chunk length and grid size a policy gives, and one launch
/// function per kernel of kernels.cuh, each checking that its parameters fit the kernel
/// parameter space beside the table it carries. Every function takes the tuning `Policy` from
/// the facade; none names a policy itself.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../bind.hpp"
#include "../../config.hpp"
#include "../../detail/access.hpp"
#include "../../detail/phases.hpp"
#include "../../error.hpp"
#include "../../rule.hpp"
#include "../../scalar.hpp"
#include "../error.cuh"
#include "kernels.cuh"
#include "tables.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

/// @brief Options of a plan or of `apply` (cuda/backend.cuh documents them).
struct options;

namespace detail {

inline int current_device()
{
  int device = 0;
  FUSEDOPT_CUDA_TRY(cudaGetDevice(&device));
  return device;
}

/// One attribute of `device`, checked.
inline int device_attribute(cudaDeviceAttr attribute, int device)
{
  int value = 0;
  FUSEDOPT_CUDA_TRY(cudaDeviceGetAttribute(&value, attribute, device));
  return value;
}

/// Whether every target this translation unit's device code is compiled for is sm_90 or newer
/// (nvcc's __CUDA_ARCH_LIST__, seen by the host pass too): only code compiled for them holds
/// the kernels' wait for their predecessor (await_predecessor). With an older target beside
/// them (say 80;90) a newer GPU may run code compiled from that target's PTX, without the wait,
/// so no launch may then be programmatic.
constexpr bool device_code_awaits_predecessor()
{
#if defined(__CUDA_ARCH_LIST__)
  constexpr int targets[] = {__CUDA_ARCH_LIST__};
  for (int target : targets) {
    if (target < 900) { return false; }
  }
  return true;
#else
  return false;
#endif
}

/// Whether launches on `device` use programmatic dependent launch: asked for
/// (options::dependent_launch), the GPU is sm_90 or newer, and the device code waits for its
/// predecessor (device_code_awaits_predecessor).
template <class Options>
bool programmatic_launch_for(Options const& opts, int device)
{
  return device_code_awaits_predecessor() && opts.dependent_launch &&
         device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 9;
}

/// Chunk length: the policy's unless overridden, rounded up to a vector multiple, and to whole
/// blocks where quantized states are bound (blocks are powers of two from 32 elements, so
/// whole blocks are whole vectors too).
template <class Policy, class Bound, class Options>
std::int64_t chunk_length(Options const& opts)
{
  constexpr std::int64_t width = vector_width<Bound>::value;
  FUSEDOPT_EXPECTS(opts.chunk_elements >= 0, "cuda::options::chunk_elements must not be negative");
  FUSEDOPT_EXPECTS(opts.max_blocks >= 0, "cuda::options::max_blocks must not be negative");
  std::int64_t const chunk = opts.chunk_elements > 0 ? opts.chunk_elements : Policy::chunk_elements;
  FUSEDOPT_EXPECTS(chunk <= (std::int64_t{1} << 30), "cuda::options::chunk_elements must be at most 2^30");
  return ::fusedopt::detail::whole_blocks<Bound>((chunk + width - 1) / width * width);
}

/// Most blocks per launch: the policy's unless overridden.
template <class Policy, class Options>
std::int64_t max_blocks_of(Options const& opts)
{
  return opts.max_blocks > 0 ? opts.max_blocks : Policy::max_blocks;
}

/// Which of the policy's shapes the update takes, and what sizes the persistent grid of an
/// update that stores quantized states (each block fills its shared copy of the maps once):
/// the device's SMs and shared memory, or the caller's cap.
struct persistent_grid {
  std::int64_t max_blocks = 0;  ///< options::max_blocks; 0: from the device
  std::int64_t multiprocessors = 0;
  std::int64_t shared_per_sm = 0;      ///< bytes of shared memory an SM gives its blocks
  std::int64_t reserved_per_block = 0; ///< bytes the driver keeps per block
  bool fast_memory = false;            ///< the policy's shape for fast memory (memory_speed)
  /// An update that stores no quantized state in the policy's shape for fast memory
  /// (plain_fast_shape_for); such an update uses nothing else of this struct.
  bool plain_fast_shape = false;
  /// The plan's work queue (zero, in device memory); null: the units are dealt round-robin.
  work_queue* queue = nullptr;

  /// Blocks of a launch whose blocks take `shared_bytes` of static shared memory each:
  /// `per_sm` (the policy's quantized_update) where that many fit in an SM's shared memory (an
  /// H100 or H200 holds 5 of AdamW's 37 KB, an A100 4), fewer where they do not, on every SM;
  /// blocks that do not fit would run as a late, partial wave.
  [[nodiscard]] std::int64_t blocks(std::int64_t shared_bytes, int per_sm) const
  {
    if (max_blocks > 0) { return max_blocks; }
    std::int64_t const fit = shared_per_sm / (shared_bytes + reserved_per_block);
    return multiprocessors * std::max<std::int64_t>(1, std::min<std::int64_t>(per_sm, fit));
  }
};

/// Peak DRAM bytes per SM cycle of `device` (the memory clock, counted twice per cycle, times
/// the bus width, over the SMs times their clock): how fast its memory is beside its SMs; 0
/// where the device does not report them.
inline double dram_bytes_per_sm_cycle(int device)
{
  double const memory_khz = device_attribute(cudaDevAttrMemoryClockRate, device);
  double const bus_bits = device_attribute(cudaDevAttrGlobalMemoryBusWidth, device);
  double const sm_khz = device_attribute(cudaDevAttrClockRate, device);
  double const sms = device_attribute(cudaDevAttrMultiProcessorCount, device);
  if (memory_khz <= 0 || bus_bits <= 0 || sm_khz <= 0 || sms <= 0) { return 0; }
  return 2.0 * memory_khz * (bus_bits / 8.0) / (sm_khz * sms);
}

/// Whether `device`'s memory is fast beside its SMs for `Policy`: more peak DRAM bytes per SM
/// cycle than its fast_memory_bytes_per_sm_cycle (a device that reports nothing counts as slow).
template <class Policy>
bool memory_is_fast(int device)
{
  return dram_bytes_per_sm_cycle(device) > Policy::fast_memory_bytes_per_sm_cycle;
}

/// Whether the update takes `Policy`'s shapes for fast memory on `device`: options::memory, or
/// from the device (memory_is_fast) where it is automatic.
template <class Policy, class Options>
bool fast_memory_for(Options const& opts, int device)
{
  using speed = decltype(opts.memory);  // cuda::memory_speed, declared with the options
  FUSEDOPT_EXPECTS(opts.memory == speed::automatic || opts.memory == speed::fast || opts.memory == speed::slow,
                   "cuda::options::memory must be memory_speed::automatic, fast or slow");
  return opts.memory == speed::automatic ? memory_is_fast<Policy>(device) : opts.memory == speed::fast;
}

/// Whether an update that stores no quantized state, over a launch of `chunks` chunks of
/// `tensors` tensors, takes the policy's shape for fast memory (plain_fast_update):
/// on fast memory where the tensors average fast_memory_min_chunks_per_tensor chunks or more
/// (many tensors of a few chunks, as W3's, lost 6-13 points with it and its like); always where the fast
/// shapes are `forced` (options::memory: tests run it on any GPU).
template <class Policy>
constexpr bool plain_fast_shape(bool fast_memory, bool forced, std::int64_t chunks, std::int64_t tensors)
{
  return forced || (fast_memory && chunks >= Policy::fast_memory_min_chunks_per_tensor * tensors);
}

/// plain_fast_shape for a launch over `chunked`'s chunks and tensors on `device` under `opts`.
template <class Policy, class Options, std::size_t S>
bool plain_fast_shape_for(Options const& opts, int device, layout<S> const& chunked)
{
  using speed = decltype(opts.memory);
  bool const fast_memory = fast_memory_for<Policy>(opts, device);  // checks options::memory
  return plain_fast_shape<Policy>(fast_memory, opts.memory == speed::fast,
                                  static_cast<std::int64_t>(chunked.chunks.size()),
                                  static_cast<std::int64_t>(chunked.tensors.size()));
}

template <class Policy, class Options>
persistent_grid persistent_grid_of(Options const& opts, int device)
{
  persistent_grid grid;
  grid.max_blocks = opts.max_blocks;
  grid.fast_memory = fast_memory_for<Policy>(opts, device);
  if (grid.max_blocks > 0) { return grid; }
  grid.multiprocessors = device_attribute(cudaDevAttrMultiProcessorCount, device);
  grid.shared_per_sm = device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  grid.reserved_per_block = device_attribute(cudaDevAttrReservedSharedMemoryPerBlock, device);
  return grid;
}

/// Whether a launch over tensors of `bytes` (every bound slot) on `device` streams with L2
/// evict-first: between the size of the device's L2 (a step that fits there is read from it
/// again by the next step, which evict-first would prevent) and the policy's bound.
template <class Policy, class Options>
bool evict_first_for(std::int64_t bytes, Options const& opts, int device)
{
  using eviction = decltype(opts.eviction);  // cuda::l2_eviction, declared with the options
  if (opts.eviction == eviction::evict_first) { return true; }
  if (opts.eviction == eviction::evict_normal || bytes >= Policy::evict_first_below_bytes) { return false; }
  return bytes > device_attribute(cudaDevAttrL2CacheSize, device);
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

/// What every step checks before it enqueues anything. A step given as a pointer is device
/// memory: not checked (reading it would synchronise).
template <class Rule, class Bound>
void check_rule(Rule const& rule, step_info const& step)
{
  static_assert(is_rule_v<Rule>, "fusedopt: a rule must be trivially copyable (it is passed to kernels by value)");
  ::fusedopt::detail::validate_rule(rule, typename Bound::memory_slots{});
  ::fusedopt::detail::validate_step(step, false);
}

// ---- kernel parameters ---------------------------------------------------------------------

template <class Table>
inline constexpr std::size_t param_limit = param_limit_4k;
template <std::size_t S>
inline constexpr std::size_t param_limit<table_32k<S>> = param_limit_32k;

/// Parameter bytes of the results of P passes where a kernel takes them (none without passes:
/// pass_results<0> is one byte, within the alignment room below).
template <int P>
inline constexpr std::size_t results_bytes = P > 0 ? sizeof(pass_results<P>) : 0;

/// Kernel parameters of a launch: the rule, the step, the table and `Extra` bytes of other
/// arguments, with room for alignment.
template <class Rule, class Table, std::size_t Extra = 0>
inline constexpr std::size_t param_bytes = sizeof(Rule) + sizeof(step_info) + sizeof(Table) + Extra + 32;

/// Whether a launch over `Table` carries the rule and `Extra` bytes within the parameter limit.
template <class Rule, class Table, std::size_t Extra = 0>
inline constexpr bool fits_params = param_bytes<Rule, Table, Extra> <= param_limit<Table>;

/// Parameter bytes of the update's work queue: a pointer where the rule stores quantized states.
template <class Rule, class Bound>
inline constexpr std::size_t queue_bytes = ::fusedopt::detail::access<Rule, Bound>::stores_quantized ? sizeof(work_queue*) : 0;

/// Whether a rule's kernels (its passes' and its update's) can take it next to a by-value
/// table of type `Table`.
template <class Rule, class Bound, class Table>
inline constexpr bool fits_by_value =
  param_bytes<Rule, Table> +
    std::max(::fusedopt::detail::pass_count_v<Rule> > 0 ? results_bytes<::fusedopt::detail::pass_count_v<Rule>> + 16 : 0,
             results_bytes<::fusedopt::detail::pass_count_v<Rule>> + queue_bytes<Rule, Bound>) <=
  param_limit<Table>;

/// Fails a launch whose rule does not fit beside a by-value table (plans check fits_by_value
/// before a step enqueues anything; apply meets it here).
[[noreturn]] inline void rule_too_large(std::size_t rule_bytes, bool with_results)
{
  FUSEDOPT_FAIL("rule of " + std::to_string(rule_bytes) + " bytes is too large to travel next to a by-value launch table" +
                (with_results ? " and its reduction results; use transport::device_table"
                              : "; use transport::device_table (a plan)"));
}

/// The results of a rule's passes in a workspace of `rows` rows: pass J's rows
/// (`rows x N_J` doubles), its totals (`N_J`), then its finished values (`rows x F_J`), after
/// those of the passes before it.
template <class Rule, int... J>
pass_results<static_cast<int>(sizeof...(J))> make_pass_results(double const* base, std::int64_t rows,
                                                                std::integer_sequence<int, J...>)
{
  pass_results<static_cast<int>(sizeof...(J))> results{};
  std::int64_t offset = 0;
  (((results.r[J] = reduced{base + offset, base + offset + rows * ::fusedopt::detail::pass_traits<Rule, J>::reduction::size,
                             ::fusedopt::detail::pass_traits<Rule, J>::reduction::size, rows,
                             base + offset + (rows + 1) * ::fusedopt::detail::pass_traits<Rule, J>::reduction::size,
                             ::fusedopt::detail::pass_traits<Rule, J>::finished_size}),
    (offset += (rows + 1) * ::fusedopt::detail::pass_traits<Rule, J>::reduction::size +
               rows * ::fusedopt::detail::pass_traits<Rule, J>::finished_size)),
   ...);
  (void)base, (void)rows, (void)offset;
  return results;
}

// ---- launches ------------------------------------------------------------------------------

/// Enqueues `kernel` with arguments of exactly the kernel's parameter types; `programmatic`:
/// with programmatic stream serialization (the kernel awaits its predecessor on the device).
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, bool programmatic,
                   Args... args)
{
  static_assert(sizeof...(Params) == sizeof...(Args), "fusedopt: wrong number of kernel arguments");
  static_assert((std::is_same_v<std::remove_const_t<Params>, Args> && ...), "fusedopt: kernel argument types");
  void* pointers[] = {static_cast<void*>(&args)...};
#if CUDART_VERSION >= 11080  // launch attributes: CUDA 11.8
  if (programmatic) {
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    FUSEDOPT_CUDA_TRY(cudaLaunchKernelExC(&config, reinterpret_cast<void const*>(kernel), pointers));
    return;
  }
#endif
  (void)programmatic;
  FUSEDOPT_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<void const*>(kernel), grid, block, pointers, 0, stream));
}

/// Blocks of a launch over `table`: one per `chunks_per_block` chunks, at most `max_blocks` when set.
template <class Table>
unsigned grid_of(Table const& table, std::int64_t max_blocks, int chunks_per_block = 1)
{
  std::int64_t blocks = (table.num_chunks + chunks_per_block - 1) / chunks_per_block;
  if (max_blocks > 0) { blocks = std::min(blocks, max_blocks); }
  return static_cast<unsigned>(std::min<std::int64_t>(blocks, std::numeric_limits<std::int32_t>::max()));
}

/// Whether the policy's two shapes give the plain update (no quantized state stored) of
/// `Bound` different threads per block or vectors per thread; where they do not, one kernel
/// serves both.
template <class Policy, class Bound>
inline constexpr bool plain_shapes_differ_v =
  plain_shape_v<Policy, vector_width<Bound>::value, false>.block_threads !=
    plain_shape_v<Policy, vector_width<Bound>::value, true>.block_threads ||
  vectors_per_thread<Policy, vector_width<Bound>::value, vector_width<Bound>::widest, false> !=
    vectors_per_thread<Policy, vector_width<Bound>::value, vector_width<Bound>::widest, true>;

/// Elements one block of the update takes in one iteration, in the shape its launch takes
/// (launch_update: the fast one where it differs and `fast_shape`): the chunk of an update
/// over one tensor (one_tensor_table), so that every block loads once and leaves.
template <class Policy, class Bound>
constexpr std::int64_t update_iteration_elements(bool fast_shape)
{
  constexpr int width = vector_width<Bound>::value;
  constexpr std::size_t widest = vector_width<Bound>::widest;
  constexpr std::int64_t fast = std::int64_t{plain_shape_v<Policy, width, true>.block_threads} * width *
                                vectors_per_thread<Policy, width, widest, true>;
  constexpr std::int64_t slow = std::int64_t{plain_shape_v<Policy, width, false>.block_threads} * width *
                                vectors_per_thread<Policy, width, widest, false>;
  return plain_shapes_differ_v<Policy, Bound> && fast_shape ? fast : slow;
}

/// Enqueues the update over one table, with the results of the rule's P passes.
/// `persistent` chooses the shape, and sizes the grid where the rule stores quantized states
/// (persistent_grid_of).
template <class Policy, class Rule, class Bound, int P, class Table>
void launch_update(Rule const& rule, step_info const& step, Table const& table, pass_results<P> const& results,
                   std::int64_t max_blocks, persistent_grid const& persistent, cudaStream_t stream, bool programmatic)
{
  using access = ::fusedopt::detail::access<Rule, Bound>;
  auto kernel = &multi_tensor_kernel<Policy, Rule, Bound, Table, P, false>;
  int threads = update_threads_v<Policy, Rule, Bound, false>;
  if constexpr (!access::stores_quantized && plain_shapes_differ_v<Policy, Bound>) {
    if (persistent.plain_fast_shape) {
      kernel = &multi_tensor_kernel<Policy, Rule, Bound, Table, P, true>;
      threads = update_threads_v<Policy, Rule, Bound, true>;
    }
  }
  if constexpr (access::stores_quantized) {
    // The policy's shape for the device's memory speed: a second kernel only where it differs.
    bool fast = false;
    if constexpr (quantized_shapes_differ_v<Policy, access>) {
      fast = persistent.fast_memory;
      if (fast) { kernel = &multi_tensor_kernel<Policy, Rule, Bound, Table, P, true>; }
    }
    std::size_t const shared_bytes =
      sizeof(block_maps<access>) +
      (fast ? quantized_stage_bytes_v<Policy, access, true> : quantized_stage_bytes_v<Policy, access, false>);
    max_blocks = persistent.blocks(static_cast<std::int64_t>(shared_bytes),
                                   fast ? quantized_blocks_per_sm_v<Policy, access, true>
                                        : quantized_blocks_per_sm_v<Policy, access, false>);
    // process_quantized counts its units (a slot of a chunk for each warp of a block) in 32
    // bits: with fewer than 2^30 units, the unit and ticket numbers (tickets only where there
    // are 16 units a warp or more: under 1.2 times the units) stay under 2^31.
    constexpr std::int64_t warps = Policy::block_threads / 32;
    FUSEDOPT_EXPECTS(table.num_chunks * warps < (std::int64_t{1} << 30),
                     "an update that stores quantized states takes fewer than 2^30 / " + std::to_string(warps) +
                       " chunks per launch; make the chunks longer (cuda::options::chunk_elements)");
  }
  (void)persistent;
  static_assert(fits_params<Rule, global_table<Bound::num_slots>, results_bytes<P> + queue_bytes<Rule, Bound>>,
                "fusedopt: this rule is larger than a kernel's 4 KB of parameters; keep large data in device "
                "memory and give the rule a pointer to it");
  if (table.num_chunks == 0) { return; }
  if constexpr (fits_params<Rule, Table, results_bytes<P> + queue_bytes<Rule, Bound>>) {
    queue_param<access::stores_quantized> work{};
    if constexpr (access::stores_quantized) { work.queue = persistent.queue; }
    launch_kernel(kernel, dim3(grid_of(table, max_blocks)), dim3(static_cast<unsigned>(threads)), stream, programmatic, rule,
                  step, table, results, work);
  } else {
    (void)kernel, (void)threads;
    (void)rule, (void)step, (void)results, (void)max_blocks, (void)stream, (void)programmatic;
    rule_too_large(sizeof(Rule), P > 0);
  }
}

/// Enqueues reduction pass J over one table; its chunks are chunks chunk_base... of the plan.
template <class Policy, class Rule, class Bound, int J, int P, class Table>
void launch_pass(Rule const& rule, step_info const& step, Table const& table, pass_results<P> const& results,
                 double* partials, std::int64_t chunk_base, std::int64_t max_blocks, cudaStream_t stream,
                 bool programmatic)
{
  if (table.num_chunks == 0) { return; }
  if constexpr (fits_params<Rule, Table, results_bytes<P> + 16>) {
    // A warp per chunk (reduce_kernel).
    launch_kernel(&reduce_kernel<Policy, Rule, Bound, Table, J, P>,
                  dim3(grid_of(table, max_blocks, Policy::block_threads / 32)),
                  dim3(Policy::block_threads), stream, programmatic, rule, step, table, results, partials, chunk_base);
  } else {
    (void)rule, (void)step, (void)results, (void)partials, (void)chunk_base, (void)max_blocks, (void)stream,
      (void)programmatic;
    rule_too_large(sizeof(Rule), true);
  }
}

/// Enqueues the fold of reduction pass J's chunk partials into its rows and totals (and, where
/// pass J's owner finishes its results, the finished values of each row).
template <class Policy, class Rule, int J>
void launch_finalize(Rule const& rule, step_info const& step, double const* partials, chunk_range const* ranges,
                     std::int64_t rows, std::int64_t longest_row, reduced const& into, unsigned int* counter,
                     cudaStream_t stream, bool programmatic)
{
  using traits = ::fusedopt::detail::pass_traits<Rule, J>;
  using reduction = typename traits::reduction;
  // Rules that finish nothing share one finalize per reduction.
  using finish = std::conditional_t<(traits::finished_size > 0), finish_pass<Rule, J>, no_finish>;
  finish f{};
  if constexpr (traits::finished_size > 0) {
    f = finish{rule, step, const_cast<double*>(into.finished)};
  } else {
    (void)rule, (void)step;
  }
  // Wide blocks only where a row is long: the choice depends on the plan alone, so the fold
  // order (and the bits) is the same at every run.
  bool const wide = longest_row > Policy::finalize_wide_after;
  launch_kernel(wide ? &finalize_kernel<Policy::finalize_threads_wide, reduction, finish>
                     : &finalize_kernel<Policy::finalize_threads, reduction, finish>,
                dim3(static_cast<unsigned>(std::max<std::int64_t>(rows, 1))),
                dim3(wide ? Policy::finalize_threads_wide : Policy::finalize_threads), stream, programmatic, partials,
                ranges, rows, const_cast<double*>(into.per_tensor), const_cast<double*>(into.all), counter, f);
}

/// Enqueues the rule's after-step hooks (one thread), if it has any.
template <class Rule, int P>
void launch_after_step(Rule const& rule, step_info const& step, pass_results<P> const& results, cudaStream_t stream,
                       bool programmatic)
{
  if constexpr (::fusedopt::detail::needs_after_step<Rule>::value) {
    launch_kernel(&after_step_kernel<Rule, P>, dim3(1), dim3(1), stream, programmatic, rule, step, results);
  } else {
    (void)rule, (void)step, (void)results, (void)stream, (void)programmatic;
  }
}

/// step_info::advance: the counter (device memory) gains 1 in stream order before the step.
inline void advance_step(step_info const& step, cudaStream_t stream, bool programmatic)
{
  if (step.advance == nullptr) { return; }
  launch_kernel(&advance_counter<std::int64_t>, dim3(1), dim3(1), stream, programmatic, step.advance);
}

/// Enqueues the writes of `entries` into `table` on `stream`, one launch per table_piece, and
/// an ordinary launch after them (table_written) that no programmatic launch overtakes.
template <class Entry>
void write_table_by_value(Entry* table, std::vector<Entry> const& entries, cudaStream_t stream)
{
  table_piece<Entry> piece{};
  auto const n = static_cast<std::int32_t>(entries.size());
  for (std::int32_t first = 0; first < n; first += table_piece<Entry>::capacity) {
    piece.first = first;
    piece.count = std::min<std::int32_t>(table_piece<Entry>::capacity, n - first);
    for (std::int32_t i = 0; i < piece.count; ++i) { piece.entries[i] = entries[static_cast<std::size_t>(first + i)]; }
    write_table_piece<Entry><<<1, 128, 0, stream>>>(table, piece);
    FUSEDOPT_CUDA_TRY(cudaGetLastError());
  }
  table_written<Entry><<<1, 32, 0, stream>>>();
  FUSEDOPT_CUDA_TRY(cudaGetLastError());
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
