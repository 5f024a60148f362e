/// @file cuda/detail/tables.cuh
/// @brief What a launch of the CUDA backend reads besides the rule: the launch tables (where a
/// block finds its work), the results of reduction passes and the chunk ranges of their
/// rows; and the host-side planning that fills the tables: alignment and vector head per
/// tensor, chunks, and the packing of by-value tables under the kernel-parameter limits.
#pragma once

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
#include "../../error.hpp"
#include "../../numeric/quantization.hpp"
#include "../../reduce.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Elements per vector for the lists `bound_lists<B...>`: one 16-byte access of the slot with
/// the smallest element type (8 for any 16-bit slot, 4 for float, 2 for double); wider slots
/// take two or four 16-byte accesses for the same elements.
template <class Bound>
struct vector_width;
template <class... B>
struct vector_width<bound_lists<B...>> {
  // Quantized states (blockwise8 storage) are read element by element, never in vectors: they
  // count as neither the smallest nor the widest slot.
  static constexpr std::size_t smallest =
    std::min({is_blockwise_v<typename B::element_type> ? std::size_t{16} : sizeof(std::remove_const_t<typename B::element_type>)...});
  static constexpr std::size_t widest =
    std::max({is_blockwise_v<typename B::element_type> ? std::size_t{1} : sizeof(std::remove_const_t<typename B::element_type>)...});
  static constexpr int value = static_cast<int>(16 / smallest);
};

/// One tensor as a launch sees it.
template <std::size_t S>
struct tensor_entry {
  void* bases[S];      ///< element 0 of the tensor in each bound slot
  std::int32_t index;  ///< position in the bound lists (element::tensor())
  std::int32_t head;   ///< elements before the first vector-aligned one in every slot; -1: scalar only
};

/// One chunk, a block's work in the update and a warp's in a reduction pass: `count` elements
/// of a tensor from element `begin`.
struct alignas(16) chunk_entry {
  std::int64_t begin;
  std::int32_t tensor;  ///< entry in the tensor table of the launch
  std::int32_t count;
};
static_assert(sizeof(chunk_entry) == 16 && offsetof(chunk_entry, tensor) == 8 && offsetof(chunk_entry, count) == 12,
              "a chunk entry is one 16-byte load: begin, then tensor and count");

/// Chunk `k`'s entry of `table` as one 16-byte vector (the 8-bit update carries it so from one
/// crossing to the next: a vector load lands in the registers that carry it), and the entry
/// back from it.
template <class Table>
__device__ __forceinline__ uint4 chunk_bits(Table const& table, std::int64_t k)
{
  return *reinterpret_cast<uint4 const*>(&table.chunks[k]);
}
__device__ __forceinline__ chunk_entry chunk_of_bits(uint4 bits)
{
  return chunk_entry{static_cast<std::int64_t>((static_cast<std::uint64_t>(bits.y) << 32) | bits.x),
                     static_cast<std::int32_t>(bits.z), static_cast<std::int32_t>(bits.w)};
}

/// The queue from which the warps of an update that stores quantized states take their work
/// (a plan's; process_quantized): the tickets handed out so far. Zero when the plan is built;
/// the warp that gets a launch's last ticket sets it back to zero, so the plan's next launch
/// (or a graph's replay) finds it so.
struct work_queue {
  unsigned int handed;
};

/// The work queue as an update's kernel takes it: a pointer where the rule stores quantized
/// states (null: a launch without one, cuda::apply, deals the units round-robin), nothing
/// otherwise (one byte of parameters, as pass_results<0>).
template <bool Quantized>
struct queue_param {
  work_queue* queue;
};
template <>
struct queue_param<false> {};

/// Tables in device memory (plans): any number of tensors and chunks, one launch. Where
/// `chunks` is null, the launch is an update over a plan of one tensor (one_tensor_table):
/// its chunks' ranges are computed, so a block's one table read (the tensor's entry) does not
/// wait for another (2^28 elements on an H200: Adam fp32 1769 -> 1754-1756 us, AdamW over bf16
/// 1425-1426 -> 1395-1396 us; docs/tuning.md, "One tensor: the update without chunk entries").
template <std::size_t S>
struct global_table {
  chunk_entry const* chunks;
  tensor_entry<S> const* tensors;
  std::int64_t num_chunks;
  std::int32_t evict_first;  ///< streaming accesses evict first from L2 (else evict normal)
  // One tensor (chunks == nullptr): the elements of its chunk 0 (which holds the head, as
  // make_layout cuts it), of every later chunk, and in all.
  std::int64_t only_first;
  std::int64_t only_chunk;
  std::int64_t only_size;

