// Prodigy against konstmish/prodigy's Prodigy.step (reference/breadth.hpp) step by step: d
// estimated from dot products and l1 norms over all tensors in one reduction pass, its state
// (d, d_max, d_numerator) in executor memory (device memory on CUDA) read and advanced by the
// step itself; coupled and decoupled decay, beta1 = 0, bias correction, safeguard warmup, a
// finite growth rate, maximize, and the skipped step of a zero gradient; over tensors of edge
// sizes typed over float, double, half and bfloat16; bad options are rejected. On the backend
// of `executor` (executor.hpp).
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

/// The state memory against the reference's scalars: within their error bounds (the sums
/// behind them are taken in the arithmetic type).
template <class T>
void check_scalars(fo::rules::prodigy_state const& got, breadth::prodigy_scalars const& want)
{
  auto const near = [](double g, rv w) { return std::fabs(g - w.v) <= 2 * slack * precision<T>::op * w.e + 1e-300; };
  INFO("d " << got.d << " (want " << want.d.v << "), d_max " << got.d_max << " (want " << want.d_max.v
            << "), d_numerator " << got.d_numerator << " (want " << want.d_numerator.v << ")");
  CHECK(near(got.d, want.d));
  CHECK(near(got.d_max, want.d_max));
  CHECK(near(got.d_numerator, want.d_numerator));
}

template <class T>
void prodigy_trajectory(breadth::prodigy_reference const& ref, bool zero_first_gradient)
{
  std::ostringstream label;
  label << "beta1=" << ref.beta1 << " weight_decay=" << ref.weight_decay << " decouple=" << ref.decouple
        << " bias_correction=" << ref.use_bias_correction << " safeguard=" << ref.safeguard_warmup
        << " growth_rate=" << ref.growth_rate << " maximize=" << ref.maximize << " zero_first=" << zero_first_gradient;
  checker<T> check(context<T>("prodigy", label.str()));
  typename executor::template memory<fo::rules::prodigy_state> memory({7.0, 8.0, 9.0});  // garbage: not read at step 1
  fo::rules::prodigy opt;
  opt.lr = ref.lr;
  opt.beta1 = ref.beta1;
  opt.beta2 = ref.beta2;
  opt.beta3 = ref.beta3;
  opt.eps = ref.eps;
  opt.weight_decay = ref.weight_decay;
  opt.decouple = ref.decouple;
  opt.use_bias_correction = ref.use_bias_correction;
  opt.safeguard_warmup = ref.safeguard_warmup;
  opt.d0 = ref.d0;
  opt.d_coef = ref.d_coef;
  opt.growth_rate = ref.growth_rate;
  opt.maximize = ref.maximize;
  opt.state = memory.data();

  random r(101);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), p0(sizes, 0), s(sizes, 0), m(sizes, 0), v(sizes, 0), target(sizes, 0);
  param.randomize(r, -1, 1);
  target.randomize(r, -1, 1);
  // The gradients of 0.5 |param - target|^2, with noise: descending them moves the parameters
  // along the gradients seen before, which is what makes Prodigy's estimate of d grow.
  auto const draw_gradients = [&] {
    for (std::size_t k = 0; k < grad.num_tensors(); ++k) {
      for (std::size_t i = 0; i < grad.size(k); ++i) {
        grad.tensors()[k][i] = from_double<T>(param.at(k, i) - target.at(k, i) + r.uniform(-0.1, 0.1));
      }
    }
  };
  auto run = [&](auto const& plan) {
    plan.run(fo::rules::copy_slot<fo::slot::param_t, fo::slot::p0_t>{});
    REQUIRE(p0.snapshot() == param.snapshot());
    breadth::prodigy_scalars scalars{exact(ref.d0), exact(ref.d0), exact(0)};
    for (std::int64_t t = 1; t <= reference_steps; ++t) {
      if (t == 1 && zero_first_gradient) {
        grad.randomize(r, 0, 0);
      } else {
        draw_gradients();
      }
      std::vector<breadth::tensor_values> pp, ss, mm, vv;
      for (auto const& [from, to] : {std::pair{&param, &pp}, std::pair{&s, &ss}, std::pair{&m, &mm}, std::pair{&v, &vv}}) {
        for (auto const& tensor : from->snapshot()) { to->push_back(breadth::exact_values(tensor)); }
      }
      if (t > 1) {  // teacher forcing: the state the backend keeps
        auto const state = memory.get();
        scalars = {exact(state.d), exact(state.d_max), exact(state.d_numerator)};
      }
      plan.run(opt, fo::step_info{t});
      ref.step<T>(t, scalars, pp, grad.snapshot(), p0.snapshot(), ss, mm, vv);
      for_each_element(param, [&](std::size_t k, std::size_t i) {
        check("param", k, i, param.raw(k, i), pp[k][i]);
        check("s", k, i, s.raw(k, i), ss[k][i]);
        if (ref.beta1 > 0) { check("exp_avg", k, i, m.raw(k, i), mm[k][i]); }
        check("exp_avg_sq", k, i, v.raw(k, i), vv[k][i]);
      });
      INFO("step " << t);
      check.report();
      check_scalars<T>(memory.get(), scalars);
    }
  };
  if (ref.beta1 > 0) {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad), writes(fo::slot::p0, p0),
                            writes(fo::slot::s, s), writes(fo::slot::exp_avg, m), writes(fo::slot::exp_avg_sq, v)));
  } else {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad), writes(fo::slot::p0, p0),
                            writes(fo::slot::s, s), writes(fo::slot::exp_avg_sq, v)));
  }
}

}  // namespace

