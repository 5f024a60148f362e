// Reduction passes on the host backend: norms of slots and of a chain's update register,
// global-norm clipping, pass ordering in chains, determinism over thread counts.
#include <fusedopt/fusedopt.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "prelude.hpp"


namespace {

struct buffers {
  std::vector<std::vector<float>> p, g;
  explicit buffers(std::vector<std::int64_t> const& sizes, unsigned seed = 1)
  {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto n : sizes) {
      p.emplace_back(static_cast<std::size_t>(n));
      g.emplace_back(static_cast<std::size_t>(n));
      for (auto& x : p.back()) { x = normal(rng); }
      for (auto& x : g.back()) { x = normal(rng); }
    }
  }
  auto lists()
  {
    fo::tensor_list<float> pl;
    fo::tensor_list<float const> gl;
    for (std::size_t t = 0; t < p.size(); ++t) {
      pl.push_back(p[t].data(), static_cast<std::int64_t>(p[t].size()));
      gl.push_back(g[t].data(), static_cast<std::int64_t>(g[t].size()));
    }
    return fo::bind(param = pl, grad = gl);
  }
};

std::vector<std::int64_t> const sizes{1000, 1, 0, 40000, 17, 70000};

double direct_l2(std::vector<std::vector<float>> const& v, std::size_t only = SIZE_MAX)
{
  double s = 0;
  for (std::size_t t = 0; t < v.size(); ++t) {
    if (only != SIZE_MAX && t != only) { continue; }
    for (float x : v[t]) { s += static_cast<double>(x) * x; }
  }
  return std::sqrt(s);
}

}  // namespace

TEST_CASE("norm_of measures per-tensor and global norms", "[reduce]")
{
  buffers b(sizes);
  auto plan = fo::host::make_plan(b.lists());
  std::vector<double> per(sizes.size(), -1.0);
  double total = -1;
  fo::rules::norm_of<fo::slot::grad_t> l2{fo::norm_kind::l2, per.data(), &total};
  auto const before = b.p;
  plan.run(l2);
  REQUIRE(b.p == before);  // measures, writes nothing
  REQUIRE(total == fusedopt_test::Approx(direct_l2(b.g)).epsilon(1e-6));
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    REQUIRE(per[t] == fusedopt_test::Approx(direct_l2(b.g, t)).epsilon(1e-6).margin(1e-12));
  }

  double inf_total = -1;
  plan.run(fo::rules::norm_of<fo::slot::grad_t>{fo::norm_kind::inf, nullptr, &inf_total});
  double expected = 0;
  for (auto const& t : b.g) {
    for (float x : t) { expected = std::max(expected, static_cast<double>(std::fabs(x))); }
  }
  REQUIRE(inf_total == expected);

  // Alone, norm_of is its pass and its hook (no update pass); in a chain the update runs.
  STATIC_REQUIRE(fo::detail::skips_update_v<fo::rules::norm_of<fo::slot::grad_t>>);
  STATIC_REQUIRE_FALSE(fo::detail::skips_update_v<decltype(fo::chain(l2, fo::rules::sgd{}))>);
}

TEST_CASE("clip_by_global_norm then SGD matches clip_grad_norm_ followed by SGD", "[reduce]")
{
  for (double max_norm : {1.0, 1e6}) {
    buffers b(sizes);
    auto const p0 = b.p;
    double total = 0;
    fo::rules::clip_by_global_norm clip;
    clip.max_norm = max_norm;
    clip.total_norm = &total;
    fo::rules::sgd sgd;
    sgd.lr = 0.1;
    auto plan = fo::host::make_plan(b.lists());
    plan.run(fo::chain(clip, sgd));

    double const norm = direct_l2(b.g);
    REQUIRE(total == fusedopt_test::Approx(norm).epsilon(1e-6));
    double const coefficient = std::min(1.0, max_norm / (norm + 1e-6));
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < b.p[t].size(); ++i) {
        double const expected = p0[t][i] - 0.1 * coefficient * b.g[t][i];
        REQUIRE(b.p[t][i] == fusedopt_test::Approx(expected).epsilon(1e-5).margin(1e-6));
      }
    }
  }
}

