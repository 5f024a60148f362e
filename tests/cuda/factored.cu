// Factored passes on the GPU give the host backend's bits (factored.hpp: both backends add in
// one order): Adafactor and CAME over the same tensors, step by step, on the host backend and
// on the CUDA backend; shapes of 1-D, 0-D and empty tensors, R > C, R < C, 1 x N, N x 1, around
// the 256 x 64 tiles, 3-D and 4-D batches, more than 256 rows; default chunks and chunks of 16
// elements; the four element types. Both optimizers also take scalar reduction passes (RMS of
// the parameter and of the update), whose sums the two backends add in different orders
// (docs/cuda.md): with options under which those sums cannot change a value ("neutral": eps2 and
// the clipping thresholds far above any RMS), every parameter, exp_avg and statistic must have
// the host's bits after every step; with the reductions in play, the statistics that depend on
// the gradients alone must, and the rest must agree within a few roundings of each tensor's
// largest magnitude.
// (tests/rules/adafactor.hpp and came.hpp check both backends against the references.)
#include <fusedopt/fusedopt.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <sstream>
#include <vector>

#include "catch.hpp"
#include "reference/factored.hpp"
#include "rules/cuda_executor.cuh"
#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

using namespace factored_test;

std::vector<std::vector<std::int64_t>> bit_shapes()
{
  return {{7},      {},      {0},      {1},       {130, 3},   {3, 130},     {1, 67},
          {67, 1},  {65, 64}, {64, 65}, {2, 5, 9}, {300, 2}, {257, 130},   {3, 70, 66},  {2, 2, 1, 5},
          {600, 128}};
}

/// Whether two vectors hold the same bytes.
template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b)
{
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}
template <class T>
bool same_bits(slot_data<T>& a, slot_data<T>& b)
{
  for (std::size_t k = 0; k < a.num_tensors(); ++k) {
    if (!same_bits(a.tensors()[k], b.tensors()[k])) { return false; }
  }
  return true;
}

/// Whether every element of a and b agrees within `relative` of the largest magnitude in its
/// tensor (NaNs alike). A reduction's rounding moves an element by a fraction of its step, and an
/// element the step brings near zero (param - step) would fail a bound relative to itself.
template <class T>
bool close(slot_data<T>& a, slot_data<T>& b, double relative)
{
  for (std::size_t k = 0; k < a.num_tensors(); ++k) {
    auto const& x = a.tensors()[k];
    auto const& y = b.tensors()[k];
    if (x.size() != y.size()) { return false; }
    double scale = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      double const u = to_double(x[i]), v = to_double(y[i]);
      if (std::isnan(u) != std::isnan(v)) { return false; }
      if (!std::isnan(u)) { scale = std::max({scale, std::abs(u), std::abs(v)}); }
    }
    for (std::size_t i = 0; i < x.size(); ++i) {
      double const u = to_double(x[i]), v = to_double(y[i]);
      if (!std::isnan(u) && std::abs(u - v) > relative * scale + 1e-30) {
        UNSCOPED_INFO("tensor " << k << " element " << i << ": " << u << " vs " << v << ", "
                                << std::abs(u - v) / scale << " of the tensor's largest magnitude");
        return false;
      }
    }
  }
  return true;
}

/// A few roundings of the element type: what the reductions' order may move a value by.
template <class T>
double roundings()
{
  if constexpr (std::is_same_v<T, double>) {
    return 1e-12;
  } else if constexpr (std::is_same_v<T, fusedopt::bfloat16>) {
    return 2e-2;
  } else if constexpr (std::is_same_v<T, fusedopt::half>) {
    return 4e-3;
  } else {
    return 2e-5;
  }
}

/// A CUDA plan's options: chunks of `chunk` elements (0: the default), the update in the shape
/// for fast memory (one vector a thread; the factored rules' lookahead, agent.cuh's
/// update_lookahead) where `fast`, else the device's choice (the default shape for these
/// small tensors); at most `max_blocks` blocks a launch where set (a tiles kernel's warp then
/// takes several tiles one after another).
fusedopt::cuda::options shape_options(std::int64_t chunk, bool fast, std::int64_t max_blocks = 0)
{
  fusedopt::cuda::options opts;
  opts.chunk_elements = chunk;
  opts.max_blocks = max_blocks;
  opts.memory = fast ? fusedopt::cuda::memory_speed::fast : fusedopt::cuda::memory_speed::automatic;
  return opts;
}

}  // namespace

