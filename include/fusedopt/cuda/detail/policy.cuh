/// @file cuda/detail/policy.cuh
/// @brief The tuning policy of the CUDA backend: one constexpr struct that the host (when it
/// cuts tensors into chunks and sizes the grid) and the kernels (block size, unrolling) both
/// read, so they cannot disagree (CUB's tuning_*.cuh idea). The facade (cuda::basic_plan,
/// cuda::apply) takes it as a template parameter and passes it down to every launch, so a
/// policy chosen per compute capability (a selector, as CUB's policy hubs) or a variant under
/// test (scripts/gpu-throughput.cu) reaches host and kernels alike. Values and the
/// measurements behind them are in docs/tuning.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../config.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// @brief How an update that stores 8-bit quantized states runs (agent.cuh's
/// process_quantized): a persistent grid of `blocks_per_sm` blocks on every SM (fewer where an
/// SM's shared memory holds fewer: each block copies the quantization maps, up to 37 KB, into
/// it once; the kernel's launch bounds hold its registers to what lets this many fit), and
/// whether a warp issues the loads of its next block before it computes the current one (the
/// memory latency hidden behind a block's arithmetic, for the registers of one block's loads).
struct quantized_shape {
  int blocks_per_sm;
  bool lookahead;
  int lookahead_blocks = 1;  ///< with the lookahead: blocks whose loads are in flight (1 or 2)
  /// Without the lookahead: the warp's next block of the same chunk is copied into shared
  /// memory (`cp.async`) while it computes the current one.
  bool staged_next = false;
  /// With the lookahead: a tensor's last, partial block is fetched ahead and computed in the
  /// lanes' layout like a whole one (its lanes taking only the elements inside the tensor),
  /// rather than element by element when it starts.
  bool tails_in_lanes = false;
  /// Units of work (one of a chunk's slots for a warp: process_quantized) a warp takes from
  /// the plan's work queue with one request, but for the last stretch of the launch, whose
  /// units it takes one at a time; 0: no queue, the units dealt round-robin (as cuda::apply,
  /// which has no device memory for one, always does).
  int units_per_ticket = 1;
};
constexpr bool operator==(quantized_shape const& a, quantized_shape const& b)
{
  return a.blocks_per_sm == b.blocks_per_sm && a.lookahead == b.lookahead && a.lookahead_blocks == b.lookahead_blocks &&
         a.staged_next == b.staged_next && a.tails_in_lanes == b.tails_in_lanes && a.units_per_ticket == b.units_per_ticket;
}

/// @brief The shape of an update that stores no quantized state: threads per block, and the
/// bytes of its widest slot a thread loads per iteration before it computes (vectors per
/// thread = bytes_per_slot / (vector width x widest element size), at least one).
struct plain_shape {
  int block_threads;
  int bytes_per_slot;
};
constexpr bool operator==(plain_shape const& a, plain_shape const& b)
{
  return a.block_threads == b.block_threads && a.bytes_per_slot == b.bytes_per_slot;
}

/// Policy::plain_fast_min_blocks_per_sm, or min_blocks_per_sm for a policy without it (a
/// policy of one's own written before it).
template <class Policy, class = void>
inline constexpr int plain_fast_min_blocks_v = Policy::min_blocks_per_sm;
template <class Policy>
inline constexpr int plain_fast_min_blocks_v<Policy, std::void_t<decltype(Policy::plain_fast_min_blocks_per_sm)>> =
  Policy::plain_fast_min_blocks_per_sm;

