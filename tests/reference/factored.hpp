// What the tests of rules with factored statistics (factored.hpp: Adafactor, CAME) share: the
// statistics of a list of tensor shapes in an executor's memory, as a caller keeps them (the
// layout, the statistics, the workspace and the table of entries), and small helpers.
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reference/harness.hpp"

namespace fusedopt_test::factored_test {

inline std::int64_t elements(std::vector<std::int64_t> const& dims)
{
  std::int64_t n = 1;
  for (auto d : dims) { n *= d; }
  return n;
}

/// x rounded to T and back (through T's arithmetic type, as a store of the backend).
template <class T>
double in_type(double x)
{
  return to_double(from_double<T>(x));
}

/// The statistics of tensors of `dims` in backend memory (Executor::array), their table and
/// the workspace, as a caller keeps them.
template <class Executor, class S>
struct statistics {
  fusedopt::factored_layout layout;
  std::vector<std::int64_t> row_offsets, col_offsets;
  typename Executor::template array<S> rows, cols;
  typename Executor::template array<double> workspace;
  typename Executor::template array<fusedopt::factored_tensor<S>> entries;

  static fusedopt::factored_layout make(std::vector<std::vector<std::int64_t>> const& dims, bool vectors)
  {
    fusedopt::factored_layout l;
    for (auto const& d : dims) { l.add_torch_shape(d, vectors); }
    return l;
  }
  static std::int64_t total(fusedopt::factored_layout const& l, bool columns)
  {
    std::int64_t n = 0;
    for (std::size_t t = 0; t < l.num_tensors(); ++t) { n += columns ? l.col_elements(t) : l.row_elements(t); }
    return n;
  }

  /// `vectors`: whether tensors of fewer than two dimensions have statistics (a row statistic
  /// per element, factored_layout::add_torch_shape).
  explicit statistics(std::vector<std::vector<std::int64_t>> const& dims, bool vectors = true)
    : layout(make(dims, vectors)), rows(static_cast<std::size_t>(total(layout, false)), fusedopt::from_opmath<S>(0.0f)),
      cols(static_cast<std::size_t>(total(layout, true)), fusedopt::from_opmath<S>(0.0f)),
      workspace(static_cast<std::size_t>(layout.workspace_doubles())), entries(layout.num_tensors())
  {
    std::vector<S*> row_pointers, col_pointers;
    std::int64_t r = 0, c = 0;
    for (std::size_t t = 0; t < layout.num_tensors(); ++t) {
      row_offsets.push_back(r);
      col_offsets.push_back(c);
      row_pointers.push_back(rows.data() + r);
      col_pointers.push_back(cols.data() + c);
      r += layout.row_elements(t);
      c += layout.col_elements(t);
    }
    row_offsets.push_back(r);
    col_offsets.push_back(c);
    entries.set(layout.entries<S>(row_pointers, col_pointers, workspace.data()));
  }
  [[nodiscard]] fusedopt::factored_table<S> table() { return layout.table<S>(entries.data()); }

  /// Tensor t's statistics, exactly, in double.
  static std::vector<double> slice(std::vector<S> const& all, std::vector<std::int64_t> const& offsets, std::size_t t)
  {
    std::vector<double> out;
    for (auto k = offsets[t]; k < offsets[t + 1]; ++k) { out.push_back(to_double(all[static_cast<std::size_t>(k)])); }
    return out;
  }
};

}  // namespace fusedopt_test::factored_test
