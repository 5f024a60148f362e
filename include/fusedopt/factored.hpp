/// @file factored.hpp
/// @brief Factored per-tensor statistics: a reduction pass whose result per tensor is a vector,
/// the row sums and column sums of the tensor seen as matrices (its last two dimensions; the
/// leading ones are a batch, as torch's Adafactor factors them: shape (..., R, C) gives row
/// statistics (..., R) and column statistics (..., C)).
///
/// The statistics are the caller's memory (they are optimizer state: Adafactor's row_var and
/// col_var), described per tensor by a `factored_tensor<T>` in a table the caller keeps
/// (device memory for the CUDA backend). A rule part that declares a factored pass
/// (`factors()`, `prepare_factor(step)`, `prepare_fold(step)`, see docs/rules.md, "Factored
/// passes") gets, before every other pass of the step:
///  1. the value `prepare_factor(step)(e)` of every element of every factored tensor summed,
///     in double, per row and per column of each matrix, in a fixed order (tiles of
///     `factored_tile_rows` x `factored_tile_cols` elements; within a tile in a fixed order,
///     tiles in order), the same on every backend, so the bits are the host's on the GPU too;
///  2. each statistic folded with its sum, `row[k] = fold(row[k], sum, C)`,
///     `col[k] = fold(col[k], sum, R)` (the count is the number of elements summed), stored in T;
///  3. per matrix, the sum of its R folded row statistics, in double (`row_total`; the
///     normaliser of a factored second moment, r c / mean(r)).
/// Passes and the update then read each element's statistics through `factored_lookup`. A part
/// may also have its pass store slots (`stored_by_pass`; docs/rules.md): the update then resumes
/// after it, and its table must cover every tensor with elements (factored_table::elements).
///
/// `factored_layout` builds the table from the tensors' shapes and sizes the workspace the pass
/// needs (its tile partials and the row totals), which the caller allocates once, beside the
/// statistics. Nothing is allocated or synchronised in a step. The host backend checks each
/// entry against its tensor's size before writing anything; the CUDA backend cannot (the table
/// is device memory): there an entry that does not describe its tensor reads and writes out of
/// bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "numeric/dtypes.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief Rows of the tiles a factored pass sums in (the order of its additions): tall tiles,
/// so that a column's sum adds few partials in order (a 50257-row embedding: 197).
inline constexpr std::int64_t factored_tile_rows = 256;
/// @brief Columns of those tiles.
inline constexpr std::int64_t factored_tile_cols = 64;

/// @brief The CUDA chunk length (cuda::options::chunk_elements) that rules reading factored
/// statistics run fastest with: their per-tensor setup (each chunk's factored_lookup and the
/// rule's roots and divisions in double, Adafactor's RMS step size) is paid by every thread of
/// every chunk, and the default chunk of 2048 elements gives a thread 8 (the H200's 256-thread
/// update) or 16 elements to spread it over. H200, GPT-2 small (bench/adafactor.py, 2026-11-29,
/// one run): Adafactor 1329 -> 1098 us, CAME 2838 -> 2429 us from 2048 to 16384 (8192: within
/// 2%; 65536: 200 small matrices 1.8x slower, too few chunks to fill the GPU). Set it in the
/// plan's options: `cuda::options o; o.chunk_elements = factored_chunk_elements;`.
inline constexpr std::int64_t factored_chunk_elements = 16384;

