/// @file cuda/detail/factored.cuh
/// @brief Factored passes on the CUDA backend (factored.hpp): per pass three kernels (four with
/// line factors: factored_factor_kernel, a thread per statistic, after the totals), in the
/// order of detail/factored.hpp so that the statistics have the host backend's bits:
/// factored_tiles_kernel (a warp per 256 x 64 tile: a lane's two columns added in row order,
/// each row's partial by the lane tree, exchanged by shuffles),
/// factored_fold_kernel (a thread per statistic: its partials in tile order, then the rule's
/// fold) and factored_total_kernel (a block per matrix: the row total's 256-lane tree). The
/// work of each is numbered over the table (factored_tensor's first_tile, first_line,
/// first_matrix), whose totals the rule carries, so the grids are sized on the host without
/// reading the table; a tile's warp finds its tensor with all its lanes, a fold's thread and
/// a total's block by binary search.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../../config.hpp"
#include "../../detail/access.hpp"
#include "../../detail/factored.hpp"
#include "../../factored.hpp"
#include "../../numeric/dtypes.hpp"
#include "../../rule.hpp"
#include "../../scalar.hpp"
#include "dispatch.cuh"
#include "kernels.cuh"
#include "tables.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Threads of a tiles block (eight warps, a tile each) and of a total's block (its lanes).
inline constexpr int factored_block_threads = 256;
static_assert(::fusedopt::detail::factored_total_lanes == factored_block_threads,
              "a row total's lanes are the threads of one block");

