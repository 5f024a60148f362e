/// @file cuda/detail/kernels.cuh
/// @brief The `__global__` entry points of the CUDA backend. A step of a rule is: per reduction
/// pass, reduce_kernel (the chunk worker accumulating, one partial per chunk) and
/// finalize_kernel (chunk partials to per-tensor rows to totals); then multi_tensor_kernel
/// (the chunk worker updating, with the passes' results); then, where the rule has after-step
/// hooks, after_step_kernel. Every combine happens in an order fixed by the plan (never by
/// timing), so a step gives the same bits every run, with every transport and grid size.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include <cstddef>
#include <cstdint>

#include "../../config.hpp"
#include "../../detail/access.hpp"
#include "../../detail/phases.hpp"
#include "../../reduce.hpp"
#include "../../rule.hpp"
#include "../../scalar.hpp"
#include "agent.cuh"
#include "tables.cuh"

#if defined(__GNUC__) || defined(__clang__)
/// Kernels of a header-only library get hidden visibility, so two shared libraries built from
/// different versions of fusedopt never share (and mix up) their instantiations (as CUB does).
#  define FUSEDOPT_KERNEL __global__ __attribute__((visibility("hidden")))
#else
#  define FUSEDOPT_KERNEL __global__
#endif

#if defined(__CUDACC__) && (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))
// The table stays in parameter space and is indexed there; without it a kernel that indexes
// a by-value array with a run-time index may copy the whole table to local memory.
#  define FUSEDOPT_GRID_CONSTANT __grid_constant__
#else
#  define FUSEDOPT_GRID_CONSTANT
#endif

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Programmatic dependent launch (launch_kernel; sm_90 and newer, a no-op before): a kernel
/// launched with it may be running while the kernel before it in the stream finishes, so it
/// waits here, before it reads anything an earlier kernel may have written (tensors, device
/// scalars, reduction results, counters), until that kernel has completed and its memory is
/// visible; then it lets the next such launch be scheduled, whose blocks take SMs as this
/// kernel's blocks leave them. Only device memory that no kernel writes (the quantization maps)
/// is read before it.
__device__ __forceinline__ void await_predecessor()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/// Folds two accumulator sets with the reduction's operations (the operator of the warp fold and
/// of the finalize's block trees).
template <class Reduction>
struct combine_all {
  template <class T, int N>
  __device__ __forceinline__ accumulator<T, N> operator()(accumulator<T, N> const& a, accumulator<T, N> const& b) const
  {
    accumulator<T, N> out;
#pragma unroll
    for (int k = 0; k < N; ++k) { out[k] = Reduction::combine(k, a[k], b[k]); }
    return out;
  }
};

template <class Reduction, class T>
__device__ __forceinline__ accumulator<T, Reduction::size> identities()
{
  accumulator<T, Reduction::size> a;
#pragma unroll
  for (int k = 0; k < Reduction::size; ++k) { a[k] = Reduction::template identity<T>(k); }
  return a;
}

/// Folds items tid, tid + Threads, tid + 2 Threads, ... (< count) of a strided sequence into
/// `a`, in that order, with `Batch` loads in flight before they are folded: the order (and so
/// the bits) of a plain loop, without one memory latency per item. `load(i)` gives item i.
template <int Threads, int Batch, class Reduction, class Load>
__device__ __forceinline__ accumulator<double, Reduction::size> fold_strided(accumulator<double, Reduction::size> a,
                                                                            std::int64_t count, Load const& load)
{
  using acc_t = accumulator<double, Reduction::size>;
  combine_all<Reduction> const op{};
  std::int64_t i = threadIdx.x;
  for (; i + (Batch - 1) * std::int64_t{Threads} < count; i += Batch * std::int64_t{Threads}) {
    acc_t b[Batch];
#pragma unroll
    for (int u = 0; u < Batch; ++u) { b[u] = load(i + u * std::int64_t{Threads}); }
#pragma unroll
    for (int u = 0; u < Batch; ++u) { a = op(a, b[u]); }
  }
  for (; i < count; i += Threads) { a = op(a, load(i)); }
  return a;
}

