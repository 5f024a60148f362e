/// @file cuda/detail/reduce.cuh
/// @brief The kernels behind reduction passes and after-step hooks on the CUDA backend:
/// the pass kernel (the update kernel's chunks and vector path, accumulating instead of
/// storing, one partial per chunk), the finalize kernel (chunk partials to per-tensor rows to
/// totals, in a fixed order), the update kernel that reads the passes' results, and the
/// one-thread after-step kernel. Every combine happens in an order fixed by the plan (never
/// by timing), so a step gives the same bits every run, with every transport and grid size.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "../../config.hpp"
#include "../../detail/access.hpp"
#include "../../detail/phases.hpp"
#include "../../reduce.hpp"
#include "../../rule.hpp"
#include "../../scalar.hpp"
#include "kernel.cuh"
#include "tables.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// The results of a rule's P passes as kernels receive them: by value (pointers into the
/// plan's workspace, known when the plan is built), at least one entry so that a rule without
/// passes still gets a valid (empty) array. Kernels take it `__grid_constant__`: the bodies
/// index it through a pointer, which would otherwise copy it to local memory.
template <int P>
struct pass_results {
  reduced r[P > 0 ? P : 1];
};

/// Where the chunk partials of one row of the bound lists are: `count` chunks from `first`
/// in the plan's chunk order (the layout's order, which every transport keeps).
struct chunk_range {
  std::int64_t first;
  std::int64_t count;
};

template <class>
inline constexpr bool never = false;

/// The access plan of a reduction pass: loads only the slots the pass reads (`Reads`), stores
/// nothing; everything else (element type, registers) is the rule's access plan.
template <class Access, class Reads, class Memory = typename Access::memory>
struct pass_access;
template <class Access, class Reads, class... S>
struct pass_access<Access, Reads, slots<S...>> : Access {
  using reads = Reads;
  static constexpr bool loads[sizeof...(S)] = {::fusedopt::detail::declares_v<Reads, S>...};
  static constexpr bool stores[sizeof...(S)] = {never<S>...};
};

/// Folds two accumulator sets with the reduction's operations (the block reduction's operator).
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

/// Loads the pass's slots for one iteration and accumulates every valid element, in a fixed
/// order (vector u, then element j of the vector).
template <class PAccess, int W, int U, int Threads, bool StreamLoads, class Body, class Acc, std::size_t... K>
__device__ __forceinline__ void vector_accumulate(Body const& body, void* const* bases, std::int64_t index,
                                                  iteration<U> const& it, Acc& acc, std::index_sequence<K...>)
{
  typename tile_of<PAccess, W, U, std::index_sequence<K...>>::type tile;
  (load_slot<K, PAccess, W, U, Threads, StreamLoads>(tile, bases, it), ...);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!it.valid[u]) { continue; }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      typename PAccess::element_type e;
      e.set_position(index, it.first + (it.v0 + u * Threads + it.tid) * W + j);
      (to_register<K, PAccess>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
      PAccess::clear_registers(e);
      body(e, acc);
    }
  }
}

