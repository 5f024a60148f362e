// What the named optimizers promise besides their trajectories (those are tests/rules/, run on
// every backend against torch's algorithms): torch's defaults, the options torch rejects
// (rejected before anything is written), what their chains declare, optional states, and
// hyperparameters read from memory. Host backend.
#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "prelude.hpp"
#include "reference/harness.hpp"

// ---- defaults -------------------------------------------------------------------------------

TEST_CASE("sgd, adam and adamw have torch's defaults", "[optimizers]")
{
  fo::rules::adam const a;
  CHECK(a.lr.value == 1e-3);
  CHECK(a.beta1.value == 0.9);
  CHECK(a.beta2.value == 0.999);
  CHECK(a.eps.value == 1e-8);
  CHECK(a.weight_decay.value == 0);
  CHECK_FALSE(a.amsgrad);
  CHECK_FALSE(a.maximize);
  fo::rules::adamw const w;
  CHECK(w.lr.value == 1e-3);
  CHECK(w.beta1.value == 0.9);
  CHECK(w.beta2.value == 0.999);
  CHECK(w.eps.value == 1e-8);
  CHECK(w.weight_decay.value == 1e-2);
  CHECK_FALSE(w.amsgrad);
  CHECK_FALSE(w.maximize);
  // torch.optim.SGD's lr default is 1e-3 since torch 2.2 (it was required before).
  fo::rules::sgd const s;
  CHECK(s.lr.value == 1e-3);
  CHECK(s.momentum.value == 0);
  CHECK(s.dampening.value == 0);
  CHECK(s.weight_decay.value == 0);
  CHECK_FALSE(s.nesterov);
  CHECK_FALSE(s.maximize);
}

TEST_CASE("nadam, radam and lion have torch's defaults", "[optimizers]")
{
  fo::rules::nadam const n;
  CHECK(n.lr.value == 2e-3);
  CHECK(n.beta1.value == 0.9);
  CHECK(n.beta2.value == 0.999);
  CHECK(n.eps.value == 1e-8);
  CHECK(n.weight_decay.value == 0);
  CHECK(n.momentum_decay.value == 4e-3);
  CHECK_FALSE(n.decoupled_weight_decay);
  CHECK_FALSE(n.maximize);
  CHECK(n.mu_product.value == 1);
  fo::rules::radam const r;
  CHECK(r.lr.value == 1e-3);
  CHECK(r.beta1.value == 0.9);
  CHECK(r.beta2.value == 0.999);
  CHECK(r.eps.value == 1e-8);
  CHECK(r.weight_decay.value == 0);
  CHECK_FALSE(r.decoupled_weight_decay);
  CHECK_FALSE(r.maximize);
  fo::rules::lion const l;
  CHECK(l.lr.value == 1e-4);
  CHECK(l.beta1.value == 0.9);
  CHECK(l.beta2.value == 0.99);
  CHECK(l.weight_decay.value == 0);
  CHECK_FALSE(l.maximize);
}

TEST_CASE("nadam, radam and lion declare what their chains touch", "[optimizers]")
{
  using fo::contains_v;
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::nadam>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::radam>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::lion>);
  STATIC_REQUIRE(contains_v<fo::rules::nadam::writes, fo::slot::exp_avg_sq_t>);
  STATIC_REQUIRE(contains_v<fo::rules::nadam::writes, fo::slot::param_t>);
  STATIC_REQUIRE_FALSE(contains_v<fo::rules::nadam::writes, fo::slot::grad_t>);
  STATIC_REQUIRE(contains_v<fo::rules::radam::reads, fo::slot::exp_avg_sq_t>);
  STATIC_REQUIRE_FALSE(contains_v<fo::rules::radam::writes, fo::slot::grad_t>);
  STATIC_REQUIRE(contains_v<fo::rules::lion::writes, fo::slot::exp_avg_t>);
  STATIC_REQUIRE_FALSE(contains_v<fo::rules::lion::reads, fo::slot::exp_avg_sq_t>);
  STATIC_REQUIRE_FALSE(contains_v<fo::rules::lion::writes, fo::slot::grad_t>);
}

// ---- options rejected -----------------------------------------------------------------------