// A kernel instantiated for a rule of internal linkage (a rule in an anonymous namespace, a
// lambda's type) has internal linkage itself, and nvcc warns that it cannot be hidden; hidden
// visibility only matters for kernels other libraries could also instantiate, so the warning
// says nothing useful there.
#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic push
#  pragma nv_diag_suppress 1407
#endif

/// Blocks per SM the update kernel's registers must allow: the persistent grid of a rule that
/// stores quantized states counts on its shape's blocks per SM fitting at once
/// (Policy::quantized_update; a policy needs it only for such rules); the fast shape's over
/// 4-byte slots alone (plain_fast_min_blocks_per_sm) keeps enough warps on an SM to hide
/// memory's latency. Not where a slot is 8 bytes (double), whose vectors take twice the
/// registers (or, all double, blocks of 512 threads: three would leave 40 registers a thread,
/// and they spilled), nor 16-bit, whose 128-thread blocks it does not hold back.
template <class Policy, class Rule, class Bound, bool FastMemory>
constexpr int update_min_blocks()
{
  if constexpr (::fusedopt::detail::access<Rule, Bound>::stores_quantized) {
    return quantized_blocks_per_sm_v<Policy, ::fusedopt::detail::access<Rule, Bound>, FastMemory>;
  } else if constexpr (FastMemory && vector_width<Bound>::value == 4 && vector_width<Bound>::widest == 4) {
    return plain_fast_min_blocks_v<Policy>;
  } else {
    return Policy::min_blocks_per_sm;
  }
}

/// Threads per block of the update kernel: the shape's (plain_shape_v) where the rule stores no
/// quantized state, else the policy's block_threads.
template <class Policy, class Rule, class Bound, bool FastMemory>
inline constexpr int update_threads_v = ::fusedopt::detail::access<Rule, Bound>::stores_quantized
                                          ? Policy::block_threads
                                          : plain_shape_v<Policy, vector_width<Bound>::value, FastMemory>.block_threads;

