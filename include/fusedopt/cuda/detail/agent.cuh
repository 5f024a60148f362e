/// @file cuda/detail/agent.cuh
/// @brief The per-block chunk worker (CUB's "agent"): a block's threads take the elements of
/// one chunk of one tensor, scalar at the tensor's unaligned head and tail, in 16-byte vectors
/// in between. One worker serves both passes of a step: the update pass (load, run the body,
/// store) and a reduction pass (load what the pass reads, accumulate, store nothing).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "../../config.hpp"
#include "../../detail/access.hpp"
#include "../../detail/rule_traits.hpp"
#include "../../meta.hpp"
#include "tables.cuh"
#include "vector_io.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

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

/// Vectors a thread loads per iteration: Policy::bytes_per_slot of its widest slot (one
/// vector of a slot of `widest`-byte elements is W * widest bytes), at least one.
template <class Policy, int W, std::size_t Widest>
inline constexpr int vectors_per_thread =
  Policy::bytes_per_slot / (W * static_cast<int>(Widest)) > 1 ? Policy::bytes_per_slot / (W * static_cast<int>(Widest)) : 1;

/// One element on the scalar path (a tensor's head and tail, or a tensor whose slots are
/// misaligned differently): updated when no accumulator is given, else accumulated into it
/// (`Access` is then a pass_access).
template <class Access, class Body, class... Acc>
__device__ __forceinline__ void scalar_element(Body const& body, void* const* bases, std::int64_t tensor,
                                               std::int64_t i, Acc&... acc)
{
  if constexpr (sizeof...(Acc) == 0) {
    Access::update(body, bases, tensor, i);
  } else {
    Access::template accumulate<typename Access::reads>(body, bases, tensor, i, acc...);
  }
}

/// One iteration of the vector path: every slot `Access` loads is loaded for the iteration,
/// the body runs on each valid element (as `body(e)`, or `body(e, acc)` in a reduction pass),
/// in a fixed order (vector u, then element j of the vector), then every slot `Access` stores
/// is stored: the same per-element semantics as detail::access::update and ::accumulate.
template <class Access, int W, int U, int Threads, int LoadMode, int StoreMode, class Body,
          std::size_t... K, class... Acc>
__device__ __forceinline__ void vector_iteration(Body const& body, void* const* bases, std::int64_t index,
                                                 iteration<U> const& it, std::index_sequence<K...>, Acc&... acc)
{
  typename tile_of<Access, W, U, std::index_sequence<K...>>::type tile;
  // Every load of the iteration is issued before the first use: several independent 16-byte
  // loads per slot in flight per thread.
  (load_slot<K, Access, W, U, Threads, LoadMode>(tile, bases, it), ...);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!it.valid[u]) { continue; }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      typename Access::element_type e;
      e.set_position(index, it.first + (it.v0 + u * Threads + it.tid) * W + j);
      (to_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
      Access::clear_registers(e);
      body(e, acc...);
      (from_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
    }
  }
  (store_slot<K, Access, W, U, Threads, StoreMode>(tile, bases, it), ...);
}

/// The vector path of process_chunk: scalar head elements up to the first vector-aligned one,
/// vectors of `W` elements, a scalar tail.
template <class Policy, class Access, int W, std::size_t Widest, class Body, std::size_t S, class... Acc>
__device__ __forceinline__ void process_vectors(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                                std::int32_t count, std::uint64_t cache_policy, Acc&... acc)
{
  constexpr int threads = Policy::block_threads;
  constexpr int unroll = vectors_per_thread<Policy, W, Widest>;
  int const tid = static_cast<int>(threadIdx.x);
  std::int64_t const end = begin + count;
  std::int64_t const index = te.index;

  // First vector-aligned element at or after `begin` (the elements congruent to head mod W).
  std::int64_t first = begin + ((static_cast<std::int64_t>(te.head) - begin) & (W - 1));
  if (first > end) { first = end; }
  std::int64_t const vectors = (end - first) / W;
  std::int64_t const vector_end = first + vectors * W;
  int const heads = static_cast<int>(first - begin);
  int const tails = static_cast<int>(end - vector_end);
  if (tid < heads) {
    scalar_element<Access>(body, te.bases, index, begin + tid, acc...);
  } else if (tid < heads + tails) {
    scalar_element<Access>(body, te.bases, index, vector_end + (tid - heads), acc...);
  }

  constexpr int load_mode = Policy::streaming_loads ? cache_streaming : cache_plain;
  constexpr int store_mode = Policy::streaming_stores ? cache_streaming : cache_plain;
  constexpr std::int64_t step = static_cast<std::int64_t>(threads) * unroll;
  for (std::int64_t v0 = 0; v0 < vectors; v0 += step) {
    iteration<unroll> it;
    it.first = first;
    it.v0 = v0;
    it.cache_policy = cache_policy;
    it.tid = tid;
#pragma unroll
    for (int u = 0; u < unroll; ++u) { it.valid[u] = v0 + u * threads + tid < vectors; }
    vector_iteration<Access, W, unroll, threads, load_mode, store_mode>(
      body, te.bases, index, it, std::make_index_sequence<S>{}, acc...);
  }
}

