// Adamax against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.Adamax's algorithm) for every combination of its options, typed over the four
// element types, as whole trajectories (reference/trajectory.hpp); on the backend of
// `executor` (rules/executor.hpp).
#pragma once

#include "reference/trajectory.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("adamax matches torch.optim.Adamax", "[optimizers][adamax]")
{
  using T = TestType;
  std::uint64_t seed = 300;
  for (auto const& [maximize, weight_decay, betas] :
       trajectory::combinations({false, true}, {0.0, 1e-2}, {std::pair{0.9, 0.999}, std::pair{0.5, 0.9}})) {
    auto const [beta1, beta2] = betas;
    // The reference's options and the rule's fields are torch's, in torch's order.
    ref_a::adamax_options const o{2e-2, beta1, beta2, 1e-8, weight_decay, maximize};
    fo::rules::adamax const rule{{}, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.maximize};
    std::vector<trajectory::field<T>> fields{{"param", 0}, {"grad", 0}, {"exp_avg", 0}, {"exp_inf", 0}};
    trajectory::check_trajectory<executor>(
      "adamax " + trajectory::describe({{"maximize", maximize}, {"weight_decay", weight_decay}, {"beta1", beta1},
                                        {"beta2", beta2}}),
      rule, fields, fo::slots<fo::slot::exp_avg_t, fo::slot::exp_inf_t>{},
      [&o](double* v, std::int64_t step) { ref_a::adamax_step(v[0], v[1], v[2], v[3], step, o); }, seed++);
  }
}

}  // namespace fusedopt_test