namespace {
/// A rule of type Rule with its defaults changed by `change`.
template <class Rule, class Change>
Rule changed(Change change)
{
  Rule rule;
  change(rule);
  return rule;
}

// Runs `opt` once over poisoned tensors (every state any of these optimizers takes bound) and
// expects a fusedopt::error mentioning `words`, with the memory left as it was.
template <class Rule>
void expect_rejected(Rule const& opt, std::string const& words)
{
  std::vector<float> p(8, 0.25f), g(8, 0.5f), m(8, -1.f), v(8, 2.f), w(8, 3.f), b(8, 4.f);
  auto const before = std::vector<std::vector<float>>{p, m, v, w, b};
  fo::tensor_list<float> pl{{p.data(), 8}}, ml{{m.data(), 8}}, vl{{v.data(), 8}}, wl{{w.data(), 8}}, bl{{b.data(), 8}};
  fo::tensor_list<float const> gl{{g.data(), 8}};
  auto const lists = fo::bind(fo::slot::param = pl, fo::slot::grad = gl, fo::slot::exp_avg = ml,
                              fo::slot::exp_avg_sq = vl, fo::slot::max_exp_avg_sq = wl, fo::slot::momentum_buffer = bl);
  try {
    fo::host::apply(opt, lists);
    FAIL("no error for " << words);
  } catch (fo::error const& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(words) != std::string::npos);
  }
  CHECK((std::vector<std::vector<float>>{p, m, v, w, b}) == before);
}
}  // namespace

TEST_CASE("sgd, adam and adamw reject bad options as torch does", "[optimizers][errors]")
{
  expect_rejected(changed<fo::rules::sgd>([](auto& o) { o.lr = -0.1; }), "learning rate");
  expect_rejected(changed<fo::rules::sgd>([](auto& o) { o.momentum = -0.5; }), "momentum");
  expect_rejected(changed<fo::rules::sgd>([](auto& o) { o.weight_decay = -0.5; }), "weight_decay");
  // nesterov without momentum, then with dampening
  expect_rejected(changed<fo::rules::sgd>([](auto& o) { o.nesterov = true; }), "nesterov");
  expect_rejected(changed<fo::rules::sgd>([](auto& o) { o.nesterov = true; o.momentum = 0.9; o.dampening = 0.1; }),
                  "nesterov");
  expect_rejected(changed<fo::rules::adam>([](auto& o) { o.beta1 = 1.0; }), "beta1");
  expect_rejected(changed<fo::rules::adam>([](auto& o) { o.beta2 = -0.1; }), "beta2");
  expect_rejected(changed<fo::rules::adam>([](auto& o) { o.eps = -1.0; }), "eps");
  expect_rejected(changed<fo::rules::adam>([](auto& o) { o.weight_decay = -1.0; }), "weight_decay");
  expect_rejected(changed<fo::rules::adamw>([](auto& o) { o.lr = -1.0; }), "learning rate");
  expect_rejected(changed<fo::rules::adamw>([](auto& o) { o.beta2 = 1.5; }), "beta2");
  // decoupled decay: torch.optim.AdamW rejects a negative one too
  expect_rejected(changed<fo::rules::adamw>([](auto& o) { o.weight_decay = -0.01; }), "weight_decay");
}

TEST_CASE("nadam, radam and lion reject bad options as torch does", "[optimizers][errors]")
{
  expect_rejected(changed<fo::rules::nadam>([](auto& o) { o.beta1 = 1.0; }), "beta1");
  expect_rejected(changed<fo::rules::nadam>([](auto& o) { o.beta2 = -0.1; }), "beta2");
  expect_rejected(changed<fo::rules::nadam>([](auto& o) { o.eps = -1e-8; }), "eps");
  expect_rejected(changed<fo::rules::nadam>([](auto& o) { o.momentum_decay = -1e-3; }), "momentum_decay");
  expect_rejected(changed<fo::rules::nadam>([](auto& o) { o.weight_decay = -0.1; }), "weight_decay");
  expect_rejected(changed<fo::rules::nadam>([](auto& o) { o.lr = -1e-3; }), "learning rate");
  expect_rejected(changed<fo::rules::nadam>([](auto& o) { o.mu_product = 0.0; }), "mu_product");
  expect_rejected(changed<fo::rules::radam>([](auto& o) { o.beta2 = 1.0; }), "beta2");
  expect_rejected(changed<fo::rules::radam>([](auto& o) { o.weight_decay = -0.1; o.decoupled_weight_decay = true; }),
                  "weight_decay");
  expect_rejected(changed<fo::rules::radam>([](auto& o) { o.eps = -1.0; }), "eps");
  expect_rejected(changed<fo::rules::lion>([](auto& o) { o.beta1 = 1.5; }), "beta1");
  expect_rejected(changed<fo::rules::lion>([](auto& o) { o.beta2 = -0.5; }), "beta2");
}

