// torch.optim.SGD against its double-precision reference (reference/rv.hpp) for every
// combination of its options, over 12 steps of several tensors of different sizes, typed
// over float, double, half and bfloat16; on the backend of `executor` (executor.hpp).
#pragma once

#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

struct momentum_case {
  double momentum, dampening;
  bool nesterov;
};

}  // namespace

FUSEDOPT_RULE_TEST("sgd matches torch.optim.SGD step by step", "[optimizers][sgd]")
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.1);
  momentum_case const mc = GENERATE(momentum_case{0.0, 0.0, false}, momentum_case{0.9, 0.0, false},
                                    momentum_case{0.8, 0.3, false}, momentum_case{0.9, 0.0, true});
  fo::rules::sgd opt;
  opt.lr = 0.05;
  opt.momentum = mc.momentum;
  opt.dampening = mc.dampening;
  opt.nesterov = mc.nesterov;
  opt.weight_decay = weight_decay;
  opt.maximize = maximize;
  sgd_reference const ref{0.05, mc.momentum, mc.dampening, weight_decay, mc.nesterov, maximize};

  std::ostringstream options;
  options << "maximize=" << maximize << " weight_decay=" << weight_decay << " momentum=" << mc.momentum
          << " dampening=" << mc.dampening << " nesterov=" << mc.nesterov;
  checker<T> check(context<T>("sgd", options.str()));

  random r(1);
  auto const sizes = mixed_sizes();
  // The buffer starts as garbage: torch has no buffer before step 1, so its content must not matter.
  slot_data<T> param(sizes, 0), grad(sizes, 0), buffer(sizes, 0);
  param.randomize(r, -1, 1);
  buffer.randomize(r, -100, 100);

  auto run = [&](auto const& plan) {
    for (std::int64_t t = 1; t <= reference_steps; ++t) {
      grad.randomize(r, -1, 1);
      auto const p0 = param.snapshot();
      auto const b0 = buffer.snapshot();
      plan.run(opt, fo::step_info{t});
      for_each_element(param, [&](std::size_t k, std::size_t i) {
        rv p = exact(p0[k][i]), b = exact(b0[k][i]);
        ref.step<T>(t == 1, p, exact(grad.at(k, i)), b);
        check("param", k, i, param.raw(k, i), p);
        if (mc.momentum != 0) { check("momentum_buffer", k, i, buffer.raw(k, i), b); }
      });
      INFO("step " << t);
      check.report();
    }
  };
  // As torch: a momentum buffer exists only with momentum.
  if (mc.momentum != 0) {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                            writes(fo::slot::momentum_buffer, buffer)));
  } else {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad)));
  }
}

}  // namespace fusedopt_test
