/// @file cuda/detail/agent.cuh
/// @brief The chunk worker (CUB's "agent"): a group of threads (the block in the update, a warp
/// in a reduction pass) takes the elements of one chunk of one tensor, scalar at the tensor's
/// unaligned head and tail, in 16-byte vectors in between. One worker serves both passes of a
/// step: the update pass (load, run the body, store) and a reduction pass (load what the pass
/// reads, accumulate, store nothing). And the update that stores 8-bit quantized states, a warp
/// per block of codes (process_quantized).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "../../config.hpp"
#include "../../detail/access.hpp"
#include "../../detail/factored.hpp"
#include "../../detail/rule_traits.hpp"
#include "../../meta.hpp"
#include "policy.cuh"
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

/// Vectors per thread and iteration: `bytes` over the bytes one vector takes of the slots
/// loaded together (`vector_bytes` > 0), at least one.
constexpr int vectors_for(int bytes, int vector_bytes)
{
  return bytes / vector_bytes > 1 ? bytes / vector_bytes : 1;
}

/// The shape of the update that stores no quantized state over vectors of W elements: the
/// policy's block_threads and bytes_per_slot, or its plain_fast_update in the shape for fast
/// memory.
template <class Policy, int W, bool FastMemory>
inline constexpr plain_shape plain_shape_v =
  FastMemory ? Policy::plain_fast_update(W) : plain_shape{Policy::block_threads, Policy::bytes_per_slot};

/// Vectors a thread of the update loads per iteration: the shape's bytes_per_slot of its
/// widest slot (one vector of a slot of `widest`-byte elements is W * widest bytes), at least
/// one.
template <class Policy, int W, std::size_t Widest, bool FastMemory = false>
inline constexpr int vectors_per_thread =
  vectors_for(plain_shape_v<Policy, W, FastMemory>.bytes_per_slot, W * static_cast<int>(Widest));

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

/// The body on each valid element of a loaded tile of an update, in vector_iteration's
/// order (vector u, then element j of the vector); the tile's values are replaced by the
/// element's registers after it.
template <class Access, int W, int U, int Threads, class Body, class Tile, std::size_t... K>
__device__ __forceinline__ void tile_elements(Body const& body, Tile& tile, std::int64_t index, iteration<U> const& it,
                                              std::index_sequence<K...>)
{
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!it.valid[u]) { continue; }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      typename Access::element_type e;
      e.set_position(index, it.first + (it.v0 + u * Threads + it.tid) * W + j);
      e.set_vector_lane(j, W);
      (to_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
      Access::clear_registers(e);
      body(e);
      (from_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
    }
  }
}

/// One iteration of the vector path, in one function: every slot `Access` loads is loaded
/// (several independent 16-byte loads per slot in flight per thread before the first use),
/// then `form()` gives the body (a block's first iteration prepares the rule here, behind its
/// loads: process_first_chunk; otherwise it hands over the body it holds), which runs as
/// `for_tensor(form())` on each valid element (as `body(e)`, or `body(e, acc)` in a reduction
/// pass) in a fixed order (vector u, then element j of the vector); then every slot `Access`
/// stores is stored: the same per-element semantics as detail::access::update and ::accumulate.
/// Returns what `form()` gave. Loads, arithmetic and stores stay in one function body on
/// purpose: split into a load function and a compute-and-store function (both inlined), an
/// iteration of one vector a slot kept the loaded values live across two branches on `valid`
/// and took AdamW over bf16 from 64 to 83 registers.
template <class Access, int W, int U, int Threads, int LoadMode, int StoreMode, class Form, class ForTensor,
          std::size_t... K, class... Acc>
__device__ __forceinline__ auto vector_iteration(Form const& form, ForTensor const& for_tensor, void* const* bases,
                                                 std::int64_t index, iteration<U> const& it, std::index_sequence<K...>,
                                                 Acc&... acc)
{
  typename tile_of<Access, W, U, std::index_sequence<K...>>::type tile;
  (load_slot<K, Access, W, U, Threads, LoadMode>(tile, bases, it), ...);
  auto const& formed = form();
  auto const& body = for_tensor(formed);
  // The loop of tile_elements, written out here: through the helper (inlined all the same) the
  // update kernels of AdamW and StableAdamW came out of nvcc with 12-29 more address
  // instructions (PTX), on the path every rule's update takes.
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!it.valid[u]) { continue; }
#pragma unroll
    for (int j = 0; j < W; ++j) {
      typename Access::element_type e;
      e.set_position(index, it.first + (it.v0 + u * Threads + it.tid) * W + j);
      e.set_vector_lane(j, W);
      (to_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
      Access::clear_registers(e);
      body(e, acc...);
      (from_register<K, Access>(e, ::fusedopt::detail::pack_get<K>(tile).p[u].v[j]), ...);
    }
  }
  (store_slot<K, Access, W, U, Threads, StoreMode>(tile, bases, it), ...);
  return formed;
}

/// The body a vector_iteration is given as it is (its form() and for_tensor()).
template <class Body>
struct given_body {
  Body const& body;
  __device__ __forceinline__ Body const& operator()() const { return body; }
  __device__ __forceinline__ Body const& operator()(Body const& b) const { return b; }
};

/// Where a chunk's vectors lie: scalar head elements up to the first element aligned in every
/// slot, `vectors` vectors of W elements from `first`, a scalar tail from `vector_end`.
struct chunk_span {
  std::int64_t first, vectors, vector_end;
  int heads, tails;
};
template <int W, std::size_t S>
__device__ __forceinline__ chunk_span span_of(tensor_entry<S> const& te, std::int64_t begin, std::int32_t count)
{
  std::int64_t const end = begin + count;
  // First vector-aligned element at or after `begin` (the elements congruent to head mod W).
  std::int64_t first = begin + ((static_cast<std::int64_t>(te.head) - begin) & (W - 1));
  if (first > end) { first = end; }
  std::int64_t const vectors = (end - first) / W;
  std::int64_t const vector_end = first + vectors * W;
  return {first, vectors, vector_end, static_cast<int>(first - begin), static_cast<int>(end - vector_end)};
}

/// The addressing of the iteration at vector `v0` of a span.
template <int U, int Threads>
__device__ __forceinline__ iteration<U> iteration_at(chunk_span const& span, std::int64_t v0, std::uint64_t cache_policy,
                                                     int tid)
{
  iteration<U> it;
  it.first = span.first;
  it.v0 = v0;
  it.cache_policy = cache_policy;
  it.tid = tid;
#pragma unroll
  for (int u = 0; u < U; ++u) { it.valid[u] = v0 + u * Threads + tid < span.vectors; }
  return it;
}

/// The scalar elements of a span: a chunk's head and tail, one element per thread at most.
template <class Access, class Body, std::size_t S, class... Acc>
__device__ __forceinline__ void span_ends(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                          chunk_span const& span, int tid, Acc&... acc)
{
  if (tid < span.heads) {
    scalar_element<Access>(body, te.bases, te.index, begin + tid, acc...);
  } else if (tid < span.heads + span.tails) {
    scalar_element<Access>(body, te.bases, te.index, span.vector_end + (tid - span.heads), acc...);
  }
}