namespace {
/// Runs `rule` once over a small float problem with `states` bound; returns whether it threw
/// fusedopt::error, and checks that nothing was written when it did.
struct small_problem {
  std::vector<float> p{0.5f, -0.5f}, g{0.25f, 0.75f}, a{0.f, 0.f}, b{0.f, 0.f}, c{0.f, 0.f};
  fo::tensor_list<float> pl{{p.data(), 2}}, al{{a.data(), 2}}, bl{{b.data(), 2}}, cl{{c.data(), 2}};
  fo::tensor_list<float const> gl{{g.data(), 2}};

  bool untouched() const
  {
    return p == std::vector<float>{0.5f, -0.5f} && a == std::vector<float>{0.f, 0.f} &&
           b == std::vector<float>{0.f, 0.f} && c == std::vector<float>{0.f, 0.f};
  }
};
}  // namespace

TEST_CASE("adagrad rejects bad options as torch does", "[optimizers][adagrad][errors]")
{
  small_problem s;
  auto const lists = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::sum_sq = s.al);
  fo::rules::adagrad rule;
  REQUIRE_NOTHROW(fo::host::make_plan(lists).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = {0.f, 0.f};
  SECTION("negative lr") { rule.lr = -1e-2; }
  SECTION("negative lr_decay") { rule.lr_decay = -0.1; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  SECTION("negative eps") { rule.eps = -1e-10; }
  REQUIRE_THROWS_AS(fo::host::make_plan(lists).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("fill_initial_accumulator rejects a negative value", "[optimizers][adagrad][errors]")
{
  small_problem s;
  REQUIRE_THROWS_AS(fo::rules::fill_initial_accumulator(s.al, -0.1), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("rmsprop rejects bad options and missing states", "[optimizers][rmsprop][errors]")
{
  small_problem s;
  auto const minimal = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::square_avg = s.al);
  fo::rules::rmsprop rule;
  REQUIRE_NOTHROW(fo::host::make_plan(minimal).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = {0.f, 0.f};
  SECTION("centered without grad_avg") { rule.centered = true; }
  SECTION("momentum without momentum_buffer") { rule.momentum = 0.9; }
  SECTION("momentum from memory without momentum_buffer")
  {
    static double const momentum = 0.0;
    rule.momentum = fo::scalar<double>::from_pointer(&momentum);
  }
  SECTION("negative lr") { rule.lr = -1e-2; }
  SECTION("negative alpha") { rule.alpha = -0.5; }
  SECTION("negative eps") { rule.eps = -1e-8; }
  SECTION("negative momentum") { rule.momentum = -0.9; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  REQUIRE_THROWS_AS(fo::host::make_plan(minimal).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("rmsprop accepts its options when the states are bound", "[optimizers][rmsprop]")
{
  small_problem s;
  auto const full = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::square_avg = s.al,
                             fo::slot::grad_avg = s.bl, fo::slot::momentum_buffer = s.cl);
  fo::rules::rmsprop rule;
  rule.centered = true;
  rule.momentum = 0.9;
  REQUIRE_NOTHROW(fo::host::make_plan(full).run(rule));
  CHECK_FALSE(s.untouched());
}

TEST_CASE("adadelta rejects bad options as torch does", "[optimizers][adadelta][errors]")
{
  small_problem s;
  auto const lists = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::square_avg = s.al,
                              fo::slot::acc_delta = s.bl);
  fo::rules::adadelta rule;
  rule.rho = 1.0;  // allowed by torch (0 <= rho <= 1)
  REQUIRE_NOTHROW(fo::host::make_plan(lists).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = s.b = {0.f, 0.f};
  SECTION("negative lr") { rule.lr = -1.0; }
  SECTION("rho below 0") { rule.rho = -0.1; }
  SECTION("rho above 1") { rule.rho = 1.5; }
  SECTION("negative eps") { rule.eps = -1e-6; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  REQUIRE_THROWS_AS(fo::host::make_plan(lists).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("adamax rejects bad options as torch does", "[optimizers][adamax][errors]")
{
  small_problem s;
  auto const lists = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::exp_avg = s.al,
                              fo::slot::exp_inf = s.bl);
  fo::rules::adamax rule;
  REQUIRE_NOTHROW(fo::host::make_plan(lists).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = s.b = {0.f, 0.f};
  SECTION("negative lr") { rule.lr = -2e-3; }
  SECTION("beta1 of 1") { rule.beta1 = 1.0; }
  SECTION("negative beta1") { rule.beta1 = -0.1; }
  SECTION("beta2 of 1") { rule.beta2 = 1.0; }
  SECTION("negative beta2") { rule.beta2 = -0.1; }
  SECTION("negative eps") { rule.eps = -1e-8; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  REQUIRE_THROWS_AS(fo::host::make_plan(lists).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("the named optimizers are trivially copyable chains", "[optimizers]")
{
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::adagrad>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::rmsprop>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::adadelta>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::adamax>);
  // Only the states are stored; the gradient is read, never written.
  STATIC_REQUIRE_FALSE(fo::contains_v<fo::rules::rmsprop::writes, fo::slot::grad_t>);
  STATIC_REQUIRE(fo::contains_v<fo::rules::rmsprop::writes, fo::slot::grad_avg_t>);
  STATIC_REQUIRE(fo::contains_v<fo::rules::adamax::reads, fo::slot::exp_inf_t>);
}

// ---- structure and hyperparameters in memory ------------------------------------------------

TEST_CASE("rmsprop runs without the optional states and gives the same bits", "[optimizers][rmsprop]")
{
  std::vector<float> p1(300), p2(300), g(300), sq1(300, 0.f), sq2(300, 0.f), ga(300, 0.f), buf(300, 0.f);
  fusedopt_test::random random(7);
  for (std::size_t i = 0; i < p1.size(); ++i) {
    p1[i] = p2[i] = static_cast<float>(random.uniform(-1, 1));
  }
  fo::tensor_list<float> pl1{{p1.data(), 300}}, pl2{{p2.data(), 300}}, sql1{{sq1.data(), 300}},
    sql2{{sq2.data(), 300}}, gal{{ga.data(), 300}}, bufl{{buf.data(), 300}};
  fo::tensor_list<float const> gl{{g.data(), 300}};
  auto const full = fo::host::make_plan(fo::bind(fo::slot::param = pl1, fo::slot::grad = gl,
                                                 fo::slot::square_avg = sql1, fo::slot::grad_avg = gal,
                                                 fo::slot::momentum_buffer = bufl));
  auto const minimal = fo::host::make_plan(fo::bind(fo::slot::param = pl2, fo::slot::grad = gl,
                                                    fo::slot::square_avg = sql2));
  fo::rules::rmsprop rule;
  rule.weight_decay = 1e-2;
  for (std::int64_t step = 1; step <= 5; ++step) {
    for (float& x : g) { x = static_cast<float>(random.uniform(-1, 1)); }
    fo::step_info info;
    info.step = step;
    full.run(rule, info);
    minimal.run(rule, info);
  }
  CHECK(p1 == p2);
  CHECK(sq1 == sq2);
  CHECK(std::all_of(ga.begin(), ga.end(), [](float x) { return x == 0.f; }));
  CHECK(std::all_of(buf.begin(), buf.end(), [](float x) { return x == 0.f; }));
}

TEST_CASE("hyperparameters read from memory give the same bits as values", "[optimizers]")
{
  std::vector<float> p1{0.5f, -0.25f, 1.f}, p2 = p1, s1(3, 0.f), s2(3, 0.f), m1(3, 0.f), m2(3, 0.f);
  std::vector<float> const g{0.3f, -0.7f, 0.2f};
  fo::tensor_list<float const> gl{{g.data(), 3}};
  fo::tensor_list<float> pl1{{p1.data(), 3}}, pl2{{p2.data(), 3}}, sl1{{s1.data(), 3}}, sl2{{s2.data(), 3}},
    ml1{{m1.data(), 3}}, ml2{{m2.data(), 3}};
  double const lr = 0.05, momentum = 0.8;
  fo::rules::rmsprop by_value;
  by_value.lr = lr;
  by_value.momentum = momentum;
  fo::rules::rmsprop by_pointer;
  by_pointer.lr = fo::scalar<double>::from_pointer(&lr);
  by_pointer.momentum = fo::scalar<double>::from_pointer(&momentum);
  auto const a = fo::host::make_plan(
    fo::bind(fo::slot::param = pl1, fo::slot::grad = gl, fo::slot::square_avg = sl1, fo::slot::momentum_buffer = ml1));
  auto const b = fo::host::make_plan(
    fo::bind(fo::slot::param = pl2, fo::slot::grad = gl, fo::slot::square_avg = sl2, fo::slot::momentum_buffer = ml2));
  for (std::int64_t step = 1; step <= 3; ++step) {
    fo::step_info info;
    info.step = step;
    a.run(by_value, info);
    b.run(by_pointer, info);
  }
  CHECK(p1 == p2);
  CHECK(m1 == m2);
  CHECK(p1 != std::vector<float>{0.5f, -0.25f, 1.f});
}

TEST_CASE("nadam, radam and lion read hyperparameters from memory at every step", "[optimizers][scalar]")
{
  // The same trajectory with values and with pointers gives the same bits, also when the
  // learning rate in memory changes between steps.
  auto const sizes = fusedopt_test::mixed_sizes();
  auto run = [&](auto make_rule, bool from_memory) {
    fusedopt_test::random r(21);
    fusedopt_test::slot_data<float> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0), exp_avg_sq(sizes, 0);
    param.randomize(r, -1, 1);
    auto const plan =
      fo::host::make_plan(fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list(),
                                   fo::slot::exp_avg = exp_avg.list(), fo::slot::exp_avg_sq = exp_avg_sq.list()));
    double lr = 0.01, beta1 = 0.85, weight_decay = 0.1;
    auto opt = make_rule();
    if (from_memory) {
      opt.lr = fo::scalar<double>::from_pointer(&lr);
      opt.beta1 = fo::scalar<double>::from_pointer(&beta1);
      opt.weight_decay = fo::scalar<double>::from_pointer(&weight_decay);
    } else {
      opt.lr = lr;
      opt.beta1 = beta1;
      opt.weight_decay = weight_decay;
    }
    for (std::int64_t t = 1; t <= 4; ++t) {
      grad.randomize(r, -1, 1);
      plan.run(opt, fo::step_info{t});
      lr *= 0.5;
      if (!from_memory) { opt.lr = lr; }
    }
    return param.snapshot();
  };
  auto const nadam = [] { return fo::rules::nadam{}; };
  auto const radam = [] { return fo::rules::radam{}; };
  auto const lion = [] { return fo::rules::lion{}; };
  CHECK(run(nadam, true) == run(nadam, false));
  CHECK(run(radam, true) == run(radam, false));
  CHECK(run(lion, true) == run(lion, false));
}

TEST_CASE("nadam's momentum cache power matches pow to a few ulp", "[optimizers][nadam]")
{
  fusedopt_test::random r(3);
  double worst = 0;
  for (int i = 0; i < 20000; ++i) {
    double const x = i < 10000 ? r.uniform(0, 2) : r.uniform(0, 400);
    double const want = std::pow(0.96, x);
    double const got = fo::math::momentum_cache_power(x);
    worst = std::max(worst, std::fabs(got - want) / want);
  }
  CHECK(worst <= 16 * 0x1p-53);
  CHECK(fo::math::momentum_cache_power(0) == 1.0);
  CHECK(fo::math::momentum_cache_power(1) == 0.96);
  CHECK(fo::math::momentum_cache_power(40000) == 0.0);
  CHECK(fo::math::momentum_cache_power(std::numeric_limits<double>::infinity()) == 0.0);
}

TEST_CASE("ipow_pair gives the bits of two ipow calls", "[math]")
{
  // Adam's, LAMB's and RAdam's bias corrections take both betas to the step in one loop; a
  // step's constants must not change with that (the host and CUDA backends share them). The
  // reference is repeated squaring written out here, as math::ipow was before ipow_pair.
  auto const squaring = [](double base, std::int64_t exponent) {
    double result = 1.0;
    for (; exponent > 0; exponent >>= 1) {
      if (exponent & 1) { result *= base; }
      base *= base;
    }
    return result;
  };
  std::int64_t const steps[] = {0, 1, 2, 3, 7, 8, 1000, 65535, 100000, (std::int64_t{1} << 40) + 12345, -3};
  double const bases[][2] = {{0.9, 0.999}, {0.95, 0.98}, {0.0, 1.0}, {0.5, 0.1}};
  for (auto const& b : bases) {
    for (std::int64_t t : steps) {
      CAPTURE(b[0], b[1], t);
      fo::math::power_pair const p = fo::math::ipow_pair(b[0], b[1], t);
      double const first = squaring(b[0], t);
      double const second = squaring(b[1], t);
      double const single = fo::math::ipow(b[1], t);
      CHECK(std::memcmp(&p.first, &first, sizeof(double)) == 0);
      CHECK(std::memcmp(&p.second, &second, sizeof(double)) == 0);
      CHECK(std::memcmp(&single, &second, sizeof(double)) == 0);
    }
  }
}