/// The tensor of the table whose work items [first, first + count) hold `item`: the last
/// entry whose `first` is at most `item` (entries without work share their first with the
/// next one, which comes after them).
template <class T, class First>
__device__ __forceinline__ std::int64_t factored_owner(factored_table<T> const& table, std::int64_t item,
                                                       First const& first)
{
  std::int64_t low = 0, high = table.num_tensors - 1;
  while (low < high) {
    std::int64_t const mid = (low + high + 1) / 2;
    if (first(table.tensors[mid]) <= item) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

/// The last i in [from, n) with key(i) <= item (keys ascending, key(from) <= item), found by a
/// warp: each lane tests i = from + lane, + 32, ... and a ballot picks the one whose successor
/// is past `item`. A warp's tiles come in increasing order, so `from` (its last answer) makes
/// the first round the last one almost always.
template <class Key>
__device__ __forceinline__ std::int64_t warp_find_last(std::int64_t from, std::int64_t n, std::int64_t item,
                                                       Key const& key)
{
  int const lane = static_cast<int>(threadIdx.x) & 31;
  for (std::int64_t base = from; base < n; base += 32) {
    std::int64_t const i = base + lane;
    bool const hit = i < n && key(i) <= item && (i + 1 == n || key(i + 1) > item);
    unsigned const mask = __ballot_sync(0xffffffffu, hit);
    if (mask != 0) { return base + __ffs(static_cast<int>(mask)) - 1; }
  }
  return n - 1;  // not reached for keys as above
}

/// One exchange of the row partials' butterfly (detail/factored.hpp's lane tree): a lane holds
/// N rows' values; lanes `mask` apart swap halves, so that each keeps N / 2 rows, its own value
/// of them plus its partner's. The lane whose `mask` bit is set keeps the upper half.
template <int N>
__device__ __forceinline__ void butterfly_halve(double* a, int mask)
{
  bool const upper = (threadIdx.x & mask) != 0;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    double const send = upper ? a[i] : a[i + N / 2];
    double const keep = upper ? a[i + N / 2] : a[i];
    a[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
  }
}

#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic push
#  pragma nv_diag_suppress 1407
#endif

/// Whether the tiles kernel of pass J issues a group's loads before any of its values (it
/// then runs at 2 blocks per SM, 128 registers a thread, else 3 and 80): where the pass loads
/// more than one slot. Its value body is then longer and may branch (CAME's instability runs
/// its first direction, the clip and the momentum first, and locates each element's line
/// factors), and loads after a branch are not issued before it; at 80 registers, 16 elements
/// of two slots in flight spilled 196-644 bytes a thread. H200, CAME on GPT-2 small: that
/// kernel 808 -> 527 us under ncu, the step 1834 -> 1506 us. A pass of one slot (grad^2) keeps
/// each element's value computed as it is loaded: the loads-first order spilled 8 bytes
/// there at 80 registers and ran 6% slower (docs/optimizers.md, session 61).
template <class Rule, class Bound, int J>
inline constexpr bool factored_tiles_loads_first =
  ::fusedopt::detail::access<Rule, Bound>::template reads_count<typename ::fusedopt::detail::factor_traits<Rule, J>::reads> > 1;

/// The tiles of factored pass J, a warp per tile: warp w of the grid takes tiles w, w + warps,
/// ... of the table. Lane l holds columns l and l + 32 of the tile; row by row it adds their
/// values to its two column partials (in row order) and, eight rows at a time, forms each
/// row's partial by the lane tree of detail/factored.hpp (a value per lane: its two columns'
/// sum), exchanged by shuffles: no shared memory, no barrier, each lane's loads of eight rows
/// in flight at once.
template <class Rule, class Bound, int J, int P, class T>
FUSEDOPT_KERNEL void __launch_bounds__(factored_block_threads, (factored_tiles_loads_first<Rule, Bound, J> ? 2 : 3))
  factored_tiles_kernel(Rule const rule, step_info const step, FUSEDOPT_GRID_CONSTANT pass_results<P> const results,
                        tensor_entry<Bound::num_slots> const* entries, std::int32_t num_entries,
                        factored_table<T> const table)
{
  using access = ::fusedopt::detail::access<Rule, Bound>;
  using reads = typename ::fusedopt::detail::factor_traits<Rule, J>::reads;
  using stores = typename ::fusedopt::detail::factor_traits<Rule, J>::stores;
  constexpr int H = static_cast<int>(factored_tile_rows), B = static_cast<int>(factored_tile_cols);
  constexpr int group = 8;  // rows whose partials one butterfly forms
  static_assert(B == 64 && H % group == 0, "a tile row is two columns a lane, its rows groups of eight");
  await_predecessor();
  auto const body = ::fusedopt::detail::prepare_factor_pass<J>(rule, step, results.data());
  int const lane = static_cast<int>(threadIdx.x) & 31;
  std::int64_t const warps = std::int64_t{gridDim.x} * (blockDim.x / 32);
  std::int64_t t = 0, entry = 0;  // the last tile's tensor and plan entry (tiles come in order)
  for (std::int64_t k = std::int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32; k < table.tiles; k += warps) {
    // The tile's tensor (the last whose first tile is at most k: tensors without tiles share
    // their first with the next one), then its plan entry (entries are in list order, empty
    // tensors left out: the last whose index is at most t).
    t = warp_find_last(t, table.num_tensors, k, [&](std::int64_t i) { return table.tensors[i].first_tile; });
    factored_tensor<T> const e = table.tensors[t];
    entry = warp_find_last(entry, num_entries, t, [&](std::int64_t i) { return std::int64_t{entries[i].index}; });
    tensor_entry<Bound::num_slots> const& te = entries[entry];
    std::int64_t const local = k - e.first_tile;
    std::int64_t const per_matrix = e.row_tiles() * e.col_tiles();
    std::int64_t const m = local / per_matrix;
    std::int64_t const i = local % per_matrix / e.col_tiles();
    std::int64_t const j = local % e.col_tiles();
    int const h = static_cast<int>(e.rows - i * H < H ? e.rows - i * H : H);
    int const w = static_cast<int>(e.cols - j * B < B ? e.cols - j * B : B);
    std::int64_t const first = (m * e.rows + i * H) * e.cols + j * B;
    auto const tensor_body = ::fusedopt::detail::body_for_tensor(body, t);
    void* bases[Bound::num_slots];
#pragma unroll
    for (std::size_t s = 0; s < Bound::num_slots; ++s) { bases[s] = te.bases[s]; }
    // Element (r, lane) of the tile is `row_at` for row r (advanced by a row's length, not
    // multiplied per row).
    std::int64_t row_at = first + lane;
    bool const in0 = lane < w, in1 = lane + 32 < w;
    using element_type = typename access::element_type;
    auto const value = [&](element_type& x, bool in) { return in ? tensor_body(x) : 0.0; };
    double col0 = 0.0, col1 = 0.0;
    double* const row_out = e.row_partials(m, j) + i * H;
    // A whole tile (most of them) runs without a bounds test per element. Where the pass loads
    // several slots (its value body looks up line factors), the elements of a tensor of fewer
    // than 2^31 elements (all but the largest) say so (element::narrow_index, a constant here):
    // the lookups then locate them in 32 bits with no branch on the tensor's size, and without
    // that branch the group's elements are scheduled together, not one after another (CAME's
    // second tiles kernel on an H200, Nsight Compute: 523 -> 477 us; docs/decisions.md).
    auto const rows_of = [&](auto whole, auto narrow) {
      constexpr bool full = decltype(whole)::value;
      auto const in = [&](int r, bool column_in) { return (full || r < h) && (full || column_in); };
      auto const load = [&](element_type& x, bool element_in, std::int64_t at) {
        if (element_in) {
          ::fusedopt::detail::load_factor_element<access, reads>(x, bases, t, at);
          x.set_narrow_index(decltype(narrow)::value);
        }
      };
      // What the pass stores (stored_by_pass; nothing for most passes), after its value.
      auto const store = [&](element_type const& x, bool element_in, std::int64_t at) {
        if (element_in) { ::fusedopt::detail::store_factor_element<access, stores>(x, bases, at); }
      };
      for (int r0 = 0; r0 < (full ? H : h); r0 += group) {
        double v0[group], v1[group];
        if constexpr (factored_tiles_loads_first<Rule, Bound, J>) {
          element_type x0[group], x1[group];
          std::int64_t const group_at = row_at;
#pragma unroll
          for (int q = 0; q < group; ++q) {
            load(x0[q], in(r0 + q, in0), row_at);
            load(x1[q], in(r0 + q, in1), row_at + 32);
            row_at += e.cols;
          }
#pragma unroll
          for (int q = 0; q < group; ++q) {
            v0[q] = value(x0[q], in(r0 + q, in0));
            v1[q] = value(x1[q], in(r0 + q, in1));
            store(x0[q], in(r0 + q, in0), group_at + q * e.cols);
            store(x1[q], in(r0 + q, in1), group_at + q * e.cols + 32);
          }
        } else {
          // Each element's own locals: arrays declared for the whole group, filled and read in
          // the same iteration, still cost 72 bytes of spill at 80 registers (ptxas, sm_90).
#pragma unroll
          for (int q = 0; q < group; ++q) {
            element_type x0, x1;
            load(x0, in(r0 + q, in0), row_at);
            load(x1, in(r0 + q, in1), row_at + 32);
            v0[q] = value(x0, in(r0 + q, in0));
            v1[q] = value(x1, in(r0 + q, in1));
            store(x0, in(r0 + q, in0), row_at);
            store(x1, in(r0 + q, in1), row_at + 32);
            row_at += e.cols;
          }
        }
        double a[group];
#pragma unroll
        for (int q = 0; q < group; ++q) {
          // The rows past the tile's end add 0.0: a column partial starts at +0.0 and so is
          // never -0.0, and x + 0.0 is x (NaN stays NaN): the partial of the tile's rows only.
          col0 += v0[q];
          col1 += v1[q];
          a[q] = v0[q] + v1[q];
        }
        // The lane tree's exchanges 16, 8, 4 leave row 4 bit4 + 2 bit3 + bit2 of the lane in a[0];
        // 2 and 1 finish its sum.
        butterfly_halve<group>(a, 16);
        butterfly_halve<group / 2>(a, 8);
        butterfly_halve<group / 4>(a, 4);
        double sum = a[0];
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        int const r = r0 + (lane >> 2);
        if ((lane & 3) == 0 && (full || r < h)) { row_out[r] = sum; }
      }
    };
    bool const whole = h == H && w == B;
    auto const tile = [&](auto narrow) {
      if (whole) {
        rows_of(std::true_type{}, narrow);
      } else {
        rows_of(std::false_type{}, narrow);
      }
    };
    if constexpr (factored_tiles_loads_first<Rule, Bound, J>) {
      if (e.small) {
        tile(std::true_type{});
      } else {
        tile(std::false_type{});
      }
    } else {
      tile(std::false_type{});  // a pass of one slot (grad^2) has no lookup to tell
    }
    if (e.col != nullptr) {
      double* const col_out = e.col_partials(m, i) + j * B;
      if (lane < w) { col_out[lane] = col0; }
      if (lane + 32 < w) { col_out[lane + 32] = col1; }
    }
  }
}

/// ((0 + x[0]) + x[stride]) + ... + x[(count - 1) stride], each x as a double (T's arithmetic
/// value): the additions in order, the loads sixteen at a time ahead of them (a column of a
/// tall matrix has hundreds of partials, a row total a lane hundreds of rows: one load in
/// flight per addition would make the sum wait on memory count times).
template <class T>
__device__ __forceinline__ double sum_in_order(T const* x, std::int64_t stride, std::int64_t count)
{
  constexpr int ahead = 16;
  auto const load = [&](std::int64_t k) { return static_cast<double>(to_opmath<opmath_t<T>>(x[k * stride])); };
  double sum = 0.0;
  std::int64_t k = 0;
  for (; k + ahead <= count; k += ahead) {
    double loaded[ahead];
#pragma unroll
    for (int q = 0; q < ahead; ++q) { loaded[q] = load(k + q); }
#pragma unroll
    for (int q = 0; q < ahead; ++q) { sum += loaded[q]; }
  }
  for (; k < count; ++k) { sum += load(k); }
  return sum;
}

/// The fold of factored pass J: thread g of the grid takes statistics g, g + threads, ... of
/// the table (a tensor's row statistics, then its column statistics): its partials added in
/// tile order, then the rule's fold, stored.
template <class Rule, int J, class T>
FUSEDOPT_KERNEL void factored_fold_kernel(Rule const rule, step_info const step, factored_table<T> const table)
{
  await_predecessor();
  auto const fold = ::fusedopt::detail::factor_owner<J>(rule).prepare_fold(step);
  std::int64_t const stride = std::int64_t{gridDim.x} * blockDim.x;
  for (std::int64_t g = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; g < table.lines; g += stride) {
    std::int64_t const t =
      factored_owner(table, g, [](factored_tensor<T> const& e) { return e.first_line; });
    factored_tensor<T> const e = table.tensors[t];
    std::int64_t const k = g - e.first_line;
    std::int64_t const row_lines = e.matrices * e.rows;
    if (k < row_lines) {
      std::int64_t const m = k / e.rows, r = k % e.rows;
      double const sum = sum_in_order(e.row_partials(m, 0) + r, e.rows, e.col_tiles());
      ::fusedopt::detail::fold_statistic(fold, e.row + k, sum, e.cols);
    } else {
      std::int64_t const l = k - row_lines;
      std::int64_t const m = l / e.cols, c = l % e.cols;
      double const sum = sum_in_order(e.col_partials(m, 0) + c, e.cols, e.row_tiles());
      ::fusedopt::detail::fold_statistic(fold, e.col + l, sum, e.rows);
    }
  }
}

/// The row totals: block b takes matrices b, b + gridDim.x, ... of the table (those of tensors
/// that keep one): lane k adds rows k, k + 256, ... in order, then the tree of
/// detail/factored.hpp.
template <class T>
FUSEDOPT_KERNEL void __launch_bounds__(factored_block_threads) factored_total_kernel(factored_table<T> const table)
{
  constexpr int lanes = factored_block_threads;
  __shared__ double lane[lanes];
  await_predecessor();
  int const tid = static_cast<int>(threadIdx.x);
  for (std::int64_t g = blockIdx.x; g < table.matrices; g += gridDim.x) {
    std::int64_t const t =
      factored_owner(table, g, [](factored_tensor<T> const& e) { return e.first_matrix; });
    factored_tensor<T> const e = table.tensors[t];
    if (e.row_total == nullptr) { continue; }  // the same for the whole block
    std::int64_t const m = g - e.first_matrix;
    lane[tid] = tid < e.rows ? sum_in_order(e.row + m * e.rows + tid, lanes, (e.rows - tid + lanes - 1) / lanes) : 0.0;
    __syncthreads();
    for (int s = lanes / 2; s > 0; s /= 2) {
      if (tid < s) { lane[tid] += lane[tid + s]; }
      __syncthreads();
    }
    if (tid == 0) { e.row_total[m] = lane[0]; }
    __syncthreads();  // lane[0] is read before the next matrix overwrites it
  }
}

/// The line factors (detail/factored.hpp), after the totals: thread g of the grid takes
/// statistics g, g + threads, ... of the table, as the fold does; those of matrices (tensors
/// with a row total) get their factor, and so do vectors' where the body gives them.
template <class T, class Factors>
FUSEDOPT_KERNEL void factored_factor_kernel(Factors const factors, factored_table<T> const table)
{
  await_predecessor();
  std::int64_t const stride = std::int64_t{gridDim.x} * blockDim.x;
  for (std::int64_t g = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; g < table.lines; g += stride) {
    std::int64_t const t =
      factored_owner(table, g, [](factored_tensor<T> const& e) { return e.first_line; });
    factored_tensor<T> const e = table.tensors[t];
    std::int64_t const k = g - e.first_line;
    if (e.row_total == nullptr) {  // a vector
      ::fusedopt::detail::write_vector_factor(factors, e, k);
      continue;
    }
    std::int64_t const row_lines = e.matrices * e.rows;
    if (k < row_lines) {
      ::fusedopt::detail::write_row_factor(factors, e, k, ::fusedopt::detail::row_mean(e.row_total[k / e.rows], e.rows));
    } else {
      ::fusedopt::detail::write_col_factor(factors, e, k - row_lines);
    }
  }
}

#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic pop
#endif

/// Blocks of a grid-stride launch over `items`: all of them up to `cap` (a few waves of the
/// device), at least one, at most a grid's x dimension (2^31 - 1).
inline unsigned factored_grid(std::int64_t items, std::int64_t cap)
{
  std::int64_t const blocks = std::max<std::int64_t>(1, std::min(items, cap));
  return static_cast<unsigned>(std::min<std::int64_t>(blocks, std::numeric_limits<std::int32_t>::max()));
}

/// Enqueues factored pass J of `Rule` over the plan's tensor entries (`entries`, device
/// memory, `num_entries` of them in list order), after the reduction passes whose `results`
/// the parts before its owner read: tiles, fold, totals. The table and its
/// totals are the rule's values (factors()); nothing is read from device memory here.
template <class Rule, class Bound, int J, int P>
void launch_factored_pass(Rule const& rule, step_info const& step, pass_results<P> const& results,
                          tensor_entry<Bound::num_slots> const* entries, std::int32_t num_entries,
                          std::int64_t max_blocks, cudaStream_t stream, bool programmatic)
{
  auto const table = ::fusedopt::detail::factor_owner<J>(rule).factors();
  using T = ::fusedopt::detail::factor_state_t<Rule, J>;
  static_assert(fits_params<Rule, factored_table<T>, results_bytes<P> + sizeof(void*) + 8>,
                "fusedopt: this rule is larger than a kernel's 4 KB of parameters");
  std::int64_t const cap = max_blocks > 0 ? max_blocks : std::int64_t{1} << 20;
  if (table.tiles > 0) {
    constexpr std::int64_t warps = factored_block_threads / 32;  // a tile each
    launch_kernel(&factored_tiles_kernel<Rule, Bound, J, P, T>, dim3(factored_grid((table.tiles + warps - 1) / warps, cap)),
                  dim3(factored_block_threads), stream, programmatic, rule, step, results, entries, num_entries,
                  table);
  }
  if (table.lines > 0) {
    constexpr std::int64_t threads = 256;
    launch_kernel(&factored_fold_kernel<Rule, J, T>, dim3(factored_grid((table.lines + threads - 1) / threads, cap)),
                  dim3(static_cast<unsigned>(threads)), stream, programmatic, rule, step, table);
  }
  if (table.matrices > 0) {
    launch_kernel(&factored_total_kernel<T>, dim3(factored_grid(table.matrices, cap)), dim3(factored_block_threads),
                  stream, programmatic, table);
    auto const factors = ::fusedopt::detail::prepare_line_factors<J>(rule, step);
    if constexpr (!std::is_same_v<decltype(factors), ::fusedopt::detail::no_line_factors const>) {
      constexpr std::int64_t threads = 256;
      launch_kernel(&factored_factor_kernel<T, std::remove_const_t<decltype(factors)>>,
                    dim3(factored_grid((table.lines + threads - 1) / threads, cap)), dim3(static_cast<unsigned>(threads)),
                    stream, programmatic, factors, table);
    }
  }
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
