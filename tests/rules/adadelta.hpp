// Adadelta against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.Adadelta's algorithm) for every combination of its options, typed over the four
// element types, as whole trajectories (reference/trajectory.hpp); on the backend of
// `executor` (rules/executor.hpp).
#pragma once

#include "reference/trajectory.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("adadelta matches torch.optim.Adadelta", "[optimizers][adadelta]")
{
  using T = TestType;
  std::uint64_t seed = 200;
  // torch's defaults (lr, rho, eps), and a set where the steps are large enough to move
  // 16-bit params.
  for (auto const& [maximize, weight_decay, set] : trajectory::combinations(
         {false, true}, {0.0, 1e-2}, {std::tuple{1.0, 0.9, 1e-6}, std::tuple{2.0, 0.95, 1e-4}})) {
    auto const [lr, rho, eps] = set;
    // The reference's options and the rule's fields are torch's, in torch's order.
    ref_a::adadelta_options const o{lr, rho, eps, weight_decay, maximize};
    fo::rules::adadelta const rule{{}, o.lr, o.rho, o.eps, o.weight_decay, o.maximize};
    std::vector<trajectory::field<T>> fields{{"param", 0}, {"grad", 0}, {"square_avg", 0}, {"acc_delta", 0}};
    trajectory::check_trajectory<executor>(
      "adadelta " + trajectory::describe({{"maximize", maximize}, {"weight_decay", weight_decay}, {"lr", lr},
                                          {"rho", rho}, {"eps", eps}}),
      rule, fields, fo::slots<fo::slot::square_avg_t, fo::slot::acc_delta_t>{},
      [&o](double* v, std::int64_t) { ref_a::adadelta_step(v[0], v[1], v[2], v[3], o); }, seed++);
  }
}

}  // namespace fusedopt_test