TEST_CASE("a reduction pass sees the element as the parts before it left it", "[reduce]")
{
  // clip first, then measure the norm of the update Adam computes from the clipped gradient:
  // two reduction passes, the second running clip's final body before it accumulates.
  buffers b(sizes);
  std::vector<std::vector<float>> m, v;
  fo::tensor_list<float> ml, vl;
  for (auto const& t : b.p) {
    m.emplace_back(t.size(), 0.f);
    v.emplace_back(t.size(), 0.f);
  }
  for (std::size_t t = 0; t < m.size(); ++t) {
    ml.push_back(m[t].data(), static_cast<std::int64_t>(m[t].size()));
    vl.push_back(v[t].data(), static_cast<std::int64_t>(v[t].size()));
  }
  fo::tensor_list<float> pl;
  fo::tensor_list<float const> gl;
  for (std::size_t t = 0; t < b.p.size(); ++t) {
    pl.push_back(b.p[t].data(), static_cast<std::int64_t>(b.p[t].size()));
    gl.push_back(b.g[t].data(), static_cast<std::int64_t>(b.g[t].size()));
  }
  auto plan = fo::host::make_plan(fo::bind(param = pl, grad = gl, fo::slot::exp_avg = ml, fo::slot::exp_avg_sq = vl));
  fo::rules::clip_by_global_norm clip;
  clip.max_norm = 0.5;
  double update_norm = -1;
  fo::rules::norm_of<fo::slot::update_t> measure{fo::norm_kind::l2, nullptr, &update_norm};
  auto rule = fo::chain(clip, fo::rules::scale_by_adam{}, measure, fo::rules::scale_by_lr{0.01}, fo::rules::apply_update{});
  STATIC_REQUIRE(fo::pass_count_v<decltype(rule)> == 2);
  auto const p0 = b.p;
  plan.run(rule);

  // At step 1 with zero moments, Adam's update is g_c / (|g_c| + eps) elementwise (bias
  // corrections cancel), where g_c is the clipped gradient.
  double const coefficient = std::min(1.0, 0.5 / (direct_l2(b.g) + 1e-6));
  double expected_norm2 = 0;
  for (std::size_t t = 0; t < b.g.size(); ++t) {
    for (std::size_t i = 0; i < b.g[t].size(); ++i) {
      double const gc = coefficient * b.g[t][i];
      double const u = gc / (std::fabs(gc) + 1e-8);
      expected_norm2 += u * u;
      REQUIRE(b.p[t][i] == fusedopt_test::Approx(p0[t][i] - 0.01 * u).epsilon(1e-5).margin(1e-6));
    }
  }
  REQUIRE(update_norm == fusedopt_test::Approx(std::sqrt(expected_norm2)).epsilon(1e-5));
}

TEST_CASE("reductions give the same bits whatever the thread count", "[reduce]")
{
  std::vector<double> totals;
  for (int threads : {1, 2, 0}) {
    buffers b(sizes);
    fo::host::options opts;
    opts.threads = threads;
    opts.chunk_elements = 1000;
    auto plan = fo::host::make_plan(b.lists(), opts);
    double total = 0;
    plan.run(fo::rules::norm_of<fo::slot::grad_t>{fo::norm_kind::l2, nullptr, &total});
    totals.push_back(total);
  }
  REQUIRE(std::memcmp(&totals[0], &totals[1], sizeof(double)) == 0);
  REQUIRE(std::memcmp(&totals[0], &totals[2], sizeof(double)) == 0);
}