/// The chunk worker: elements [begin, begin + count) of one tensor, updated (no `acc`) or
/// accumulated into this thread's `acc` (a reduction pass, `Access` a pass_access). Scalar
/// head elements up to the first vector-aligned one, then vectors of `W` elements, then a
/// scalar tail; a tensor whose slots are misaligned differently (head < 0) goes scalar, and
/// so do all elements where quantized states are bound (a reduction pass, or an update that
/// only reads them: process_blocks updates the ones it stores).
template <class Policy, class Access, int W, std::size_t Widest, class Body, std::size_t S, class... Acc>
__device__ __forceinline__ void process_chunk(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                              std::int32_t count, std::uint64_t cache_policy, Acc&... acc)
{
  static_assert(sizeof...(Acc) <= 1, "one accumulator set per pass");
  static_assert((W & (W - 1)) == 0, "vector widths are powers of two");
  constexpr int threads = Policy::block_threads;
  int const tid = static_cast<int>(threadIdx.x);
  std::int64_t const end = begin + count;
  std::int64_t const index = te.index;

  if (Access::any_quantized || te.head < 0) {
    // The slots are misaligned differently: no element is aligned in all of them at once; or
    // quantized states are bound, whose records are not vectors of elements (a pass over them
    // reads element by element; process_blocks updates them).
    for (std::int64_t i = begin + tid; i < end; i += threads) { scalar_element<Access>(body, te.bases, index, i, acc...); }
    return;
  }
  if constexpr (!Access::any_quantized) {
    process_vectors<Policy, Access, W, Widest>(body, te, begin, count, cache_policy, acc...);
  }
}

/// Folds the block summaries of a warp's lanes: the largest magnitude (as bits) and whether any
/// lane saw a change, for every quantized slot the rule stores. Every lane gets the result.
template <class Access>
__device__ __forceinline__ void warp_summary(typename Access::block_summary& s)
{
  Access::for_each_stored_quantized(s, [](std::uint32_t& max_bits, bool& changed) {
    constexpr unsigned all_lanes = 0xffffffffu;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      std::uint32_t const other = __shfl_xor_sync(all_lanes, max_bits, offset);
      max_bits = other > max_bits ? other : max_bits;
    }
    changed = __any_sync(all_lanes, changed) != 0;
  });
}

/// The map type of a quantized list type T; void for other types.
template <class T, bool = ::fusedopt::is_blockwise_v<T>>
struct map_type_of {
  using type = void;
};
template <class T>
struct map_type_of<T, true> {
  using type = typename T::map_type;
};

template <class Access, class Map, std::size_t... K>
constexpr bool uses_map(std::index_sequence<K...>)
{
  return (std::is_same_v<typename map_type_of<typename Access::template element_t<K>>::type, Map> || ...);
}

template <class Map, bool Used>
struct shared_map {};
template <class Map>
struct shared_map<Map, true> {
  ::fusedopt::detail::map_t<Map> map;
};

/// The maps of the quantized slots of `Access`, in the shared memory of a block (37 KB for a
/// signed and an unsigned map): every element looks up a value to dequantize and a search
/// entry to quantize at data-dependent places, and shared memory serves a warp's 32 scattered
/// lookups in a few bank cycles where L1 takes a pass per cache line they touch (the lookups
/// bounded the kernel with the maps in global memory: docs/quantized_states.md).
template <class Access>
struct block_maps
  : shared_map<signed_dynamic_map, uses_map<Access, signed_dynamic_map>(std::make_index_sequence<Access::num_slots>{})>,
    shared_map<unsigned_dynamic_map,
               uses_map<Access, unsigned_dynamic_map>(std::make_index_sequence<Access::num_slots>{})> {
  template <class Map>
  __device__ __forceinline__ ::fusedopt::detail::map_t<Map> const& get() const
  {
    return static_cast<shared_map<Map, true> const&>(*this).map;
  }

  /// Copies the maps in use from global memory: all threads of the block take part; the caller
  /// synchronises the block before any lookup.
  __device__ __forceinline__ void fill()
  {
    copy<signed_dynamic_map>();
    copy<unsigned_dynamic_map>();
  }

 private:
  template <class Map>
  __device__ __forceinline__ void copy()
  {
    if constexpr (std::is_base_of_v<shared_map<Map, true>, block_maps>) {
      using map_type = ::fusedopt::detail::map_t<Map>;
      static_assert(sizeof(map_type) % sizeof(std::uint32_t) == 0, "maps are copied in 4-byte words");
      constexpr int words = static_cast<int>(sizeof(map_type) / sizeof(std::uint32_t));
      auto const* from = reinterpret_cast<std::uint32_t const*>(&::fusedopt::detail::device_map<Map>);
      auto* to = reinterpret_cast<std::uint32_t*>(&static_cast<shared_map<Map, true>&>(*this).map);
      for (int w = static_cast<int>(threadIdx.x); w < words; w += static_cast<int>(blockDim.x)) { to[w] = from[w]; }
    }
  }
};

