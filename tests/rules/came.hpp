// CAME against yangluo7/CAME's `CAME.py`, read again here in double precision, step by step
// (teacher forcing: each step starts from the parameters, exp_avg and statistics the backend
// holds): the factored second moment and confidence statistics of tensors of two or more
// dimensions (3-D batches, R > C, R < C, 1 x N, N x 1, around the 256 x 64 tiles), the full
// exp_avg_sq of vectors, a scalar and an empty tensor; the update clipping by RMS active
// (gradients tenfold on some steps) and weight decay. Typed over float, double, half and
// bfloat16 parameters, whose exp_avg and statistics are the arithmetic type (float, double), as
// the reference keeps them after upcasting 16-bit gradients. On the backend of `executor`.
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

namespace came_test {

using namespace factored_test;

struct options {
  double lr = 2e-4, eps1 = 1e-30, eps2 = 1e-16, clip = 1.0, beta1 = 0.9, beta2 = 0.999, beta3 = 0.9999,
         weight_decay = 0.0;
};

/// One tensor's step of `CAME.step` in double. `sq_row`, `sq_col` are exp_avg_sq_row and _col
/// (sq_row the full exp_avg_sq of a tensor of fewer than two dimensions, sq_col then empty),
/// `res_row`, `res_col` exp_avg_res_row and _col (empty for those); `step_term` gets lr times
/// the final update per element, `direction` the clipped U and `step_scale` the size of the
/// step's terms (for the tolerances).
struct reference {
  options o;

  static void approximation(std::vector<double> const& row, std::vector<double> const& col, std::int64_t matrices,
                            std::int64_t R, std::int64_t C, std::vector<double>& out)
  {
    for (std::int64_t m = 0; m < matrices; ++m) {
      double mean = 0;
      for (std::int64_t r = 0; r < R; ++r) { mean += row[static_cast<std::size_t>(m * R + r)]; }
      mean /= static_cast<double>(R);
      for (std::int64_t r = 0; r < R; ++r) {
        for (std::int64_t c = 0; c < C; ++c) {
          out[static_cast<std::size_t>((m * R + r) * C + c)] = 1 / std::sqrt(row[static_cast<std::size_t>(m * R + r)] / mean) *
                                                               (1 / std::sqrt(col[static_cast<std::size_t>(m * C + c)]));
        }
      }
    }
  }
  /// stat = beta stat + (1 - beta) mean over the last (rows) or second-to-last (cols) dimension.
  static void average(std::vector<double> const& x, std::int64_t matrices, std::int64_t R, std::int64_t C, double beta,
                      std::vector<double>& row, std::vector<double>& col)
  {
    for (std::int64_t m = 0; m < matrices; ++m) {
      for (std::int64_t r = 0; r < R; ++r) {
        double s = 0;
        for (std::int64_t c = 0; c < C; ++c) { s += x[static_cast<std::size_t>((m * R + r) * C + c)]; }
        auto& v = row[static_cast<std::size_t>(m * R + r)];
        v = v * beta + (1 - beta) * (s / static_cast<double>(C));
      }
      for (std::int64_t c = 0; c < C; ++c) {
        double s = 0;
        for (std::int64_t r = 0; r < R; ++r) { s += x[static_cast<std::size_t>((m * R + r) * C + c)]; }
        auto& v = col[static_cast<std::size_t>(m * C + c)];
        v = v * beta + (1 - beta) * (s / static_cast<double>(R));
      }
    }
  }