namespace detail {
/// q = n / d and r = n % d for 0 <= n < 2^48 and d >= 1, with a multiplication by 1 / d in
/// double (a 64-bit division costs dozens of instructions on a GPU) corrected to the exact
/// integers: the product is within 1 of n / d there.
struct index_divider {
  std::int64_t d = 1;
  double inverse = 1.0;
  FUSEDOPT_HOST_DEVICE static index_divider of(std::int64_t divisor)
  {
    return {divisor, 1.0 / static_cast<double>(divisor)};
  }
  FUSEDOPT_HOST_DEVICE std::int64_t quotient(std::int64_t n, std::int64_t& remainder) const
  {
    auto q = static_cast<std::int64_t>(static_cast<double>(n) * inverse);
    std::int64_t r = n - q * d;
    if (r < 0) {
      --q;
      r += d;
    } else if (r >= d) {
      ++q;
      r -= d;
    }
    remainder = r;
    return q;
  }
};

/// n / d for 0 <= n < 2^31 and d >= 1 by Granlund and Montgomery's multiplication: with
/// l = ceil(log2 d) and magic = floor(2^32 (2^l - d) / d) + 1, n / d = (hi32(n magic) + n) >> l
/// (exact for n < 2^32 with a 33-bit sum; below 2^31 the sum fits 32 bits); for d >= 2^31,
/// magic 0 and shift 31 give n / d = 0. Three instructions on a GPU; the numbers are made on the
/// host (factored_layout::entries), once.
struct small_divider {
  std::uint32_t magic = 1;
  std::uint32_t shift = 0;
  /// The divider of d (d >= 1).
  static small_divider of(std::int64_t d)
  {
    if (d >= (std::int64_t{1} << 31)) { return {0, 31}; }
    std::uint32_t l = 0;
    while ((std::uint64_t{1} << l) < static_cast<std::uint64_t>(d)) { ++l; }
    auto const m = (((std::uint64_t{1} << l) - static_cast<std::uint64_t>(d)) << 32) / static_cast<std::uint64_t>(d) + 1;
    return {static_cast<std::uint32_t>(m), l};
  }
  FUSEDOPT_HOST_DEVICE std::uint32_t quotient(std::uint32_t n) const
  {
#if defined(__CUDA_ARCH__)
    std::uint32_t const high = __umulhi(n, magic);
#else
    auto const high = static_cast<std::uint32_t>((std::uint64_t{n} * magic) >> 32);
#endif
    return (high + n) >> shift;
  }
};
/// Tensors of fewer elements take the 32-bit dividers (small_divider).
inline constexpr std::int64_t small_index_limit = std::int64_t{1} << 31;
}  // namespace detail

/// @brief One tensor's factored statistics, as the pass and the rules read them. Filled by
/// factored_layout::entries; caller memory (device memory for the CUDA backend).
template <class T>
struct factored_tensor {
  std::int64_t rows = 0;       ///< R, the second-to-last dimension; 0: no statistics (skipped)
  std::int64_t cols = 0;       ///< C, the last dimension (1 for a vector: its own row statistic)
  std::int64_t matrices = 0;   ///< the batch: elements / (R C)
  T* row = nullptr;            ///< matrices x R row statistics
  T* col = nullptr;            ///< matrices x C column statistics; null: rows only (a vector)
  double* row_total = nullptr; ///< matrices sums of the folded row statistics; null: not kept
  double* partials = nullptr;  ///< the pass's tile partials: matrices x (R ceil(C / tile) + C ceil(R / tile))
  /// Line factors (written after the totals where the part declares prepare_line_factors):
  /// matrices x R and matrices x C, in T's arithmetic type. A vector's (row statistics only)
  /// are a factor per row, its elements' own (the part's vector(stat)), and column factors of
  /// 1, so that the passes read a vector's factor through the code that reads a matrix's.
  opmath_t<T>* row_factor = nullptr;
  opmath_t<T>* col_factor = nullptr;
  /// Dividers by C and by R for indices below 2^31 (made for every tensor with statistics;
  /// every index where the tensor has fewer than 2^31 elements: small = true):
  /// factored_lookup's element position in 32-bit multiplications.
  bool small = false;
  detail::small_divider by_cols{};
  detail::small_divider by_rows{};
  std::int64_t first_tile = 0; ///< tiles of the tensors before this one (the pass's work order)
  std::int64_t first_line = 0; ///< rows and columns of the tensors before this one
  std::int64_t first_matrix = 0;  ///< matrices of the tensors before this one