/// Four consecutive elements of a slot of type T in one access (8, 16 or 32 bytes).
template <class T>
struct alignas(4 * sizeof(T) < 16 ? 4 * sizeof(T) : 16) quad {
  T v[4];
};

/// Loads elements i..i+3 of slot K (i a multiple of 4 within one quantized block) into e[0..3]:
/// a quantized slot as one 4-byte load of codes and the block's scale, any other as one quad.
template <class Access, std::size_t K>
__device__ __forceinline__ void load_quad(typename Access::element_type* e, void* const* bases, std::int64_t i,
                                          block_maps<Access> const& maps)
{
  using T = typename Access::template element_t<K>;
  using V = typename Access::value_type;
  if constexpr (!Access::loads[K]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) { e[j].at(K) = V(0); }
  } else if constexpr (Access::quantized[K]) {
    T const& record = static_cast<T const*>(bases[K])[i / T::block_elements];
    std::uint32_t const codes = *reinterpret_cast<std::uint32_t const*>(record.codes + i % T::block_elements);
    float const absmax = record.absmax;
    auto const& map = maps.template get<typename T::map_type>();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      e[j].at(K) = ::fusedopt::detail::dequantize(map, static_cast<std::uint8_t>(codes >> (8 * j)), absmax);
    }
  } else {
    quad<T> const q = *reinterpret_cast<quad<T> const*>(static_cast<T const*>(bases[K]) + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) { e[j].at(K) = ::fusedopt::to_opmath<V>(q.v[j]); }
  }
}

/// Stores e[0..3] into elements i..i+3 of slot K, a written slot that is not quantized, as one
/// quad.
template <class Access, std::size_t K>
__device__ __forceinline__ void store_plain_quad(typename Access::element_type const* e, void* const* bases,
                                                 std::int64_t i)
{
  using T = typename Access::template element_t<K>;
  if constexpr (Access::stores[K] && !Access::quantized[K]) {
    quad<T> q;
#pragma unroll
    for (int j = 0; j < 4; ++j) { q.v[j] = ::fusedopt::from_opmath<T>(e[j].at(K)); }
    *reinterpret_cast<quad<T>*>(static_cast<T*>(bases[K]) + i) = q;
  }
}

/// Stores the codes of e[0..3] into elements i..i+3 of slot K, a written quantized slot, as one
/// 4-byte store, when the block is rewritten.
template <class Access, std::size_t K>
__device__ __forceinline__ void store_code_quad(typename Access::element_type const* e, void* const* bases,
                                                std::int64_t i, typename Access::block_summary const& summary,
                                                block_maps<Access> const& maps)
{
  using T = typename Access::template element_t<K>;
  if constexpr (Access::stores[K] && Access::quantized[K]) {
    if (Access::template rewrites<K>(summary)) {
      T& record = static_cast<T*>(bases[K])[i / T::block_elements];
      float const inverse = ::fusedopt::detail::inverse_scale(::fusedopt::detail::bits_float(summary.max_bits[K]));
      auto const& map = maps.template get<typename T::map_type>();
      std::uint32_t codes = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        codes |= std::uint32_t{::fusedopt::detail::quantize(map, e[j].at(K), inverse)} << (8 * j);
      }
      *reinterpret_cast<std::uint32_t*>(record.codes + i % T::block_elements) = codes;
    }
  }
}

template <class Access, std::size_t... K>
__device__ __forceinline__ void load_quads(typename Access::element_type* e, void* const* bases, std::int64_t i,
                                           block_maps<Access> const& maps, std::index_sequence<K...>)
{
  (load_quad<Access, K>(e, bases, i, maps), ...);
}

