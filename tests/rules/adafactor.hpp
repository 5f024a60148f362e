// Adafactor against torch.optim.Adafactor's algorithm (torch 2.11, `_single_tensor_adafactor`),
// read again here in double precision, step by step (teacher forcing: each step starts from
// the parameters and statistics the backend holds): the row and column statistics of tensors
// of two or more dimensions (the last two factored, the leading ones a batch: 3-D shapes),
// R > C, R < C, 1 x N, N x 1, shapes around the factored pass's 256 x 64 tiles, vectors
// (variance), a scalar and an empty tensor; eps1's None (finfo of the statistics' dtype),
// weight decay, maximize, the clipping threshold d, the relative step's switch from lr to
// 1 / sqrt(t), eps2 taking over from a tiny RMS(param). Typed over float, double, half and
// bfloat16 (statistics in the parameter's dtype, as torch keeps them). On the backend of
// `executor` (executor.hpp). And the factored pass itself: row and column sums of a
// known value, and bad options rejected before anything is written.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <vector>

#include "reference/factored.hpp"
#include "reference/harness.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {

namespace adafactor_test {

using namespace factored_test;

/// torch's lerp in double (its switch of formula at weight 0.5).
inline double lerp(double self, double end, double weight)
{
  return std::fabs(weight) < 0.5 ? self + weight * (end - self) : end - (end - self) * (1 - weight);
}

/// Python's max(a, b).
inline double python_max(double a, double b) { return b > a ? b : a; }

struct options {
  double lr = 1e-2, beta2_decay = -0.8, eps1 = -1, eps2 = 1e-3, d = 1.0, weight_decay = 0.0;
  bool maximize = false;
};

/// One tensor's step of `_single_tensor_adafactor` in double. `row` and `col` are its
/// statistics (row_var, col_var; `row` is the variance of a tensor of fewer than two
/// dimensions, `col` then empty); `step_term` gets -alpha / denom * update per element, the
/// scale of what the step added (for the tolerance).
struct reference {
  options o;
  double finfo_eps;

  void step(std::int64_t t, std::vector<std::int64_t> const& dims, std::vector<double>& p, std::vector<double> g,
            std::vector<double>& row, std::vector<double>& col, std::vector<double>& step_term) const
  {
    auto const n = p.size();
    if (o.maximize) {
      for (auto& x : g) { x = -x; }
    }
    double const eps1 = o.eps1 < 0 ? finfo_eps : o.eps1;
    auto const step = static_cast<double>(t);
    double const one_minus_beta2 = std::pow(step, o.beta2_decay);
    double const rho = std::min(o.lr, 1 / std::sqrt(step));
    double norm_p = 0;
    for (double x : p) { norm_p += x * x; }
    double const alpha = python_max(o.eps2, std::sqrt(norm_p) / std::sqrt(static_cast<double>(n))) * rho;
    if (o.weight_decay != 0) {
      for (auto& x : p) { x *= 1 - o.lr * o.weight_decay; }
    }
    std::vector<double> v(n);
    if (dims.size() >= 2) {
      std::int64_t const R = dims[dims.size() - 2], C = dims[dims.size() - 1];
      std::int64_t const matrices = static_cast<std::int64_t>(n) / (R * C);
      for (std::int64_t m = 0; m < matrices; ++m) {
        auto at = [&](std::int64_t r, std::int64_t c) { return static_cast<std::size_t>((m * R + r) * C + c); };
        for (std::int64_t r = 0; r < R; ++r) {
          double s = 0;
          for (std::int64_t c = 0; c < C; ++c) { s += g[at(r, c)] * g[at(r, c)]; }
          auto& x = row[static_cast<std::size_t>(m * R + r)];
          x = lerp(x, s / static_cast<double>(C), one_minus_beta2);
        }
        for (std::int64_t c = 0; c < C; ++c) {
          double s = 0;
          for (std::int64_t r = 0; r < R; ++r) { s += g[at(r, c)] * g[at(r, c)]; }
          auto& x = col[static_cast<std::size_t>(m * C + c)];
          x = lerp(x, s / static_cast<double>(R), one_minus_beta2);
        }
        double mean = 0;
        for (std::int64_t r = 0; r < R; ++r) { mean += row[static_cast<std::size_t>(m * R + r)]; }
        mean = std::max(mean / static_cast<double>(R), eps1);
        for (std::int64_t r = 0; r < R; ++r) {
          for (std::int64_t c = 0; c < C; ++c) {
            v[at(r, c)] = row[static_cast<std::size_t>(m * R + r)] * col[static_cast<std::size_t>(m * C + c)] / mean;
          }
        }
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        row[i] = lerp(row[i], g[i] * g[i], one_minus_beta2);
        v[i] = row[i];
      }
    }
    std::vector<double> u(n);
    double norm_u = 0;
    for (std::size_t i = 0; i < n; ++i) {
      u[i] = 1 / std::sqrt(std::max(v[i], eps1 * eps1)) * g[i];
      norm_u += u[i] * u[i];
    }
    double const denom = python_max(1.0, std::sqrt(norm_u) / (std::sqrt(static_cast<double>(n)) * o.d));
    step_term.assign(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      step_term[i] = -alpha / denom * u[i];
      p[i] += step_term[i];
    }
  }
};

/// Shapes: vectors, a scalar and an empty tensor; matrices R > C, R < C, 1 x N, N x 1, around
/// the 256 x 64 tiles; 3-D batches.
inline std::vector<std::vector<std::int64_t>> shapes()
{
  return {{7}, {}, {0}, {1}, {130, 3}, {3, 130}, {1, 67}, {67, 1}, {65, 64}, {64, 65}, {257, 65}, {2, 5, 9}, {3, 70, 66}, {2, 2, 1, 5}};
}

}  // namespace adafactor_test