template <class Policy>
inline constexpr int load_mode_of = Policy::streaming_loads ? cache_streaming : cache_plain;
template <class Policy>
inline constexpr int store_mode_of = Policy::streaming_stores ? cache_streaming : cache_plain;

/// Vectors per iteration of a thread group.
template <int Unroll, int Threads>
inline constexpr std::int64_t iteration_vectors = static_cast<std::int64_t>(Threads) * Unroll;

/// Whether an update issues the next iteration's loads before this iteration's body
/// (iterations_ahead): where a thread holds one vector a slot and the rule looks factored
/// statistics up (factored.hpp). Such a body waits on dependent L2 loads (its line factors)
/// and is long, and without the lookahead the next vectors are not requested until it ends.
/// CAME over GPT-2 small on an H200: the update 711 -> 681 us (ncu), the step 1487 -> 1463 us.
/// Not where a thread already holds several vectors (the default shape: 146 -> 194 registers,
/// CAME over 200 small matrices 444 -> 505 us, Adafactor 820 -> 832 us), nor in reduction
/// passes (a warp per chunk at 90 -> 106 registers: CAME's 211 -> 254 us), nor for rules
/// without lookups, whose updates run at the copy's speed (docs/decisions.md).
template <class Access, int Unroll>
inline constexpr bool update_lookahead =
  Unroll == 1 && ::fusedopt::detail::factor_count_v<typename Access::rule_type> > 0;

/// The iterations of an update's span from vector `v0` on, each iteration's loads issued
/// before the previous iteration's body runs (a lookahead of one iteration a thread; the
/// block's threads all take the same number of iterations). The same per-element arithmetic
/// and order as iterations_from's.
template <class Policy, class Access, int W, int Unroll, int Threads, class Body, std::size_t S, std::size_t... K>
__device__ __forceinline__ void iterations_ahead(Body const& body, tensor_entry<S> const& te, chunk_span const& span,
                                                 std::int64_t v0, std::uint64_t cache_policy, int tid,
                                                 std::index_sequence<K...> slots)
{
  using tile_type = typename tile_of<Access, W, Unroll, std::index_sequence<K...>>::type;
  if (v0 >= span.vectors) { return; }
  iteration<Unroll> it = iteration_at<Unroll, Threads>(span, v0, cache_policy, tid);
  tile_type tile;
  (load_slot<K, Access, W, Unroll, Threads, load_mode_of<Policy>>(tile, te.bases, it), ...);
  for (;;) {
    std::int64_t const next_v0 = it.v0 + iteration_vectors<Unroll, Threads>;
    iteration<Unroll> const next = iteration_at<Unroll, Threads>(span, next_v0, cache_policy, tid);
    tile_type ahead;
    (load_slot<K, Access, W, Unroll, Threads, load_mode_of<Policy>>(ahead, te.bases, next), ...);
    tile_elements<Access, W, Unroll, Threads>(body, tile, te.index, it, slots);
    (store_slot<K, Access, W, Unroll, Threads, store_mode_of<Policy>>(tile, te.bases, it), ...);
    if (next_v0 >= span.vectors) { break; }
    tile = ahead;
    it = next;
  }
}

/// The iterations of a span from vector `v0` on.
template <class Policy, class Access, int W, int Unroll, int Threads, class Body, std::size_t S, class... Acc>
__device__ __forceinline__ void iterations_from(Body const& body, tensor_entry<S> const& te, chunk_span const& span,
                                                std::int64_t v0, std::uint64_t cache_policy, int tid, Acc&... acc)
{
  if constexpr (sizeof...(Acc) == 0 && update_lookahead<Access, Unroll>) {
    iterations_ahead<Policy, Access, W, Unroll, Threads>(body, te, span, v0, cache_policy, tid,
                                                         std::make_index_sequence<S>{});
  } else {
    given_body<Body> const given{body};
    for (; v0 < span.vectors; v0 += iteration_vectors<Unroll, Threads>) {
      vector_iteration<Access, W, Unroll, Threads, load_mode_of<Policy>, store_mode_of<Policy>>(
        given, given, te.bases, te.index, iteration_at<Unroll, Threads>(span, v0, cache_policy, tid),
        std::make_index_sequence<S>{}, acc...);
    }
  }
}

/// The vector path of process_chunk: scalar head elements up to the first vector-aligned one,
/// vectors of `W` elements (`Unroll` of them per thread and iteration), a scalar tail;
/// `Threads` threads share the chunk, this one of rank `tid`.
template <class Policy, class Access, int W, int Unroll, int Threads, class Body, std::size_t S, class... Acc>
__device__ __forceinline__ void process_vectors(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                                std::int32_t count, std::uint64_t cache_policy, int tid, Acc&... acc)
{
  static_assert(2 * (W - 1) < Threads, "a chunk's scalar head and tail take one element per thread at most");
  chunk_span const span = span_of<W>(te, begin, count);
  span_ends<Access>(body, te, begin, span, tid, acc...);
  iterations_from<Policy, Access, W, Unroll, Threads>(body, te, span, 0, cache_policy, tid, acc...);
}

/// The chunk worker: elements [begin, begin + count) of one tensor, shared by `Threads`
/// threads (this one of rank `tid`: the block in the update, a warp in a reduction pass),
/// updated (no `acc`) or accumulated into this thread's `acc` (a reduction pass, `Access` a
/// pass_access). Scalar head elements up to the first vector-aligned one, then vectors of `W`
/// elements (`Unroll` per thread and iteration), then a scalar tail; a tensor whose slots are
/// misaligned differently (head < 0) goes scalar, and so do all elements where quantized
/// states are bound (a reduction pass, or an update that only reads them: process_quantized
/// updates the ones it stores).
template <class Policy, class Access, int W, int Unroll, int Threads, class Body, std::size_t S, class... Acc>
__device__ __forceinline__ void process_chunk(Body const& body, tensor_entry<S> const& te, std::int64_t begin,
                                              std::int32_t count, std::uint64_t cache_policy, int tid, Acc&... acc)
{
  static_assert(sizeof...(Acc) <= 1, "one accumulator set per pass");
  static_assert((W & (W - 1)) == 0, "vector widths are powers of two");
  constexpr int threads = Threads;
  std::int64_t const end = begin + count;
  std::int64_t const index = te.index;

  if (Access::any_quantized || te.head < 0) {
    // The slots are misaligned differently: no element is aligned in all of them at once; or
    // quantized states are bound, whose codes are not vectors of elements (a pass over them
    // reads element by element; process_quantized updates them).
    for (std::int64_t i = begin + tid; i < end; i += threads) { scalar_element<Access>(body, te.bases, index, i, acc...); }
    return;
  }
  if constexpr (!Access::any_quantized) {
    process_vectors<Policy, Access, W, Unroll, Threads>(body, te, begin, count, cache_policy, tid, acc...);
  }
}