  void step(std::vector<std::int64_t> const& dims, std::vector<double>& p, std::vector<double> const& g,
            std::vector<double>& m, std::vector<double>& sq_row, std::vector<double>& sq_col,
            std::vector<double>& res_row, std::vector<double>& res_col, std::vector<double>& step_term,
            std::vector<double>& direction, std::vector<double>& step_scale) const
  {
    std::vector<double> const m_old = m;
    std::size_t const n = p.size();
    bool const factored = dims.size() >= 2;
    std::int64_t const R = factored ? dims[dims.size() - 2] : 0, C = factored ? dims.back() : 0;
    std::int64_t const matrices = factored ? static_cast<std::int64_t>(n) / (R * C) : 0;
    std::vector<double> u(n);
    for (std::size_t i = 0; i < n; ++i) { u[i] = g[i] * g[i] + o.eps1; }
    if (factored) {
      average(u, matrices, R, C, o.beta2, sq_row, sq_col);
      std::vector<double> a(n);
      approximation(sq_row, sq_col, matrices, R, C, a);
      for (std::size_t i = 0; i < n; ++i) { u[i] = a[i] * g[i]; }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        sq_row[i] = sq_row[i] * o.beta2 + (1 - o.beta2) * u[i];
        u[i] = 1 / std::sqrt(sq_row[i]) * g[i];
      }
    }
    double norm = 0;
    for (double x : u) { norm += x * x; }
    double const divisor = std::max(std::sqrt(norm) / std::sqrt(static_cast<double>(n)) / o.clip, 1.0);
    std::vector<double> res(n);
    for (std::size_t i = 0; i < n; ++i) {
      u[i] /= divisor;
      m[i] = m[i] * o.beta1 + (1 - o.beta1) * u[i];
      res[i] = (u[i] - m[i]) * (u[i] - m[i]) + o.eps2;
    }
    direction = u;
    std::vector<double> s = m, a(n, 1.0);
    if (factored) {
      average(res, matrices, R, C, o.beta3, res_row, res_col);
      approximation(res_row, res_col, matrices, R, C, a);
      for (std::size_t i = 0; i < n; ++i) { s[i] = a[i] * m[i]; }
    }
    step_term.assign(n, 0.0);
    step_scale.assign(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      if (o.weight_decay != 0) { p[i] += -o.weight_decay * o.lr * p[i]; }
      step_term[i] = s[i] * o.lr;
      // exp_avg may cancel (beta1 m + (1 - beta1) U): its error scales with its terms.
      step_scale[i] = o.lr * a[i] * (std::fabs(m_old[i]) + std::fabs(u[i]));
      p[i] -= step_term[i];
    }
  }
};

inline std::vector<std::vector<std::int64_t>> shapes()
{
  return {{7}, {}, {0}, {130, 3}, {3, 130}, {1, 67}, {67, 1}, {65, 64}, {257, 65}, {2, 5, 9}, {3, 70, 66}};
}

}  // namespace came_test

FUSEDOPT_RULE_TEST("came matches CAME.py step by step", "[optimizers][came]")
{
  using T = TestType;
  using S = fusedopt::opmath_t<T>;  // exp_avg and the statistics: the reference's upcast type
  using p = precision<T>;
  using q = precision<S>;
  using namespace came_test;
  // lr, clip_threshold, weight_decay
  auto const [lr, clip, weight_decay] =
    GENERATE(table<double, double, double>({{2e-4, 1.0, 0.0}, {1e-2, 0.5, 0.1}, {0.05, 1e9, 0.0}}));
  options o;
  o.lr = lr;
  o.clip = clip;
  o.weight_decay = weight_decay;
  reference const ref{o};

  auto const dims = shapes();
  std::vector<std::int64_t> sizes;
  for (auto const& s : dims) { sizes.push_back(elements(s)); }
  statistics<executor, S> second(dims), confidence(dims);
  fusedopt::rules::basic_came<S> opt;
  opt.lr = lr;
  opt.clip_threshold = clip;
  opt.weight_decay = weight_decay;
  opt.second_moment = second.table();
  opt.confidence = confidence.table();

  std::ostringstream label;
  label << "lr=" << lr << " clip_threshold=" << clip << " weight_decay=" << weight_decay;
  INFO(context<T>("came", label.str()));
  random r(7);
  slot_data<T> param(sizes, 0), grad(sizes, 0);
  slot_data<S> exp_avg(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fusedopt::slot::param, param), reads(fusedopt::slot::grad, grad),
                                        writes(fusedopt::slot::exp_avg, exp_avg));
  // Tolerances as Adafactor's (tests/rules/adafactor.hpp), in the statistics' type for them and
  // exp_avg; the confidence statistics average (U - m)^2, whose difference cancels: a wider
  // bound for them and for what they scale.
  double const sums = 0x1p-53 * 2048;
  double const stat_tol = q::store + 16 * q::op + sums;
  double const res_tol = 1024 * q::op + sums;
  double const param_tol = p::store + 8 * p::op;  // of the decayed parameter; its store: of the result
  double const step_tol = 1024 * q::op + sums;
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    double const g_scale = t % 4 == 0 ? 10.0 : 1.0;
    grad.randomize(r, -g_scale, g_scale);
    auto const p0 = param.snapshot();
    auto const g = grad.snapshot();
    auto const m0 = exp_avg.snapshot();
    auto const sr0 = second.rows.get(), sc0 = second.cols.get(), rr0 = confidence.rows.get(),
               rc0 = confidence.cols.get();
    plan.run(opt, fusedopt::step_info{t});
    auto const sr1 = second.rows.get(), sc1 = second.cols.get(), rr1 = confidence.rows.get(),
               rc1 = confidence.cols.get();
    std::size_t failures = 0, checked = 0;
    std::string first;
    auto const check = [&](char const* what, std::size_t k, std::size_t i, double got, double want, double tol) {
      ++checked;
      if (!(std::fabs(got - want) <= tol) && failures++ == 0) {
        std::ostringstream s;
        s.precision(17);
        s << what << " of tensor " << k << " element " << i << ": got " << got << ", want " << want << " (tolerance "
          << tol << ")";
        first = s.str();
      }
    };
    using stats = statistics<executor, S>;
    for (std::size_t k = 0; k < dims.size(); ++k) {
      auto pk = p0[k];
      if (pk.empty()) { continue; }
      auto mk = m0[k];
      auto sq_row = stats::slice(sr0, second.row_offsets, k), sq_col = stats::slice(sc0, second.col_offsets, k);
      auto res_row = stats::slice(rr0, confidence.row_offsets, k), res_col = stats::slice(rc0, confidence.col_offsets, k);
      std::vector<double> step_term, direction, step_scale;
      auto const m_old = mk;
      ref.step(dims[k], pk, g[k], mk, sq_row, sq_col, res_row, res_col, step_term, direction, step_scale);
      auto const got = [&](std::vector<S> const& all, std::vector<std::int64_t> const& offsets) {
        return stats::slice(all, offsets, k);
      };
      auto const g_sr = got(sr1, second.row_offsets), g_sc = got(sc1, second.col_offsets);
      auto const g_rr = got(rr1, confidence.row_offsets), g_rc = got(rc1, confidence.col_offsets);
      for (std::size_t i = 0; i < sq_row.size(); ++i) { check("exp_avg_sq_row", k, i, g_sr[i], sq_row[i], stat_tol * std::fabs(sq_row[i])); }
      for (std::size_t i = 0; i < sq_col.size(); ++i) { check("exp_avg_sq_col", k, i, g_sc[i], sq_col[i], stat_tol * std::fabs(sq_col[i])); }
      // A vector's confidence statistics (the pass needs an entry to visit it) are read by no
      // step and the reference keeps none: not compared.
      bool const matrix = dims[k].size() >= 2;
      for (std::size_t i = 0; matrix && i < res_row.size(); ++i) { check("exp_avg_res_row", k, i, g_rr[i], res_row[i], res_tol * std::fabs(res_row[i])); }
      for (std::size_t i = 0; i < res_col.size(); ++i) { check("exp_avg_res_col", k, i, g_rc[i], res_col[i], res_tol * std::fabs(res_col[i])); }
      for (std::size_t i = 0; i < pk.size(); ++i) {
        check("exp_avg", k, i, exp_avg.at(k, i), mk[i],
              stat_tol * std::fabs(mk[i]) + 64 * q::op * (std::fabs(m_old[i]) + std::fabs(direction[i])));
        double const decayed = pk[i] + step_term[i];
        check("param", k, i, param.at(k, i), pk[i],
              p::store * std::fabs(pk[i]) + param_tol * std::fabs(decayed) + step_tol * step_scale[i] + p::floor);
      }
    }
    INFO("step " << t << ": " << failures << " of " << checked << " values out of tolerance; " << first);
    CHECK(failures == 0);
  }
}