/// @brief The default policy, measured on the H100 (sm_90). Not part of the stable API:
/// benchmarks override the run-time values through `cuda::options`; a policy of one's own is
/// a struct with the same members.
struct default_policy {
  /// Threads per block.
  static constexpr int block_threads = 128;
  /// Bytes of its widest slot a thread loads per iteration, before it computes: the
  /// unrolling that keeps several independent 16-byte loads per slot in flight. Vectors per
  /// thread = bytes_per_slot / (vector width x widest element size), at least one: 4 for
  /// fp32 Adam, 2 for bf16 params with fp32 states, 1 for double states next to bf16.
  static constexpr int bytes_per_slot = 64;
  /// The shape of an update that stores no quantized state on fast memory (memory_speed,
  /// fast_memory_bytes_per_sm_cycle: the H200), for a launch whose tensors average at least
  /// `fast_memory_min_chunks_per_tensor` chunks: one vector a thread (16 bytes of the binding's
  /// narrowest slot, `vector_elements` elements) and a block iteration of 1024 elements: 256
  /// threads for fp32 (Adam fp32: 4 vectors a thread in the default shape), 128 where a slot is
  /// 16-bit (AdamW over bf16 parameters: 2), each block taking its chunk of 2048 in two
  /// iterations. On H200s Adam fp32 ran W2 / W4 at 96.7-97.0 / 96.1-96.5% of the copy in the
  /// default shape, 97.8-97.9 / 98.3% with 128 threads of two vectors (stop 36's fast shape)
  /// and 99.4-99.6 / 99.8-100.0% in this one; AdamW over bf16 at 95.5-95.7 / 96.2-96.4%, and
  /// 97.5-97.9 / 97.6-97.9% in this one. On W3 (2000 tensors of 256 to 65536 elements, 5.8
  /// chunks each) shapes of fewer bytes a thread lost 6-13 points on both GPUs, and on the H100
  /// 1-2 points on W2 and W4 (docs/tuning.md, "The plain update's shape by memory speed" and
  /// "The fast shape's block size"). Where both shapes are the same kernel (bf16 beside double
  /// states: one vector of 128 threads either way), one kernel is compiled.
  static constexpr plain_shape plain_fast_update(int vector_elements) { return {1024 / vector_elements, 16}; }
  static constexpr std::int64_t fast_memory_min_chunks_per_tensor = 32;
  /// Bytes a lane of a reduction pass (a warp per chunk) loads per iteration, over all the
  /// slots the pass reads: vectors per lane = pass_bytes_per_lane / (vector width x the
  /// bytes of one element of each of them), at least one. Measured on the H100 (docs/tuning.md,
  /// "Reduction passes"): 64 is best for a clip over bf16 gradients and within 1% of 128 for
  /// LAMB's pass over four fp32 slots; 256 (bytes_per_slot's unrolling) took LAMB's pass to
  /// 201 registers and LAMB's step 3-4% more time.
  static constexpr int pass_bytes_per_lane = 64;
  /// Loads and stores of the tensors' data carry an L2 eviction policy (evict_first_below_bytes
  /// chooses it per launch): every byte is touched once per step.
  static constexpr bool streaming_loads = true;
  static constexpr bool streaming_stores = true;
  /// Launches whose tensors take fewer bytes than this (every bound slot of every tensor) but
  /// more than the device's L2 stream with L2 evict-first, the others with evict-normal (sm_80
  /// and newer; before, the .cs hint throughout). Measured on H100s (docs/tuning.md, "L2 eviction"): evict-first wins
  /// on W1 and W3 (168 and 378 MB; AdamW bf16 by 2-3.5 points), evict-normal on W2 and W4
  /// (2.0 and 4.3 GB; Adam fp32 by 1-4 points) and on single tensors from 0.5 GB.
  static constexpr std::int64_t evict_first_below_bytes = std::int64_t{1} << 29;
  /// Second argument of __launch_bounds__: blocks per SM the register allocation must allow.
  static constexpr int min_blocks_per_sm = 1;
  /// The same for the fast shape's update (plain_fast_update) where every slot is 4 bytes
  /// (float: vectors of four, blocks of 256 threads): 3 blocks hold ptxas to 80 registers a
  /// thread. Without the bound, rules of many slots or much
  /// per-step arithmetic took what they liked and ran 2 blocks per SM (Adan: 82 registers,
  /// ADOPT: 66, its allocation of 72 one step over 4 blocks' 64): on an H200 Adan ran W2 / W4 at
  /// 90.0 / 90.8% of the copy and 97.3 / 98.5% with the bound, ADOPT 92.5 / 93.7% and 97.6 /
  /// 99.0%, AdamW (56 registers) unchanged; 4 blocks was no better (docs/tuning.md, "The fast
  /// shape's launch bounds"). Other bindings keep min_blocks_per_sm (kernels.cuh,
  /// update_min_blocks: double slots spilled under it).
  static constexpr int plain_fast_min_blocks_per_sm = 3;
  /// Elements of one tensor a block updates per chunk (a multiple of every vector width).
  static constexpr std::int64_t chunk_elements = 2048;
  /// Threads of a finalize block, which folds the chunk partials of one row of the bound
  /// lists: `finalize_threads`, or `finalize_threads_wide` when the plan's longest row has
  /// more than `finalize_wide_after` chunks. GPT-2's embedding (19 000 chunks) took 28-35 us
  /// with 128 threads on the H100 and 11-13 us with 512; 2000 short rows (W3) lost 3-9 us
  /// with 512, launching four times the threads for rows of a few chunks.
  static constexpr int finalize_threads = 128;
  static constexpr int finalize_threads_wide = 512;
  static constexpr std::int64_t finalize_wide_after = 1024;
  /// Cap on blocks per launch; 0 launches one block per chunk (a reduction pass: one per
  /// block_threads / 32 chunks, a warp each) and lets the hardware block scheduler balance
  /// chunks of unequal size. A positive cap makes blocks loop over chunks.
  static constexpr std::int64_t max_blocks = 0;
  /// The shape of an update that stores 8-bit quantized states, by the element size of its
  /// widest slot that is not quantized (parameters, gradients: 4 for fp32, 2 for bf16) and by
  /// whether the device's memory is fast beside its SMs (more DRAM bytes per SM cycle than
  /// fast_memory_bytes_per_sm_cycle): fp32 with two blocks of lookahead at 3 blocks per SM on
  /// slow memory (the H100: the update waits on memory), one block at 4 per SM on fast memory
  /// (the H200: it waits on instruction issue); 16-bit without the lookahead in registers at 5
  /// per SM on both, the warp's next block of the same chunk staged in shared memory on slow
  /// memory only (2-3% faster on the H100, 1-2% slower on the H200, whose update waits on
  /// issue: docs/quantized_states.md, "The lookahead" and "The 16-bit shape's next block", and
  /// docs/tuning.md, "Quantized updates by memory speed"). A tensor's last, partial block is
  /// computed in the lanes' layout on fast memory only (W3 fp32 138.7 -> 115.0 us on an H200; on
  /// the H100's two-block loop it gained W3 as much but cost W2 and W4 0.4%:
  /// docs/quantized_states.md, "Partial blocks"). A plan's warps take their units from its work
  /// queue, one a request for fp32 parameters on slow memory (dealt round-robin, the first and
  /// the last warp of some H100s finished 7% of the step apart), eight for 16-bit parameters
  /// (one a request capped them at the rate the queue's counter serves); fp32 on fast memory
  /// keeps the round-robin deal, which the queue did not beat on the H200
  /// (docs/quantized_states.md, "Work from a queue"). Where the two speeds get one shape, one
  /// kernel is compiled. Only policies used with quantized states need these members.
  static constexpr quantized_shape quantized_update(std::size_t widest_plain_bytes, bool fast_memory)
  {
    if (widest_plain_bytes < 4) {
      return fast_memory ? quantized_shape{5, false, 1, false, false, 8} : quantized_shape{5, false, 1, true, false, 8};
    }
    return fast_memory ? quantized_shape{4, true, 1, false, true, 0} : quantized_shape{3, true, 2, false, false, 1};
  }
  /// DRAM bytes per SM cycle (peak, from the device's attributes) above which memory is fast:
  /// the H100 SXM has 12.8 (3.35 TB/s, 132 SMs at 1.98 GHz), the H200 18.4.
  static constexpr double fast_memory_bytes_per_sm_cycle = 16.0;
};

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
