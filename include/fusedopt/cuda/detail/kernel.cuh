/// @file cuda/detail/kernel.cuh
/// @brief The multi-tensor kernel: one block per chunk (or a loop over chunks), 16-byte
/// vector loads and stores in the body of each tensor, scalar elements at its head and tail.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../../config.hpp"
#include "../../detail/access.hpp"
#include "../../detail/pack.hpp"
#include "../../numeric/dtypes.hpp"
#include "../../rule.hpp"
#include "../../scalar.hpp"
#include "../error.cuh"
#include "tables.cuh"

#if defined(__GNUC__) || defined(__clang__)
/// Kernels of a header-only library get hidden visibility, so two shared libraries built from
/// different versions of fusedopt never share (and mix up) their instantiations (as CUB does).
#  define FUSEDOPT_KERNEL __global__ __attribute__((visibility("hidden")))
#else
#  define FUSEDOPT_KERNEL __global__
#endif

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// `W` elements of type `T` in registers, 16-byte aligned: one 16-byte access per 16 bytes
/// (one for a 16-bit slot, two for a float slot next to it, four for double).
template <class T, int W>
struct alignas(16) packet {
  T v[W];
};

/// Loads one packet, with the cache-streaming hint (ld.global.cs: the data is touched once)
/// when `Streaming`.
template <bool Streaming, class T, int W>
__device__ __forceinline__ packet<T, W> load_packet(packet<T, W> const* from)
{
  if constexpr (Streaming) {
    constexpr int pieces = static_cast<int>(sizeof(packet<T, W>) / 16);
    uint4 raw[pieces];
#pragma unroll
    for (int i = 0; i < pieces; ++i) { raw[i] = __ldcs(reinterpret_cast<uint4 const*>(from) + i); }
    packet<T, W> out;
    std::memcpy(&out, raw, sizeof out);
    return out;
  } else {
    return *from;
  }
}

template <bool Streaming, class T, int W>
__device__ __forceinline__ void store_packet(packet<T, W>* to, packet<T, W> const& value)
{
  if constexpr (Streaming) {
    constexpr int pieces = static_cast<int>(sizeof(packet<T, W>) / 16);
    uint4 raw[pieces];
    std::memcpy(raw, &value, sizeof raw);
#pragma unroll
    for (int i = 0; i < pieces; ++i) { __stcs(reinterpret_cast<uint4*>(to) + i, raw[i]); }
  } else {
    *to = value;
  }
}

/// The packets a thread holds for one slot during one iteration.
template <class T, int W, int U>
struct slot_tile {
  packet<T, W> p[U];
};

template <class Access, int W, int U, class Seq>
struct tile_of;
template <class Access, int W, int U, std::size_t... K>
struct tile_of<Access, W, U, std::index_sequence<K...>> {
  using type = ::fusedopt::detail::pack<slot_tile<typename Access::template element_t<K>, W, U>...>;
};

/// Per-iteration addressing: vector `v0 + u * Threads + tid` of the body starting at `first`.
template <int U>
struct iteration {
  std::int64_t first;  // element where the vector body starts (aligned in every slot)
  std::int64_t v0;     // first vector of the block in this iteration
  int tid;
  bool valid[U];
};

template <std::size_t K, class Access, int W, int U, int Threads, bool Streaming, class Tile>
__device__ __forceinline__ void load_slot(Tile& tile, void* const* bases, iteration<U> const& it)
{
  if constexpr (Access::loads[K]) {
    using T = typename Access::template element_t<K>;
    auto const* src = reinterpret_cast<packet<T, W> const*>(static_cast<T const*>(bases[K]) + it.first);
    auto& slot = ::fusedopt::detail::pack_get<K>(tile);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (it.valid[u]) { slot.p[u] = load_packet<Streaming>(src + it.v0 + u * Threads + it.tid); }
    }
  }
}

template <std::size_t K, class Access, int W, int U, int Threads, bool Streaming, class Tile>
__device__ __forceinline__ void store_slot(Tile const& tile, void* const* bases, iteration<U> const& it)
{
  if constexpr (Access::stores[K]) {
    using T = typename Access::template element_t<K>;
    auto* dst = reinterpret_cast<packet<T, W>*>(static_cast<T*>(bases[K]) + it.first);
    auto const& slot = ::fusedopt::detail::pack_get<K>(tile);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (it.valid[u]) { store_packet<Streaming>(dst + it.v0 + u * Threads + it.tid, slot.p[u]); }
    }
  }
}

template <std::size_t K, class Access, class T>
__device__ __forceinline__ void to_register(typename Access::element_type& e, T const& stored)
{
  using O = typename Access::value_type;
  if constexpr (Access::loads[K]) {
    e.at(K) = ::fusedopt::to_opmath<O>(stored);
  } else {
    e.at(K) = O(0);
  }
}

template <std::size_t K, class Access, class T>
__device__ __forceinline__ void from_register(typename Access::element_type const& e, T& stored)
{
  if constexpr (Access::stores[K]) { stored = ::fusedopt::from_opmath<T>(e.at(K)); }
}

/// Loads every read slot for the iteration, runs the rule on each element, stores every
/// written slot: the same per-element semantics as detail::access::update.
template <class Access, int W, int U, int Threads, bool StreamLoads, bool StreamStores, class Body,
          std::size_t... K>
