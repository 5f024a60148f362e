// ADOPT against iShohei220/adopt's `_single_tensor_adopt` (reference/breadth.hpp) step by step:
// step 1 only initialises exp_avg_sq, clipping by step^0.25 (and by another exponent, and
// none), L2 and decoupled weight decay, maximize, over tensors of edge sizes typed over float,
// double, half and bfloat16; bad options are rejected. On the backend of `executor`.
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("adopt matches the reference ADOPT step by step", "[optimizers][adopt]")
{
  using T = TestType;
  // maximize, weight_decay, decouple, clipping: step^0.25 (the default), step^0.1, none.
  auto const [maximize, weight_decay, decouple, clipping] =
    GENERATE(table<bool, double, bool, int>({{false, 0.0, false, 0}, {true, 0.1, false, 0}, {false, 0.1, true, 1},
                                             {true, 0.1, true, 2}, {false, 0.0, false, 2}}));
  // Gradients up to 3 and a small beta2 make |grad| / sqrt(v) exceed the bound on some elements.
  breadth::adopt_reference const ref{0.05, 0.9, 0.5, 1e-3, clipping == 1 ? 0.1 : 0.25, weight_decay, clipping != 2,
                                     decouple, maximize};
  fo::rules::adopt opt;
  opt.lr = ref.lr;
  opt.beta2 = ref.beta2;
  opt.eps = ref.eps;
  opt.clip = ref.clip;
  opt.clip_exp = ref.clip_exp;
  opt.weight_decay = weight_decay;
  opt.decouple = decouple;
  opt.maximize = maximize;

  std::ostringstream label;
  label << "maximize=" << maximize << " weight_decay=" << weight_decay << " decouple=" << decouple
        << " clipping=" << clipping;
  checker<T> check(context<T>("adopt", label.str()));
  random r(71);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), m(sizes, 0), v(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg, m), writes(fo::slot::exp_avg_sq, v));
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    grad.randomize(r, t % 3 == 0 ? -3 : -1, t % 3 == 0 ? 3 : 1);
    auto const p0 = param.snapshot();
    auto const m0 = m.snapshot();
    auto const v0 = v.snapshot();
    plan.run(opt, fo::step_info{t});
    for_each_element(param, [&](std::size_t k, std::size_t i) {
      rv p = exact(p0[k][i]), mm = exact(m0[k][i]), vv = exact(v0[k][i]);
      ref.step<T>(t, p, exact(grad.at(k, i)), mm, vv);
      check("param", k, i, param.raw(k, i), p);
      check("exp_avg", k, i, m.raw(k, i), mm);
      check("exp_avg_sq", k, i, v.raw(k, i), vv);
    });
    INFO("step " << t);
    check.report();
  }
}

FUSEDOPT_RULE_TEST("adopt rejects bad options before writing", "[optimizers][adopt][errors]")
{
  fo::rules::adopt opt;
  SECTION("negative lr") { opt.lr = -1e-3; }
  SECTION("beta1 of 1") { opt.beta1 = 1.0; }
  SECTION("beta2 of 1") { opt.beta2 = 1.0; }
  SECTION("negative eps") { opt.eps = -1e-6; }
  SECTION("negative weight_decay") { opt.weight_decay = -0.1; }
  SECTION("negative decoupled weight_decay")
  {
    opt.weight_decay = -0.1;
    opt.decouple = true;
  }
  breadth::moments_problem<TestType>{}.template rejects<executor>(opt);
}

}  // namespace fusedopt_test
