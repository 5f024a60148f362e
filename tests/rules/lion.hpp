// Lion against the reference implementation's algorithm (lion-pytorch, reference/rv.hpp)
// with torch's maximize, over 12 steps of several tensors of different sizes, typed over
// float, double, half and bfloat16; on the backend of `executor` (executor.hpp).
#pragma once

#include "rules/executor.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("lion matches the reference Lion step by step", "[optimizers][lion]")
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
  lion_reference const ref{0.01, 0.8, 0.95, weight_decay, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay;
  checker<T> check(context<T>("lion", options.str()));

  random r(13);
  auto const sizes = mixed_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg, exp_avg));
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const m0 = exp_avg.snapshot();
    plan.run(opt, fo::step_info{t});
    for_each_element(param, [&](std::size_t k, std::size_t i) {
      rv m = exact(m0[k][i]);
      auto const candidates = ref.step<T>(exact(p0[k][i]), exact(grad.at(k, i)), m);
      check.any("param", k, i, param.raw(k, i), candidates);
      check("exp_avg", k, i, exp_avg.raw(k, i), m);
    });
    INFO("step " << t);
    check.report();
  }
}

}  // namespace fusedopt_test