FUSEDOPT_RULE_TEST("prodigy matches the reference Prodigy step by step", "[optimizers][prodigy]")
{
  // lr, beta1, beta2, beta3, eps, weight_decay, d0, d_coef, growth_rate, decouple,
  // use_bias_correction, safeguard_warmup, maximize. d0 = 1e-3 rather than 1e-6 so that the steps
  // move the parameters by more than their rounding.
  breadth::prodigy_reference const cases[] = {
    {1.0, 0.9, 0.999, -1, 1e-8, 0.0, 1e-3, 1.0, HUGE_VAL, true, false, false, false},
    {1.0, 0.9, 0.99, 0.9, 1e-8, 0.1, 1e-3, 2.0, 1.5, true, true, false, true},
    {0.5, 0.0, 0.99, -1, 1e-6, 0.1, 1e-3, 1.0, HUGE_VAL, false, false, true, false},
    {1.0, 0.8, 0.999, -1, 1e-8, 0.0, 1e-3, 1.0, 1.02, true, true, true, true},
  };
  for (auto const& ref : cases) { prodigy_trajectory<TestType>(ref, false); }
  prodigy_trajectory<TestType>(cases[0], true);
}

FUSEDOPT_RULE_TEST("prodigy rejects bad options before writing", "[optimizers][prodigy][errors]")
{
  using T = TestType;
  random r(3);
  std::vector<std::int64_t> const sizes{3, 17};
  slot_data<T> param(sizes, 0), grad(sizes, 0), p0(sizes, 0), s(sizes, 0), m(sizes, 0), v(sizes, 0);
  param.randomize(r, -1, 1);
  grad.randomize(r, -1, 1);
  typename executor::template memory<fo::rules::prodigy_state> memory;
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::p0, p0), writes(fo::slot::s, s), writes(fo::slot::exp_avg_sq, v));
  fo::rules::prodigy opt;
  opt.beta1 = 0.0;  // valid without exp_avg
  opt.state = memory.data();
  SECTION("beta1 without exp_avg bound") { opt.beta1 = 0.9; }
  SECTION("no state") { opt.state = nullptr; }
  SECTION("lr of 0") { opt.lr = 0.0; }
  SECTION("d0 of 0") { opt.d0 = 0.0; }
  SECTION("eps of 0") { opt.eps = 0.0; }
  SECTION("beta2 of 1") { opt.beta2 = 1.0; }
  SECTION("beta3 of 1") { opt.beta3 = 1.0; }
  SECTION("negative weight_decay") { opt.weight_decay = -0.1; }
  breadth::expect_rejected([&] { plan.run(opt, fo::step_info{2}); }, param, p0, s, v);
}

}  // namespace fusedopt_test
