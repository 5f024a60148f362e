// NAdam, RAdam and Lion on the host backend against independent double-precision references
// (reference_harness.hpp), for every combination of their options, over 12 steps of several
// tensors of different sizes, typed over float, double, half and bfloat16.
#include <fusedopt/fusedopt.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"
#include "reference_harness.hpp"

namespace fo = fusedopt;
using fusedopt_test::exact;
using fusedopt_test::rv;

namespace {

constexpr std::int64_t steps = 12;

template <class T>
std::string context(char const* name, std::string const& options)
{
  return std::string(name) + "<" + fo::dtype_name<T>() + "> " + options;
}

}  // namespace

// ---- NAdam ---------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("nadam matches torch.optim.NAdam step by step", "[optimizers][nadam]", float, double, fo::half,
                   fo::bfloat16)
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.05);
  bool const decoupled = GENERATE(false, true);
  // A momentum_decay larger than the default makes mu move within 12 steps; an eps that is
  // not negligible makes its placement (outside the square root) visible.
  fo::rules::nadam opt;
  opt.lr = 0.05;
  opt.beta1 = 0.85;
  opt.beta2 = 0.99;
  opt.eps = 1e-3;
  opt.weight_decay = weight_decay;
  opt.momentum_decay = 0.05;
  opt.decoupled_weight_decay = decoupled;
  opt.maximize = maximize;
  fusedopt_test::nadam_reference const ref{0.05, 0.85, 0.99, 1e-3, weight_decay, 0.05, decoupled, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay << " decoupled=" << decoupled;
  fusedopt_test::checker<T> check(context<T>("nadam", options.str()));

  fusedopt_test::random r(11);
  auto const sizes = fusedopt_test::mixed_sizes();
  fusedopt_test::slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0), exp_avg_sq(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = fo::host::make_plan(fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list(),
                                                 fo::slot::exp_avg = exp_avg.list(),
                                                 fo::slot::exp_avg_sq = exp_avg_sq.list()));
  fo::rules::nadam_mu_product mu;
  rv mu_product = exact(1);  // the reference's own state['mu_product']
  for (std::int64_t t = 1; t <= steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const m0 = exp_avg.snapshot();
    auto const v0 = exp_avg_sq.snapshot();
    opt.mu_product = mu.value();
    plan.run(opt, fo::step_info{t});
    mu.advance(opt);
    ref.begin_step(t, mu_product);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::size_t i = 0; i < param.size(k); ++i) {
        rv p = exact(p0[k][i]), m = exact(m0[k][i]), v = exact(v0[k][i]);
        ref.step<T>(t, mu_product, p, exact(grad.at(k, i)), m, v);
        check("param", k, i, param.raw(k, i), p);
        check("exp_avg", k, i, exp_avg.raw(k, i), m);
        check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
      }
    }
    INFO("step " << t);
    check.report();
  }
  // The helper's product is torch's state['mu_product'] after 12 steps.
  CHECK(mu.steps() == steps);
  CHECK(std::fabs(mu.value() - mu_product.v) <= 1e-14 * mu_product.v);
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

// ---- RAdam ---------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("radam matches torch.optim.RAdam step by step", "[optimizers][radam]", float, double, fo::half,
                   fo::bfloat16)
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.05);
  bool const decoupled = GENERATE(false, true);
  // beta2 = 0.99 makes rho_t cross 5 at step 6: steps 1-5 take the unrectified branch,
  // steps 6-12 the rectified one.
  fo::rules::radam opt;
  opt.lr = 0.05;
  opt.beta1 = 0.85;
  opt.beta2 = 0.99;
  opt.eps = 1e-3;
  opt.weight_decay = weight_decay;
  opt.decoupled_weight_decay = decoupled;
  opt.maximize = maximize;
  fusedopt_test::radam_reference const ref{0.05, 0.85, 0.99, 1e-3, weight_decay, decoupled, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay << " decoupled=" << decoupled;
  fusedopt_test::checker<T> check(context<T>("radam", options.str()));

  fusedopt_test::random r(12);
  auto const sizes = fusedopt_test::mixed_sizes();
  fusedopt_test::slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0), exp_avg_sq(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = fo::host::make_plan(fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list(),
                                                 fo::slot::exp_avg = exp_avg.list(),
                                                 fo::slot::exp_avg_sq = exp_avg_sq.list()));
  int rectified_steps = 0;
  for (std::int64_t t = 1; t <= steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const m0 = exp_avg.snapshot();
    auto const v0 = exp_avg_sq.snapshot();
    plan.run(opt, fo::step_info{t});
    bool rectified = false;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::size_t i = 0; i < param.size(k); ++i) {
        rv p = exact(p0[k][i]), m = exact(m0[k][i]), v = exact(v0[k][i]);
        rectified = ref.step<T>(t, p, exact(grad.at(k, i)), m, v);
        check("param", k, i, param.raw(k, i), p);
        check("exp_avg", k, i, exp_avg.raw(k, i), m);
        check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
      }
    }
    rectified_steps += rectified ? 1 : 0;
    INFO("step " << t << (rectified ? " (rectified)" : " (not rectified)"));
    check.report();
  }
  CHECK(rectified_steps == 7);
}

