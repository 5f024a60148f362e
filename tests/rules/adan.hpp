// Adan against sail-sg/Adan's `_single_tensor_adan` (reference/breadth.hpp) step by step, with
// both forms of weight decay (proximal and no_prox) and maximize, over tensors of edge sizes
// typed over float, double, half and bfloat16; bad options are rejected. On the backend of
// `executor` (executor.hpp).
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("adan matches the reference Adan step by step", "[optimizers][adan]")
{
  using T = TestType;
  auto const [maximize, weight_decay, no_prox] =
    GENERATE(table<bool, double, bool>({{false, 0.0, false}, {true, 0.5, false}, {false, 0.5, true}, {true, 0.0, true}}));
  // A larger lr and eps than the defaults, so that every term shows within the steps.
  breadth::adan_reference const ref{0.05, 0.98, 0.92, 0.99, 1e-3, weight_decay, no_prox, maximize};
  fo::rules::adan opt;
  opt.lr = ref.lr;
  opt.eps = ref.eps;
  opt.weight_decay = weight_decay;
  opt.no_prox = no_prox;
  opt.maximize = maximize;

  std::ostringstream label;
  label << "maximize=" << maximize << " weight_decay=" << weight_decay << " no_prox=" << no_prox;
  checker<T> check(context<T>("adan", label.str()));
  random r(61);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), m(sizes, 0), d(sizes, 0), n(sizes, 0), neg(sizes, 0);
  param.randomize(r, -1, 1);
  neg.randomize(r, -1, 1);  // garbage: step 1 sets it from the gradient
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg, m), writes(fo::slot::exp_avg_diff, d),
                                        writes(fo::slot::exp_avg_sq, n), writes(fo::slot::neg_pre_grad, neg));
  for (std::int64_t t = 1; t <= reference_steps; ++t) {
    grad.randomize(r, -1, 1);
    auto const p0 = param.snapshot();
    auto const m0 = m.snapshot();
    auto const d0 = d.snapshot();
    auto const n0 = n.snapshot();
    auto const neg0 = neg.snapshot();
    plan.run(opt, fo::step_info{t});
    for_each_element(param, [&](std::size_t k, std::size_t i) {
      rv p = exact(p0[k][i]), mm = exact(m0[k][i]), dd = exact(d0[k][i]), nn = exact(n0[k][i]),
         ng = exact(neg0[k][i]);
      ref.step<T>(t, p, exact(grad.at(k, i)), mm, dd, nn, ng);
      check("param", k, i, param.raw(k, i), p);
      check("exp_avg", k, i, m.raw(k, i), mm);
      check("exp_avg_diff", k, i, d.raw(k, i), dd);
      check("exp_avg_sq", k, i, n.raw(k, i), nn);
      check("neg_pre_grad", k, i, neg.raw(k, i), ng);
    });
    INFO("step " << t);
    check.report();
  }
}

FUSEDOPT_RULE_TEST("adan rejects bad options before writing", "[optimizers][adan][errors]")
{
  using T = TestType;
  random r(3);
  std::vector<std::int64_t> const sizes{3, 17};
  slot_data<T> param(sizes, 0), grad(sizes, 0), m(sizes, 0), d(sizes, 0), n(sizes, 0), neg(sizes, 0);
  param.randomize(r, -1, 1);
  grad.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::exp_avg, m), writes(fo::slot::exp_avg_diff, d),
                                        writes(fo::slot::exp_avg_sq, n), writes(fo::slot::neg_pre_grad, neg));
  fo::rules::adan opt;
  SECTION("negative lr") { opt.lr = -1e-3; }
  SECTION("beta1 of 1") { opt.beta1 = 1.0; }
  SECTION("negative beta2") { opt.beta2 = -0.1; }
  SECTION("beta3 of 1") { opt.beta3 = 1.0; }
  SECTION("negative eps") { opt.eps = -1e-8; }
  SECTION("negative weight_decay, proximal") { opt.weight_decay = -0.1; }
  SECTION("negative weight_decay, no_prox")
  {
    opt.weight_decay = -0.1;
    opt.no_prox = true;
  }
  breadth::expect_rejected([&] { plan.run(opt, fo::step_info{1}); }, param, m, d, n, neg);
}

}  // namespace fusedopt_test
