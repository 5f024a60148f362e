// Schedule-Free AdamW and SGD against facebookresearch/schedule_free's AdamWScheduleFree and
// SGDScheduleFree (reference/breadth.hpp) step by step, over warmup, polynomial weighting,
// weight_lr_power, weight decay at y, inner momentum and maximize, with the running scalars in
// executor memory (device memory on CUDA) checked after every step; then the eval() and train()
// swaps, and a train() before the first step that leaves the parameters as they are. Tensors of
// edge sizes, typed over float, double, half and bfloat16. On the backend of `executor`.
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

struct schedule_free_case {
  double lr, beta1;
  std::int64_t warmup_steps;
  double r, weight_lr_power, weight_decay, inner_momentum;
  bool maximize;
};

/// The state memory against the reference's group scalars.
void check_sums(fo::rules::schedule_free_state const& got, breadth::schedule_free_sums const& want)
{
  CHECK(got.lr_max == want.lr_max);
  CHECK(std::fabs(got.weight_sum - want.weight_sum) <= 1e-13 * std::fabs(want.weight_sum));
}

/// Checks param against lerp(param, z, weight) of the values before the swap.
template <class T, class Plan, class Swap>
void check_swap(Plan const& plan, Swap const& swap, slot_data<T>& param, slot_data<T> const& z, double weight,
                char const* name)
{
  checker<T> check(context<T>(name, ""));
  auto const p0 = param.snapshot();
  plan.run(swap);
  for_each_element(param, [&](std::size_t k, std::size_t i) {
    check("param", k, i, param.raw(k, i), lerp<T>(exact(p0[k][i]), exact(z.at(k, i)), weight));
  });
  check.report();
}

template <class T, bool Sgd>
void schedule_free_trajectory(schedule_free_case const& c)
{
  std::ostringstream label;
  label << (Sgd ? "sgd" : "adamw") << " warmup=" << c.warmup_steps << " r=" << c.r << " weight_lr_power="
        << c.weight_lr_power << " weight_decay=" << c.weight_decay << " maximize=" << c.maximize;
  if (!Sgd) { label << " inner_momentum=" << c.inner_momentum; }
  checker<T> check(context<T>("schedule_free", label.str()));
  random r(41);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), z(sizes, 0), exp_avg_sq(sizes, 0), exp_avg(sizes, 0);
  param.randomize(r, -1, 1);
  z.randomize(r, -1, 1);  // garbage: step 1 sets z to the parameter
  typename executor::template memory<fo::rules::schedule_free_state> memory;
  memory.set({123.0, 456.0});  // garbage: step 1 does not read it

  fo::rules::schedule_free_adamw adamw;
  adamw.lr = c.lr;
  adamw.beta1 = c.beta1;
  adamw.weight_decay = c.weight_decay;
  adamw.warmup_steps = c.warmup_steps;
  adamw.r = c.r;
  adamw.weight_lr_power = c.weight_lr_power;
  adamw.inner_momentum = c.inner_momentum;
  adamw.maximize = c.maximize;
  adamw.eps = 1e-3;  // large enough that eps shows in the denominator
  adamw.state = memory.data();
  fo::rules::schedule_free_sgd sgd_rule;
  sgd_rule.lr = c.lr;
  sgd_rule.momentum = c.beta1;
  sgd_rule.weight_decay = c.weight_decay;
  sgd_rule.warmup_steps = c.warmup_steps;
  sgd_rule.r = c.r;
  sgd_rule.weight_lr_power = c.weight_lr_power;
  sgd_rule.maximize = c.maximize;
  sgd_rule.state = memory.data();

  breadth::schedule_free_schedule const schedule{c.lr, c.warmup_steps, c.r, c.weight_lr_power};
  breadth::schedule_free_adamw_reference const adamw_ref{c.beta1, 0.999, 1e-3, c.weight_decay, c.inner_momentum,
                                                         c.maximize};
  breadth::schedule_free_sgd_reference const sgd_ref{c.beta1, c.weight_decay, c.maximize};
  breadth::schedule_free_sums sums;

  auto run = [&](auto const& plan) {
    for (std::int64_t t = 1; t <= reference_steps; ++t) {
      grad.randomize(r, -1, 1);
      auto const p0 = param.snapshot();
      auto const z0 = z.snapshot();
      auto const v0 = exp_avg_sq.snapshot();
      auto const m0 = exp_avg.snapshot();
      if (t > 1) { sums = {memory.get().lr_max, memory.get().weight_sum}; }  // teacher forcing
      auto const values = schedule.advance(t, sums);
      if constexpr (Sgd) {
        plan.run(sgd_rule, fo::step_info{t});
      } else {
        plan.run(adamw, fo::step_info{t});
      }
      for_each_element(param, [&](std::size_t k, std::size_t i) {
        rv y = exact(p0[k][i]), zz = exact(z0[k][i]), v = exact(v0[k][i]), m = exact(m0[k][i]);
        if constexpr (Sgd) {
          sgd_ref.step<T>(t, values.lr, values.ckp1, y, exact(grad.at(k, i)), zz);
        } else {
          adamw_ref.step<T>(t, values.lr, values.ckp1, y, exact(grad.at(k, i)), zz, v, m);
          check("exp_avg_sq", k, i, exp_avg_sq.raw(k, i), v);
          if (c.inner_momentum != 0) { check("exp_avg", k, i, exp_avg.raw(k, i), m); }
        }
        check("param", k, i, param.raw(k, i), y);
        check("z", k, i, z.raw(k, i), zz);
      });
      INFO("step " << t);
      check.report();
      check_sums(memory.get(), sums);
    }
    check_swap(plan, fo::rules::schedule_free_eval{c.beta1}, param, z, 1 - 1 / c.beta1, "schedule_free_eval");
    check_swap(plan, fo::rules::schedule_free_train{c.beta1}, param, z, 1 - c.beta1, "schedule_free_train");
  };
  if constexpr (Sgd) {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad), writes(fo::slot::z, z)));
  } else if (c.inner_momentum != 0) {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad), writes(fo::slot::z, z),
                            writes(fo::slot::exp_avg_sq, exp_avg_sq), writes(fo::slot::exp_avg, exp_avg)));
  } else {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad), writes(fo::slot::z, z),
                            writes(fo::slot::exp_avg_sq, exp_avg_sq)));
  }
}