__device__ __forceinline__ void vector_iteration(Body const& body, void* const* bases, std::int64_t index,
                                                 iteration<U> const& it, std::index_sequence<K...>)
{
  typename tile_of<Access, W, U, std::index_sequence<K...>>::type tile;
  // Every load of the iteration is issued before the first use: several independent 16-byte
  // loads per slot in flight per thread.
  (load_slot<K, Access, W, U, Threads, StreamLoads>(tile, bases, it), ...);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!it.valid[u]) { continue; }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      typename Access::element_type e;
      e.set_position(index, it.first + (it.v0 + u * Threads + it.tid) * W + j);
      (to_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
      Access::clear_registers(e);
      body(e);
      (from_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
    }
  }
  (store_slot<K, Access, W, U, Threads, StreamStores>(tile, bases, it), ...);
}

/// Vectors a thread loads per iteration: Policy::bytes_per_slot of its widest slot (one
/// vector of a slot of `widest`-byte elements is W * widest bytes), at least one.
template <class Policy, int W, std::size_t Widest>
inline constexpr int vectors_per_thread =
  Policy::bytes_per_slot / (W * static_cast<int>(Widest)) > 1 ? Policy::bytes_per_slot / (W * static_cast<int>(Widest)) : 1;

/// Updates elements [begin, begin + count) of one tensor.
template <class Policy, class Access, int W, std::size_t Widest, class Body, std::size_t S>
__device__ __forceinline__ void process_chunk(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                              std::int32_t count)
{
  constexpr int threads = Policy::block_threads;
  constexpr int unroll = vectors_per_thread<Policy, W, Widest>;
  static_assert((W & (W - 1)) == 0, "vector widths are powers of two");
  int const tid = static_cast<int>(threadIdx.x);
  std::int64_t const end = begin + count;
  std::int64_t const index = te.index;

  if (te.head < 0) {
    // The slots are misaligned differently: no element is aligned in all of them at once.
    for (std::int64_t i = begin + tid; i < end; i += threads) { Access::update(body, te.bases, index, i); }
    return;
  }

  // First vector-aligned element at or after `begin` (the elements congruent to head mod W).
  std::int64_t first = begin + ((static_cast<std::int64_t>(te.head) - begin) & (W - 1));
  if (first > end) { first = end; }
  std::int64_t const vectors = (end - first) / W;
  std::int64_t const vector_end = first + vectors * W;
  int const heads = static_cast<int>(first - begin);
  int const tails = static_cast<int>(end - vector_end);
  if (tid < heads) {
    Access::update(body, te.bases, index, begin + tid);
  } else if (tid < heads + tails) {
    Access::update(body, te.bases, index, vector_end + (tid - heads));
  }

  constexpr std::int64_t step = static_cast<std::int64_t>(threads) * unroll;
  for (std::int64_t v0 = 0; v0 < vectors; v0 += step) {
    iteration<unroll> it;
    it.first = first;
    it.v0 = v0;
    it.tid = tid;
#pragma unroll
    for (int u = 0; u < unroll; ++u) { it.valid[u] = v0 + u * threads + tid < vectors; }
    vector_iteration<Access, W, unroll, threads, Policy::streaming_loads, Policy::streaming_stores>(
      body, te.bases, index, it, std::make_index_sequence<S>{});
  }
}

#if defined(__CUDACC__) && (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))
// The table stays in parameter space and is indexed there; without it a kernel that indexes
// a by-value array with a run-time index may copy the whole table to local memory.
#  define FUSEDOPT_GRID_CONSTANT __grid_constant__
#else
#  define FUSEDOPT_GRID_CONSTANT
#endif

// A kernel instantiated for a rule of internal linkage (a rule in an anonymous namespace, a
// lambda's type) has internal linkage itself, and nvcc warns that it cannot be hidden; hidden
// visibility only matters for kernels other libraries could also instantiate, so the warning
// says nothing useful there.
#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic push
#  pragma nv_diag_suppress 1407
#endif
/// The kernel: `rule` prepared once per thread for `step` (device scalars are read here, so a
/// captured launch picks up new values), then each block takes chunks `blockIdx.x`,
/// `blockIdx.x + gridDim.x`, ... of `table`.
template <class Policy, class Rule, class Bound, class Table>
FUSEDOPT_KERNEL void __launch_bounds__(Policy::block_threads, Policy::min_blocks_per_sm)
  multi_tensor_kernel(Rule const rule, step_info const step, FUSEDOPT_GRID_CONSTANT Table const table)
{
  using access = ::fusedopt::detail::access<Rule, Bound>;
  constexpr int width = vector_width<Bound>::value;
  constexpr std::size_t widest = vector_width<Bound>::widest;
  auto const body = ::fusedopt::detail::prepare_rule(rule, step);
  for (std::int64_t c = blockIdx.x; c < table.num_chunks; c += gridDim.x) {
    chunk_entry const chunk = table.chunk(c);
    tensor_entry<Bound::num_slots> const tensor = table.tensor(chunk.tensor);
    process_chunk<Policy, access, width, widest>(::fusedopt::detail::body_for_tensor(body, tensor.index), tensor,
                                                 chunk.begin, chunk.count);
  }
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

/// Enqueues the writes of `entries` into `table` on `stream`, one launch per table_piece.
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
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
