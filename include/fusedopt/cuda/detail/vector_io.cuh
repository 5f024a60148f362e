/// @file cuda/detail/vector_io.cuh
/// @brief Vector I/O of the CUDA backend: 16-byte packets (with the cache-streaming hints),
/// the register tile a thread holds for one iteration, and its loads and stores per slot.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "../../config.hpp"
#include "../../detail/pack.hpp"
#include "../../numeric/dtypes.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// `W` elements of type `T` in registers, 16-byte aligned: one 16-byte access per 16 bytes
/// (one for a 16-bit slot, two for a float slot next to it, four for double).
template <class T, int W>
struct alignas(16) packet {
  T v[W];
};

/// How a slot's packets are loaded or stored: plain, or streaming: on sm_80 and newer with the
/// L2 eviction policy the launch chose (`iteration::cache_policy`, made by make_cache_policy:
/// evict first, or evict normal), before sm_80 with the cache-streaming hint (ld/st.global.cs).
enum cache_mode : int { cache_plain = 0, cache_streaming = 1 };

/// The L2 eviction policy of a launch's streaming accesses: evict first (every line the
/// launch touches leaves L2 before other lines) or evict normal. One code path serves both:
/// the policy is a run-time operand of the loads and stores (docs/tuning.md says when each
/// wins).
__device__ __forceinline__ std::uint64_t make_cache_policy(bool evict_first)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  std::uint64_t first = 0;
  std::uint64_t normal = 0;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
  asm("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(normal));
  return evict_first ? first : normal;
#else
  return evict_first ? 1 : 0;
#endif
}

__device__ __forceinline__ uint4 load_streaming(uint4 const* from, std::uint64_t policy)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 v;
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(from), "l"(policy));
  return v;
#else
  (void)policy;
  return __ldcs(from);
#endif
}

__device__ __forceinline__ void store_streaming(uint4* to, uint4 const& v, std::uint64_t policy)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(to), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w), "l"(policy)
               : "memory");
#else
  (void)policy;
  __stcs(to, v);
#endif
}

/// Loads one packet in `Mode`.
template <int Mode, class T, int W>
__device__ __forceinline__ packet<T, W> load_packet(packet<T, W> const* from, std::uint64_t policy)
{
  if constexpr (Mode == cache_plain) {
    return *from;
  } else {
    constexpr int pieces = static_cast<int>(sizeof(packet<T, W>) / 16);
    uint4 raw[pieces];
#pragma unroll
    for (int i = 0; i < pieces; ++i) {
      auto const* piece = reinterpret_cast<uint4 const*>(from) + i;
      raw[i] = load_streaming(piece, policy);
    }
    packet<T, W> out;
    std::memcpy(&out, raw, sizeof out);
    return out;
  }
}

template <int Mode, class T, int W>
__device__ __forceinline__ void store_packet(packet<T, W>* to, packet<T, W> const& value, std::uint64_t policy)
{
  if constexpr (Mode == cache_plain) {
    *to = value;
  } else {
    constexpr int pieces = static_cast<int>(sizeof(packet<T, W>) / 16);
    uint4 raw[pieces];
    std::memcpy(raw, &value, sizeof raw);
#pragma unroll
    for (int i = 0; i < pieces; ++i) {
      auto* piece = reinterpret_cast<uint4*>(to) + i;
      store_streaming(piece, raw[i], policy);
    }
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
  std::int64_t v0;     // first vector of the thread group (block or warp) in this iteration
  std::uint64_t cache_policy;  // L2 eviction policy of the streaming accesses (make_cache_policy)
  int tid;
  bool valid[U];
};

template <std::size_t K, class Access, int W, int U, int Threads, int Mode, class Tile>
__device__ __forceinline__ void load_slot(Tile& tile, void* const* bases, iteration<U> const& it)
{
  if constexpr (Access::loads[K]) {
    using T = typename Access::template element_t<K>;
    auto const* src = reinterpret_cast<packet<T, W> const*>(static_cast<T const*>(bases[K]) + it.first);
    auto& slot = ::fusedopt::detail::pack_get<K>(tile);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (it.valid[u]) { slot.p[u] = load_packet<Mode>(src + it.v0 + u * Threads + it.tid, it.cache_policy); }
    }
  }
}

template <std::size_t K, class Access, int W, int U, int Threads, int Mode, class Tile>
__device__ __forceinline__ void store_slot(Tile const& tile, void* const* bases, iteration<U> const& it)
{
  if constexpr (Access::stores[K]) {
    using T = typename Access::template element_t<K>;
    auto* dst = reinterpret_cast<packet<T, W>*>(static_cast<T*>(bases[K]) + it.first);
    auto const& slot = ::fusedopt::detail::pack_get<K>(tile);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (it.valid[u]) { store_packet<Mode>(dst + it.v0 + u * Threads + it.tid, slot.p[u], it.cache_policy); }
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

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
