// torch.optim.Adam and AdamW against their double-precision reference (reference/rv.hpp) for
// every combination of their options, over 12 steps of several tensors of different sizes,
// typed over float, double, half and bfloat16; on the backend of `executor` (executor.hpp).
#pragma once

#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

template <class T, class Rule>
void adam_trajectory(Rule opt, adam_reference const& ref, char const* name)
{
  std::ostringstream options;
  options << "maximize=" << ref.maximize << " weight_decay=" << ref.weight_decay << " amsgrad=" << ref.amsgrad;
  checker<T> check(context<T>(name, options.str()));

  random r(2);
  auto const sizes = mixed_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), exp_avg(sizes, 0), exp_avg_sq(sizes, 0), max_exp_avg_sq(sizes, 0);
  param.randomize(r, -1, 1);

  auto run = [&](auto const& plan) {
    for (std::int64_t t = 1; t <= reference_steps; ++t) {
      // Late steps get small gradients, so that exp_avg_sq decays and AMSGrad's maximum
      // differs from it.
      double const scale = t <= reference_steps / 2 ? 1.0 : 0.05;
      grad.randomize(r, -scale, scale);
      auto const p0 = param.snapshot();
      auto const m0 = exp_avg.snapshot();
      auto const v0 = exp_avg_sq.snapshot();
      auto const w0 = max_exp_avg_sq.snapshot();
      plan.run(opt, fo::step_info{t});
      for_each_element(param, [&](std::size_t k, std::size_t i) {
        rv p = exact(p0[k][i]), m = exact(m0[k][i]), v = exact(v0[k][i]), w = exact(w0[k][i]);
        ref.step<T>(t, p, exact(grad.at(k, i)), m, v, w);
        check("param", k, i, param.raw(k, i), p);
        check("exp_avg", k, i, exp_avg.raw(k, i), m);
        check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
        if (ref.amsgrad) { check("max_exp_avg_sq", k, i, max_exp_avg_sq.raw(k, i), w); }
      });
      INFO("step " << t);
      check.report();
    }
  };
  // As torch: max_exp_avg_sq exists only with amsgrad.
  if (ref.amsgrad) {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                            writes(fo::slot::exp_avg, exp_avg), writes(fo::slot::exp_avg_sq, exp_avg_sq),
                            writes(fo::slot::max_exp_avg_sq, max_exp_avg_sq)));
  } else {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                            writes(fo::slot::exp_avg, exp_avg), writes(fo::slot::exp_avg_sq, exp_avg_sq)));
  }
}

/// Adam or AdamW with the test's hyperparameters, and its reference.
template <class Rule, class T>
void adam_case(double weight_decay, bool amsgrad, bool maximize, bool decoupled, char const* name)
{
  auto opt = adam_family::rule<Rule>(weight_decay, maximize);
  opt.amsgrad = amsgrad;
  namespace af = adam_family;
  adam_reference const ref{af::lr, af::beta1, af::beta2, af::eps, weight_decay, amsgrad, maximize, decoupled};
  adam_trajectory<T>(opt, ref, name);
}

}  // namespace

FUSEDOPT_RULE_TEST("adam matches torch.optim.Adam step by step", "[optimizers][adam]")
{
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.1);
  bool const amsgrad = GENERATE(false, true);
  adam_case<fo::rules::adam, TestType>(weight_decay, amsgrad, maximize, false, "adam");
}

FUSEDOPT_RULE_TEST("adamw matches torch.optim.AdamW step by step", "[optimizers][adamw]")
{
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.5);
  bool const amsgrad = GENERATE(false, true);
  adam_case<fo::rules::adamw, TestType>(weight_decay, amsgrad, maximize, true, "adamw");
}

}  // namespace fusedopt_test