  /// Tiles of one matrix along the rows and along the columns.
  FUSEDOPT_HOST_DEVICE std::int64_t row_tiles() const { return (rows + factored_tile_rows - 1) / factored_tile_rows; }
  FUSEDOPT_HOST_DEVICE std::int64_t col_tiles() const { return (cols + factored_tile_cols - 1) / factored_tile_cols; }
  /// Tiles of the whole tensor (0 when it has no statistics).
  FUSEDOPT_HOST_DEVICE std::int64_t tiles() const { return rows > 0 ? matrices * row_tiles() * col_tiles() : 0; }
  /// Statistics of the whole tensor: rows, then columns (when kept).
  FUSEDOPT_HOST_DEVICE std::int64_t lines() const
  {
    return rows > 0 ? matrices * (rows + (col != nullptr ? cols : 0)) : 0;
  }
  /// Where the row partials of matrix m, column tile j start ([m][j][r]), and the column
  /// partials of matrix m, row tile i ([m][i][c]).
  FUSEDOPT_HOST_DEVICE double* row_partials(std::int64_t m, std::int64_t j) const
  {
    return partials + (m * col_tiles() + j) * rows;
  }
  FUSEDOPT_HOST_DEVICE double* col_partials(std::int64_t m, std::int64_t i) const
  {
    return partials + matrices * col_tiles() * rows + (m * row_tiles() + i) * cols;
  }
};

/// @brief The statistics of every bound tensor, as a rule carries them (by value): the table
/// (one entry per tensor of the bound lists, caller memory) and its totals, which size the
/// launches without reading the table.
template <class T>
struct factored_table {
  factored_tensor<T> const* tensors = nullptr;
  std::int64_t num_tensors = 0;
  std::int64_t tiles = 0;     ///< sum of tiles()
  std::int64_t lines = 0;     ///< sum of lines()
  std::int64_t matrices = 0;  ///< sum of matrices over tensors with statistics
  std::int64_t elements = 0;  ///< elements of the tensors with statistics (a storing pass's check)
};


/// @brief One tensor's statistics as an element reads them: `locate(index)`, then its row
/// statistic, column statistic, its matrix's row total and, where the pass's part declares
/// them, its line factors (`factor(at)`, the row's times the column's; `factor_of(e)`, the same
/// with the element located once per vector). Made once per chunk (a rule's `for_tensor`) from
/// the table. The elements of a tensor of fewer than 2^31 elements (all but the largest), and
/// an element whose backend says its index is below 2^31 (element::narrow_index), are located
/// with 32-bit multiplications by the table's magic numbers; the others by a division in double
/// corrected to the exact integers (dozens of instructions on a GPU, where the passes over
/// factored statistics were bound by instruction issue).
template <class T>
struct factored_lookup {
  using factor_type = opmath_t<T>;
  T const* row = nullptr;
  T const* col = nullptr;
  double const* row_total = nullptr;
  factor_type const* row_factor = nullptr;
  factor_type const* col_factor = nullptr;
  std::int64_t rows = 1;
  std::int64_t cols = 1;
  bool batched = false;  ///< more than one matrix: the matrix of a row needs a division
  bool small = false;    ///< fewer than 2^31 elements: the 32-bit dividers
  detail::small_divider small_by_cols{};
  detail::small_divider small_by_rows{};
  detail::index_divider by_cols{};
  detail::index_divider by_rows{};

  /// The entry of tensor t of `table` (a zero-row entry gives a lookup with no statistics).
  FUSEDOPT_HOST_DEVICE static factored_lookup of(factored_table<T> const& table, std::int64_t t)
  {
    factored_tensor<T> const entry = table.tensors[t];
    factored_lookup l;
    l.row = entry.row;
    l.col = entry.col;
    l.row_total = entry.row_total;
    l.row_factor = entry.row_factor;
    l.col_factor = entry.col_factor;
    l.rows = entry.rows > 0 ? entry.rows : 1;
    l.cols = entry.cols > 0 ? entry.cols : 1;
    l.batched = entry.matrices > 1;
    l.small = entry.small;
    l.small_by_cols = entry.by_cols;
    l.small_by_rows = entry.by_rows;
    if (!l.small) {
      l.by_cols = detail::index_divider::of(l.cols);
      l.by_rows = detail::index_divider::of(l.rows);
    }
    return l;
  }
  /// True when the tensor has column statistics (a matrix), false for a vector (or none).
  FUSEDOPT_HOST_DEVICE bool factored() const { return col != nullptr; }

