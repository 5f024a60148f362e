/// @file cuda/backend.cuh
/// @brief The CUDA backend: runs a rule over bound tensor lists in device memory, in one
/// kernel launch per step (a plan) or a few (one-shot `apply`).
///
/// @code
/// auto lists = fusedopt::bind(slot::param = p, slot::grad = g, slot::exp_avg = m, slot::exp_avg_sq = v);
/// auto plan = fusedopt::cuda::make_plan(lists, {}, stream);   // allocates and uploads once
/// fusedopt::rules::adamw opt;
/// for (std::int64_t t = 1; t <= steps; ++t) { plan.run(opt, {t}, stream); }   // one launch each
/// @endcode
///
/// Work is cut into chunks of one tensor; each block of the kernel updates one chunk with
/// 16-byte loads and stores, so that the step runs at close to the copy bandwidth whatever the
/// number and sizes of the tensors (docs/cuda.md). Results are bit-identical to the host
/// backend when the code is built with `-fmad=false` (docs/cuda.md, "Bit identity").
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../bind.hpp"
#include "../config.hpp"
#include "../detail/rebind.hpp"
#include "../scalar.hpp"
#include "detail/address_tables.cuh"
#include "detail/policy.cuh"
#include "detail/tables.cuh"
#include "detail/workspace.cuh"
#include "error.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

/// @brief How a launch finds its work (the table of tensor addresses and chunks).
enum class transport {
  automatic,     ///< plans: device_table; apply: param_32k where available, else param_4k
  param_4k,      ///< by value in the kernel parameters, under the 4 KB limit (several launches for long lists)
  param_32k,     ///< by value under the 32 KB limit (CUDA 12.1 driver and runtime, sm_70 or newer)
  device_table,  ///< in device memory owned by a plan: one launch whatever the lists
};

/// @brief The L2 eviction priority of a launch's loads and stores of tensor data (sm_80 and
/// newer; older GPUs take the cache-streaming hint throughout).
enum class l2_eviction {
  automatic,     ///< evict first from the device's L2 size up to the policy's evict_first_below_bytes of bound tensors, else normal
  evict_first,   ///< the data leaves L2 before anything else (small steps: the launch tables stay cached)
  evict_normal,  ///< ordinary priority (large steps)
};

/// @brief How fast a device's memory is beside its SMs, which chooses the shape of the update
/// (the tuning policy's `plain_fast_update` and `quantized_update`).
enum class memory_speed {
  automatic,  ///< from the device: DRAM bytes per SM cycle above the policy's fast_memory_bytes_per_sm_cycle is fast
  fast,       ///< the shape for memory that outruns the arithmetic (H200: more warps)
  slow,       ///< the shape for memory whose latency bounds the update (H100: deeper lookahead)
};

