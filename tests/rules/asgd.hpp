// ASGD against torch.optim.ASGD's `_single_tensor_asgd` (reference/breadth.hpp: eta and mu set
// from the step and kept in float32, as torch keeps them) step by step, with weight decay,
// maximize and averaging that starts within the steps, over tensors of edge sizes typed over
// float, double, half and bfloat16; bad options are rejected. On the backend of `executor`.
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("asgd matches torch.optim.ASGD step by step", "[optimizers][asgd]")
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.1);
  double const t0 = GENERATE(1e6, 3.0);  // torch's default, and averaging from step 5 on
  // A large lambd and lr so that the decay and eta's schedule show within the steps.
  breadth::asgd_reference const ref{0.05, 0.2, 0.75, t0, weight_decay, maximize};
  fo::rules::asgd opt;
  opt.lr = ref.lr;
  opt.lambd = ref.lambd;
  opt.alpha = ref.alpha;
  opt.t0 = ref.t0;
  opt.weight_decay = ref.weight_decay;
  opt.maximize = ref.maximize;

  std::ostringstream label;
  label << "maximize=" << maximize << " weight_decay=" << weight_decay << " t0=" << t0;
  checker<T> check(context<T>("asgd", label.str()));
  random r(31);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), ax(sizes, 0);
  param.randomize(r, -1, 1);
  auto const plan =
    executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad), writes(fo::slot::ax, ax));
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const ax0 = ax.snapshot();
    plan.run(opt, fo::step_info{t});
    for_each_element(param, [&](std::size_t k, std::size_t i) {
      rv p = exact(p0[k][i]), a = exact(ax0[k][i]);
      ref.step<T>(t, p, exact(grad.at(k, i)), a);
      check("param", k, i, param.raw(k, i), p);
      check("ax", k, i, ax.raw(k, i), a);
    });
    INFO("step " << t);
    check.report();
  }
}

FUSEDOPT_RULE_TEST("asgd rejects the options torch rejects before writing", "[optimizers][asgd][errors]")
{
  using T = TestType;
  random r(3);
  std::vector<std::int64_t> const sizes{3, 17};
  slot_data<T> param(sizes, 0), grad(sizes, 0), ax(sizes, 0);
  param.randomize(r, -1, 1);
  grad.randomize(r, -1, 1);
  auto const plan =
    executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad), writes(fo::slot::ax, ax));
  fo::rules::asgd opt;
  SECTION("negative lr") { opt.lr = -1e-2; }
  SECTION("negative lambd") { opt.lambd = -1e-4; }
  SECTION("negative alpha") { opt.alpha = -0.75; }
  SECTION("negative weight_decay") { opt.weight_decay = -0.1; }
  breadth::expect_rejected([&] { plan.run(opt, fo::step_info{1}); }, param, ax);
}

}  // namespace fusedopt_test