/// process_first_chunk's vector path (a chunk whose slots are aligned alike, no quantized slot).
template <class Policy, class Access, int W, int Unroll, int Threads, class MakeBody, std::size_t S>
__device__ __forceinline__ auto first_chunk_vectors(MakeBody const& make_body, tensor_entry<S> const& te,
                                                    std::int64_t begin, std::int32_t count,
                                                    std::uint64_t cache_policy, int tid)
{
  using body_type = decltype(make_body());
  static_assert(2 * (W - 1) < Threads, "a chunk's scalar head and tail take one element per thread at most");
  chunk_span const span = span_of<W>(te, begin, count);
  body_type const body = vector_iteration<Access, W, Unroll, Threads, load_mode_of<Policy>, store_mode_of<Policy>>(
    make_body, [&](body_type const& formed) { return ::fusedopt::detail::body_for_tensor(formed, te.index); }, te.bases,
    te.index, iteration_at<Unroll, Threads>(span, 0, cache_policy, tid), std::make_index_sequence<S>{});
  auto const tensor_body = ::fusedopt::detail::body_for_tensor(body, te.index);
  iterations_from<Policy, Access, W, Unroll, Threads>(tensor_body, te, span, iteration_vectors<Unroll, Threads>,
                                                      cache_policy, tid);
  span_ends<Access>(tensor_body, te, begin, span, tid);
  return body;
}

/// The update of a block's first chunk, the rule's body formed by `make_body()` only once the
/// chunk's first loads are in flight: the rule's prepare (Adam's bias corrections: integer
/// powers of the betas, a loop of dependent double multiplications as long as log2 of the
/// step, a root and a division; device scalars read) then takes its time while those loads
/// wait on memory, where before them it delayed every block's first access (at step 100 000,
/// 1% of W1's step: docs/tuning.md, "W1's ceiling, the rule's prepare, ..."). Returns the
/// body for the block's further chunks; the bits are those of process_chunk (every element is
/// updated alone, in the same arithmetic).
template <class Policy, class Access, int W, int Unroll, int Threads, class MakeBody, std::size_t S>
__device__ __forceinline__ auto process_first_chunk(MakeBody const& make_body, tensor_entry<S> const& te,
                                                    std::int64_t begin, std::int32_t count,
                                                    std::uint64_t cache_policy, int tid)
{
  using body_type = decltype(make_body());
  auto const element_by_element = [&] {
    body_type const body = make_body();
    process_chunk<Policy, Access, W, Unroll, Threads>(::fusedopt::detail::body_for_tensor(body, te.index), te, begin,
                                                      count, cache_policy, tid);
    return body;
  };
  if constexpr (Access::any_quantized) {
    return element_by_element();
  } else {
    if (te.head < 0) { return element_by_element(); }
    return first_chunk_vectors<Policy, Access, W, Unroll, Threads>(make_body, te, begin, count, cache_policy, tid);
  }
}

/// Folds the block summaries of a warp's lanes: the largest magnitude (as bits) and whether any
/// lane saw a change, for every quantized slot the rule stores. Every lane gets the result.
template <class Access>
__device__ __forceinline__ void warp_summary(typename Access::block_summary& s)
{
  Access::for_each_stored_quantized(s, [](std::uint32_t& max_bits, bool& changed) {
    constexpr unsigned all_lanes = 0xffffffffu;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    // One warp-wide reduction (REDUX) where the shuffles took five dependent rounds of two
    // instructions: 3% fewer instructions in the 8-bit update, 3.5-4% faster on an H200, up to
    // 3% on an H100 (docs/quantized_states.md, "The block's maximum in one instruction").
    max_bits = __reduce_max_sync(all_lanes, max_bits);
#else
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      std::uint32_t const other = __shfl_xor_sync(all_lanes, max_bits, offset);
      max_bits = other > max_bits ? other : max_bits;
    }
#endif
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

/// The block of quantized states holding element `i` (never negative) of a tensor: an unsigned
/// division is a shift, where the signed one took a sign fix-up.
template <std::int64_t Block>
__device__ __forceinline__ std::uint64_t block_of(std::int64_t i)
{
  return static_cast<std::uint64_t>(i) / static_cast<std::uint64_t>(Block);
}

/// Four consecutive elements of a slot of type T in one access (8, 16 or 32 bytes).
template <class T>
struct alignas(4 * sizeof(T) < 16 ? 4 * sizeof(T) : 16) quad {
  T v[4];
};

/// A lane's codes of one whole block of a quantized slot: G words, group g's four codes in word g
/// (elements 128 g + 4 l .. + 3 for lane l), side by side in the block's codes (lane order,
/// blockwise8::code_position), so one access of up to 16 bytes moves them.
template <int G>
struct alignas(G >= 4 ? 16 : 4 * G) lane_codes {
  std::uint32_t w[G];
};
/// Elements of lane `lane`'s group g (elements 128 g + 4 lane .. + 3 of a block) inside the
/// first `count` elements of the block: 4 or more where the whole group is, 0 or less where
/// none of it is.
__device__ __forceinline__ int group_inside(int count, int g, int lane) { return count - (g * 128 + 4 * lane); }
/// Lane `lane`'s codes of the whole block at element `first` (a multiple of the block) of a
/// tensor whose codes start at `codes`: the block's codes start `first` bytes after them.
template <int G, class Byte>
__device__ __forceinline__ auto lane_codes_at(Byte* codes, std::int64_t first, int lane)
{
  using word = std::conditional_t<std::is_const_v<Byte>, lane_codes<G> const, lane_codes<G>>;
  return reinterpret_cast<word*>(codes + first) + lane;
}

/// What a lane reads of slot K of a whole block before it computes (quantized worker): G
/// groups of four consecutive elements, lane l's group g being elements 128 g + 4 l .. + 3 of
/// the block: a quad of a plain slot, or the lane's codes (lane_codes) and the block's scale of
/// a quantized one; nothing for a slot the rule does not read. `fetch` issues the loads,
/// `decode` turns them into the elements' values (dequantized through the CTA's maps), so
/// that the loads of the next block can be in flight while this one computes.
template <class Access, std::size_t K, int G, bool Load = Access::loads[K], bool Quantized = Access::quantized[K]>
struct raw_slot {
  __device__ __forceinline__ void fetch(void* const*, std::int64_t, int) {}
  __device__ __forceinline__ void fetch_tail(void* const*, std::int64_t, int, int) {}
  __device__ __forceinline__ void decode(typename Access::element_type* e, block_maps<Access> const&) const
  {
#pragma unroll
    for (int j = 0; j < 4 * G; ++j) { e[j].at(K) = typename Access::value_type(0); }
  }
};
template <class Access, std::size_t K, int G>
struct raw_slot<Access, K, G, true, false> {
  using T = typename Access::template element_t<K>;
  quad<T> q[G];
  /// Where lane `lane`'s group g of the block at element `first` is (staged_slot copies it too).
  static __device__ __forceinline__ quad<T> const* source(void* const* bases, std::int64_t first, int lane, int g)
  {
    return reinterpret_cast<quad<T> const*>(static_cast<T const*>(bases[K]) + first + g * 128 + 4 * lane);
  }
  __device__ __forceinline__ void fetch(void* const* bases, std::int64_t first, int lane)
  {
#pragma unroll
    for (int g = 0; g < G; ++g) { q[g] = *source(bases, first, lane, g); }
  }
  /// The same for a tensor's last block, of `count` elements (fewer than the block): a group
  /// inside the tensor in one access, one that straddles its end element by element, nothing
  /// (zeros) past it.
  __device__ __forceinline__ void fetch_tail(void* const* bases, std::int64_t first, int lane, int count)
  {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      int const inside = group_inside(count, g, lane);
      if (inside >= 4) {
        q[g] = *source(bases, first, lane, g);
      } else {
        // Element pointers, not the quad's: no access of the group may reach past the tensor.
        T const* const from = static_cast<T const*>(bases[K]) + first + g * 128 + 4 * lane;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          q[g].v[j] = T(0);
          if (j < inside) { q[g].v[j] = from[j]; }
        }
      }
    }
  }
  __device__ __forceinline__ void decode(typename Access::element_type* e, block_maps<Access> const&) const
  {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int j = 0; j < 4; ++j) { e[4 * g + j].at(K) = ::fusedopt::to_opmath<typename Access::value_type>(q[g].v[j]); }
    }
  }
};
template <class Access, std::size_t K, int G>
struct raw_slot<Access, K, G, true, true> {
  using T = typename Access::template element_t<K>;
  lane_codes<G> codes;
  float absmax;
  /// Lane `lane`'s codes and the scale of the block at element `first` (staged_slot copies
  /// from here too).
  static __device__ __forceinline__ lane_codes<G> const* codes_of(void* const* bases, std::int64_t first, int lane)
  {
    return lane_codes_at<G>(static_cast<std::uint8_t const*>(bases[K]), first, lane);
  }
  static __device__ __forceinline__ float const* scale_of(void* const* bases, std::int64_t first)
  {
    return reinterpret_cast<float const*>(::fusedopt::detail::scale_address(
      static_cast<std::uint8_t const*>(bases[K]), block_of<T::block_elements>(first)));
  }
  __device__ __forceinline__ void fetch(void* const* bases, std::int64_t first, int lane)
  {
    codes = *codes_of(bases, first, lane);
    absmax = *scale_of(bases, first);
  }
  /// A tensor's last block: its codes are stored for the whole block (blockwise8::bytes_for).
  __device__ __forceinline__ void fetch_tail(void* const* bases, std::int64_t first, int lane, int)
  {
    fetch(bases, first, lane);
  }
  __device__ __forceinline__ void decode(typename Access::element_type* e, block_maps<Access> const& maps) const
  {
    auto const& map = maps.template get<typename T::map_type>();
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        e[4 * g + j].at(K) =
          ::fusedopt::detail::dequantize(map, static_cast<std::uint8_t>(codes.w[g] >> (8 * j)), absmax);
      }
    }
  }
};