TEST_CASE("a rule needing more accumulators than the plan holds is rejected before any write", "[reduce][errors]")
{
  buffers b(sizes);
  auto const before = b.p;
  fo::host::options opts;
  opts.reduction_capacity = 1;
  auto plan = fo::host::make_plan(b.lists(), opts);
  REQUIRE_THROWS_AS(plan.run(fo::chain(fo::rules::clip_by_global_norm{}, fo::rules::sgd{})), fo::error);
  REQUIRE(b.p == before);
}

namespace {

/// Divides each parameter by its tensor's L2 norm, the divisor finished once per tensor
/// (reduce.hpp, prepare_finish; `calls` counts the finishes); the second finished value is
/// the tensor's index, which the update checks.
struct divide_by_tensor_norm {
  using reduction = fo::reduction<fo::reduce_op::sum>;
  using reads = fo::slots<fo::slot::param_t>;
  using writes = fo::slots<fo::slot::param_t>;
  static constexpr int finished_size = 2;
  int* calls = nullptr;

  struct accumulate {
    template <class E, class Acc>
    void operator()(E& e, Acc& acc) const
    {
      using A = std::remove_reference_t<decltype(acc[0])>;
      acc[0] += static_cast<A>(e[param]) * static_cast<A>(e[param]);
    }
  };
  accumulate prepare_reduce(fo::step_info const&) const { return {}; }

  struct finish {
    int* calls;
    void operator()(std::int64_t tensor, double const* sums, double* finished) const
    {
      ++*calls;
      finished[0] = std::sqrt(sums[0]);
      finished[1] = static_cast<double>(tensor);
    }
  };
  finish prepare_finish(fo::step_info const&) const { return {calls}; }

  struct divide {
    double norm;
    bool right_tensor;
    template <class E>
    void operator()(E& e) const
    {
      e[param] = right_tensor ? static_cast<float>(e[param] / norm) : -1.0f;
    }
  };
  struct prepared {
    fo::reduced results;
    template <class E>
    void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    divide for_tensor(std::int64_t tensor) const
    {
      return {results.finished_of(tensor, 0), results.finished_of(tensor, 1) == static_cast<double>(tensor)};
    }
  };
  prepared prepare(fo::step_info const&, fo::reduced const& r) const { return {r}; }
};

}  // namespace

TEST_CASE("a rule's finish runs once per tensor after its pass, and the update reads its values", "[reduce]")
{
  buffers b(sizes);
  auto const before = b.p;
  int calls = 0;
  fo::host::options opts;
  opts.chunk_elements = 1000;  // tensors of several chunks: still one finish each
  auto plan = fo::host::make_plan(b.lists(), opts);
  plan.run(divide_by_tensor_norm{&calls});
  REQUIRE(calls == static_cast<int>(sizes.size()));
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    double const norm = direct_l2(before, t);
    for (std::size_t i = 0; i < before[t].size(); ++i) {
      REQUIRE(b.p[t][i] == fusedopt_test::Approx(before[t][i] / norm).epsilon(1e-5));
    }
  }
}

TEST_CASE("a rule's finished values count toward the reduction capacity", "[reduce][errors]")
{
  buffers b(sizes);
  auto const before = b.p;
  int calls = 0;
  fo::host::options opts;
  opts.reduction_capacity = 2;  // one accumulator and two finished values need 3
  auto plan = fo::host::make_plan(b.lists(), opts);
  REQUIRE_THROWS_AS(plan.run(divide_by_tensor_norm{&calls}), fo::error);
  REQUIRE(calls == 0);
  REQUIRE(b.p == before);
}

TEST_CASE("step_info::advance counts steps in memory", "[reduce]")
{
  buffers b({10});
  auto plan = fo::host::make_plan(b.lists());
  std::int64_t counter = 0;
  fo::step_info step;
  step.step = fo::scalar<std::int64_t>::from_pointer(&counter);
  step.advance = &counter;
  for (int i = 0; i < 3; ++i) { plan.run(fo::rules::sgd{}, step); }
  REQUIRE(counter == 3);
}