// The reference's defaults, then warmup (lr_max and the weights grow), polynomial weighting
// with a real weight_lr_power, decay at y, inner momentum and maximize.
schedule_free_case const schedule_free_cases[] = {
  {0.0025, 0.9, 0, 0.0, 2.0, 0.0, 0.0, false},   {0.05, 0.9, 5, 0.0, 2.0, 0.0, 0.0, false},
  {0.05, 0.8, 4, 0.5, 1.5, 0.1, 0.0, false},     {0.05, 0.9, 0, 1.0, 2.0, 0.1, 0.9, true},
  {0.05, 0.95, 3, 0.25, 0.0, 0.0, 0.5, false},
};

}  // namespace

FUSEDOPT_RULE_TEST("schedule_free_adamw matches AdamWScheduleFree step by step", "[optimizers][schedule_free]")
{
  for (auto const& c : schedule_free_cases) { schedule_free_trajectory<TestType, false>(c); }
}

FUSEDOPT_RULE_TEST("schedule_free_sgd matches SGDScheduleFree step by step", "[optimizers][schedule_free]")
{
  // Warmup, r, weight_lr_power, decay and maximize (SGD has no inner momentum: ignored).
  for (auto const& c : {schedule_free_cases[2], schedule_free_cases[3]}) { schedule_free_trajectory<TestType, true>(c); }
}

FUSEDOPT_RULE_TEST("schedule_free_train before the first step leaves a parameter whose z is its copy",
                   "[optimizers][schedule_free]")
{
  using T = TestType;
  random r(5);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), z(sizes, 0);
  param.randomize(r, -1, 1);
  z.tensors() = param.tensors();
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::z, z));
  auto const before = param.snapshot();
  plan.run(fo::rules::schedule_free_train{0.9});
  CHECK(param.snapshot() == before);
}

FUSEDOPT_RULE_TEST("schedule-free rejects bad options before writing", "[optimizers][schedule_free][errors]")
{
  using T = TestType;
  random r(3);
  std::vector<std::int64_t> const sizes{3, 17};
  slot_data<T> param(sizes, 0), grad(sizes, 0), z(sizes, 0), v(sizes, 0);
  param.randomize(r, -1, 1);
  grad.randomize(r, -1, 1);
  typename executor::template memory<fo::rules::schedule_free_state> memory;
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::z, z), writes(fo::slot::exp_avg_sq, v));
  fo::rules::schedule_free_adamw opt;
  opt.state = memory.data();
  SECTION("no state") { opt.state = nullptr; }
  SECTION("negative lr") { opt.lr = -1.0; }
  SECTION("beta1 of 0") { opt.beta1 = 0.0; }
  SECTION("beta2 of 1") { opt.beta2 = 1.0; }
  SECTION("negative eps") { opt.eps = -1e-8; }
  SECTION("negative weight_decay") { opt.weight_decay = -0.1; }
  SECTION("negative warmup") { opt.warmup_steps = -1; }
  SECTION("inner momentum without exp_avg") { opt.inner_momentum = 0.9; }
  breadth::expect_rejected([&] { plan.run(opt, fo::step_info{2}); }, param, z, v);
}

}  // namespace fusedopt_test
