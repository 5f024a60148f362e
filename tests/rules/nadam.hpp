// torch.optim.NAdam (NAdamW with decoupled_weight_decay) against its double-precision
// reference (reference/rv.hpp) for every combination of its options, over 12 steps of several
// tensors of different sizes, typed over float, double, half and bfloat16, with
// rules::nadam_mu_product keeping torch's state['mu_product']; on the backend of `executor`
// (executor.hpp).
#pragma once

#include "rules/executor.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("nadam matches torch.optim.NAdam step by step", "[optimizers][nadam]")
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.05);
  bool const decoupled = GENERATE(false, true);
  // A momentum_decay larger than the default makes mu move within 12 steps; an eps that is
  // not negligible makes its placement (outside the square root) visible.
  auto opt = adam_family::rule<fo::rules::nadam>(weight_decay, maximize);
  opt.momentum_decay = 0.05;
  opt.decoupled_weight_decay = decoupled;
  namespace af = adam_family;
  nadam_reference const ref{af::lr, af::beta1, af::beta2, af::eps, weight_decay, 0.05, decoupled, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay << " decoupled=" << decoupled;
  checker<T> check(context<T>("nadam", options.str()));

  random r(11);
  auto const sizes = mixed_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0), exp_avg_sq(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg, exp_avg), writes(fo::slot::exp_avg_sq, exp_avg_sq));
  fo::rules::nadam_mu_product mu;
  rv mu_product = exact(1);  // the reference's own state['mu_product']
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const m0 = exp_avg.snapshot();
    auto const v0 = exp_avg_sq.snapshot();
    opt.mu_product = mu.value();
    plan.run(opt, fo::step_info{t});
    mu.advance(opt);
    ref.begin_step(t, mu_product);
    for_each_element(param, [&](std::size_t k, std::size_t i) {
      rv p = exact(p0[k][i]), m = exact(m0[k][i]), v = exact(v0[k][i]);
      ref.step<T>(t, mu_product, p, exact(grad.at(k, i)), m, v);
      check("param", k, i, param.raw(k, i), p);
      check("exp_avg", k, i, exp_avg.raw(k, i), m);
      check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
    });
    INFO("step " << t);
    check.report();
  }
  // The helper's product is torch's state['mu_product'] after 12 steps.
  CHECK(mu.steps() == reference_steps);
  CHECK(std::fabs(mu.value() - mu_product.v) <= 1e-14 * mu_product.v);
}

}  // namespace fusedopt_test