/// The update: `rule` prepared once per thread for `step` with the results of its P reduction
/// passes (prepare_final: device scalars and the results are read here, so a captured launch
/// picks up new values; without passes it is the rule's own prepare; once the block's first
/// chunk's loads are issued, process_first_chunk), then each block takes chunks `blockIdx.x`,
/// `blockIdx.x + gridDim.x`, ... of `table` (a warp per block of quantized states where the
/// rule stores some: process_quantized, with the maps in shared memory). `FastMemory`: the
/// policy's shape for fast memory (plain_fast_update; quantized_update's), chosen per
/// launch by launch_update.
template <class Policy, class Rule, class Bound, class Table, int P, bool FastMemory = false>
FUSEDOPT_KERNEL void __launch_bounds__((update_threads_v<Policy, Rule, Bound, FastMemory>),
                                       (update_min_blocks<Policy, Rule, Bound, FastMemory>()))
  multi_tensor_kernel(Rule const rule, step_info const step, FUSEDOPT_GRID_CONSTANT Table const table,
                      FUSEDOPT_GRID_CONSTANT pass_results<P> const results,
                      queue_param<::fusedopt::detail::access<Rule, Bound>::stores_quantized> const work)
{
  using access = ::fusedopt::detail::access<Rule, Bound>;
  constexpr int width = vector_width<Bound>::value;
  constexpr std::size_t widest = vector_width<Bound>::widest;
  std::uint64_t const cache_policy = make_cache_policy(table.evict_first != 0);
  // Where the rule stores quantized states, a persistent grid (launch_update): each block
  // copies the maps once for many chunks, while the kernel before it may still run (no kernel
  // writes them); without quantized states `maps` is empty.
  __shared__ block_maps<access> maps;
  auto const prepare = [&] { return ::fusedopt::detail::prepare_final(rule, step, results.data()); };
  if constexpr (access::stores_quantized) {
    maps.fill();
    await_predecessor();
    auto const body = prepare();
    __syncthreads();
    process_quantized<Policy, access, FastMemory>(body, table, maps, work.queue);
  } else {
    (void)work;
    // The block's first chunk and its tensor's addresses are read before the wait: no kernel
    // writes a table but write_table_piece, which write_table_by_value follows with an ordinary
    // launch (table_written). Blocks of a dependent launch that take SMs while the kernel before
    // finishes then start with their first loads when it ends, not with two dependent reads.
    if (blockIdx.x >= table.num_chunks) { return; }
    chunk_entry const first = table.first_chunk(blockIdx.x);
    tensor_entry<Bound::num_slots> const first_tensor = table.tensor(first.tensor);
    await_predecessor();
    constexpr int unroll = vectors_per_thread<Policy, width, widest, FastMemory>;
    constexpr int threads = update_threads_v<Policy, Rule, Bound, FastMemory>;
    // threadIdx.x is read where it is used, not held in a variable: held, its products stayed
    // live across the chunk loop (AdamW over bf16 in one vector a slot: 64 -> 70 registers).
    auto const one_chunk = [&](auto const& body, tensor_entry<Bound::num_slots> const& tensor, chunk_entry const& chunk) {
      process_chunk<Policy, access, width, unroll, threads>(
        ::fusedopt::detail::body_for_tensor(body, tensor.index), tensor, chunk.begin, chunk.count, cache_policy,
        static_cast<int>(threadIdx.x));
    };
    if constexpr (P == 0 && unroll > 1) {
      // The rule's prepare runs behind the first chunk's loads (process_first_chunk).
      auto const body = process_first_chunk<Policy, access, width, unroll, threads>(
        prepare, first_tensor, first.begin, first.count, cache_policy, static_cast<int>(threadIdx.x));
      for (std::int64_t c = std::int64_t{blockIdx.x} + gridDim.x; c < table.num_chunks; c += gridDim.x) {
        chunk_entry const chunk = table.chunk(c);
        one_chunk(body, table.tensor(chunk.tensor), chunk);
      }
    } else {
      // A rule with reduction passes prepares first: its prepare reads the passes' results and
      // holds more state, and behind the loads it took clip + AdamW over bf16 from 102 to 136
      // registers (three blocks per SM where five fit) and 2-5% more time. So does a shape of
      // one vector a slot: a thread's prepare is then most of its work, and behind the loads
      // it took Adam in t256 b16 from 64 to 88 registers and the H200's W1 from 92.8 to 75.1%.
      // One loop from the first chunk (a first call apart cost Adam in t256 b16 10 registers).
      auto const body = prepare();
      chunk_entry chunk = first;
      tensor_entry<Bound::num_slots> tensor = first_tensor;
      for (std::int64_t c = blockIdx.x;;) {
        one_chunk(body, tensor, chunk);
        c += gridDim.x;
        if (c >= table.num_chunks) { break; }
        chunk = table.chunk(c);
        tensor = table.tensor(chunk.tensor);
      }
    }
  }
}

/// The fold of a warp's accumulators (lane 0 gets the result): a fixed tree of shuffles, so a
/// chunk's partial has the same bits whichever warp, block or grid computes it.
template <class Reduction>
__device__ __forceinline__ accumulator<double, Reduction::size> warp_fold(accumulator<double, Reduction::size> a)
{
  constexpr unsigned all_lanes = 0xffffffffu;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    accumulator<double, Reduction::size> other;
#pragma unroll
    for (int k = 0; k < Reduction::size; ++k) { other[k] = __shfl_down_sync(all_lanes, a[k], offset); }
    a = combine_all<Reduction>{}(a, other);
  }
  return a;
}

