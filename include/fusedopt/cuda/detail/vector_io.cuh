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

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