  __device__ __forceinline__ chunk_entry chunk(std::int64_t c) const { return chunks[c]; }
  /// A block's first chunk in the update; the only one where `chunks` is null (a grid of one
  /// block per chunk: no block loop).
  __device__ __forceinline__ chunk_entry first_chunk(std::int64_t c) const
  {
    if (chunks != nullptr) { return chunks[c]; }
    if (c == 0) { return chunk_entry{0, 0, static_cast<std::int32_t>(only_first)}; }
    std::int64_t const begin = only_first + (c - 1) * only_chunk;
    std::int64_t const left = only_size - begin;
    return chunk_entry{begin, 0, static_cast<std::int32_t>(left < only_chunk ? left : only_chunk)};
  }
  __device__ __forceinline__ tensor_entry<S> tensor(std::int32_t t) const { return tensors[t]; }
};

/// The update's table for a plan of one tensor of `size` elements (global_table with no chunk
/// entries; the launch sets `tensors`): chunks of `chunk` elements, cut as make_layout cuts
/// them (chunk 0 also holds the `head` elements before the first aligned vector).
template <std::size_t S>
global_table<S> one_tensor_table(std::int64_t size, int head, std::int64_t chunk, bool evict_first)
{
  global_table<S> table{};
  table.only_size = size;
  table.only_chunk = chunk;
  table.only_first = std::min(size, chunk + std::max(head, 0));
  table.num_chunks = 1 + (size - table.only_first + chunk - 1) / chunk;
  table.evict_first = evict_first ? 1 : 0;
  return table;
}

/// Tables carried by value in the kernel parameters, `Bytes` at most. Room is split so that
/// a launch holds about two chunks per tensor; whichever fills first closes the launch.
template <std::size_t S, std::size_t Bytes>
struct inline_table {
  static constexpr std::size_t room = Bytes - 16;
  static constexpr std::size_t max_tensors = room / (sizeof(tensor_entry<S>) + 2 * sizeof(chunk_entry));
  static constexpr std::size_t max_chunks = (room - max_tensors * sizeof(tensor_entry<S>)) / sizeof(chunk_entry);
  static_assert(max_tensors >= 1 && max_chunks >= 1, "fusedopt: too many slots bound for a by-value launch table");

  chunk_entry chunks[max_chunks];
  tensor_entry<S> tensors[max_tensors];
  std::int64_t num_chunks;
  std::int32_t num_tensors;
  std::int32_t evict_first;  ///< as global_table::evict_first

  __device__ __forceinline__ chunk_entry chunk(std::int64_t c) const { return chunks[c]; }
  __device__ __forceinline__ chunk_entry first_chunk(std::int64_t c) const { return chunks[c]; }
  __device__ __forceinline__ tensor_entry<S> tensor(std::int32_t t) const { return tensors[t]; }
};

/// The results of a rule's P passes as kernels receive them: by value (pointers into the
/// plan's workspace, known when the plan is built). Kernels take it `__grid_constant__`: the
/// bodies index it through a pointer, which would otherwise copy it to local memory.
template <int P>
struct pass_results {
  reduced r[P];
  FUSEDOPT_HOST_DEVICE reduced const* data() const { return r; }
};
/// A rule without passes: no results (one byte of kernel parameters, where `reduced[1]` would
/// take 32 from the room a by-value table leaves the rule).
template <>
struct pass_results<0> {
  FUSEDOPT_HOST_DEVICE reduced const* data() const { return nullptr; }
};

/// Where the chunk partials of one row of the bound lists are: `count` chunks from `first`
/// in the plan's chunk order (the layout's order, which every transport keeps).
struct chunk_range {
  std::int64_t first;
  std::int64_t count;
};

/// Kernel-parameter limits: 4 KB everywhere, 32 764 bytes from CUDA 12.1 on Volta and newer.
inline constexpr std::size_t param_limit_4k = 4096;
inline constexpr std::size_t param_limit_32k = 32764;
/// Parameter bytes kept for the rule, the step and alignment: a rule up to this size
/// minus 48 bytes can be carried next to a by-value table.
inline constexpr std::size_t rule_reserve = 512;