TEMPLATE_TEST_CASE("adafactor's statistics and steps on the GPU have the host backend's bits", "[factored][adafactor]",
                   float, double, fusedopt::half, fusedopt::bfloat16)
{
  using T = TestType;
  std::int64_t const chunk = GENERATE(std::int64_t{0}, std::int64_t{16}, fusedopt::factored_chunk_elements);
  bool const fast = GENERATE(false, true);
  bool const decay = GENERATE(false, true);
  bool const neutral = GENERATE(true, false);
  auto const dims = bit_shapes();
  std::vector<std::int64_t> sizes;
  for (auto const& s : dims) { sizes.push_back(elements(s)); }
  statistics<host_executor, T> host_stats(dims);
  statistics<cuda_executor, T> device_stats(dims);
  slot_data<T> host_param(sizes, 0), host_grad(sizes, 0), device_param(sizes, 0), device_grad(sizes, 0);
  random r(11);
  host_param.randomize(r, -1, 1);
  device_param.tensors() = host_param.tensors();
  auto const host_plan =
    host_executor::make_plan(chunk, writes(fusedopt::slot::param, host_param), reads(fusedopt::slot::grad, host_grad));
  auto const device_plan = cuda_executor::make_plan_with(
    shape_options(chunk, fast), writes(fusedopt::slot::param, device_param), reads(fusedopt::slot::grad, device_grad));
  fusedopt::rules::basic_adafactor<T> host_rule, device_rule;
  host_rule.lr = device_rule.lr = 0.3;
  host_rule.weight_decay = device_rule.weight_decay = decay ? 0.1 : 0.0;
  host_rule.maximize = device_rule.maximize = decay;
  if (neutral) {
    // alpha = max(eps2, RMS(param)) rho = eps2 lr exactly (rho = lr, RMS(param) far below
    // eps2), and the update's divisor max(1, RMS(update) / d) = 1 exactly.
    host_rule.lr = device_rule.lr = 1e-8;
    host_rule.eps2 = device_rule.eps2 = 1e6;
    host_rule.d = device_rule.d = 1e30;
  }
  host_rule.statistics = host_stats.table();
  device_rule.statistics = device_stats.table();
  for (std::int64_t t = 1; t <= 6; ++t) {
    INFO("chunk " << chunk << " fast " << fast << " decay " << decay << " neutral " << neutral << " step " << t);
    host_grad.randomize(r, t % 3 == 0 ? -10 : -1, t % 3 == 0 ? 10 : 1);
    device_grad.tensors() = host_grad.tensors();
    host_plan.run(host_rule, fusedopt::step_info{t});
    device_plan.run(device_rule, fusedopt::step_info{t});
    CHECK(same_bits(host_stats.rows.get(), device_stats.rows.get()));
    CHECK(same_bits(host_stats.cols.get(), device_stats.cols.get()));
    if (neutral) {
      CHECK(same_bits(host_param, device_param));
    } else {
      // Each step's alpha and divisor may differ by a rounding: t of them by step t.
      CHECK(close(host_param, device_param, static_cast<double>(t) * roundings<T>()));
    }
  }
}

TEST_CASE("a factored statistics table that does not cover the plan's tensors is refused before any launch",
          "[factored]")
{
  auto const dims = bit_shapes();
  std::vector<std::int64_t> sizes;
  for (auto const& s : dims) { sizes.push_back(elements(s)); }
  slot_data<float> param(sizes, 0), grad(sizes, 0);
  random r(13);
  param.randomize(r, -1, 1);
  grad.randomize(r, -1, 1);
  auto const before = param.tensors();
  auto const plan =
    cuda_executor::make_plan(0, writes(fusedopt::slot::param, param), reads(fusedopt::slot::grad, grad));
  fusedopt::rules::basic_adafactor<float> rule;  // statistics: the default table, of no entries
  CHECK_THROWS_AS(plan.run(rule, fusedopt::step_info{1}), fusedopt::error);
  statistics<cuda_executor, float> short_table(std::vector<std::vector<std::int64_t>>{{7}});  // 1 entry, 14 tensors
  rule.statistics = short_table.table();
  CHECK_THROWS_AS(plan.run(rule, fusedopt::step_info{1}), fusedopt::error);
  CHECK(param.tensors() == before);
}

