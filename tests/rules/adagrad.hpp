// Adagrad against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.Adagrad's algorithm) for every combination of its options, typed over the four
// element types, as whole trajectories (reference/trajectory.hpp); on the backend of
// `executor` (rules/executor.hpp).
#pragma once

#include "reference/trajectory.hpp"

namespace fusedopt_test {

FUSEDOPT_RULE_TEST("adagrad matches torch.optim.Adagrad", "[optimizers][adagrad]")
{
  using T = TestType;
  std::uint64_t seed = 1;
  for (auto const& [maximize, weight_decay, lr_decay, initial_sum] :
       trajectory::combinations({false, true}, {0.0, 1e-2}, {0.0, 0.05}, {0.0, 0.1})) {
    // The reference's options and the rule's fields are torch's, in torch's order.
    ref_a::adagrad_options const o{0.1, lr_decay, weight_decay, 1e-10, maximize};
    fo::rules::adagrad const rule{{}, o.lr, o.lr_decay, o.weight_decay, o.eps, o.maximize};
    std::vector<trajectory::field<T>> fields{{"param", 0}, {"grad", 0}, {"sum_sq", initial_sum}};
    // The caller's initialisation of torch's state['sum'], through the helper.
    for (auto& v : fields[2].stored) { std::fill(v.begin(), v.end(), T{}); }
    fo::rules::fill_initial_accumulator(writes(fo::slot::sum_sq, fields[2]).host_list(), initial_sum);
    CHECK(to_double(fields[2].stored[0][0]) == to_double(from_double<T>(initial_sum)));
    trajectory::check_trajectory<executor>(
      "adagrad " + trajectory::describe({{"maximize", maximize}, {"weight_decay", weight_decay},
                                         {"lr_decay", lr_decay}, {"initial_accumulator_value", initial_sum}}),
      rule, fields, fo::slots<fo::slot::sum_sq_t>{},
      [&o](double* v, std::int64_t step) { ref_a::adagrad_step(v[0], v[1], v[2], step, o); }, seed++);
  }
}

}  // namespace fusedopt_test
