// Rprop against torch.optim.Rprop's algorithm (reference/breadth.hpp) step by step, with
// maximize and two sets of etas and step-size bounds, over tensors of edge sizes typed over
// float, double, half and bfloat16 (basic_rprop<T>: torch's arithmetic in the gradient's type);
// a product that underflows to 0 keeps the step size; bad options are rejected. On the backend
// of `executor` (executor.hpp).
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

template <class T>
fo::rules::basic_rprop<T> rprop_rule(breadth::rprop_reference const& ref)
{
  fo::rules::basic_rprop<T> opt;
  opt.lr = ref.lr;
  opt.etaminus = ref.etaminus;
  opt.etaplus = ref.etaplus;
  opt.step_size_min = ref.step_size_min;
  opt.step_size_max = ref.step_size_max;
  opt.maximize = ref.maximize;
  return opt;
}

/// Runs `steps` steps on gradients from `draw(grad, t)` and checks every element against the
/// reference. The states start as garbage: step 1 must not read them.
template <class T, class Draw>
void rprop_trajectory(breadth::rprop_reference const& ref, std::vector<std::int64_t> const& sizes, std::int64_t steps,
                      std::string const& label, Draw&& draw)
{
  checker<T> check(context<T>("rprop", label));
  random r(21);
  slot_data<T> param(sizes, 0), grad(sizes, 0), prev(sizes, 0), step_size(sizes, 0);
  param.randomize(r, -1, 1);
  prev.randomize(r, -1, 1);
  step_size.randomize(r, 0, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::prev, prev), writes(fo::slot::step_size, step_size));
  auto const opt = rprop_rule<T>(ref);
  for (std::int64_t t = 1; t <= steps; ++t) {
    draw(grad, r, t);
    auto const p0 = param.snapshot();
    auto const prev0 = prev.snapshot();
    auto const size0 = step_size.snapshot();
    plan.run(opt, fo::step_info{t});
    for_each_element(param, [&](std::size_t k, std::size_t i) {
      rv p = exact(p0[k][i]);
      double pv = prev0[k][i];
      rv size = exact(size0[k][i]);
      ref.step<T>(t == 1, p, grad.at(k, i), pv, size);
      check("param", k, i, param.raw(k, i), p);
      check("prev", k, i, prev.raw(k, i), exact(pv));
      check("step_size", k, i, step_size.raw(k, i), size);
    });
    INFO("step " << t);
    check.report();
  }
}

}  // namespace

FUSEDOPT_RULE_TEST("rprop matches torch.optim.Rprop step by step", "[optimizers][rprop]")
{
  using T = TestType;
  bool const maximize = GENERATE(false, true);
  bool const narrow = GENERATE(false, true);
  // torch's defaults, and bounds that both clamps reach within the steps.
  breadth::rprop_reference const ref = narrow ? breadth::rprop_reference{0.05, 0.3, 1.5, 0.02, 0.08, maximize}
                                              : breadth::rprop_reference{1e-2, 0.5, 1.2, 1e-6, 50, maximize};
  std::ostringstream label;
  label << "maximize=" << maximize << " narrow=" << narrow;
  rprop_trajectory<T>(ref, breadth::trajectory_sizes(), reference_steps, label.str(),
                      [](slot_data<T>& grad, random& r, std::int64_t) { grad.randomize(r, -1, 1); });
}

FUSEDOPT_RULE_TEST("rprop keeps the step size where grad * prev underflows in the gradient's type",
                   "[optimizers][rprop]")
{
  using T = TestType;
  // Two gradients whose product is below half the smallest subnormal of T: torch's sign of it is
  // 0, so the step size is kept (factor 1), where the signs' product would grow or shrink it.
  double const tiny = std::is_same_v<T, double>  ? 5e-163
                      : std::is_same_v<T, float> ? 1e-23
                      : std::is_same_v<T, fo::half> ? 7e-5
                                                     : 1e-21;
  breadth::rprop_reference const ref{1e-2, 0.5, 1.2, 1e-6, 50, false};
  rprop_trajectory<T>(ref, {1, 17, 129}, 4, "underflow", [tiny](slot_data<T>& grad, random& r, std::int64_t t) {
    grad.randomize(r, 1, 2);
    for (auto& tensor : grad.tensors()) {
      for (std::size_t i = 0; i < tensor.size(); ++i) {
        // Alternate signs between steps on odd elements, so that both a positive and a negative
        // product underflow.
        double const sign = (i % 2 == 1 && t % 2 == 0) ? -1.0 : 1.0;
        tensor[i] = from_double<T>(sign * tiny * to_double(tensor[i]));
      }
    }
  });
}

FUSEDOPT_RULE_TEST("rprop rejects the options torch rejects before writing", "[optimizers][rprop][errors]")
{
  using T = TestType;
  random r(3);
  std::vector<std::int64_t> const sizes{3, 17};
  slot_data<T> param(sizes, 0), grad(sizes, 0), prev(sizes, 0), step_size(sizes, 0);
  param.randomize(r, -1, 1);
  grad.randomize(r, -1, 1);
  auto const plan = executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                                        writes(fo::slot::prev, prev), writes(fo::slot::step_size, step_size));
  fo::rules::basic_rprop<T> opt;
  SECTION("negative lr") { opt.lr = -1e-2; }
  SECTION("etaminus of 0") { opt.etaminus = 0.0; }
  SECTION("etaminus of 1") { opt.etaminus = 1.0; }
  SECTION("etaplus of 1") { opt.etaplus = 1.0; }
  breadth::expect_rejected([&] { plan.run(opt, fo::step_info{1}); }, param, prev, step_size);
}

}  // namespace fusedopt_test