TEMPLATE_TEST_CASE("came's statistics and steps on the GPU have the host backend's bits", "[factored][came]", float,
                   double, fusedopt::half, fusedopt::bfloat16)
{
  using T = TestType;
  using S = fusedopt::opmath_t<T>;
  std::int64_t const chunk = GENERATE(std::int64_t{0}, std::int64_t{16}, fusedopt::factored_chunk_elements);
  bool const fast = GENERATE(false, true);
  bool const neutral = GENERATE(true, false);
  auto const dims = bit_shapes();
  std::vector<std::int64_t> sizes;
  for (auto const& s : dims) { sizes.push_back(elements(s)); }
  statistics<host_executor, S> host_second(dims), host_confidence(dims);
  statistics<cuda_executor, S> device_second(dims), device_confidence(dims);
  slot_data<T> host_param(sizes, 0), host_grad(sizes, 0), device_param(sizes, 0), device_grad(sizes, 0);
  slot_data<S> host_m(sizes, 0), device_m(sizes, 0);
  random r(12);
  host_param.randomize(r, -1, 1);
  device_param.tensors() = host_param.tensors();
  auto const host_plan = host_executor::make_plan(chunk, writes(fusedopt::slot::param, host_param),
                                                  reads(fusedopt::slot::grad, host_grad),
                                                  writes(fusedopt::slot::exp_avg, host_m));
  // Chunks of 16 with one block a launch: each of its warps takes several tiles, whole and
  // partial, one after another.
  auto const device_plan = cuda_executor::make_plan_with(shape_options(chunk, fast, chunk == 16 ? 1 : 0),
                                                         writes(fusedopt::slot::param, device_param),
                                                         reads(fusedopt::slot::grad, device_grad),
                                                         writes(fusedopt::slot::exp_avg, device_m));
  fusedopt::rules::basic_came<S> host_rule, device_rule;
  host_rule.lr = device_rule.lr = 1e-2;
  host_rule.weight_decay = device_rule.weight_decay = 0.1;
  // Neutral: the update's divisor max(1, RMS(update) / threshold) = 1 exactly.
  host_rule.clip_threshold = device_rule.clip_threshold = neutral ? 1e30 : 0.5;
  host_rule.second_moment = host_second.table();
  host_rule.confidence = host_confidence.table();
  device_rule.second_moment = device_second.table();
  device_rule.confidence = device_confidence.table();
  for (std::int64_t t = 1; t <= 6; ++t) {
    INFO("chunk " << chunk << " fast " << fast << " neutral " << neutral << " step " << t);
    host_grad.randomize(r, t % 3 == 0 ? -10 : -1, t % 3 == 0 ? 10 : 1);
    device_grad.tensors() = host_grad.tensors();
    host_plan.run(host_rule, fusedopt::step_info{t});
    device_plan.run(device_rule, fusedopt::step_info{t});
    CHECK(same_bits(host_second.rows.get(), device_second.rows.get()));
    CHECK(same_bits(host_second.cols.get(), device_second.cols.get()));
    if (neutral) {
      CHECK(same_bits(host_confidence.rows.get(), device_confidence.rows.get()));
      CHECK(same_bits(host_confidence.cols.get(), device_confidence.cols.get()));
      CHECK(same_bits(host_m, device_m));
      CHECK(same_bits(host_param, device_param));
    } else {
      // The clipped update (and all that follows from it) may differ by a rounding a step.
      double const bound = static_cast<double>(t) * roundings<S>();
      CHECK(close(host_m, device_m, bound));
      CHECK(close(host_param, device_param, static_cast<double>(t) * roundings<T>()));
    }
  }
}

}  // namespace fusedopt_test