/// @brief Options of a plan or of `apply`.
struct options {
  /// Metadata transport; force one to test or compare them.
  transport metadata = transport::automatic;
  /// Tuning override: elements of one tensor per chunk, a block's work in the update and a
  /// warp's in a reduction pass (rounded up to a multiple of the vector width); 0 takes the
  /// tuning policy's default (2048). Rules reading factored statistics (Adafactor, CAME) run
  /// faster with fusedopt::factored_chunk_elements (factored.hpp).
  std::int64_t chunk_elements = 0;
  /// Tuning override for benchmarks and tests: the L2 eviction priority of tensor data.
  l2_eviction eviction = l2_eviction::automatic;
  /// Tuning override for benchmarks and tests: most blocks per launch, blocks then loop over
  /// chunks; 0 takes the policy's default (one block per chunk, per four in a reduction pass
  /// whose warps take a chunk each; for an update that stores 8-bit quantized states, a
  /// persistent grid of the policy's `quantized_update` blocks on every SM, fewer where an
  /// SM's shared memory holds fewer).
  std::int64_t max_blocks = 0;
  /// Tuning override for benchmarks and tests: which of the policy's shapes the update takes,
  /// the one for fast memory (H200) or for slow memory (H100); both give the same results.
  /// An update that stores 8-bit quantized states takes its shape by memory speed alone, any
  /// other on fast memory only where the launch's tensors average the policy's
  /// `fast_memory_min_chunks_per_tensor` chunks (docs/tuning.md, "Quantized updates by memory
  /// speed" and "The plain update's shape by memory speed"). Was `quantized_memory`.
  memory_speed memory = memory_speed::automatic;
  /// Plans: accumulators (summed over a rule's reduction passes) the plan's device workspace
  /// has room for, allocated when the plan is built, so that `run` never allocates and can be
  /// captured. 8 doubles per chunk (2048 elements) and per tensor: about 0.1% of an fp32 Adam
  /// step's memory. A rule needing more is rejected by `run`; 0 allocates no workspace (then
  /// only rules without reduction passes run). Ignored by `apply`.
  int reduction_capacity = 8;
  /// Plans with device tables: copies of the address table kept on the device, one per address
  /// set seen recently (at least 1). A rebind to addresses one of them holds switches to it with
  /// no upload and no work on the device; PyTorch's caching allocator cycles through a few sets
  /// under `zero_grad(set_to_none=True)`. Each copy takes 8 bytes per tensor and slot (plus
  /// 8 per tensor) of device memory. Ignored by `apply`.
  int address_tables = 4;
  /// Launch the step's kernels with programmatic dependent launch (sm_90 and newer GPUs, and
  /// code built only for such targets; ignored otherwise): each may be scheduled while the
  /// kernel before it in the stream finishes, and
  /// waits on the device for that kernel's completion and memory before it reads anything, so
  /// launch latency and block dispatch overlap the previous kernel's last wave (docs/cuda.md,
  /// "Dependent launch"). Results do not change; `false` launches them the ordinary way.
  bool dependent_launch = true;
};

namespace detail {
struct plan_steps;  // the pieces of a step, for plans that put work between them (cuda/sharded.cuh)
}  // namespace detail

/// @brief True when kernels can take 32 KB of parameters on `device`: the runtime and the
/// driver are CUDA 12.1 or newer and the GPU is sm_70 or newer.
/// @throws fusedopt::error if a CUDA query fails.
inline bool param_32k_available(int device);

/// @brief Bound lists in device memory made ready for repeated steps: validated, cut into
/// chunks, their launch tables uploaded once. Move-only; owns its device tables.
///
/// A plan is made from the lists' geometry: the number of tensors, their sizes, element types
/// and alignment classes (where the first 16-byte-aligned element of each tensor falls). Its
/// chunks, launch shape and workspace depend on nothing else. Addresses are not geometry:
/// `rebind` points the plan at lists of the same geometry at new addresses (new gradient
/// buffers every step, as PyTorch's `zero_grad(set_to_none=True)` or a caching allocator hand
/// out) with O(tensors) host work, no allocation, no synchronisation and at most one
/// asynchronous upload (none when the addresses are a set the plan was bound to recently:
/// `options::address_tables`); only a change of geometry needs a new plan (`can_rebind` tells).
///
/// Contract: the plan keeps a copy of the lists (pointers and sizes), never of the tensors.
/// The caller keeps every tensor allocated, at the address last bound, while the plan is used;
/// a plan cannot see memory freed or moved under it: `rebind` it (or build a new plan) when
/// tensors move. The plan runs on the device that was current when it was built (checked at
/// every `run`). A CUDA graph that captured `run` reads the plan's device tables: keep the plan
/// alive while the graph may be launched, and do not rebind it while a graph that captured it
/// may still be replayed (the graph would follow the new addresses of a device table).
///
/// @tparam Policy the tuning policy (cuda/detail/policy.cuh) that cuts the chunks, sizes the
/// grid and shapes every kernel of the plan; `plan<B...>` takes the default. Not a stable
/// interface: it is there for tuning sweeps and for a policy chosen per compute capability.
template <class Policy, class... B>
class basic_plan {
 public:
  using lists_type = bound_lists<B...>;
  using policy_type = Policy;
  static constexpr std::size_t num_slots = sizeof...(B);