template <std::size_t S>
using table_4k = inline_table<S, param_limit_4k - rule_reserve>;
template <std::size_t S>
using table_32k = inline_table<S, param_limit_32k - rule_reserve>;

/// The host's view of a plan: every non-empty tensor, and its chunks in tensor order.
template <std::size_t S>
struct layout {
  std::vector<tensor_entry<S>> tensors;  // tensor_entry::index is the position in the lists
  std::vector<chunk_entry> chunks;       // chunk_entry::tensor indexes `tensors`
  std::int64_t bytes = 0;                // of every bound slot of every tensor
};

/// Elements before the first element at which every slot's address is 16-byte aligned, or -1
/// when no such element exists (slots misaligned differently): then the tensor takes the
/// scalar path. `sizes[k]` is the element size of slot k; addresses are element-aligned.
template <std::size_t S>
int vector_head(void* const (&bases)[S], std::size_t const (&sizes)[S], int width)
{
  for (int h = 0; h < width; ++h) {
    bool aligned = true;
    for (std::size_t k = 0; k < S; ++k) {
      aligned = aligned && (reinterpret_cast<std::uintptr_t>(bases[k]) + static_cast<std::uintptr_t>(h) * sizes[k]) % 16 == 0;
    }
    if (aligned) { return h; }
  }
  return -1;
}

/// Element 0 of tensor `t` in every slot of `lists`.
template <class... B, std::size_t... K>
void tensor_bases(bound_lists<B...> const& lists, std::size_t t, void* (&bases)[sizeof...(B)], std::index_sequence<K...>)
{
  ((bases[K] = lists.template address<K>(t)), ...);
}
template <class... B>
void tensor_bases(bound_lists<B...> const& lists, std::size_t t, void* (&bases)[sizeof...(B)])
{
  tensor_bases(lists, t, bases, std::index_sequence_for<B...>{});
}

/// The first slot whose address is not a multiple of its element's alignment, or -1.
template <std::size_t S>
int misaligned_slot(void* const (&bases)[S], std::size_t const (&alignments)[S])
{
  for (std::size_t k = 0; k < S; ++k) {
    if (reinterpret_cast<std::uintptr_t>(bases[k]) % alignments[k] != 0) { return static_cast<int>(k); }
  }
  return -1;
}

/// What the plans check of one tensor's addresses in lists `Bound`: its slots' alignment and
/// its head (the alignment class).
template <class Bound>
struct slot_geometry;
template <class... B>
struct slot_geometry<bound_lists<B...>> {
  static constexpr std::size_t S = sizeof...(B);
  static constexpr bool quantized = (is_blockwise_v<typename B::element_type> || ...);

  /// The first slot whose address is not aligned to its element type, or -1.
  static int misaligned(void* const (&bases)[S])
  {
    static constexpr std::size_t alignments[S] = {alignof(std::remove_const_t<typename B::element_type>)...};
    return misaligned_slot(bases, alignments);
  }
  /// The memory a tensor of `size` elements takes in all slots together.
  static std::int64_t bytes(std::int64_t size)
  {
    return (std::int64_t{0} + ... +
            (::fusedopt::detail::storage_units<typename B::element_type>(size) *
             static_cast<std::int64_t>(sizeof(std::remove_const_t<typename B::element_type>))));
  }
  /// vector_head. Where quantized states are bound (a warp per block, agent.cuh's
  /// process_quantized): 0 when every other slot is aligned for accesses of four elements (their
  /// quads: 8 bytes for 16-bit types, 16 for wider ones), else -1 (elements one by one).
  static int head(void* const (&bases)[S])
  {
    static constexpr std::size_t sizes[S] = {sizeof(std::remove_const_t<typename B::element_type>)...};
    if constexpr (quantized) {
      static constexpr bool blockwise[S] = {is_blockwise_v<typename B::element_type>...};
      for (std::size_t k = 0; k < S; ++k) {
        std::size_t const quad_bytes = std::min<std::size_t>(4 * sizes[k], 16);
        if (!blockwise[k] && reinterpret_cast<std::uintptr_t>(bases[k]) % quad_bytes != 0) { return -1; }
      }
      return 0;
    } else {
      return vector_head(bases, sizes, vector_width<bound_lists<B...>>::value);
    }
  }
};