FUSEDOPT_RULE_TEST("adafactor matches torch's Adafactor step by step", "[optimizers][adafactor]")
{
  using T = TestType;
  using p = precision<T>;
  using namespace adafactor_test;
  // lr, beta2_decay, eps1 (< 0: None), d, weight_decay, maximize, the parameters' scale, the
  // plan's chunk length (0: the backend's; 16: chunks that cut rows and tiles, each with its
  // own per-tensor body)
  auto const [lr, beta2_decay, eps1, d, weight_decay, maximize, scale, chunk] =
    GENERATE(table<double, double, double, double, double, bool, double, std::int64_t>({
      {1e-2, -0.8, -1.0, 1.0, 0.0, false, 1.0, 0},   // torch's defaults
      {0.3, -0.8, 1e-3, 1.0, 0.1, true, 1.0, 0},     // rho_t = 1 / sqrt(t) from step 12 on; decay; maximize
      {0.05, -0.5, -1.0, 2.0, 0.0, false, 1e-5, 0},  // eps2 above RMS(param); another beta2 schedule and d
      {1e-2, -0.8, -1.0, 1.0, 0.0, false, 1.0, 16},
    }));
  options o;
  o.lr = lr;
  o.beta2_decay = beta2_decay;
  o.eps1 = eps1;
  o.d = d;
  o.weight_decay = weight_decay;
  o.maximize = maximize;
  reference const ref{o, fusedopt::detail::finfo_eps<T>()};

  auto const dims = shapes();
  std::vector<std::int64_t> sizes;
  for (auto const& s : dims) { sizes.push_back(elements(s)); }
  statistics<executor, T> stats(dims);
  fusedopt::rules::basic_adafactor<T> opt;
  opt.lr = lr;
  opt.beta2_decay = beta2_decay;
  opt.eps1 = eps1;
  opt.d = d;
  opt.weight_decay = weight_decay;
  opt.maximize = maximize;
  opt.statistics = stats.table();

  std::ostringstream label;
  label << "lr=" << lr << " beta2_decay=" << beta2_decay << " eps1=" << eps1 << " d=" << d
        << " weight_decay=" << weight_decay << " maximize=" << maximize << " scale=" << scale << " chunk=" << chunk;
  INFO(context<T>("adafactor", label.str()));
  random r(42);
  slot_data<T> param(sizes, 0), grad(sizes, 0);
  param.randomize(r, -scale, scale);
  auto const plan = executor::make_plan(chunk, writes(fusedopt::slot::param, param), reads(fusedopt::slot::grad, grad));
  // The tolerances: the statistics are stored in T after a few operations in the arithmetic
  // type; the update reads the stored statistics (the reference its exact ones), so its
  // terms carry their rounding, halved by the square root, and the RMS over the tensor; sums
  // over thousands of elements in double (the backend's order is not the reference's) add
  // their own, which shows in double.
  double const sums = 0x1p-53 * 2048;
  double const stat_tol = p::store + 16 * p::op + sums;
  double const param_tol = p::store + 8 * p::op;
  double const step_tol = 4 * p::store + 64 * p::op + sums;
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    double const g_scale = t % 4 == 0 ? 10.0 : 1.0;
    grad.randomize(r, -g_scale, g_scale);
    auto const p0 = param.snapshot();
    auto const g = grad.snapshot();
    auto const rows0 = stats.rows.get();
    auto const cols0 = stats.cols.get();
    plan.run(opt, fusedopt::step_info{t});
    auto const rows1 = stats.rows.get();
    auto const cols1 = stats.cols.get();
    std::size_t failures = 0, checked = 0;
    std::string first;
    auto const check = [&](char const* what, std::size_t k, std::size_t i, double got, double want, double tol) {
      ++checked;
      if (!(std::fabs(got - want) <= tol)) {
        if (failures++ == 0) {
          std::ostringstream s;
          s.precision(17);
          s << what << " of tensor " << k << " element " << i << ": got " << got << ", want " << want << " (tolerance "
            << tol << ")";
          first = s.str();
        }
      }
    };
    for (std::size_t k = 0; k < dims.size(); ++k) {
      auto pk = p0[k];
      auto row = statistics<executor, T>::slice(rows0, stats.row_offsets, k);
      auto col = statistics<executor, T>::slice(cols0, stats.col_offsets, k);
      std::vector<double> step_term;
      if (pk.empty()) { continue; }
      ref.step(t, dims[k], pk, g[k], row, col, step_term);
      auto const got_row = statistics<executor, T>::slice(rows1, stats.row_offsets, k);
      auto const got_col = statistics<executor, T>::slice(cols1, stats.col_offsets, k);
      for (std::size_t i = 0; i < row.size(); ++i) {
        check("row statistic", k, i, got_row[i], row[i], stat_tol * std::fabs(row[i]) + p::floor);
      }
      for (std::size_t i = 0; i < col.size(); ++i) {
        check("column statistic", k, i, got_col[i], col[i], stat_tol * std::fabs(col[i]) + p::floor);
      }
      for (std::size_t i = 0; i < pk.size(); ++i) {
        double const decayed = pk[i] - step_term[i];
        check("param", k, i, param.at(k, i), pk[i],
              p::store * std::fabs(pk[i]) + param_tol * std::fabs(decayed) + step_tol * std::fabs(step_term[i]) +
                p::floor);
      }
    }
    INFO("step " << t << ": " << failures << " of " << checked << " values out of tolerance; " << first);
    CHECK(failures == 0);
  }
}