  /// Element `index`'s statistics: its row's, its column's, its matrix's row total, and its
  /// column within its row.
  struct position {
    std::int64_t row_line, col_line, matrix, col;
  };
  FUSEDOPT_HOST_DEVICE position locate(std::int64_t index) const
  {
    if (small) { return locate_narrow(index); }
    std::int64_t c = 0, r = 0, m = 0;
    std::int64_t const q = by_cols.quotient(index, c);
    if (batched) { m = by_rows.quotient(q, r); }
    return {q, m * cols + c, m, c};
  }
  /// locate() for an index below 2^31 (of any tensor with statistics: the table's 32-bit
  /// dividers are made for all), in 32-bit multiplications by the magic numbers.
  FUSEDOPT_HOST_DEVICE position locate_narrow(std::int64_t index) const
  {
    auto const n = static_cast<std::uint32_t>(index);
    std::uint32_t const q = small_by_cols.quotient(n);  // the row over the whole batch
    std::uint32_t const c = n - q * static_cast<std::uint32_t>(cols);
    std::uint32_t const m = batched ? small_by_rows.quotient(q) : 0u;
    // m C + c < index / R + C < 2^32 (and where C >= 2^31, q = m = 0, c = index): in 32 bits.
    return {q, m * static_cast<std::uint32_t>(cols) + c, m, c};
  }
  /// The element's line factor: its row's times its column's (a matrix's, where written).
  FUSEDOPT_HOST_DEVICE factor_type factor(position const& at) const
  {
    return row_factor[at.row_line] * col_factor[at.col_line];
  }
  /// factor(locate(e.index())), the element located once per run of consecutive elements
  /// (element::vector_lane(): the CUDA backend's vectors): lane 0 finds its row's factor and
  /// its column line, and the other lanes of a run within that row only load their column's
  /// factor; a run that crosses a row's end is located element by element. The same bits.
  /// Call it on the one lookup a run goes through (a rule's for_tensor body) for every lane of
  /// the run, unconditionally, lane 0 first: a lane reached without its run's lane 0 reads the
  /// row another run left. A lookup made for one element alone locates it.
  template <class E>
  FUSEDOPT_HOST_DEVICE factor_type factor_of(E const& e) const
  {
    int const lane = e.vector_lane();
    if (lane == 0 || !run_in_row_) {
      // An element whose backend says its index is below 2^31 skips locate()'s test of the
      // tensor's size (a branch per element in the tiles kernel, where nothing hoists it).
      position const at = e.narrow_index() ? locate_narrow(e.index()) : locate(e.index());
      if (lane == 0) { run_in_row_ = at.col + e.vector_width() <= cols; }
      run_row_factor_ = row_factor[at.row_line];
      run_first_col_ = at.col_line - lane;
    }
    return run_row_factor_ * col_factor[run_first_col_ + lane];
  }

 private:
  // factor_of's run: its first element's column line, its row's factor, whether it ends in
  // that row. (With them the lookup is no longer an aggregate; it stays trivially copyable,
  // which is what the rules' bodies need: it is made by of() only.)
  mutable std::int64_t run_first_col_ = 0;
  mutable factor_type run_row_factor_{};
  mutable bool run_in_row_ = false;
};

