/// @file cuda/detail/factored.cuh
/// @brief Factored passes on the CUDA backend (factored.hpp): per pass three kernels, in the
/// order of detail/factored.hpp so that the statistics have the host backend's bits:
/// factored_tiles_kernel (a block per 64 x 64 tile: the values into shared memory, then a
/// thread per column and one per row add them in order into the tile's partials),
/// factored_fold_kernel (a thread per statistic: its partials in tile order, then the rule's
/// fold) and factored_total_kernel (a block per matrix: the row total's 256-lane tree). The
/// work of each is numbered over the table (factored_tensor's first_tile, first_line,
/// first_matrix), whose totals the rule carries, so the grids are sized on the host without
/// reading the table; a tile's block finds its tensor with all its threads, a fold's thread
/// and a total's block by binary search.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

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

/// Threads of a tile block (a tile's 4096 values are 16 a thread) and of a total's block (its
/// lanes).
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

/// The last i in [0, n) with key(i) <= item (keys ascending, key(0) <= item), found by the
/// whole block: each thread tests its own i, i + blockDim.x, ..., so a table of up to
/// blockDim.x entries costs one round of loads where a binary search by one thread costs
/// log2(n) dependent ones (per tile, that wait was a large part of the tiles kernel's time).
/// Every thread of the block calls it; `found` is a shared slot no other call of the same
/// round uses.
template <class Key>
__device__ __forceinline__ std::int64_t block_find_last(std::int64_t n, std::int64_t item, Key const& key,
                                                        std::int64_t* found)
{
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (key(i) <= item && (i + 1 == n || key(i + 1) > item)) { *found = i; }
  }
  __syncthreads();
  return *found;
}

#if defined(__NVCC_DIAG_PRAGMA_SUPPORT__)
#  pragma nv_diagnostic push
#  pragma nv_diag_suppress 1407
#endif

