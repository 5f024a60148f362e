// Regression tests for the library rows of issue 15 (a red-team table of bad input): each
// case failed before its fix. Step numbers below 1, steps near the ends of int64, tensor
// sizes whose bytes wrap around the address space, and global norms of float gradients whose
// squares overflow float. (Row 8 is the packaging test headers_vendored, row 9 the
// compile-fail test int16_state.)
#include <fusedopt/fusedopt.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "catch.hpp"
#include "prelude.hpp"

namespace slot = fusedopt::slot;

namespace {

constexpr std::int64_t int64_max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t int64_min = std::numeric_limits<std::int64_t>::min();

/// Six slots of three tensors, filled with a pattern that any write would change, bound so
/// that every optimizer below finds its states.
struct poisoned {
  static constexpr int slots = 6;
  std::vector<float> memory[slots];
  fo::tensor_list<float> lists[slots];

  poisoned()
  {
    float x = 0.375f;
    for (int s = 0; s < slots; ++s) {
      memory[s].resize(40);
      for (auto& e : memory[s]) { e = (x += 0.625f); }
      if (s == 4 || s == 5) {
        for (auto& e : memory[s]) { e = std::fabs(e); }  // second moments must not be negative
      }
      lists[s].push_back(memory[s].data(), 7);
      lists[s].push_back(memory[s].data() + 7, 0);
      lists[s].push_back(memory[s].data() + 8, 32);
    }
  }
  auto bound() const
  {
    return fo::bind(slot::param = lists[0], slot::grad = lists[1], slot::exp_avg = lists[2],
                    slot::momentum_buffer = lists[3], slot::exp_avg_sq = lists[4], slot::exp_inf = lists[5]);
  }
  [[nodiscard]] std::vector<std::vector<float>> snapshot() const { return {std::begin(memory), std::end(memory)}; }
  [[nodiscard]] bool unchanged(std::vector<std::vector<float>> const& before) const
  {
    for (int s = 0; s < slots; ++s) {
      if (std::memcmp(before[static_cast<std::size_t>(s)].data(), memory[s].data(), memory[s].size() * sizeof(float)) !=
          0) {
        return false;
      }
    }
    return true;
  }
};

/// Runs `rule` at `step` on poisoned memory: must throw (steps are 1-based) and write nothing.
template <class Rule>
void expect_step_rejected(Rule const& rule, fo::step_info const& step)
{
  poisoned p;
  auto const before = p.snapshot();
  auto plan = fo::host::make_plan(p.bound());
  expect_error([&] { plan.run(rule, step); }, {"1-based"});
  CHECK(p.unchanged(before));
}

}  // namespace

// ---- row 1: steps are 1-based ----------------------------------------------------------------

TEST_CASE("a step below 1 is rejected before any write, for every optimizer", "[red_team][step]")
{
  std::int64_t const t = GENERATE(as<std::int64_t>{}, 0, -1, -7, int64_min);
  INFO("step " << t);
  fo::step_info const step{t};
  fo::rules::sgd sgd;
  sgd.momentum = 0.9;  // its first-step restart would be wrong at step 0 too
  SECTION("adam") { expect_step_rejected(fo::rules::adam{}, step); }
  SECTION("adamw") { expect_step_rejected(fo::rules::adamw{}, step); }
  SECTION("lamb") { expect_step_rejected(fo::rules::lamb{}, step); }
  SECTION("adamax") { expect_step_rejected(fo::rules::adamax{}, step); }
  SECTION("radam") { expect_step_rejected(fo::rules::radam{}, step); }
  SECTION("nadam") { expect_step_rejected(fo::rules::nadam{}, step); }
  SECTION("sgd with momentum") { expect_step_rejected(sgd, step); }
  SECTION("a chain with a reduction pass")
  {
    expect_step_rejected(fo::chain(fo::rules::clip_by_global_norm{1.0}, fo::rules::adamw{}), step);
  }
}

TEST_CASE("a step read through a host pointer is checked, with the count advance gives it", "[red_team][step]")
{
  fo::rules::adamw const opt;
  SECTION("a pointer to 0")
  {
    std::int64_t counter = 0;
    expect_step_rejected(opt, fo::step_info{fo::scalar<std::int64_t>::from_pointer(&counter)});
  }
  SECTION("advance from -1 would give step 0: rejected, and the counter is not advanced")
  {
    std::int64_t counter = -1;
    expect_step_rejected(opt, fo::step_info{fo::scalar<std::int64_t>::from_pointer(&counter), &counter});
    CHECK(counter == -1);
  }
  SECTION("advance from 0 gives step 1: accepted")
  {
    std::int64_t counter = 0;
    poisoned p;
    fo::host::make_plan(p.bound()).run(opt, fo::step_info{fo::scalar<std::int64_t>::from_pointer(&counter), &counter});
    CHECK(counter == 1);
  }
  SECTION("a counter at INT64_MAX would overflow: rejected, and left as it is")
  {
    std::int64_t counter = int64_max;
    poisoned p;
    auto const before = p.snapshot();
    auto plan = fo::host::make_plan(p.bound());
    expect_error([&] { plan.run(opt, fo::step_info{fo::scalar<std::int64_t>::from_pointer(&counter), &counter}); },
                 {"INT64_MAX"});
    CHECK(counter == int64_max);
    CHECK(p.unchanged(before));
  }
}