/// @brief Builds a factored_table's entries from the tensors' shapes (host code, once, when the
/// optimizer state is created), and sizes the workspace the pass needs.
///
/// @code
/// fusedopt::factored_layout layout;
/// for (auto const& shape : shapes) layout.add_torch_shape(shape);   // torch's Adafactor factoring
/// // allocate layout.row_elements(t), layout.col_elements(t) statistics per tensor (zeros) and
/// // layout.workspace_doubles() doubles, then:
/// auto entries = layout.entries<float>(row_pointers, col_pointers, workspace);
/// // copy `entries` where the backend reads (device memory for CUDA), and give the rule
/// auto table = layout.table<float>(entries_in_backend_memory);
/// @endcode
class factored_layout {
 public:
  /// @brief A tensor seen as `matrices` matrices of `rows` x `cols`; `columns` false keeps row
  /// statistics only (a vector: rows = its elements, cols = 1). rows 0: no statistics (the
  /// pass skips the tensor), for a rule that reads none there and whose pass stores nothing
  /// (a pass that stores, as CAME's confidence, must visit every element: both backends refuse
  /// such an entry for a tensor with elements). Adafactor's and CAME's second moments read the
  /// row statistics of every non-empty tensor: give their tables vectors (add_torch_shape's
  /// default). An entry of no rows there would be read through a null pointer, which neither
  /// backend can tell from an entry a rule reads nothing of.
  /// @throws fusedopt::error for negative sizes or more than 2^48 elements.
  void add(std::int64_t matrices, std::int64_t rows, std::int64_t cols, bool columns)
  {
    FUSEDOPT_EXPECTS(matrices >= 0 && rows >= 0 && cols >= 0,
                     "factored_layout: tensor " + std::to_string(shapes_.size()) + " has a negative size");
    FUSEDOPT_EXPECTS(rows == 0 || (cols <= (std::int64_t{1} << 48) / (rows > 0 ? rows : 1) &&
                                   matrices <= (std::int64_t{1} << 48) / (rows * (cols > 0 ? cols : 1))),
                     "factored_layout: tensor " + std::to_string(shapes_.size()) + " has more than 2^48 elements");
    shapes_.push_back(shape{matrices, rows, cols, columns});
  }
  /// @brief torch's Adafactor factoring of a tensor of shape `dims`: two or more dimensions
  /// are matrices of the last two (the leading ones a batch), with row and column statistics;
  /// fewer are a vector of its elements with one statistic each, or none when `vectors` is
  /// false (for a pass that reads and stores nothing of them).
  void add_torch_shape(std::vector<std::int64_t> const& dims, bool vectors = true)
  {
    std::int64_t elements = 1;
    for (auto d : dims) { elements *= d; }
    if (dims.size() >= 2) {
      std::int64_t const rows = dims[dims.size() - 2];
      std::int64_t const cols = dims[dims.size() - 1];
      std::int64_t matrices = 1;
      for (std::size_t k = 0; k + 2 < dims.size(); ++k) { matrices *= dims[k]; }
      add(matrices, rows, cols, true);
    } else {
      add(1, vectors ? elements : 0, 1, false);
    }
  }

  [[nodiscard]] std::size_t num_tensors() const { return shapes_.size(); }
  /// Row statistics of tensor t (torch's row_var, or a vector's variance).
  [[nodiscard]] std::int64_t row_elements(std::size_t t) const { return shapes_[t].matrices * shapes_[t].rows; }
  /// Column statistics of tensor t (0 for a vector).
  [[nodiscard]] std::int64_t col_elements(std::size_t t) const
  {
    return shapes_[t].columns ? shapes_[t].matrices * shapes_[t].cols : 0;
  }
  /// Elements of tensor t (what it must be bound with).
  [[nodiscard]] std::int64_t elements(std::size_t t) const
  {
    return shapes_[t].matrices * shapes_[t].rows * shapes_[t].cols;
  }
  /// Doubles of workspace for every tensor's tile partials, row totals and line factors.
  [[nodiscard]] std::int64_t workspace_doubles() const
  {
    std::int64_t n = 0;
    for (auto const& s : shapes_) { n += partial_doubles(s) + total_and_factor_doubles(s); }
    return n;
  }