/// Reduction pass J of `Rule`: each warp takes chunks (warp w of block b: chunks b * warps + w,
/// then gridDim.x * warps further on), its lanes accumulate their elements in the rule's
/// arithmetic type (what the rule's accumulating body is written for), the warp folds them in
/// double (warp_fold), and lane 0 writes the chunk's partial to `partials[(chunk_base + c) * N
/// + k]`. A warp per chunk, not the block: a pass reads few bytes per element (2 for a clip
/// over bf16 gradients), and a block-wide tree per chunk (two barriers) cost as much as the
/// reads (docs/decisions.md, "Reduction passes: a warp per chunk"). A lane whose float sum came
/// out non-finite accumulates its elements again in double. Nothing is stored to any tensor.
template <class Policy, class Rule, class Bound, class Table, int J, int P>
FUSEDOPT_KERNEL void __launch_bounds__(Policy::block_threads, Policy::min_blocks_per_sm)
  reduce_kernel(Rule const rule, step_info const step, FUSEDOPT_GRID_CONSTANT Table const table,
                FUSEDOPT_GRID_CONSTANT pass_results<P> const results, double* partials, std::int64_t chunk_base)
{
  using access = ::fusedopt::detail::access<Rule, Bound>;
  using traits = ::fusedopt::detail::pass_traits<Rule, J>;
  using reduction = typename traits::reduction;
  using paccess = pass_access<access, typename traits::reads>;
  using value_type = typename access::value_type;
  constexpr int n = reduction::size;
  constexpr int width = vector_width<Bound>::value;
  // Vectors per lane by the bytes of the slots the pass reads, not the plan's widest slot.
  constexpr int unroll = pass_vectors_per_lane<Policy, paccess, width>;
  constexpr int lanes = 32;
  static_assert(Policy::block_threads % lanes == 0, "a block of the CUDA backend is whole warps");
  constexpr int warps = Policy::block_threads / lanes;
  int const lane = static_cast<int>(threadIdx.x) % lanes;
  int const warp = static_cast<int>(threadIdx.x) / lanes;

  await_predecessor();
  auto const body = ::fusedopt::detail::prepare_pass<J>(rule, step, results.data());
  std::uint64_t const cache_policy = make_cache_policy(table.evict_first != 0);
  for (std::int64_t c = std::int64_t{blockIdx.x} * warps + warp; c < table.num_chunks;
       c += std::int64_t{gridDim.x} * warps) {
    chunk_entry const chunk = table.chunk(c);
    tensor_entry<Bound::num_slots> const tensor = table.tensor(chunk.tensor);
    auto acc = identities<reduction, value_type>();
    process_chunk<Policy, paccess, width, unroll, lanes>(::fusedopt::detail::body_for_tensor(body, tensor.index),
                                                         tensor, chunk.begin, chunk.count, cache_policy, lane, acc);
    accumulator<double, n> wide;
#pragma unroll
    for (int k = 0; k < n; ++k) { wide[k] = static_cast<double>(acc[k]); }
    if constexpr (::fusedopt::detail::widens_overflowing_sums_v<reduction, value_type>) {
      // A float sum that came out non-finite is accumulated again in double (as the host
      // backend does for a chunk; ::fusedopt::detail::sums_finite): one test per lane and
      // chunk, and no FP64 work unless a sum overflowed or an input is not finite.
      if (!::fusedopt::detail::sums_finite<reduction>(acc)) {
        wide = identities<reduction, double>();
        // One vector a lane: a lane's vectors come in the same order with any unrolling (the
        // bits of the sums), and this rare path then holds fewer loads in registers.
        process_chunk<Policy, paccess, width, 1, lanes>(::fusedopt::detail::body_for_tensor(body, tensor.index), tensor,
                                                        chunk.begin, chunk.count, cache_policy, lane, wide);
      }
    }
    accumulator<double, n> const total = warp_fold<reduction>(wide);
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < n; ++k) { partials[(chunk_base + c) * n + k] = total[k]; }
    }
  }
}

/// The finalize of a pass whose owner finishes nothing per tensor.
struct no_finish {
  __device__ void operator()(std::int64_t, double const*) const {}
};

/// Pass J's finish (reduce.hpp, prepare_finish): a row's finished values from its results,
/// once per tensor and step, where every thread of every chunk of the update would otherwise
/// derive them. The rule is prepared in the kernel: device scalars are read when it runs.
template <class Rule, int J>
struct finish_pass {
  static constexpr int size = ::fusedopt::detail::pass_traits<Rule, J>::finished_size;
  Rule rule;
  step_info step;
  double* finished;  ///< [row * size + k]
  __device__ void operator()(std::int64_t row, double const* sums) const
  {
    ::fusedopt::detail::prepare_finish<J>(rule, step)(row, sums, finished + row * size);
  }
};