/// Accumulates elements [begin, begin + count) of one tensor into this thread's `acc`: the
/// same split into scalar head, vector body and scalar tail as process_chunk.
template <class Policy, class PAccess, int W, std::size_t Widest, class Body, class Acc, std::size_t S>
__device__ __forceinline__ void accumulate_chunk(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                                 std::int32_t count, Acc& acc)
{
  constexpr int threads = Policy::block_threads;
  constexpr int unroll = vectors_per_thread<Policy, W, Widest>;
  using reads = typename PAccess::reads;
  int const tid = static_cast<int>(threadIdx.x);
  std::int64_t const end = begin + count;
  std::int64_t const index = te.index;

  if (te.head < 0) {
    for (std::int64_t i = begin + tid; i < end; i += threads) {
      PAccess::template accumulate<reads>(body, te.bases, index, i, acc);
    }
    return;
  }
  std::int64_t first = begin + ((static_cast<std::int64_t>(te.head) - begin) & (W - 1));
  if (first > end) { first = end; }
  std::int64_t const vectors = (end - first) / W;
  std::int64_t const vector_end = first + vectors * W;
  int const heads = static_cast<int>(first - begin);
  int const tails = static_cast<int>(end - vector_end);
  if (tid < heads) {
    PAccess::template accumulate<reads>(body, te.bases, index, begin + tid, acc);
  } else if (tid < heads + tails) {
    PAccess::template accumulate<reads>(body, te.bases, index, vector_end + (tid - heads), acc);
  }
  constexpr std::int64_t step = static_cast<std::int64_t>(threads) * unroll;
  for (std::int64_t v0 = 0; v0 < vectors; v0 += step) {
    iteration<unroll> it;
    it.first = first;
    it.v0 = v0;
    it.tid = tid;
#pragma unroll
    for (int u = 0; u < unroll; ++u) { it.valid[u] = v0 + u * threads + tid < vectors; }
    vector_accumulate<PAccess, W, unroll, threads, Policy::streaming_loads>(body, te.bases, index, it, acc,
                                                                            std::make_index_sequence<S>{});
  }
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

#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic push
#  pragma nv_diag_suppress 1407
#endif

/// Reduction pass J of `Rule`: each block takes chunks as the update kernel does; each thread
/// accumulates its elements in the rule's arithmetic type (what the rule's accumulating body
/// is written for), the block combines the threads in double with cub::BlockReduce (a fixed
/// tree), and thread 0 writes the chunk's partial to `partials[(chunk_base + c) * N + k]`.
/// A thread whose float sum came out non-finite accumulates its elements again in double.
/// Nothing is stored to any tensor.
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
  constexpr std::size_t widest = vector_width<Bound>::widest;
  using block_reduce = cub::BlockReduce<accumulator<double, n>, Policy::block_threads>;
  __shared__ typename block_reduce::TempStorage temp;

  auto const body = ::fusedopt::detail::prepare_pass<J>(rule, step, results.r);
  for (std::int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    chunk_entry const chunk = table.chunk(c);
    tensor_entry<Bound::num_slots> const tensor = table.tensor(chunk.tensor);
    auto acc = identities<reduction, value_type>();
    accumulate_chunk<Policy, paccess, width, widest>(::fusedopt::detail::body_for_tensor(body, tensor.index), tensor,
                                                      chunk.begin, chunk.count, acc);
    accumulator<double, n> wide;
#pragma unroll
    for (int k = 0; k < n; ++k) { wide[k] = static_cast<double>(acc[k]); }
    if constexpr (::fusedopt::detail::widens_overflowing_sums_v<reduction, value_type>) {
      // A float sum that came out non-finite is accumulated again in double (as the host
      // backend does for a chunk; ::fusedopt::detail::sums_finite): one test per thread and
      // chunk, and no FP64 work unless a sum overflowed or an input is not finite.
      if (!::fusedopt::detail::sums_finite<reduction>(acc)) {
        wide = identities<reduction, double>();
        accumulate_chunk<Policy, paccess, width, widest>(::fusedopt::detail::body_for_tensor(body, tensor.index),
                                                          tensor, chunk.begin, chunk.count, wide);
      }
    }
    accumulator<double, n> const total = block_reduce(temp).Reduce(wide, combine_all<reduction>{});
    if (threadIdx.x == 0) {
#pragma unroll
      for (int k = 0; k < n; ++k) { partials[(chunk_base + c) * n + k] = total[k]; }
    }
    __syncthreads();  // `temp` is reused by the next chunk
  }
}

/// Combines one pass's chunk partials: block `row` folds the chunks of row `row` of the bound
/// lists (thread i takes chunks i, i + Threads, ... in order, fold_strided; then a fixed block
/// tree) into `per_tensor[row * N + k]` (the identity for an empty tensor); the last block to
/// finish (a counter in the workspace, which it resets, so graph replays find it at 0) folds
/// the rows the same way into `all[k]`. Launched with max(rows, 1) blocks of Threads.
template <int Threads, class Reduction>
FUSEDOPT_KERNEL void __launch_bounds__(Threads)
  finalize_kernel(double const* partials, chunk_range const* ranges, std::int64_t rows, double* per_tensor, double* all,
                  unsigned int* counter)
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

/// The update kernel of a rule with reduction passes: the body is prepare_final(rule, step,
/// results) (the rule's prepare(step, reduced) runs on the device, reading the results the
/// passes left in the workspace); otherwise multi_tensor_kernel.
template <class Policy, class Rule, class Bound, class Table, int P>
FUSEDOPT_KERNEL void __launch_bounds__(Policy::block_threads, Policy::min_blocks_per_sm)
  reduced_update_kernel(Rule const rule, step_info const step, FUSEDOPT_GRID_CONSTANT Table const table,
                        FUSEDOPT_GRID_CONSTANT pass_results<P> const results)
{
  using access = ::fusedopt::detail::access<Rule, Bound>;
  constexpr int width = vector_width<Bound>::value;
  constexpr std::size_t widest = vector_width<Bound>::widest;
  auto const body = ::fusedopt::detail::prepare_final(rule, step, results.r);
  for (std::int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    chunk_entry const chunk = table.chunk(c);
    tensor_entry<Bound::num_slots> const tensor = table.tensor(chunk.tensor);
    process_chunk<Policy, access, width, widest>(::fusedopt::detail::body_for_tensor(body, tensor.index), tensor,
                                                 chunk.begin, chunk.count);
  }
}

/// The rule's after-step hooks, once, in one thread, after the update in stream order.
template <class Rule, int P>
FUSEDOPT_KERNEL void after_step_kernel(Rule const rule, step_info const step,
                                      FUSEDOPT_GRID_CONSTANT pass_results<P> const results)
{
  ::fusedopt::detail::after_step(rule, step, results.r);
}

#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic pop
#endif

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