TEST_CASE("step 1 and the largest step are accepted", "[red_team][step]")
{
  std::int64_t const t = GENERATE(as<std::int64_t>{}, 1, int64_max);
  poisoned p;
  auto plan = fo::host::make_plan(p.bound());
  REQUIRE_NOTHROW(plan.run(fo::rules::adamw{}, fo::step_info{t}));
  for (float x : p.memory[0]) { CHECK(std::isfinite(x)); }
}

// ---- row 4: steps near the ends of int64 ----------------------------------------------------

TEST_CASE("nadam and adagrad stay defined at the largest and smallest steps", "[red_team][step]")
{
  SECTION("nadam at INT64_MAX: mu_t and mu_{t+1} are beta1 (0.96^(t psi) underflows)")
  {
    fo::rules::scale_by_nadam const nadam{};
    auto const p = nadam.prepare(fo::step_info{int64_max});
    double const mu = 0.9;
    CHECK(p.grad_coefficient == (1.0 - mu) / (1.0 - 1.0 * mu));
    CHECK(p.exp_avg_coefficient == mu / (1.0 - mu * mu));
    CHECK(p.bias_correction2 == 1.0);
  }
  SECTION("nadam at INT64_MIN (a device step is not checked): finite, no overflow")
  {
    // 0.96^x for x < 0 is clamped to 0.96^0; before, t * psi went through an int64 cast.
    CHECK(fo::math::momentum_cache_power(-1e300) == 1.0);
    CHECK(fo::math::momentum_cache_power(-std::numeric_limits<double>::infinity()) == 1.0);
    CHECK(fo::math::momentum_cache_power(std::numeric_limits<double>::quiet_NaN()) == 0.0);
    fo::rules::scale_by_nadam const nadam{};
    auto const p = nadam.prepare(fo::step_info{int64_min});
    CHECK(std::isfinite(p.exp_avg_coefficient));
  }
  SECTION("adagrad's decay uses step - 1 in double, without the int64 overflow at INT64_MIN")
  {
    fo::rules::scale_by_decayed_lr const decayed{0.5, {1e-3}};
    auto const low = decayed.prepare(fo::step_info{int64_min});
    CHECK(low.factor == -(0.5 / (1.0 + (static_cast<double>(int64_min) - 1.0) * 1e-3)));
    auto const high = decayed.prepare(fo::step_info{int64_max});
    CHECK(high.factor == -(0.5 / (1.0 + (static_cast<double>(int64_max) - 1.0) * 1e-3)));
  }
  SECTION("the whole nadam and adagrad steps at INT64_MAX run (under UBSan in the asan preset)")
  {
    poisoned p;
    auto plan = fo::host::make_plan(p.bound());
    plan.run(fo::rules::nadam{}, fo::step_info{int64_max});
    auto lists = fo::bind(slot::param = p.lists[0], slot::grad = p.lists[1], slot::sum_sq = p.lists[4]);
    fo::host::make_plan(lists).run(fo::rules::adagrad{}, fo::step_info{int64_max});
    for (float x : p.memory[0]) { CHECK(std::isfinite(x)); }
  }
}

// ---- row 7: sizes whose bytes wrap around ---------------------------------------------------

TEST_CASE("a tensor whose bytes would wrap around the address space is rejected", "[red_team][bind]")
{
  std::vector<float> arena(64);
  // 2^62 floats are 2^64 bytes: the end wrapped to the start, and the tensor looked empty to
  // the overlap check, so a param over the grad's memory was accepted.
  std::int64_t const huge = std::int64_t{1} << 62;
  fo::tensor_list<float> params{{arena.data() + 16, huge}};
  fo::tensor_list<float> grads{{arena.data(), huge}};
  expect_error([&] { (void)fo::bind(slot::param = params, slot::grad = grads); }, {"address space"});
  SECTION("also when the size alone fits but start + bytes does not")
  {
    std::int64_t const most = std::numeric_limits<std::int64_t>::max() / 4;  // 2^61 - 1: bytes fit in 2^63
    fo::tensor_list<float> p{{arena.data(), most}};
    fo::tensor_list<float> g{{arena.data() + 4, most}};
    auto const start = reinterpret_cast<std::uintptr_t>(arena.data());
    if (start > std::numeric_limits<std::uintptr_t>::max() - static_cast<std::uintptr_t>(most) * 4) {
      expect_error([&] { (void)fo::bind(slot::param = p, slot::grad = g); }, {"address space"});
    } else {
      // Fits: then the overlap must be seen.
      expect_error([&] { (void)fo::bind(slot::param = p, slot::grad = g); }, {"overlaps"});
    }
  }
  SECTION("a huge double tensor at a high address, read-only next to a written one")
  {
    fo::tensor_list<double const> g{{reinterpret_cast<double const*>(arena.data()), huge / 2}};
    fo::tensor_list<double> p{{reinterpret_cast<double*>(arena.data() + 32), huge / 2}};
    expect_error([&] { (void)fo::bind(slot::param = p, slot::grad = g); }, {"address space"});
  }
}