/// The tiles of factored pass J: block b takes tiles b, b + gridDim.x, ... of the table. Each
/// thread computes the values of 16 elements of the tile (consecutive threads, consecutive
/// columns: coalesced loads) into registers, then shared memory; then thread c < 64 adds
/// column c's values in row order and thread 64 + r row r's in column order, and writes the
/// partials.
template <class Rule, class Bound, int J, int P, class T>
FUSEDOPT_KERNEL void __launch_bounds__(factored_block_threads)
  factored_tiles_kernel(Rule const rule, step_info const step, FUSEDOPT_GRID_CONSTANT pass_results<P> const results,
                        tensor_entry<Bound::num_slots> const* entries, std::int32_t num_entries,
                        factored_table<T> const table)
{
  using access = ::fusedopt::detail::access<Rule, Bound>;
  using reads = typename ::fusedopt::detail::factor_traits<Rule, J>::reads;
  constexpr int B = static_cast<int>(factored_tile);
  constexpr int threads = factored_block_threads;
  __shared__ double values[B][B + 1];  // + 1: a row's values in other banks than the next row's
  __shared__ std::int64_t found[2];     // block_find_last's answers: the tile's tensor and entry
  await_predecessor();
  auto const body = ::fusedopt::detail::prepare_factor_pass<J>(rule, step, results.data());
  int const tid = static_cast<int>(threadIdx.x);
  for (std::int64_t k = blockIdx.x; k < table.tiles; k += gridDim.x) {
    // The tile's tensor (the last whose first tile is at most k: tensors without tiles share
    // their first with the next one), then its plan entry (entries are in list order, empty
    // tensors left out: the last whose index is at most t).
    std::int64_t const t = block_find_last(
      table.num_tensors, k, [&](std::int64_t i) { return table.tensors[i].first_tile; }, &found[0]);
    factored_tensor<T> const e = table.tensors[t];
    tensor_entry<Bound::num_slots> const& te = entries[block_find_last(
      num_entries, t, [&](std::int64_t i) { return std::int64_t{entries[i].index}; }, &found[1])];
    std::int64_t const local = k - e.first_tile;
    std::int64_t const per_matrix = e.row_tiles() * e.col_tiles();
    std::int64_t const m = local / per_matrix;
    std::int64_t const i = local % per_matrix / e.col_tiles();
    std::int64_t const j = local % e.col_tiles();
    int const h = static_cast<int>(e.rows - i * B < B ? e.rows - i * B : B);
    int const w = static_cast<int>(e.cols - j * B < B ? e.cols - j * B : B);
    std::int64_t const first = (m * e.rows + i * B) * e.cols + j * B;
    auto const tensor_body = ::fusedopt::detail::body_for_tensor(body, t);
    void* bases[Bound::num_slots];
#pragma unroll
    for (std::size_t s = 0; s < Bound::num_slots; ++s) { bases[s] = te.bases[s]; }
    // Thread tid takes column tid % B of rows tid / B, + 4, + 8, ...: all 16 loads are issued
    // before the first store to shared memory, so 16 are in flight per thread, not one (the
    // tile's bandwidth is bound by the loads in flight per SM).
    constexpr int per_thread = B * B / threads;
    constexpr int row_step = threads / B;
    static_assert(B * B % threads == 0 && threads % B == 0, "a tile is whole rows of threads");
    int const c = tid % B, r0 = tid / B;
    double loaded[per_thread];
#pragma unroll
    for (int q = 0; q < per_thread; ++q) {
      int const r = r0 + q * row_step;
      loaded[q] = r < h && c < w ? ::fusedopt::detail::factor_value<access, reads>(tensor_body, bases, t,
                                                                                     first + r * e.cols + c)
                                 : 0.0;
    }
#pragma unroll
    for (int q = 0; q < per_thread; ++q) { values[r0 + q * row_step][c] = loaded[q]; }
    __syncthreads();
    if (tid < B) {
      if (tid < w && e.col != nullptr) {
        double sum = 0.0;
        for (int r = 0; r < h; ++r) { sum += values[r][tid]; }
        e.col_partials(m, i)[j * B + tid] = sum;
      }
    } else if (tid < 2 * B) {
      int const r = tid - B;
      if (r < h) {
        double sum = 0.0;
        for (int c = 0; c < w; ++c) { sum += values[r][c]; }
        e.row_partials(m, j)[i * B + r] = sum;
      }
    }
    __syncthreads();  // the values are read before the next tile overwrites them
  }
}

/// ((0 + x[0]) + x[stride]) + ... + x[(count - 1) stride]: the additions in order, the loads
/// sixteen at a time ahead of them (a column of a tall matrix has hundreds of partials: one load
/// in flight per addition would make the fold wait on memory count times).
__device__ __forceinline__ double sum_in_order(double const* x, std::int64_t stride, std::int64_t count)
{
  constexpr int ahead = 16;
  double sum = 0.0;
  std::int64_t k = 0;
  for (; k + ahead <= count; k += ahead) {
    double loaded[ahead];
#pragma unroll
    for (int q = 0; q < ahead; ++q) { loaded[q] = x[(k + q) * stride]; }
#pragma unroll
    for (int q = 0; q < ahead; ++q) { sum += loaded[q]; }
  }
  for (; k < count; ++k) { sum += x[k * stride]; }
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
    T const* const row = e.row + m * e.rows;
    double sum = 0.0;
    for (std::int64_t r = tid; r < e.rows; r += lanes) { sum += static_cast<double>(to_opmath<opmath_t<T>>(row[r])); }
    lane[tid] = sum;
    __syncthreads();
    for (int s = lanes / 2; s > 0; s /= 2) {
      if (tid < s) { lane[tid] += lane[tid + s]; }
      __syncthreads();
    }
    if (tid == 0) { e.row_total[m] = lane[0]; }
    __syncthreads();  // lane[0] is read before the next matrix overwrites it
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
    launch_kernel(&factored_tiles_kernel<Rule, Bound, J, P, T>, dim3(factored_grid(table.tiles, cap)),
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
  }
}

}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END