FUSEDOPT_RULE_TEST("a factored pass sums each row and column of the matrices in the tensor's last two dimensions",
                   "[factored]")
{
  using T = TestType;
  using namespace adafactor_test;
  // With beta2_decay 0 the fold's weight is 1: each statistic is its mean of grad^2. Gradients
  // of small integers (exact in every type) give sums that are exact: the statistics are the
  // exact means rounded once to T.
  std::vector<std::vector<std::int64_t>> const dims = {{3, 129, 70}, {5}, {200, 1}, {1, 200}, {64, 64}};
  std::vector<std::int64_t> sizes;
  for (auto const& s : dims) { sizes.push_back(elements(s)); }
  statistics<executor, T> stats(dims);
  fusedopt::rules::basic_adafactor<T> opt;
  opt.beta2_decay = 0.0;
  opt.statistics = stats.table();
  slot_data<T> param(sizes, 1), grad(sizes, 0);
  for (std::size_t k = 0; k < grad.num_tensors(); ++k) {
    for (std::size_t i = 0; i < grad.size(k); ++i) {
      grad.tensors()[k][i] = from_double<T>(static_cast<double>(static_cast<int>((i * 7 + k) % 9) - 4));
    }
  }
  auto const plan = executor::make_plan(0, writes(fusedopt::slot::param, param), reads(fusedopt::slot::grad, grad));
  plan.run(opt, fusedopt::step_info{1});
  auto const rows = stats.rows.get();
  auto const cols = stats.cols.get();
  for (std::size_t k = 0; k < dims.size(); ++k) {
    auto const g = grad.snapshot()[k];
    auto const got_row = statistics<executor, T>::slice(rows, stats.row_offsets, k);
    auto const got_col = statistics<executor, T>::slice(cols, stats.col_offsets, k);
    if (dims[k].size() < 2) {
      for (std::size_t i = 0; i < g.size(); ++i) { CHECK(got_row[i] == in_type<T>(g[i] * g[i])); }
      continue;
    }
    std::int64_t const R = dims[k][dims[k].size() - 2], C = dims[k].back();
    std::int64_t const matrices = elements(dims[k]) / (R * C);
    for (std::int64_t m = 0; m < matrices; ++m) {
      for (std::int64_t r = 0; r < R; ++r) {
        double s = 0;
        for (std::int64_t c = 0; c < C; ++c) { s += g[static_cast<std::size_t>((m * R + r) * C + c)] * g[static_cast<std::size_t>((m * R + r) * C + c)]; }
        CHECK(got_row[static_cast<std::size_t>(m * R + r)] == in_type<T>(s / static_cast<double>(C)));
      }
      for (std::int64_t c = 0; c < C; ++c) {
        double s = 0;
        for (std::int64_t r = 0; r < R; ++r) { s += g[static_cast<std::size_t>((m * R + r) * C + c)] * g[static_cast<std::size_t>((m * R + r) * C + c)]; }
        CHECK(got_col[static_cast<std::size_t>(m * C + c)] == in_type<T>(s / static_cast<double>(R)));
      }
    }
  }
}