FUSEDOPT_RULE_TEST("came rejects bad options before writing", "[optimizers][came][errors]")
{
  using S = fusedopt::opmath_t<TestType>;
  using namespace came_test;
  std::vector<std::vector<std::int64_t>> const dims = {{3, 17}, {5}};
  statistics<executor, S> second(dims), confidence(dims);
  fusedopt::rules::basic_came<S> opt;
  opt.second_moment = second.table();
  opt.confidence = confidence.table();
  SECTION("lr of 0") { opt.lr = 0.0; }
  SECTION("beta1 above 1") { opt.beta1 = 1.5; }
  SECTION("negative beta2") { opt.beta2 = -0.1; }
  SECTION("beta3 above 1") { opt.beta3 = 1.01; }
  SECTION("no second-moment statistics") { opt.second_moment = fusedopt::factored_table<S>{nullptr, 2, 0, 0, 0}; }
  SECTION("no confidence statistics") { opt.confidence = fusedopt::factored_table<S>{nullptr, 2, 0, 0, 0}; }
  // The confidence pass stores exp_avg, so it must visit the vector too.
  statistics<executor, S> without_vectors(dims, false);
  SECTION("confidence statistics without the vector's") { opt.confidence = without_vectors.table(); }
  slot_data<TestType> param({51, 5}, 0.5), grad({51, 5}, 0.25);
  slot_data<S> exp_avg({51, 5}, 0.0);
  auto const plan = executor::make_plan(0, writes(fusedopt::slot::param, param), reads(fusedopt::slot::grad, grad),
                                        writes(fusedopt::slot::exp_avg, exp_avg));
  auto const before = param.snapshot();
  REQUIRE_THROWS_AS(plan.run(opt, fusedopt::step_info{1}), fusedopt::error);
  CHECK(param.snapshot() == before);
}

}  // namespace fusedopt_test
