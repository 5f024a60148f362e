// SGD, Adam and AdamW on the host backend against independent double-precision references
// written from torch.optim's algorithms (reference_harness.hpp), for every combination of their
// options, over 12 steps of several tensors of different sizes, typed over float, double,
// half and bfloat16. An independent check of rules/sgd.hpp and rules/adam.hpp.
#include <fusedopt/fusedopt.hpp>

#include <cstdint>
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

struct momentum_case {
  double momentum, dampening;
  bool nesterov;
};

}  // namespace

// ---- SGD -----------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("sgd matches torch.optim.SGD step by step", "[optimizers][sgd]", float, double, fo::half,
                   fo::bfloat16)
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.1);
  momentum_case const mc = GENERATE(momentum_case{0.0, 0.0, false}, momentum_case{0.9, 0.0, false},
                                    momentum_case{0.8, 0.3, false}, momentum_case{0.9, 0.0, true});
  fo::rules::sgd opt;
  opt.lr = 0.05;
  opt.momentum = mc.momentum;
  opt.dampening = mc.dampening;
  opt.nesterov = mc.nesterov;
  opt.weight_decay = weight_decay;
  opt.maximize = maximize;
  fusedopt_test::sgd_reference const ref{0.05, mc.momentum, mc.dampening, weight_decay, mc.nesterov, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay << " momentum=" << mc.momentum
          << " dampening=" << mc.dampening << " nesterov=" << mc.nesterov;
  fusedopt_test::checker<T> check(context<T>("sgd", options.str()));

  fusedopt_test::random r(1);
  auto const sizes = fusedopt_test::mixed_sizes();
  // The buffer starts as garbage: torch has no buffer before step 1, so its content must not matter.
  fusedopt_test::slot_data<T> param(sizes, 0), grad(sizes, 0), buffer(sizes, 0);
  param.randomize(r, -1, 1);
  buffer.randomize(r, -100, 100);

  auto run = [&](auto const& plan) {
    for (std::int64_t t = 1; t <= steps; ++t) {
      grad.randomize(r, -1, 1);
      auto const p0 = param.snapshot();
      auto const b0 = buffer.snapshot();
      plan.run(opt, fo::step_info{t});
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        for (std::size_t i = 0; i < param.size(k); ++i) {
          rv p = exact(p0[k][i]), b = exact(b0[k][i]);
          ref.step<T>(t == 1, p, exact(grad.at(k, i)), b);
          check("param", k, i, param.raw(k, i), p);
          if (mc.momentum != 0) { check("momentum_buffer", k, i, buffer.raw(k, i), b); }
        }
      }
      INFO("step " << t);
      check.report();
    }
  };
  // As torch: a momentum buffer exists only with momentum.
  if (mc.momentum != 0) {
    run(fo::host::make_plan(fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list(),
                                     fo::slot::momentum_buffer = buffer.list())));
  } else {
    run(fo::host::make_plan(fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list())));
  }
}

// ---- Adam and AdamW ------------------------------------------------------------------------

namespace {

template <class T, class Rule>
void adam_trajectory(Rule opt, fusedopt_test::adam_reference const& ref, std::string const& name)
{
  std::ostringstream options;
  options << "maximize=" << ref.maximize << " weight_decay=" << ref.weight_decay << " amsgrad=" << ref.amsgrad;
  fusedopt_test::checker<T> check(context<T>(name.c_str(), options.str()));

  fusedopt_test::random r(2);
  auto const sizes = fusedopt_test::mixed_sizes();
  fusedopt_test::slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0), exp_avg_sq(sizes, 0),
    max_exp_avg_sq(sizes, 0);
  param.randomize(r, -1, 1);