FUSEDOPT_RULE_TEST("adafactor rejects bad options before writing", "[optimizers][adafactor][errors]")
{
  using T = TestType;
  using namespace adafactor_test;
  std::vector<std::vector<std::int64_t>> const dims = {{3, 17}, {5}};
  statistics<executor, T> stats(dims);
  fusedopt::rules::basic_adafactor<T> opt;
  opt.statistics = stats.table();
  SECTION("negative lr") { opt.lr = -1e-3; }
  SECTION("positive beta2_decay") { opt.beta2_decay = 0.5; }
  SECTION("NaN eps1") { opt.eps1 = std::nan(""); }
  SECTION("negative eps2") { opt.eps2 = -1e-3; }
  SECTION("d below 1") { opt.d = 0.5; }
  SECTION("negative weight_decay") { opt.weight_decay = -0.1; }
  SECTION("no statistics") { opt.statistics = fusedopt::factored_table<T>{nullptr, 2, 0, 0, 0}; }
  slot_data<T> param({51, 5}, 0.5), grad({51, 5}, 0.25);
  auto const plan = executor::make_plan(0, writes(fusedopt::slot::param, param), reads(fusedopt::slot::grad, grad));
  auto const before = param.snapshot();
  REQUIRE_THROWS_AS(plan.run(opt, fusedopt::step_info{1}), fusedopt::error);
  CHECK(param.snapshot() == before);
}

}  // namespace fusedopt_test