/// A lane's reads of every slot of one whole block (raw_slot).
template <class Access, int G, class Slots = std::make_index_sequence<Access::num_slots>>
struct raw_block;
template <class Access, int G, std::size_t... K>
struct raw_block<Access, G, std::index_sequence<K...>> {
  ::fusedopt::detail::pack<raw_slot<Access, K, G>...> slots;
  __device__ __forceinline__ void fetch(void* const* bases, std::int64_t first, int lane)
  {
    (::fusedopt::detail::pack_get<K>(slots).fetch(bases, first, lane), ...);
  }
  __device__ __forceinline__ void fetch_tail(void* const* bases, std::int64_t first, int lane, int count)
  {
    (::fusedopt::detail::pack_get<K>(slots).fetch_tail(bases, first, lane, count), ...);
  }
  __device__ __forceinline__ void decode(typename Access::element_type* e, block_maps<Access> const& maps) const
  {
    (::fusedopt::detail::pack_get<K>(slots).decode(e, maps), ...);
  }
};

/// `Bytes` (4, 8 or 16) from global memory to this thread's place in shared memory without
/// waiting (`cp.async`, sm_80 and newer; before, an ordinary load and store): this thread's
/// copies are complete after copies_wait_all().
template <int Bytes>
__device__ __forceinline__ void copy_async(void* shared, void const* global)
{
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  auto const to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(to), "l"(global), "n"(Bytes) : "memory");
  }
#else
  struct alignas(Bytes) piece {
    unsigned char b[Bytes];
  };
  *static_cast<piece*>(shared) = *static_cast<piece const*>(global);
#endif
}
/// Closes this thread's group of copy_async copies.
__device__ __forceinline__ void copies_commit()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
/// Waits until this thread's committed copy_async copies are complete.
__device__ __forceinline__ void copies_wait_all()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
}

/// A warp's copy in shared memory of what raw_slot holds, each lane's bytes in its own column
/// (lane l's group g of a plain slot at q[g][l]: a warp's reads and copies touch consecutive
/// words, no bank conflicts): the next block's loads land here while the warp computes.
template <class Access, std::size_t K, int G, bool Load = Access::loads[K], bool Quantized = Access::quantized[K]>
struct staged_slot {
  __device__ __forceinline__ void fetch_async(void* const*, std::int64_t, int) {}
  __device__ __forceinline__ void load(raw_slot<Access, K, G>&, int) const {}
};
template <class Access, std::size_t K, int G>
struct staged_slot<Access, K, G, true, false> {
  using T = typename Access::template element_t<K>;
  quad<T> q[G][32];
  __device__ __forceinline__ void fetch_async(void* const* bases, std::int64_t first, int lane)
  {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      copy_async<sizeof(quad<T>)>(&q[g][lane], raw_slot<Access, K, G>::source(bases, first, lane, g));
    }
  }
  __device__ __forceinline__ void load(raw_slot<Access, K, G>& r, int lane) const
  {
#pragma unroll
    for (int g = 0; g < G; ++g) { r.q[g] = q[g][lane]; }
  }
};
template <class Access, std::size_t K, int G>
struct staged_slot<Access, K, G, true, true> {
  using T = typename Access::template element_t<K>;
  lane_codes<G> codes[32];
  float absmax[32];
  __device__ __forceinline__ void fetch_async(void* const* bases, std::int64_t first, int lane)
  {
    using raw = raw_slot<Access, K, G>;
    constexpr int piece = sizeof(lane_codes<G>) < 16 ? static_cast<int>(sizeof(lane_codes<G>)) : 16;
    auto const* from = reinterpret_cast<unsigned char const*>(raw::codes_of(bases, first, lane));
#pragma unroll
    for (int b = 0; b < static_cast<int>(sizeof(lane_codes<G>)); b += piece) {
      copy_async<piece>(reinterpret_cast<unsigned char*>(&codes[lane]) + b, from + b);
    }
    copy_async<4>(&absmax[lane], raw::scale_of(bases, first));
  }
  __device__ __forceinline__ void load(raw_slot<Access, K, G>& r, int lane) const
  {
    r.codes = codes[lane];
    r.absmax = absmax[lane];
  }
};