  /// @brief Validates the lists, decides vector alignment per tensor, cuts the tensors into
  /// chunks and (for device tables) allocates and uploads the tables with cudaMemcpyAsync on
  /// `stream`, then synchronises `stream`. Do not build a plan while `stream` is being captured.
  /// @throws fusedopt::error if a pointer is not aligned to its element size, a slot's memory
  /// is pageable host memory, an option is out of range, the transport forced is not
  /// available, or a CUDA call fails.
  explicit basic_plan(lists_type lists, options opts = {}, cudaStream_t stream = nullptr);

  basic_plan(basic_plan&&) noexcept = default;
  basic_plan& operator=(basic_plan&&) noexcept = default;
  basic_plan(basic_plan const&) = delete;
  basic_plan& operator=(basic_plan const&) = delete;
  ~basic_plan() = default;

  /// @brief Enqueues one step of `rule` over every element on `stream`: no allocation, no
  /// copy, no synchronisation; one launch with device tables (launches_per_run() in all cases).
  /// Capturable in a CUDA graph; values the rule reads through `scalar::from_pointer` (and
  /// `step.step`, if a pointer) are read on the device when the kernel runs. When
  /// `step.advance` is set (device memory), a one-thread kernel adds 1 to it first, in stream
  /// order, so a replayed graph counts its own steps.
  ///
  /// A rule with reduction passes (clip_by_global_norm, LAMB, LARS, skip_if_nonfinite, ...)
  /// enqueues, per pass, a pass kernel (one partial per chunk into the plan's workspace) and a
  /// finalize kernel (per-tensor rows and totals), then the update kernel, whose prepare(step,
  /// reduced) runs on the device with the results; after-step hooks run in a one-thread kernel
  /// after the update (a rule that declares `updates = false`, norm_of, has no update kernel).
  /// Still no allocation, copy or synchronisation: the whole step is
  /// capturable, and results are the same bits every run (docs/cuda.md, "Reduction passes").
  /// The workspace belongs to the plan: do not run one plan on two streams at once.
  /// @throws fusedopt::error if the rule's options need a slot that is not bound, the step
  /// is a value below 1 (steps are 1-based; a step read from device memory is not checked)
  /// or the rule needs more accumulators than `options::reduction_capacity` (before anything
  /// is enqueued), the current device is not the plan's, the rule is too large for a by-value
  /// table, or a launch fails.
  template <class Rule>
  void run(Rule const& rule, step_info const& step = {}, cudaStream_t stream = nullptr) const;

  /// @brief True when `lists` have this plan's geometry (tensor count, sizes, alignment classes
  /// and element alignment), so that `rebind(lists)` can take them. Host work only.
  [[nodiscard]] bool can_rebind(lists_type const& lists) const;

  /// @brief Points the plan at `lists`, the same geometry at new addresses (validated by
  /// `fusedopt::bind` like any lists). Host work is O(tensors) with no allocation and no
  /// synchronisation. With device tables, when an address changed, one cudaMemcpyAsync on
  /// `stream` uploads the new address table from a pinned staging buffer (the host waits
  /// only when it runs four rebinds ahead of `stream`) into the least recently used of the
  /// plan's `options::address_tables` device copies, or, when one of them holds these
  /// addresses already, the plan switches to it and enqueues nothing; by-value tables are
  /// updated on the host. Runs enqueued on `stream` afterwards update the new tensors; runs enqueued before
  /// it still update the old ones. Lists at the addresses already bound cost a comparison and
  /// enqueue nothing. While `stream` is being captured (torch's CUDA-graph recipe captures a
  /// step whose gradients were just allocated), a device table is written by launches that
  /// carry the addresses in their parameters instead, so each replay writes the captured
  /// addresses before the step reads them (into a copy the graph keeps: later rebinds leave it
  /// alone while another copy is free); the next `run` outside a capture publishes the
  /// addresses again (a switch or an upload) before it launches.
  /// @throws fusedopt::error, leaving the plan unchanged, if the geometry differs (the message
  /// names the first tensor and what differs: make a new plan), a slot's memory is pageable
  /// host memory, or a CUDA call fails.
  void rebind(lists_type const& lists, cudaStream_t stream = nullptr);

