// StableAdamW against optimi's StableAdamW (reference/breadth.hpp) step by step: debiased betas,
// the learning rate clipped per tensor by the RMS of grad^2 / max(exp_avg_sq, eps^2) (gradients
// that grow tenfold on some steps make it clip), decoupled and fully decoupled (decouple_lr)
// weight decay, maximize, over tensors of edge sizes typed over float, double, half and
// bfloat16; bad options are rejected. On the backend of `executor` (executor.hpp).
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("stable_adamw matches optimi's StableAdamW step by step", "[optimizers][stable_adamw]")
{
  using T = TestType;
  // weight_decay, decouple_lr, max_lr (0: lr), maximize
  auto const [weight_decay, decouple_lr, max_lr, maximize] = GENERATE(table<double, bool, double, bool>(
    {{0.0, false, 0.0, false}, {0.1, false, 0.0, true}, {0.1, true, 0.0, false}, {0.5, true, 0.2, true}}));
  breadth::stable_adamw_reference const ref{0.05, 0.9, 0.99, weight_decay, 1e-6, max_lr == 0 ? 0.05 : max_lr,
                                            decouple_lr, maximize};
  fo::rules::stable_adamw opt;
  opt.lr = ref.lr;
  opt.weight_decay = weight_decay;
  opt.decouple_lr = decouple_lr;
  opt.max_lr = max_lr;
  opt.maximize = maximize;

  std::ostringstream label;
  label << "weight_decay=" << weight_decay << " decouple_lr=" << decouple_lr << " max_lr=" << max_lr
        << " maximize=" << maximize;
  checker<T> check(context<T>("stable_adamw", label.str()));
  random r(81);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), m(sizes, 0), v(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg, m), writes(fo::slot::exp_avg_sq, v));
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    double const scale = t % 4 == 0 ? 10.0 : 1.0;
    grad.randomize(r, -scale, scale);
    auto const p0 = param.snapshot();
    auto const m0 = m.snapshot();
    auto const v0 = v.snapshot();
    auto const g = grad.snapshot();
    plan.run(opt, fo::step_info{t});
    for (std::size_t k = 0; k < param.num_tensors(); ++k) {
      auto p = breadth::exact_values(p0[k]), mm = breadth::exact_values(m0[k]), vv = breadth::exact_values(v0[k]);
      ref.step<T>(t, p, g[k], mm, vv);
      for (std::size_t i = 0; i < param.size(k); ++i) {
        check("param", k, i, param.raw(k, i), p[i]);
        check("exp_avg", k, i, m.raw(k, i), mm[i]);
        check("exp_avg_sq", k, i, v.raw(k, i), vv[i]);
      }
    }
    INFO("step " << t);
    check.report();
  }
}

FUSEDOPT_RULE_TEST("stable_adamw rejects bad options before writing", "[optimizers][stable_adamw][errors]")
{
  fo::rules::stable_adamw opt;
  SECTION("negative lr") { opt.lr = -1e-3; }
  SECTION("beta1 of 1") { opt.beta1 = 1.0; }
  SECTION("beta2 of 1") { opt.beta2 = 1.0; }
  SECTION("negative eps") { opt.eps = -1e-6; }
  SECTION("negative weight_decay") { opt.weight_decay = -0.1; }
  SECTION("negative max_lr")
  {
    opt.decouple_lr = true;
    opt.max_lr = -1.0;
  }
  breadth::moments_problem<TestType>{}.template rejects<executor>(opt);
}

}  // namespace fusedopt_test