/// A warp's staged copy of every slot of one whole block (staged_slot).
template <class Access, int G, class Slots = std::make_index_sequence<Access::num_slots>>
struct staged_block;
template <class Access, int G, std::size_t... K>
struct staged_block<Access, G, std::index_sequence<K...>> {
  ::fusedopt::detail::pack<staged_slot<Access, K, G>...> slots;
  __device__ __forceinline__ void fetch_async(void* const* bases, std::int64_t first, int lane)
  {
    (::fusedopt::detail::pack_get<K>(slots).fetch_async(bases, first, lane), ...);
  }
  __device__ __forceinline__ void load(raw_block<Access, G>& r, int lane) const
  {
    (::fusedopt::detail::pack_get<K>(slots).load(::fusedopt::detail::pack_get<K>(r.slots), lane), ...);
  }
};

/// Groups of four consecutive elements a lane takes in a whole block of `Access`'s quantized
/// slots (process_quantized): one where a block is not a multiple of 128 elements (such blocks
/// go element by element).
template <class Access>
inline constexpr int quantized_groups_v =
  Access::block_elements % 128 == 0 ? static_cast<int>(Access::block_elements / 128) : 1;

/// Four floats rounded to bfloat16, nearest even: on sm_80 and newer, where none is a NaN, by
/// the hardware two at a time (cvt.rn.bf16x2.f32), which gives float_to_bfloat16_bits's bits
/// for every float that is not a NaN (tests/cuda/mixed_precision.cu checks all 2^32); its NaN is
/// the canonical 0x7fff, so a NaN goes through float_to_bfloat16_bits, which keeps a quiet NaN's
/// sign and payload as the host does. Two conversions where the integer rounding took about 28
/// instructions: the 8-bit update over bf16 parameters waits on instruction issue.
__device__ __forceinline__ quad<::fusedopt::bfloat16> round_to_bfloat16(float a, float b, float c, float d)
{
  quad<::fusedopt::bfloat16> q;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (!(a != a || b != b || c != c || d != d)) {
    __nv_bfloat162 const low = __floats2bfloat162_rn(a, b);
    __nv_bfloat162 const high = __floats2bfloat162_rn(c, d);
    std::memcpy(&q.v[0], &low, sizeof low);
    std::memcpy(&q.v[2], &high, sizeof high);
    return q;
  }
#endif
  q.v[0] = ::fusedopt::bfloat16(a);
  q.v[1] = ::fusedopt::bfloat16(b);
  q.v[2] = ::fusedopt::bfloat16(c);
  q.v[3] = ::fusedopt::bfloat16(d);
  return q;
}

/// Stores e[0..3] into elements i..i+3 of slot K, a written slot that is not quantized, as one
/// quad; with `Tail`, only the first `inside` of them (all four as one quad where they are).
template <class Access, std::size_t K, bool Tail>
__device__ __forceinline__ void store_plain_quad(typename Access::element_type const* e, void* const* bases,
                                                 std::int64_t i, int inside)
{
  using T = typename Access::template element_t<K>;
  if constexpr (Access::stores[K] && !Access::quantized[K]) {
    quad<T> q;
    if constexpr (std::is_same_v<T, ::fusedopt::bfloat16> && std::is_same_v<typename Access::value_type, float>) {
      q = round_to_bfloat16(e[0].at(K), e[1].at(K), e[2].at(K), e[3].at(K));
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) { q.v[j] = ::fusedopt::from_opmath<T>(e[j].at(K)); }
    }
    if (!Tail || inside >= 4) {
      *reinterpret_cast<quad<T>*>(static_cast<T*>(bases[K]) + i) = q;
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < inside) { static_cast<T*>(bases[K])[i + j] = q.v[j]; }
      }
    }
  }
}

/// Stores the codes of a lane's elements e[0 .. 4 Groups) of a whole block into block `block`
/// of slot K, a written quantized slot, when the block is rewritten: the lane's 4 Groups codes
/// side by side (lane order), one store of up to 16 bytes. With `Tail` (a tensor's last block,
/// of `count` elements), the codes past the tensor's end keep the bytes they had.
template <class Access, int Groups, bool Tail, std::size_t K>
__device__ __forceinline__ void store_block_codes(typename Access::element_type const* e, void* const* bases,
                                                  std::uint64_t block, int lane,
                                                  typename Access::block_summary const& summary,
                                                  block_maps<Access> const& maps, int count)
{
  using T = typename Access::template element_t<K>;
  if constexpr (Access::stores[K] && Access::quantized[K]) {
    if (Access::template rewrites<K>(summary)) {
      auto* const codes = lane_codes_at<Groups>(static_cast<std::uint8_t*>(bases[K]),
                                                static_cast<std::int64_t>(block * T::block_elements), lane);
      float const inverse = ::fusedopt::detail::inverse_scale(::fusedopt::detail::bits_float(summary.max_bits[K]));
      auto const& map = maps.template get<typename T::map_type>();
      lane_codes<Groups> words;
      lane_codes<Groups> before{};  // with Tail: the bytes kept past the tensor's end
      if constexpr (Tail) { before = *codes; }
#pragma unroll
      for (int g = 0; g < Groups; ++g) {
        int const inside = Tail ? group_inside(count, g, lane) : 4;
        words.w[g] = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // Past the tensor's end the lane holds no updated value (the block's absmax does not
          // bound it: quantizing it could search outside the map): a zero, its byte kept below.
          auto const value = j < inside ? e[4 * g + j].at(K) : 0.f;
          words.w[g] |= std::uint32_t{::fusedopt::detail::quantize(map, value, inverse)} << (8 * j);
        }
        if constexpr (Tail) {
          std::uint32_t const kept = inside >= 4 ? 0u : inside <= 0 ? 0xffffffffu : 0xffffffffu << (8 * inside);
          words.w[g] = (words.w[g] & ~kept) | (before.w[g] & kept);
        }
      }
      *codes = words;
    }
  }
}

template <class Access, int Groups, bool Tail, std::size_t... K>
__device__ __forceinline__ void store_block_codes(typename Access::element_type const* e, void* const* bases,
                                                  std::uint64_t block, int lane,
                                                  typename Access::block_summary const& summary,
                                                  block_maps<Access> const& maps, int count, std::index_sequence<K...>)
{
  (store_block_codes<Access, Groups, Tail, K>(e, bases, block, lane, summary, maps, count), ...);
}

template <class Access, bool Tail, std::size_t... K>
__device__ __forceinline__ void store_plain_quads(typename Access::element_type const* e, void* const* bases,
                                                  std::int64_t i, int inside, std::index_sequence<K...>)
{
  (store_plain_quad<Access, K, Tail>(e, bases, i, inside), ...);
}

/// The element size of the widest slot of `Access` that is read or written and not quantized
/// (what Policy::quantized_update chooses the quantized worker's shape by); 0 if there is none.
template <class Access, std::size_t... K>
constexpr std::size_t widest_plain_bytes(std::index_sequence<K...>)
{
  std::size_t widest = 0;
  ((widest = (Access::loads[K] || Access::stores[K]) && !Access::quantized[K] &&
                 sizeof(typename Access::template element_t<K>) > widest
               ? sizeof(typename Access::template element_t<K>)
               : widest),
   ...);
  return widest;
}