  /// @brief Pointer to the elements of slot `Slot` as bound (const for a read-only slot).
  template <class Slot>
  using slot_pointer_t = typename lists_type::template element_t<::fusedopt::detail::bound_position_v<lists_type, Slot>>*;

  /// @brief Points one slot the rule only reads (bound const, such as the gradients) at
  /// `addresses`, one per tensor, sizes unchanged: what a loop with new gradient buffers every
  /// step needs (PyTorch's `zero_grad(set_to_none=True)`, a caching allocator). Each changed
  /// address is checked as `fusedopt::bind` checks it (null, element alignment, overlap with
  /// any tensor the rule writes, looked up in memory sorted when the plan was made) and for
  /// the plan's alignment class; pageable memory as in `rebind(lists)`. Host work is
  /// O(k log n) for k changed addresses of n tensors, with no allocation and no list to
  /// bind; the table is then written as `rebind(lists)` writes it (one upload, or launches
  /// under capture). Addresses the plan was bound to recently (one of its
  /// `options::address_tables` device copies holds them, and the tensors the rule writes have
  /// not moved since) passed those checks then: outside capture they cost a comparison with
  /// each copy and a switch, with nothing enqueued. A slot the rule writes moves with
  /// `rebind(lists)`.
  /// @throws fusedopt::error, leaving the plan unchanged, if `count` is not the number of
  /// tensors, an address fails a check (another alignment class: make a new plan), or a CUDA
  /// call fails.
  template <class Slot>
  void rebind(Slot slot, slot_pointer_t<Slot> const* addresses, std::size_t count, cudaStream_t stream = nullptr);

  /// @brief Kernel launches per `run` of a rule without reduction passes or after-step hooks
  /// (0 when every tensor is empty).
  [[nodiscard]] std::size_t launches_per_run() const;

  /// @brief Kernel launches per `run(rule)`: the update's (none for a rule that declares
  /// `updates = false`), plus two per reduction pass (pass and finalize; a pass over by-value
  /// tables takes one pass launch per table), plus one for after-step hooks and one for
  /// `step_info::advance` when `with_advance`.
  template <class Rule>
  [[nodiscard]] std::size_t launches_per_run(Rule const& rule, bool with_advance = false) const;
  /// @brief Uploads of the address table so far, the plan's construction included (device
  /// tables; 0 for by-value tables): a rebind to addresses one of the plan's
  /// `options::address_tables` copies holds costs none.
  [[nodiscard]] std::uint64_t table_uploads() const { return tables_.uploads(); }
  /// @brief The lists the plan was built from.
  [[nodiscard]] lists_type const& lists() const { return lists_; }
  /// @brief The transport in use (never `automatic`).
  [[nodiscard]] transport metadata() const { return transport_; }
  /// @brief True when the update of a rule without 8-bit or factored states reads no chunk
  /// table: a plan of one non-empty tensor on device tables, without a requested chunk length
  /// or block cap, whose blocks compute their chunks (docs/cuda.md, "One tensor").
  [[nodiscard]] bool update_computes_chunks() const { return one_tensor_.num_chunks > 0; }

 private:
  friend struct detail::plan_steps;
  struct device_free {
    void operator()(void* p) const noexcept;
  };