  auto run = [&](auto const& plan) {
    for (std::int64_t t = 1; t <= steps; ++t) {
      // Late steps get small gradients, so that exp_avg_sq decays and AMSGrad's maximum
      // differs from it.
      double const scale = t <= steps / 2 ? 1.0 : 0.05;
      grad.randomize(r, -scale, scale);
      auto const p0 = param.snapshot();
      auto const m0 = exp_avg.snapshot();
      auto const v0 = exp_avg_sq.snapshot();
      auto const w0 = max_exp_avg_sq.snapshot();
      plan.run(opt, fo::step_info{t});
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        for (std::size_t i = 0; i < param.size(k); ++i) {
          rv p = exact(p0[k][i]), m = exact(m0[k][i]), v = exact(v0[k][i]), w = exact(w0[k][i]);
          ref.step<T>(t, p, exact(grad.at(k, i)), m, v, w);
          check("param", k, i, param.raw(k, i), p);
          check("exp_avg", k, i, exp_avg.raw(k, i), m);
          check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
          if (ref.amsgrad) { check("max_exp_avg_sq", k, i, max_exp_avg_sq.raw(k, i), w); }
        }
      }
      INFO("step " << t);
      check.report();
    }
  };
  // As torch: max_exp_avg_sq exists only with amsgrad.
  if (ref.amsgrad) {
    run(fo::host::make_plan(fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list(),
                                     fo::slot::exp_avg = exp_avg.list(), fo::slot::exp_avg_sq = exp_avg_sq.list(),
                                     fo::slot::max_exp_avg_sq = max_exp_avg_sq.list())));
  } else {
    run(fo::host::make_plan(fo::bind(fo::slot::param = param.list(), fo::slot::grad = grad.const_list(),
                                     fo::slot::exp_avg = exp_avg.list(), fo::slot::exp_avg_sq = exp_avg_sq.list())));
  }
}

}  // namespace

TEMPLATE_TEST_CASE("adam matches torch.optim.Adam step by step", "[optimizers][adam]", float, double, fo::half,
                   fo::bfloat16)
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.1);
  bool const amsgrad = GENERATE(false, true);
  fo::rules::adam opt;
  opt.lr = 0.05;
  opt.beta1 = 0.85;
  opt.beta2 = 0.99;
  opt.eps = 1e-3;
  opt.weight_decay = weight_decay;
  opt.amsgrad = amsgrad;
  opt.maximize = maximize;
  adam_trajectory<T>(opt, {0.05, 0.85, 0.99, 1e-3, weight_decay, amsgrad, maximize, false}, "adam");
}

TEMPLATE_TEST_CASE("adamw matches torch.optim.AdamW step by step", "[optimizers][adamw]", float, double, fo::half,
                   fo::bfloat16)
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.5);
  bool const amsgrad = GENERATE(false, true);
  fo::rules::adamw opt;
  opt.lr = 0.05;
  opt.beta1 = 0.85;
  opt.beta2 = 0.99;
  opt.eps = 1e-3;
  opt.weight_decay = weight_decay;
  opt.amsgrad = amsgrad;
  opt.maximize = maximize;
  adam_trajectory<T>(opt, {0.05, 0.85, 0.99, 1e-3, weight_decay, amsgrad, maximize, true}, "adamw");
}

// ---- defaults and options ------------------------------------------------------------------

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

namespace {
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
  {
    fo::rules::sgd o;
    o.lr = -0.1;
    expect_rejected(o, "learning rate");
  }
  {
    fo::rules::sgd o;
    o.momentum = -0.5;
    expect_rejected(o, "momentum");
  }
  {
    fo::rules::sgd o;
    o.weight_decay = -0.5;
    expect_rejected(o, "weight_decay");
  }
  {
    fo::rules::sgd o;  // nesterov without momentum
    o.nesterov = true;
    expect_rejected(o, "nesterov");
  }
  {
    fo::rules::sgd o;  // nesterov with dampening
    o.nesterov = true;
    o.momentum = 0.9;
    o.dampening = 0.1;
    expect_rejected(o, "nesterov");
  }
  {
    fo::rules::adam o;
    o.beta1 = 1.0;
    expect_rejected(o, "beta1");
  }
  {
    fo::rules::adam o;
    o.beta2 = -0.1;
    expect_rejected(o, "beta2");
  }
  {
    fo::rules::adam o;
    o.eps = -1.0;
    expect_rejected(o, "eps");
  }
  {
    fo::rules::adam o;
    o.weight_decay = -1.0;
    expect_rejected(o, "weight_decay");
  }
  {
    fo::rules::adamw o;
    o.lr = -1.0;
    expect_rejected(o, "learning rate");
  }
  {
    fo::rules::adamw o;
    o.beta2 = 1.5;
    expect_rejected(o, "beta2");
  }
  {
    fo::rules::adamw o;  // decoupled decay: torch.optim.AdamW rejects it too
    o.weight_decay = -0.01;
    expect_rejected(o, "weight_decay");
  }
}