  /// @brief The entries: `rows[t]` and `cols[t]` point at tensor t's statistics (cols[t] is
  /// ignored for a vector), `workspace` at workspace_doubles() doubles, all where the backend
  /// reads them. The vectors are host memory; copy them there.
  /// @throws fusedopt::error when a pointer list's length is not the number of tensors or a
  /// statistic the layout needs is null.
  template <class T>
  [[nodiscard]] std::vector<factored_tensor<T>> entries(std::vector<T*> const& rows, std::vector<T*> const& cols,
                                                        double* workspace) const
  {
    FUSEDOPT_EXPECTS(rows.size() == shapes_.size() && cols.size() == shapes_.size(),
                     "factored_layout::entries: one row and one column pointer per tensor");
    std::vector<factored_tensor<T>> out(shapes_.size());
    std::int64_t tiles = 0, lines = 0, matrices = 0, offset = 0;
    for (std::size_t t = 0; t < shapes_.size(); ++t) {
      shape const& s = shapes_[t];
      factored_tensor<T>& e = out[t];
      e.first_tile = tiles;
      e.first_line = lines;
      e.first_matrix = matrices;
      if (s.rows == 0 || s.matrices == 0) { continue; }  // rows 0: no statistics
      FUSEDOPT_EXPECTS(rows[t] != nullptr && (!s.columns || cols[t] != nullptr) && workspace != nullptr,
                       "factored_layout::entries: tensor " + std::to_string(t) + " needs its statistics");
      e.rows = s.rows;
      e.cols = s.cols;
      e.matrices = s.matrices;
      e.row = rows[t];
      e.col = s.columns ? cols[t] : nullptr;
      e.small = s.matrices * s.rows * s.cols < detail::small_index_limit;
      e.by_cols = detail::small_divider::of(s.cols > 0 ? s.cols : 1);
      e.by_rows = detail::small_divider::of(s.rows);
      e.partials = workspace + offset;
      offset += partial_doubles(s);
      // A factor per double: room for any arithmetic type (float or double).
      static_assert(sizeof(opmath_t<T>) <= sizeof(double) && alignof(opmath_t<T>) <= alignof(double));
      double* const totals = workspace + offset;
      std::int64_t const kept_totals = s.columns ? s.matrices : 0;  // a vector has no row total
      if (s.columns) { e.row_total = totals; }
      e.row_factor = reinterpret_cast<opmath_t<T>*>(totals + kept_totals);
      e.col_factor = reinterpret_cast<opmath_t<T>*>(totals + kept_totals + s.matrices * s.rows);
      offset += total_and_factor_doubles(s);
      tiles += e.tiles();
      lines += e.lines();
      matrices += s.matrices;
    }
    return out;
  }

  /// @brief The table a rule carries: `entries` (entries<T>()'s, where the backend reads
  /// them) and the layout's totals.
  template <class T>
  [[nodiscard]] factored_table<T> table(factored_tensor<T> const* entries) const
  {
    factored_table<T> table;
    table.tensors = entries;
    table.num_tensors = static_cast<std::int64_t>(shapes_.size());
    for (auto const& s : shapes_) {
      if (s.rows == 0 || s.matrices == 0) { continue; }
      table.tiles += s.matrices * ((s.rows + factored_tile_rows - 1) / factored_tile_rows) *
                     ((s.cols + factored_tile_cols - 1) / factored_tile_cols);
      table.lines += s.matrices * (s.rows + (s.columns ? s.cols : 0));
      table.matrices += s.matrices;
      table.elements += s.matrices * s.rows * s.cols;
    }
    return table;
  }

 private:
  struct shape {
    std::int64_t matrices, rows, cols;
    bool columns;
  };
  static std::int64_t partial_doubles(shape const& s)
  {
    if (s.rows == 0) { return 0; }
    std::int64_t const row_tiles = (s.rows + factored_tile_rows - 1) / factored_tile_rows;
    std::int64_t const col_tiles = (s.cols + factored_tile_cols - 1) / factored_tile_cols;
    return s.matrices * (s.rows * col_tiles + (s.columns ? s.cols * row_tiles : 0));
  }
  /// A matrix's row totals, and the line factors of any tensor with statistics.
  static std::int64_t total_and_factor_doubles(shape const& s)
  {
    if (s.rows == 0) { return 0; }
    return (s.columns ? s.matrices : 0) + s.matrices * (s.rows + s.cols);
  }
  std::vector<shape> shapes_;
};

FUSEDOPT_NAMESPACE_END