template <class Access>
inline constexpr std::size_t widest_plain_bytes_v =
  widest_plain_bytes<Access>(std::make_index_sequence<Access::num_slots>{});

/// The bytes of one element of every slot `Access` loads (quantized states excepted), at
/// least 1 (a pass that reads only quantized states goes element by element, unrolled or not).
template <class Access, std::size_t... K>
constexpr std::size_t loaded_bytes(std::index_sequence<K...>)
{
  std::size_t const bytes =
    ((Access::loads[K] && !Access::quantized[K] ? sizeof(typename Access::template element_t<K>) : 0) + ... + 0);
  return bytes > 0 ? bytes : 1;
}

/// Vectors of `W` elements a lane of a reduction pass (`Access` a pass_access) loads per
/// iteration of every slot it reads: Policy::pass_bytes_per_lane over all those slots, at
/// least one (docs/tuning.md, "Reduction passes").
template <class Policy, class Access, int W>
inline constexpr int pass_vectors_per_lane = vectors_for(
  Policy::pass_bytes_per_lane, W * static_cast<int>(loaded_bytes<Access>(std::make_index_sequence<Access::num_slots>{})));

/// The quantized worker's shape for `Access` under `Policy` on memory that is fast (or not)
/// beside the SMs: blocks per SM and lookahead.
template <class Policy, class Access, bool FastMemory>
inline constexpr quantized_shape quantized_shape_v =
  Policy::quantized_update(widest_plain_bytes_v<Access>, FastMemory);
/// Whether the two memory speeds take different shapes (then both kernels are compiled).
template <class Policy, class Access>
inline constexpr bool quantized_shapes_differ_v =
  !(quantized_shape_v<Policy, Access, false> == quantized_shape_v<Policy, Access, true>);
template <class Policy, class Access, bool FastMemory>
inline constexpr int quantized_blocks_per_sm_v = quantized_shape_v<Policy, Access, FastMemory>.blocks_per_sm;

/// A block's staged copies, one staged_block per warp (the shape with quantized_shape::staged_next).
template <class Policy, class Access>
using warp_stages = staged_block<Access, quantized_groups_v<Access>>[Policy::block_threads / 32];
/// Bytes of shared memory a block of the quantized update takes beside its maps: warp_stages
/// where the shape stages its next block, none in the others. The persistent grid counts them
/// (launch_update).
template <class Policy, class Access, bool FastMemory>
inline constexpr std::size_t quantized_stage_bytes_v =
  quantized_shape_v<Policy, Access, FastMemory>.staged_next ? sizeof(warp_stages<Policy, Access>) : 0;

/// Where a warp of the quantized worker stands: one of its blocks, elements [first, first +
/// block) of the tensor (the block may end early at `end`, the chunk's end).
template <std::size_t S>
struct block_cursor {
  std::int64_t first;
  std::int64_t end;
  tensor_entry<S> tensor;
};