// ---- row 10: float sums of squares that overflow float ---------------------------------------

namespace {

/// sqrt of the sum of squares in long double: the norm a float sum should have given.
template <class T>
double exact_norm(std::vector<T> const& values)
{
  long double sum = 0;
  for (T v : values) {
    auto const x = static_cast<long double>(static_cast<float>(v));
    sum += x * x;
  }
  return static_cast<double>(std::sqrt(sum));
}

}  // namespace

TEMPLATE_TEST_CASE("a global norm of float gradients whose squares overflow float is finite", "[red_team][reduce]",
                   float, fo::bfloat16)
{
  using T = TestType;
  std::int64_t const chunk = GENERATE(as<std::int64_t>{}, 5, std::int64_t{1} << 15);
  INFO("chunk_elements " << chunk);
  // Squares above float's 3.4e38 (1e20, -3e19), and a sum above it of squares below it
  // (eight times 1e19: 8e38), among ordinary values, across tensors and chunks.
  std::vector<T> g;
  for (int i = 0; i < 40; ++i) { g.push_back(T(static_cast<float>(i % 7) - 3.f)); }
  g[3] = T(1e20f);
  g[17] = T(-3e19f);
  for (int i = 24; i < 32; ++i) { g[static_cast<std::size_t>(i)] = T(1e19f); }
  std::vector<float> p(g.size(), 0.f);
  fo::tensor_list<T const> grads{{g.data(), 10}, {g.data() + 10, 30}};
  fo::tensor_list<float> params{{p.data(), 10}, {p.data() + 10, 30}};
  auto plan = fo::host::make_plan(fo::bind(slot::param = params, slot::grad = grads), fo::host::options{1, chunk});

  double total = 0;
  double per_tensor[2] = {0, 0};
  int nonfinite = -1;
  fo::rules::clip_by_global_norm clip{1.0};
  clip.total_norm = &total;
  clip.nonfinite = &nonfinite;
  fo::rules::sgd sgd;
  sgd.lr = 1.0;
  plan.run(fo::chain(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, per_tensor, nullptr}, clip, sgd));

  // Within float summation's rounding: only the chunks whose float sum overflowed are summed
  // in double, the others stay in float as before.
  double const expected = exact_norm(g);
  REQUIRE(std::isfinite(total));
  CHECK(total == fusedopt_test::Approx(expected).epsilon(1e-6));
  CHECK(nonfinite == 0);
  CHECK(per_tensor[0] == fusedopt_test::Approx(exact_norm(std::vector<T>(g.begin(), g.begin() + 10))).epsilon(1e-6));
  CHECK(per_tensor[1] == fusedopt_test::Approx(exact_norm(std::vector<T>(g.begin() + 10, g.end()))).epsilon(1e-6));
  // Every gradient scaled by max_norm / (norm + 1e-6), not zeroed: param = -g * coefficient.
  double const coefficient = 1.0 / (expected + 1e-6);
  for (std::size_t i = 0; i < g.size(); ++i) {
    double const want = -static_cast<double>(static_cast<float>(g[i])) * coefficient;
    INFO("element " << i);
    CHECK(p[i] == fusedopt_test::Approx(want).epsilon(1e-6).margin(1e-30));
  }
  CHECK(p[3] < -0.9f);
}

TEST_CASE("non-finite gradients still give a non-finite norm", "[red_team][reduce]")
{
  float const bad = GENERATE(std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> g(20, 1e20f), p(20, 0.f);
  g[11] = bad;
  fo::tensor_list<float const> grads{{g.data(), 20}};
  fo::tensor_list<float> params{{p.data(), 20}};
  double total = 0;
  int nonfinite = -1;
  fo::rules::clip_by_global_norm clip{1.0};
  clip.total_norm = &total;
  clip.nonfinite = &nonfinite;
  clip.error_if_nonfinite = true;
  fo::host::make_plan(fo::bind(slot::param = params, slot::grad = grads)).run(clip);
  CHECK_FALSE(std::isfinite(total));
  CHECK(std::isnan(total) == std::isnan(bad));
  CHECK(nonfinite == 1);
}