/// Records every non-empty tensor (bases, head) and cuts it into chunks of `chunk` elements
/// (a multiple of `width`) whose boundaries fall on vector boundaries: chunk 0 holds the head,
/// so only the first chunk of a tensor has scalar head elements and only the last a tail.
/// With quantized states the head is 0 or -1 and `chunk` a multiple of their block: every
/// chunk starts at a multiple of `chunk`, so it holds whole blocks of its tensor.
/// @throws fusedopt::error if a pointer is not aligned to its element size or the list holds
/// more than 2^31 - 1 tensors.
template <class... B, std::size_t... K>
layout<sizeof...(B)> make_layout(bound_lists<B...> const& lists, std::int64_t chunk, std::index_sequence<K...>)
{
  constexpr std::size_t S = sizeof...(B);
  using geometry = slot_geometry<bound_lists<B...>>;
  static constexpr char const* names[] = {B::slot_type::name...};
  std::size_t const n = lists.num_tensors();
  FUSEDOPT_EXPECTS(n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                   "the CUDA backend takes at most 2^31 - 1 tensors per list");
  layout<S> out;
  for (std::size_t t = 0; t < n; ++t) {
    std::int64_t const size = lists.tensor_size(t);
    if (size == 0) { continue; }
    tensor_entry<S> e{};
    tensor_bases(lists, t, e.bases);
    int const misaligned = geometry::misaligned(e.bases);
    FUSEDOPT_EXPECTS(misaligned < 0, "tensor " + std::to_string(t) + " of slot '" + names[misaligned < 0 ? 0 : misaligned] +
                                       "' is not aligned to its element size (the GPU faults on misaligned accesses)");
    e.index = static_cast<std::int32_t>(t);
    e.head = geometry::head(e.bases);
    auto const local = static_cast<std::int32_t>(out.tensors.size());
    out.tensors.push_back(e);
    out.bytes += geometry::bytes(size);
    // A head of h shifts every boundary by h so that chunks after the first start aligned.
    std::int64_t const first = std::min(size, chunk + std::max(e.head, 0));
    out.chunks.push_back(chunk_entry{0, local, static_cast<std::int32_t>(first)});
    for (std::int64_t begin = first; begin < size; begin += chunk) {
      out.chunks.push_back(chunk_entry{begin, local, static_cast<std::int32_t>(std::min(chunk, size - begin))});
    }
  }
  return out;
}

/// Packs a layout into by-value tables of type `Table`, in order, each as full as it can be.
template <class Table, std::size_t S>
std::vector<Table> pack_tables(layout<S> const& plan, bool evict_first)
{
  std::vector<Table> tables;
  Table* current = nullptr;
  std::int32_t last_tensor = -1;  // layout index of the tensor in the current table's last slot
  for (chunk_entry const& c : plan.chunks) {
    bool const new_tensor = current == nullptr || c.tensor != last_tensor;
    if (current == nullptr || static_cast<std::size_t>(current->num_chunks) == Table::max_chunks ||
        (new_tensor && static_cast<std::size_t>(current->num_tensors) == Table::max_tensors)) {
      tables.emplace_back();
      current = &tables.back();
      current->num_chunks = 0;
      current->num_tensors = 0;
      current->evict_first = evict_first ? 1 : 0;
      last_tensor = -1;
    }
    if (c.tensor != last_tensor) {
      current->tensors[current->num_tensors++] = plan.tensors[static_cast<std::size_t>(c.tensor)];
      last_tensor = c.tensor;
    }
    current->chunks[current->num_chunks++] = chunk_entry{c.begin, current->num_tensors - 1, c.count};
  }
  return tables;
}

/// Copies the addresses of `tensors` (a plan's entries, in list order) into a by-value table
/// packed from the same layout; `cursor` walks `tensors` across the tables of the plan, taken
/// in order (each table's entries are in list order; a tensor split between two tables
/// appears in both).
template <class Table, std::size_t S>
void rebase_table(Table& table, std::vector<tensor_entry<S>> const& tensors, std::size_t& cursor)
{
  for (std::int32_t k = 0; k < table.num_tensors; ++k) {
    tensor_entry<S>& entry = table.tensors[k];
    while (tensors[cursor].index != entry.index) { ++cursor; }
    std::copy(std::begin(tensors[cursor].bases), std::end(tensors[cursor].bases), std::begin(entry.bases));
  }
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