// ---- Lion ----------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("lion matches the reference Lion step by step", "[optimizers][lion]", float, double, fo::half,
                   fo::bfloat16)
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.5);
  fo::rules::lion opt;
  opt.lr = 0.01;
  opt.beta1 = 0.8;
  opt.beta2 = 0.95;
  opt.weight_decay = weight_decay;
  opt.maximize = maximize;
  fusedopt_test::lion_reference const ref{0.01, 0.8, 0.95, weight_decay, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay;
  fusedopt_test::checker<T> check(context<T>("lion", options.str()));

  fusedopt_test::random r(13);
  auto const sizes = fusedopt_test::mixed_sizes();
  fusedopt_test::slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = fo::host::make_plan(
    fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list(), fo::slot::exp_avg = exp_avg.list()));
  for (std::int64_t t = 1; t <= steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const m0 = exp_avg.snapshot();
    plan.run(opt, fo::step_info{t});
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::size_t i = 0; i < param.size(k); ++i) {
        rv m = exact(m0[k][i]);
        auto const candidates = ref.step<T>(exact(p0[k][i]), exact(grad.at(k, i)), m);
        check.any("param", k, i, param.raw(k, i), candidates);
        check("exp_avg", k, i, exp_avg.raw(k, i), m);
      }
    }
    INFO("step " << t);
    check.report();
  }
}

// ---- options, defaults, declarations --------------------------------------------------------

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

namespace {
// Runs `opt` once over a poisoned tensor and expects a fusedopt::error mentioning `words`,
// with the memory left as it was.
template <class Rule>
void expect_rejected(Rule const& opt, std::string const& words)
{
  std::vector<float> p(8, 0.25f), g(8, 0.5f), m(8, -1.f), v(8, 2.f);
  auto const before = std::vector<std::vector<float>>{p, m, v};
  fo::tensor_list<float> pl{{p.data(), 8}}, ml{{m.data(), 8}}, vl{{v.data(), 8}};
  fo::tensor_list<float const> gl{{g.data(), 8}};
  auto const lists = fo::bind(fo::slot::param = pl, fo::slot::grad = gl, fo::slot::exp_avg = ml, fo::slot::exp_avg_sq = vl);
  try {
    fo::host::apply(opt, lists);
    FAIL("no error for " << words);
  } catch (fo::error const& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(words) != std::string::npos);
  }
  CHECK((std::vector<std::vector<float>>{p, m, v}) == before);
}
}  // namespace

TEST_CASE("nadam, radam and lion reject bad options as torch does", "[optimizers][errors]")
{
  {
    fo::rules::nadam o;
    o.beta1 = 1.0;
    expect_rejected(o, "beta1");
  }
  {
    fo::rules::nadam o;
    o.beta2 = -0.1;
    expect_rejected(o, "beta2");
  }
  {
    fo::rules::nadam o;
    o.eps = -1e-8;
    expect_rejected(o, "eps");
  }
  {
    fo::rules::nadam o;
    o.momentum_decay = -1e-3;
    expect_rejected(o, "momentum_decay");
  }
  {
    fo::rules::nadam o;
    o.weight_decay = -0.1;
    expect_rejected(o, "weight_decay");
  }
  {
    fo::rules::nadam o;
    o.lr = -1e-3;
    expect_rejected(o, "learning rate");
  }
  {
    fo::rules::nadam o;
    o.mu_product = 0.0;
    expect_rejected(o, "mu_product");
  }
  {
    fo::rules::radam o;
    o.beta2 = 1.0;
    expect_rejected(o, "beta2");
  }
  {
    fo::rules::radam o;
    o.weight_decay = -0.1;
    o.decoupled_weight_decay = true;
    expect_rejected(o, "weight_decay");
  }
  {
    fo::rules::radam o;
    o.eps = -1.0;
    expect_rejected(o, "eps");
  }
  {
    fo::rules::lion o;
    o.beta1 = 1.5;
    expect_rejected(o, "beta1");
  }
  {
    fo::rules::lion o;
    o.beta2 = -0.5;
    expect_rejected(o, "beta2");
  }
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
