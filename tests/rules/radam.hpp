// torch.optim.RAdam (RAdamW with decoupled_weight_decay) against its double-precision
// reference (reference/rv.hpp) for every combination of its options, over 12 steps that cross
// the rectification switch, typed over float, double, half and bfloat16; on the backend of
// `executor` (executor.hpp).
#pragma once

#include "rules/executor.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("radam matches torch.optim.RAdam step by step", "[optimizers][radam]")
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.05);
  bool const decoupled = GENERATE(false, true);
  // beta2 = 0.99 makes rho_t cross 5 at step 6: steps 1-5 take the unrectified branch,
  // steps 6-12 the rectified one.
  auto opt = adam_family::rule<fo::rules::radam>(weight_decay, maximize);
  opt.decoupled_weight_decay = decoupled;
  namespace af = adam_family;
  radam_reference const ref{af::lr, af::beta1, af::beta2, af::eps, weight_decay, decoupled, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay << " decoupled=" << decoupled;
  checker<T> check(context<T>("radam", options.str()));

  random r(12);
  auto const sizes = mixed_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0), exp_avg_sq(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg, exp_avg), writes(fo::slot::exp_avg_sq, exp_avg_sq));
  int rectified_steps = 0;
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const m0 = exp_avg.snapshot();
    auto const v0 = exp_avg_sq.snapshot();
    plan.run(opt, fo::step_info{t});
    bool rectified = false;
    for_each_element(param, [&](std::size_t k, std::size_t i) {
      rv p = exact(p0[k][i]), m = exact(m0[k][i]), v = exact(v0[k][i]);
      rectified = ref.step<T>(t, p, exact(grad.at(k, i)), m, v);
      check("param", k, i, param.raw(k, i), p);
      check("exp_avg", k, i, exp_avg.raw(k, i), m);
      check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
    });
    rectified_steps += rectified ? 1 : 0;
    INFO("step " << t << (rectified ? " (rectified)" : " (not rectified)"));
    check.report();
  }
  CHECK(rectified_steps == reference_steps - 5);  // steps 6 on (the comment above)
}

}  // namespace fusedopt_test