template <class Access, std::size_t... K>
__device__ __forceinline__ void store_plain_quads(typename Access::element_type const* e, void* const* bases,
                                                  std::int64_t i, std::index_sequence<K...>)
{
  (store_plain_quad<Access, K>(e, bases, i), ...);
}

template <class Access, std::size_t... K>
__device__ __forceinline__ void store_code_quads(typename Access::element_type const* e, void* const* bases,
                                                 std::int64_t i, typename Access::block_summary const& summary,
                                                 block_maps<Access> const& maps, std::index_sequence<K...>)
{
  (store_code_quad<Access, K>(e, bases, i, summary, maps), ...);
}

/// The update worker where quantized states are stored: elements [begin, begin + count) of one
/// tensor, `begin` a multiple of the block size (make_layout). One warp owns a block: warp w
/// takes blocks w, w + warps, ... of the chunk. In a whole block of a tensor whose other slots
/// are aligned for 4-element accesses (head 0, slot_geometry::head), lane l takes elements
/// 128 g + 4 l .. 128 g + 4 l + 3 for each g: one access per slot and four elements (16 bytes
/// of fp32, 4 of codes), each warp access 32 consecutive such groups. Otherwise (a tensor's
/// last, partial block, or misaligned slots) lane l takes elements l, l + 32, ... one by one.
/// The lanes update their elements in registers, the warp folds their summaries with shuffles
/// (no other launch), every lane stores its elements with the block's new scale and lane 0
/// stores the scale: the steps of detail::access::update_block, the same bits. Whole blocks
/// look their codes up in `maps` (the CTA's shared copy); the rare element path in the maps in
/// global memory, through the host's code.
template <class Policy, class Access, class Body, std::size_t S>
__device__ __forceinline__ void process_blocks(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                               std::int32_t count, block_maps<Access> const& maps)
{
  constexpr int lanes = 32;
  static_assert(Policy::block_threads % lanes == 0, "a block of the CUDA backend is whole warps");
  constexpr int warps = Policy::block_threads / lanes;
  constexpr std::int64_t block = Access::block_elements;
  constexpr int per_lane = static_cast<int>(block / lanes);
  constexpr bool quads = block % (4 * lanes) == 0;
  int const lane = static_cast<int>(threadIdx.x) % lanes;
  int const warp = static_cast<int>(threadIdx.x) / lanes;
  std::int64_t const end = begin + count;
  auto update = [&](typename Access::element_type& e, std::int64_t i, typename Access::block_summary& summary) {
    e.set_position(te.index, i);
    Access::clear_registers(e);
    auto const before = e;
    body(e);
    Access::summarize(summary, e, before);
  };
  // `first` is the same in every lane of a warp: the shuffles below see all 32 lanes.
  for (std::int64_t first = begin + warp * block; first < end; first += warps * block) {
    typename Access::element_type e[per_lane];
    auto summary = Access::empty_summary();
    if (quads && te.head == 0 && first + block <= end) {
#pragma unroll
      for (int g = 0; g < per_lane / 4; ++g) {
        load_quads<Access>(e + 4 * g, te.bases, first + g * 4 * lanes + 4 * lane, maps, std::make_index_sequence<S>{});
      }
#pragma unroll
      for (int g = 0; g < per_lane / 4; ++g) {
#pragma unroll
        for (int j = 4 * g; j < 4 * g + 4; ++j) { update(e[j], first + g * 4 * lanes + 4 * lane + j % 4, summary); }
        // The slots stored as they are go out before the warp's fold: their registers are free
        // sooner (more blocks fit on an SM) and the stores overlap the fold.
        store_plain_quads<Access>(e + 4 * g, te.bases, first + g * 4 * lanes + 4 * lane, std::make_index_sequence<S>{});
      }
      warp_summary<Access>(summary);
#pragma unroll
      for (int g = 0; g < per_lane / 4; ++g) {
        store_code_quads<Access>(e + 4 * g, te.bases, first + g * 4 * lanes + 4 * lane, summary, maps,
                                 std::make_index_sequence<S>{});
      }
    } else {
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        std::int64_t const i = first + lane + j * lanes;
        if (i < end) {
          Access::load(e[j], te.bases, i, std::make_index_sequence<S>{});
          update(e[j], i, summary);
        }
      }
      warp_summary<Access>(summary);
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        std::int64_t const i = first + lane + j * lanes;
        if (i < end) { Access::store_in_block(e[j], te.bases, i, summary, std::make_index_sequence<S>{}); }
      }
    }
    if (lane == 0) { Access::store_scales(te.bases, first / block, summary); }
  }
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