/// The update where quantized states are stored, by a persistent grid over the chunks of
/// `table` (chunks start at multiples of the block size, make_layout). One warp owns a block;
/// a warp's unit of work is one of a chunk's `warps` slots, slot s its blocks s, s + warps, ...
/// (unit u: slot u % warps of chunk u / warps). Each warp of the grid takes its first three
/// units round-robin (w, w + the grid's warps, ...), then those `queue` hands it, a ticket of
/// the shape's `units_per_ticket` at a time, in the order the warps ask (a warp asks when its
/// last ticket comes in), so warps on SMs that get more of the memory's time take more units;
/// without a queue (cuda::apply, a shape without one, a launch of few units a warp) every
/// unit is dealt round-robin, with which the first and the last warp of some H100s finished
/// 7% (fp32 parameters) to 20% (bf16) of the step apart (docs/quantized_states.md, "Work from a
/// queue"). In
/// a whole block of a tensor whose other slots are aligned for 4-element accesses (head 0,
/// slot_geometry::head), lane l takes elements 128 g + 4 l .. 128 g + 4 l + 3 for each g: one
/// access per slot and four elements (16 bytes of fp32, 4 of codes), each warp access 32
/// consecutive such groups; with the lookahead (quantized_shape_v) the warp issues the loads of its
/// next block (raw_block) before it computes this one, so their memory latency is hidden
/// behind its arithmetic. Where the shape says so (tails_in_lanes) a tensor's last, partial
/// block takes the same layout, its lanes loading, updating and storing only the elements
/// inside the tensor (and keeping the codes past its end); in the other shapes, and where the
/// slots are misaligned, lane l takes elements l, l + 32, ... one by one. The lanes update their elements in
/// registers, store the slots that are not quantized (the parameters) at once, fold the
/// summaries over the warp (warp-wide reductions, no other launch), store their codes with the block's
/// new scale, and lane 0 stores the scale: the steps of detail::access::update_block, the same
/// bits. Both paths look their codes up in `maps` (the CTA's shared copy); the element path
/// through the host's code (detail::access::load and store_in_block given these maps).
template <class Policy, class Access, bool FastMemory, class Body, class Table>
__device__ __forceinline__ void process_quantized(Body const& body, Table const& table, block_maps<Access> const& maps,
                                                  work_queue* queue)
{
  constexpr int lanes = 32;
  static_assert(Policy::block_threads % lanes == 0, "a block of the CUDA backend is whole warps");
  constexpr int warps = Policy::block_threads / lanes;
  constexpr std::int64_t block = Access::block_elements;
  constexpr int per_lane = static_cast<int>(block / lanes);
  constexpr bool quads = block % (4 * lanes) == 0;
  constexpr int groups = quantized_groups_v<Access>;
  constexpr std::size_t S = Access::num_slots;
  constexpr quantized_shape shape = quantized_shape_v<Policy, Access, FastMemory>;
  constexpr bool lookahead = shape.lookahead;
  static_assert(!lookahead || shape.lookahead_blocks == 1 || shape.lookahead_blocks == 2,
                "fusedopt: quantized_shape::lookahead_blocks is 1 or 2");
  static_assert(!(lookahead && shape.staged_next), "fusedopt: quantized_shape::staged_next is for shapes without lookahead");
  using cursor = block_cursor<S>;
  int const lane = static_cast<int>(threadIdx.x) % lanes;
  int const warp = static_cast<int>(threadIdx.x) / lanes;

  // The warp's next block, crossing into its next unit that has one. With
  // two blocks of lookahead the entry of the unit after that is loaded at each crossing, a
  // crossing ahead of its use, and the tensor's entry only where the chunk is of another tensor
  // (rare for large tensors): Nsight Compute put a fifth of that kernel's stall samples on these
  // two dependent table loads when every crossing made both. The shapes bound by instruction
  // issue lost 2-3% with it (docs/quantized_states.md, "Crossing into the next chunk").
  // The entry ahead is 16 bytes loaded as one vector, outside the loop over chunks that have no
  // block for this warp: the load then goes straight into the registers that carry it to the
  // next crossing (loaded into others, its move into these made the warp wait for the load at
  // once: a tenth of the stall samples).
  constexpr bool two_ahead = lookahead && shape.lookahead_blocks == 2;
  // The loops that look past a crossing before they reach it (two blocks ahead; the staged
  // loop, which stages the first block of the warp's next chunk) carry that chunk's entry.
  constexpr bool entry_ahead = two_ahead || shape.staged_next;
  // Units in 32 bits (launch_update checks that they fit): fewer registers.
  std::uint32_t const num_units = static_cast<std::uint32_t>(table.num_chunks) * warps;
  std::uint32_t const grid_warps = gridDim.x * warps;
  // The queue (quantized_shape::units_per_ticket > 0, a plan's launch of at least
  // `queue_from_units_per_warp` units a warp: below it the round-robin deal is within a unit of
  // even and the queue cost more than it balanced: W1 lost 4-7 us with its first version on an
  // H100 and an H200). Its tickets, counted past `head`: the first three units of every warp are its own
  // (round-robin: the first request, made at the start, has two units to come back in, while
  // every warp asks at once); then a ticket is `ticket_units` units in a row, taken one after
  // the other; the last `2 ticket_units grid_warps` units go a unit a ticket, so that the warps
  // end within about a unit of each other.
  constexpr std::uint32_t ticket_units = static_cast<std::uint32_t>(shape.units_per_ticket);
  static_assert(shape.units_per_ticket >= 0, "fusedopt: quantized_shape::units_per_ticket is 0 (no queue) or more");
  constexpr std::uint64_t queue_from_units_per_warp = 16;
  bool const from_queue =
    ticket_units > 0 && queue != nullptr && std::uint64_t{num_units} >= queue_from_units_per_warp * grid_warps;
  std::uint32_t const head = 3 * grid_warps;
  std::uint64_t const unbatched = head + (ticket_units > 1 ? std::uint64_t{2} * ticket_units * grid_warps : 0);
  std::uint32_t const batched_tickets =
    ticket_units > 1 && num_units > unbatched ? static_cast<std::uint32_t>((num_units - unbatched) / ticket_units) : 0;
  // The unit the warp enters at its next crossing, the end of the units its ticket gave it,
  // and (lane 0) its next ticket, asked for when the last came in (its latency hides behind the
  // warp's units).
  std::uint32_t following = blockIdx.x * warps + warp;
  std::uint32_t batch_end = following + 1;
  std::uint32_t answer = 0;
  if (from_queue && lane == 0) { answer = atomicAdd(&queue->handed, 1u) + head; }
  // The unit after `following` (round-robin without the queue): the warp's next of the head,
  // the next of its ticket's, or the next ticket's first, asking for the one after.
  auto unit_after_following = [&]() -> std::uint32_t {
    if (!from_queue) { return following + grid_warps; }
    if (following + 1 < batch_end) { return following + 1; }
    if (following + grid_warps < head) {
      batch_end = following + grid_warps + 1;
      return following + grid_warps;
    }
    std::uint32_t const ticket = __shfl_sync(0xffffffffu, answer, 0);
    if (lane == 0) { answer = atomicAdd(&queue->handed, 1u) + head; }
    std::uint32_t const past_head = ticket - head;
    std::uint32_t first = head + (ticket_units - 1) * batched_tickets + past_head;  // past the batches, a unit a ticket
    std::uint32_t count = 1;
    if constexpr (ticket_units > 1) {
      if (past_head < batched_tickets) {
        first = head + ticket_units * past_head;
        count = ticket_units;
      }
    }
    batch_end = first + count;
    return first;
  };
  uint4 upcoming{};  // with the entry ahead: the entry of `following`'s chunk
  if (entry_ahead && following < num_units) { upcoming = chunk_bits(table, blockIdx.x); }
  std::int32_t tensor_in_cursor = -1;  // with the entry ahead: the table's entry the advancing cursor holds
  // The first block of `unit`, whose chunk's entry is `entry` (entering it, or looking at it
  // from the crossing before).
  auto first_block = [](chunk_entry const& entry, std::uint32_t unit) {
    return entry.begin + static_cast<std::int64_t>(unit % warps) * block;
  };
  auto enter = [&](cursor& c, chunk_entry const& entry, std::uint32_t unit) {
    if (!entry_ahead || entry.tensor != tensor_in_cursor) {
      c.tensor = table.tensor(entry.tensor);
      tensor_in_cursor = entry.tensor;
    }
    c.first = first_block(entry, unit);
    c.end = entry.begin + entry.count;
  };
  auto advance = [&](cursor& c) {
    c.first += warps * block;
    if (c.first < c.end) { return true; }
    bool carried = entry_ahead;  // `upcoming` holds the entry of the unit entered
    for (;;) {
      std::uint32_t const unit = following;
      if (unit >= num_units) { return false; }
      following = unit_after_following();
      enter(c, carried ? chunk_of_bits(upcoming) : table.chunk(unit / warps), unit);
      if (c.first < c.end) { break; }
      // A unit without a block (a slot past a tensor's short last chunk): on to the next,
      // waiting for its entry.
      carried = false;
    }
    // Past the last unit the load reads chunk 0's entry (a valid address, never used).
    if constexpr (entry_ahead) { upcoming = chunk_bits(table, following < num_units ? following / warps : 0u); }
    return true;
  };
  auto whole = [&](cursor const& c) { return quads && c.tensor.head == 0 && c.first + block <= c.end; };
  // In the lanes' layout (fetched ahead, computed on the whole blocks' code): whole blocks and,
  // where the shape asks for it (quantized_shape::tails_in_lanes), a tensor's last block with
  // its slots aligned as a whole one's.
  constexpr bool tails_in_lanes = shape.tails_in_lanes;
  static_assert(!tails_in_lanes || lookahead, "fusedopt: quantized_shape::tails_in_lanes is for shapes with lookahead");
  auto lanes_layout = [&](cursor const& c) {
    return tails_in_lanes ? quads && c.tensor.head == 0 : whole(c);
  };
  auto fetch_block = [&](raw_block<Access, quantized_groups_v<Access>>& r, cursor const& c) {
    if (!tails_in_lanes || c.first + block <= c.end) {
      r.fetch(c.tensor.bases, c.first, lane);
    } else {
      r.fetch_tail(c.tensor.bases, c.first, lane, static_cast<int>(c.end - c.first));
    }
  };

  using element = typename Access::element_type;
  using raw = raw_block<Access, groups>;
  // One block. Where it is whole its elements come from the lanes' loads `data`, decoded here,
  // or with `data` null from `decoded`, where the two-block lookahead decoded them before the
  // loads of a later block went into the same registers; a block that is not whole loads element
  // by element. The elements live in `decoded`, or in registers of their own with `decoded`
  // null: which of the two the caller picks moved the register allocation (no spills for 16-bit
  // parameters with the caller's array, 1% faster with its own for fp32 on the H200).
  auto update_block = [&](cursor const& c, raw const* data, element* decoded) {
    element own[per_lane];
    element* const e = decoded != nullptr ? decoded : own;
    bool const is_whole = whole(c);
    auto const tensor_body = ::fusedopt::detail::body_for_tensor(body, c.tensor.index);
    auto update = [&](element& x, std::int64_t i, typename Access::block_summary& summary) {
      x.set_position(c.tensor.index, i);
      Access::clear_registers(x);
      auto const before = x;
      tensor_body(x);
      Access::summarize(summary, x, before);
    };
    void* const* bases = c.tensor.bases;
    std::uint64_t const block_index = block_of<block>(c.first);
    auto summary = Access::empty_summary();
    // A block in the lanes' layout: whole, or (`tail`) a tensor's last block of `count`
    // elements, whose lanes update and store only the elements inside the tensor.
    auto in_lanes = [&](auto tail, int count) {
      constexpr bool is_tail = decltype(tail)::value;
      if (data != nullptr) { data->decode(e, maps); }
#pragma unroll
      for (int g = 0; g < per_lane / 4; ++g) {
        int const inside = group_inside(count, g, lane);
#pragma unroll
        for (int j = 4 * g; j < 4 * g + 4; ++j) {
          if (!is_tail || j % 4 < inside) { update(e[j], c.first + g * 4 * lanes + 4 * lane + j % 4, summary); }
        }
        // The slots stored as they are go out before the warp's fold: their registers are free
        // sooner and the stores overlap the fold.
        store_plain_quads<Access, is_tail>(e + 4 * g, bases, c.first + g * 4 * lanes + 4 * lane, inside,
                                           std::make_index_sequence<S>{});
      }
      warp_summary<Access>(summary);
      store_block_codes<Access, per_lane / 4, is_tail>(e, bases, block_index, lane, summary, maps, count,
                                                       std::make_index_sequence<S>{});
    };
    if (is_whole) {
      in_lanes(std::false_type{}, static_cast<int>(block));
    } else if (tails_in_lanes && lanes_layout(c)) {
      in_lanes(std::true_type{}, static_cast<int>(c.end - c.first));
    } else {
      // Element by element (slots misaligned for the lanes' layout; a tensor's last block in
      // the shapes without tails_in_lanes), the codes looked up in the block's maps: through the
      // maps in global memory W3's partial blocks took 28% of its step
      // (docs/quantized_states.md, "Partial blocks").
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        std::int64_t const i = c.first + lane + j * lanes;
        if (i < c.end) {
          Access::load(e[j], bases, i, std::make_index_sequence<S>{}, maps);
          update(e[j], i, summary);
        }
      }
      warp_summary<Access>(summary);
#pragma unroll
      for (int j = 0; j < per_lane; ++j) {
        std::int64_t const i = c.first + lane + j * lanes;
        if (i < c.end) { Access::store_in_block(e[j], bases, i, summary, std::make_index_sequence<S>{}, maps); }
      }
    }
    if (lane == 0) { Access::store_scales(bases, static_cast<std::int64_t>(block_index), summary); }
  };

  // `first` is the same in every lane of a warp: the warp-wide reductions see all 32 lanes.
  cursor at{0, 0, {}};
  bool more = advance(at);
  if constexpr (two_ahead) {
    // Two blocks in flight: the loads of the block after next are issued before this one
    // computes, into the registers this one's loads were decoded from. The buffers alternate,
    // so the loop takes two blocks per turn (written twice rather than copied between them).
    cursor near = at;
    bool near_more = more;
    raw first_data, second_data;
    if (near_more && lanes_layout(near)) { fetch_block(first_data, near); }
    bool far_more = near_more && advance(at);
    if (far_more && lanes_layout(at)) { fetch_block(second_data, at); }
    auto turn = [&](raw& data) {
      cursor const c = near;
      element e[per_lane];
      if (lanes_layout(c)) { data.decode(e, maps); }
      near = at;
      near_more = far_more;
      far_more = far_more && advance(at);
      if (far_more && lanes_layout(at)) { fetch_block(data, at); }
      update_block(c, nullptr, e);
    };
    while (near_more) {
      turn(first_data);
      if (!near_more) { break; }
      turn(second_data);
    }
  } else if constexpr (lookahead) {
    // Decoding before the next loads go into the same registers, as above, was 2-3% slower
    // here (the H200, bound by issue) than this copy.
    raw ahead;
    if (more && lanes_layout(at)) { fetch_block(ahead, at); }
    while (more) {
      cursor const c = at;
      raw const data = ahead;
      more = advance(at);
      if (more && lanes_layout(at)) { fetch_block(ahead, at); }
      update_block(c, &data, nullptr);
    }
  } else if constexpr (shape.staged_next) {
    // One cursor live, no registers for a lookahead: the warp's next block is copied into shared
    // memory (cp.async) while this one computes, in the same chunk or, through the entry of the
    // warp's next chunk carried from the last crossing, the first block of that chunk where it
    // is of the same tensor (another tensor's block is loaded when it starts: its entry is not
    // in registers yet). The staged bytes are decoded (read into registers and used) before the
    // next copies into the same place are issued.
    __shared__ warp_stages<Policy, Access> stages;
    auto& stage = stages[warp];
    bool staged = more && whole(at);
    if (staged) { stage.fetch_async(at.tensor.bases, at.first, lane); }
    copies_commit();
    while (more) {
      element e[per_lane];
      if (whole(at)) {
        raw data;
        if (staged) {
          copies_wait_all();
          stage.load(data, lane);
        } else {
          data.fetch(at.tensor.bases, at.first, lane);
        }
        data.decode(e, maps);
      }
      // The block advance() goes to next, and whether it is whole (whole() written out: through
      // one lambda taking the element, ptxas spilled 24 bytes more in this loop).
      std::int64_t next = at.first + warps * block;
      staged = quads && at.tensor.head == 0;
      if (next < at.end) {
        staged = staged && next + block <= at.end;
      } else {
        chunk_entry const entry = chunk_of_bits(upcoming);
        next = first_block(entry, following);
        staged = staged && following < num_units && entry.tensor == tensor_in_cursor &&
                 next + block <= entry.begin + entry.count;
      }
      if (staged) { stage.fetch_async(at.tensor.bases, next, lane); }
      copies_commit();
      update_block(at, nullptr, e);
      more = advance(at);
    }
  } else {
    // One cursor live: the loads of a block are issued when it starts.
    while (more) {
      raw data;
      if (whole(at)) { data.fetch(at.tensor.bases, at.first, lane); }
      element e[per_lane];
      update_block(at, &data, e);
      more = advance(at);
    }
  }
  // The launch's last request empties the queue for the plan's next launch: each warp asks
  // once at the start and once for each ticket it takes, and stops after taking one past the
  // last unit, so there are `requests` in all (every ticket up to the last unit's, and two more
  // a warp), and the one that got the last number knows every other has been served.
  if (from_queue && lane == 0) {
    std::uint32_t const requests = num_units - grid_warps - (ticket_units - 1) * batched_tickets;
    if (answer == head + requests - 1) { queue->handed = 0; }
  }
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
