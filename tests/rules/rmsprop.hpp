// RMSprop against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.RMSprop's algorithm) for every combination of its options, typed over the four
// element types, as whole trajectories (reference/trajectory.hpp); on the backend of
// `executor` (rules/executor.hpp).
#pragma once

#include "reference/trajectory.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("rmsprop matches torch.optim.RMSprop", "[optimizers][rmsprop]")
{
  using T = TestType;
  std::uint64_t seed = 100;
  for (auto const& [maximize, weight_decay, centered, momentum] :
       trajectory::combinations({false, true}, {0.0, 1e-2}, {false, true}, {0.0, 0.9})) {
    // The reference's options and the rule's fields are torch's, in torch's order.
    ref_a::rmsprop_options const o{1e-2, 0.99, 1e-8, weight_decay, momentum, centered, maximize};
    fo::rules::rmsprop const rule{{}, o.lr, o.alpha, o.eps, o.weight_decay, o.momentum, o.centered, o.maximize};
    // Every state bound whatever the options: a state the options do not use must come back
    // unchanged (zero), which the comparison checks.
    std::vector<trajectory::field<T>> fields{
      {"param", 0}, {"grad", 0}, {"square_avg", 0}, {"grad_avg", 0}, {"momentum_buffer", 0}};
    trajectory::check_trajectory<executor>(
      "rmsprop " + trajectory::describe({{"maximize", maximize}, {"weight_decay", weight_decay},
                                         {"centered", centered}, {"momentum", momentum}}),
      rule, fields, fo::slots<fo::slot::square_avg_t, fo::slot::grad_avg_t, fo::slot::momentum_buffer_t>{},
      [&o](double* v, std::int64_t) { ref_a::rmsprop_step(v[0], v[1], v[2], v[3], v[4], o); }, seed++);
  }
}

}  // namespace fusedopt_test