  lists_type lists_;
  transport transport_ = transport::device_table;
  int device_ = 0;
  bool programmatic_ = false;  // launches with programmatic dependent launch (options::dependent_launch)
  std::int64_t max_blocks_ = 0;
  std::int64_t elements_ = 0;  // of every tensor: what a storing factored pass's table must cover
  detail::persistent_grid persistent_;  // the update's shape; the grid of updates that store quantized states
  template <class Rule, int P, int... J>
  void run_passes(Rule const& rule, step_info const& step, detail::pass_results<P> const& results,
                  cudaStream_t stream, std::integer_sequence<int, J...>) const;

  // Calls f(table) for every launch table of the transport in use, in chunk order: each
  // by-value table, or the device table (when it has chunks). Every launch and every table
  // rewrite of the plan goes through it.
  template <class F>
  void for_each_table(F&& f) const;
  template <class F>
  void for_each_table(F&& f);
  template <class Self, class F>
  static void visit_tables(Self& self, F&& f);

  // Empty when `lists` fit, else why not (the first difference found).
  [[nodiscard]] std::string geometry_mismatch(lists_type const& lists) const;

  // After tensors_ got new bases: the by-value tables rebased, or the device table written.
  void publish_bases(cudaStream_t stream);

  // The memory of every tensor the rule writes, sorted: rebind(slot, addresses) checks against it.
  ::fusedopt::detail::written_memory written_;

  std::unique_ptr<void, device_free> memory_;  // device tables: the chunk entries
  std::unique_ptr<void, device_free> queue_memory_;  // lists with quantized states: the update's work queue
  // The tensor entries of every non-empty tensor, as the host last published or packed them.
  std::vector<detail::tensor_entry<num_slots>> tensors_;
  std::vector<detail::tensor_entry<num_slots>> candidate_;  // rebind(slot, ...)'s entries before they are taken
  // Device tables: the copies of tensors_ on the device. Mutable: a run after a rebind under
  // stream capture publishes tensors_ again first (that copy holds them only when the graph
  // replays).
  mutable detail::address_tables<detail::tensor_entry<num_slots>> tables_;
  // Reduction workspace: pass results, chunk partials, the chunk range of each row.
  detail::reduction_workspace workspace_;
  detail::global_table<num_slots> global_{};
  // A plan of one tensor: the update's table without chunk entries (one_tensor_table; the
  // address table's current copy set at each launch); num_chunks 0 where not used.
  detail::global_table<num_slots> one_tensor_{};
  std::vector<detail::table_4k<num_slots>> tables_4k_;
  std::vector<detail::table_32k<num_slots>> tables_32k_;
};

/// @brief A plan with the default tuning policy: what make_plan returns.
template <class... B>
using plan = basic_plan<detail::default_policy, B...>;

/// @brief Makes a plan over `lists` (see basic_plan), with the default tuning policy unless
/// another is named (`make_plan<my_policy>(lists)`).
template <class Policy = detail::default_policy, class... B>
[[nodiscard]] basic_plan<Policy, B...> make_plan(bound_lists<B...> lists, options opts = {},
                                                 cudaStream_t stream = nullptr);

/// @brief One-shot: enqueues one step of `rule` over `lists` on `stream`, carrying the launch
/// tables by value (32 KB where available, else 4 KB; as many launches as the lists need), so
/// it allocates no device memory and never synchronises. Keep a plan for repeated steps: it
/// does the host-side planning once and launches once. Rules with reduction passes need a
/// workspace for their results and are rejected at compile time (make a plan); after-step
/// hooks of rules without passes (grad_scaler_update) run.
/// @throws fusedopt::error on invalid rule options or a step value below 1 (before anything
/// is enqueued), misaligned
/// or pageable pointers, `transport::device_table` (apply has no tables to own), a transport
/// that is not available, or a failed launch.
/// @tparam Policy the tuning policy (see basic_plan).
template <class Policy = detail::default_policy, class Rule, class... B>
void apply(Rule const& rule, bound_lists<B...> const& lists, step_info const& step = {}, options opts = {},
           cudaStream_t stream = nullptr);

}  // namespace cuda
FUSEDOPT_NAMESPACE_END

#include "detail/backend.inl"
