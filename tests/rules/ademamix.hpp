// AdEMAMix against apple/ml-ademamix's PyTorch reference (reference/breadth.hpp) step by step,
// with its alpha and beta3 schedulers, beta1 = 0 (no fast EMA), weight decay and maximize,
// over tensors of edge sizes typed over float, double, half and bfloat16; bad options are
// rejected. On the backend of `executor` (executor.hpp).
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

template <class T>
void ademamix_trajectory(breadth::ademamix_reference const& ref)
{
  std::ostringstream label;
  label << "beta1=" << ref.beta1 << " alpha_warmup=" << ref.alpha_warmup << " beta3_warmup=" << ref.beta3_warmup
        << " weight_decay=" << ref.weight_decay << " maximize=" << ref.maximize;
  checker<T> check(context<T>("ademamix", label.str()));
  fo::rules::ademamix opt;
  opt.lr = ref.lr;
  opt.beta1 = ref.beta1;
  opt.beta2 = ref.beta2;
  opt.beta3 = ref.beta3;
  opt.alpha = ref.alpha;
  opt.alpha_warmup = ref.alpha_warmup;
  opt.beta3_warmup = ref.beta3_warmup;
  opt.eps = ref.eps;
  opt.weight_decay = ref.weight_decay;
  opt.maximize = ref.maximize;

  random r(51);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), fast(sizes, 0), slow(sizes, 0), exp_avg_sq(sizes, 0);
  param.randomize(r, -1, 1);
  auto run = [&](auto const& plan) {
    for (std::int64_t t = 1; t <= reference_steps; ++t) {
      grad.randomize(r, -1, 1);
      auto const p0 = param.snapshot();
      auto const fast0 = fast.snapshot();
      auto const slow0 = slow.snapshot();
      auto const v0 = exp_avg_sq.snapshot();
      plan.run(opt, fo::step_info{t});
      for_each_element(param, [&](std::size_t k, std::size_t i) {
        rv p = exact(p0[k][i]), m1 = exact(fast0[k][i]), m2 = exact(slow0[k][i]), v = exact(v0[k][i]);
        ref.step<T>(t, p, exact(grad.at(k, i)), m1, m2, v);
        check("param", k, i, param.raw(k, i), p);
        if (ref.beta1 != 0) { check("exp_avg", k, i, fast.raw(k, i), m1); }
        check("exp_avg_slow", k, i, slow.raw(k, i), m2);
        check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
      });
      INFO("step " << t);
      check.report();
    }
  };
  if (ref.beta1 != 0) {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                            writes(fo::slot::exp_avg, fast), writes(fo::slot::exp_avg_slow, slow),
                            writes(fo::slot::exp_avg_sq, exp_avg_sq)));
  } else {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                            writes(fo::slot::exp_avg_slow, slow), writes(fo::slot::exp_avg_sq, exp_avg_sq)));
  }
}

}  // namespace

FUSEDOPT_RULE_TEST("ademamix matches the reference AdEMAMix step by step", "[optimizers][ademamix]")
{
  // lr, beta1, beta2, beta3, alpha, eps, weight_decay, alpha_warmup, beta3_warmup, maximize: the
  // reference's defaults but a larger lr and eps, then both schedulers within the steps (and past
  // their end), beta1 = 0, decay and maximize.
  breadth::ademamix_reference const cases[] = {
    {0.05, 0.9, 0.999, 0.9999, 2.0, 1e-3, 0.0, 0, 0, false},
    {0.05, 0.9, 0.99, 0.999, 5.0, 1e-3, 0.0, 8, 6, false},
    {0.05, 0.0, 0.99, 0.99, 2.0, 1e-3, 0.1, 0, 10, true},
    {0.05, 0.8, 0.99, 0.999, 3.0, 1e-3, 0.5, 20, 0, true},
  };
  for (auto const& ref : cases) { ademamix_trajectory<TestType>(ref); }
}

FUSEDOPT_RULE_TEST("ademamix rejects bad options before writing", "[optimizers][ademamix][errors]")
{
  using T = TestType;
  random r(3);
  std::vector<std::int64_t> const sizes{3, 17};
  slot_data<T> param(sizes, 0), grad(sizes, 0), slow(sizes, 0), v(sizes, 0);
  param.randomize(r, -1, 1);
  grad.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg_slow, slow), writes(fo::slot::exp_avg_sq, v));
  fo::rules::ademamix opt;
  opt.beta1 = 0.0;  // valid without exp_avg
  SECTION("beta1 without exp_avg bound") { opt.beta1 = 0.9; }
  SECTION("negative lr") { opt.lr = -1e-3; }
  SECTION("beta2 of 1") { opt.beta2 = 1.0; }
  SECTION("beta3 of 1") { opt.beta3 = 1.0; }
  SECTION("negative alpha") { opt.alpha = -1.0; }
  SECTION("negative eps") { opt.eps = -1e-8; }
  SECTION("negative weight_decay") { opt.weight_decay = -0.1; }
  SECTION("negative warmup") { opt.beta3_warmup = -1; }
  breadth::expect_rejected([&] { plan.run(opt, fo::step_info{1}); }, param, slow, v);
}

}  // namespace fusedopt_test