/// Combines one pass's chunk partials: block `row` folds the chunks of row `row` of the bound
/// lists (thread i takes chunks i, i + Threads, ... in order, fold_strided; then a fixed block
/// tree) into `per_tensor[row * N + k]` (the identity for an empty tensor), and `finish`es the
/// row; the last block to finish (a counter in the workspace, which it resets, so graph replays
/// find it at 0) folds the rows the same way into `all[k]`. Launched with max(rows, 1) blocks
/// of Threads.
template <int Threads, class Reduction, class Finish>
FUSEDOPT_KERNEL void __launch_bounds__(Threads)
  finalize_kernel(double const* partials, chunk_range const* ranges, std::int64_t rows, double* per_tensor, double* all,
                  unsigned int* counter, Finish const finish)
{
  constexpr int n = Reduction::size;
  constexpr int threads = Threads;
  using acc_t = accumulator<double, n>;
  using block_reduce = cub::BlockReduce<acc_t, threads>;
  __shared__ typename block_reduce::TempStorage temp;
  __shared__ bool last;
  combine_all<Reduction> const op{};

  // 8 loads in flight per thread: GPT-2's embedding alone has 19 000 chunk partials.
  constexpr int batch = 8;
  await_predecessor();
  std::int64_t const row = blockIdx.x;
  if (row < rows) {
    chunk_range const range = ranges[row];
    acc_t const a = fold_strided<threads, batch, Reduction>(identities<Reduction, double>(), range.count,
                                                            [&](std::int64_t i) {
                                                              acc_t b;
#pragma unroll
                                                              for (int k = 0; k < n; ++k) {
                                                                b[k] = partials[(range.first + i) * n + k];
                                                              }
                                                              return b;
                                                            });
    acc_t const total = block_reduce(temp).Reduce(a, op);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int k = 0; k < n; ++k) { per_tensor[row * n + k] = total[k]; }
      finish(row, total.values);
    }
  }
  if (threadIdx.x == 0) {
    __threadfence();  // this block's row is visible device-wide before it is counted
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) { return; }
  __threadfence();
  acc_t const a = fold_strided<threads, batch, Reduction>(identities<Reduction, double>(), rows, [&](std::int64_t r) {
    acc_t b;
#pragma unroll
    for (int k = 0; k < n; ++k) { b[k] = __ldcg(per_tensor + r * n + k); }  // L2: written by other blocks
    return b;
  });
  acc_t const total = block_reduce(temp).Reduce(a, op);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < n; ++k) { all[k] = total[k]; }
    *counter = 0;
  }
}

/// The rule's after-step hooks, once, in one thread, after the update in stream order.
template <class Rule, int P>
FUSEDOPT_KERNEL void after_step_kernel(Rule const rule, step_info const step,
                                      FUSEDOPT_GRID_CONSTANT pass_results<P> const results)
{
  await_predecessor();
  ::fusedopt::detail::after_step(rule, step, results.data());
}

#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic pop
#endif

/// step_info::advance on the device: one thread adds 1 in stream order, before the step's
/// kernel reads the counter (a template only so that a header can define it in every
/// translation unit).
template <class Counter>
FUSEDOPT_KERNEL void advance_counter(Counter* counter)
{
  await_predecessor();
  *counter += 1;
}

/// Entries [first, first + count) of a device table, carried by value in kernel parameters
/// (under 4 KB with the table pointer).
template <class Entry>
struct table_piece {
  static constexpr int capacity = static_cast<int>((4000 - 2 * sizeof(std::int32_t) - sizeof(void*)) / sizeof(Entry));
  Entry entries[capacity];
  std::int32_t first;
  std::int32_t count;
};

/// Writes a table piece into the device table. A plan rebound while its stream is captured
/// writes its table this way: the graph keeps the parameters, so every replay writes the
/// captured addresses before the step's kernels read them (a copy from a host buffer would
/// replay whatever the buffer holds then).
template <class Entry>
FUSEDOPT_KERNEL void write_table_piece(Entry* table, table_piece<Entry> const piece)
{
  for (int i = static_cast<int>(threadIdx.x); i < piece.count; i += static_cast<int>(blockDim.x)) {
    table[piece.first + i] = piece.entries[i];
  }
}

/// Launched ordinarily after write_table_piece: an update kernel reads its first table entries
/// before it awaits its predecessor (multi_tensor_kernel), so the kernel right before a
/// programmatic launch must not be one that writes them. This one has completed, and so have
/// the writes before it, when any block of the next launch starts.
template <class Entry>
FUSEDOPT_KERNEL void table_written()
{
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
