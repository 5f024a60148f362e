// Adagrad against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.Adagrad's algorithm) for every combination of its options, typed over the four element
// types, as whole trajectories (reference/trajectory.hpp); on the backend of `executor`
// (executor.hpp).
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference/adaptive.hpp"
#include "reference/trajectory.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {

TEMPLATE_TEST_CASE("adagrad matches torch.optim.Adagrad", "[optimizers][adagrad]" FUSEDOPT_TEST_BACKEND_TAG,
                   float, double, fusedopt::half, fusedopt::bfloat16)
{
  namespace fo = fusedopt;
  namespace ref = ref_a;
  using namespace trajectory;
  using T = TestType;
  std::uint64_t seed = 1;
  for (bool maximize : {false, true}) {
    for (double weight_decay : {0.0, 1e-2}) {
      for (double lr_decay : {0.0, 0.05}) {
        for (double initial_accumulator_value : {0.0, 0.1}) {
          ref::adagrad_options o;
          o.lr = 0.1;
          o.lr_decay = lr_decay;
          o.weight_decay = weight_decay;
          o.maximize = maximize;
          fo::rules::adagrad rule;
          rule.lr = o.lr;
          rule.lr_decay = o.lr_decay;
          rule.weight_decay = o.weight_decay;
          rule.eps = o.eps;
          rule.maximize = o.maximize;

          std::vector<field<T>> fields{{"param", 0}, {"grad", 0}, {"sum_sq", initial_accumulator_value}};
          // The caller's initialisation of torch's state['sum'], through the helper.
          for (auto& v : fields[2].stored) { std::fill(v.begin(), v.end(), T{}); }
          fo::rules::fill_initial_accumulator(writes(fo::slot::sum_sq, fields[2]).host_list(), initial_accumulator_value);
          CHECK(to_double(fields[2].stored[0][0]) == to_double(round_to<T>(initial_accumulator_value)));

          check_trajectory<T>(
            "adagrad " + describe({{"maximize", maximize}, {"weight_decay", weight_decay}, {"lr_decay", lr_decay},
                                   {"initial_accumulator_value", initial_accumulator_value}}),
            rule, fields,
            [](std::vector<field<T>>& f, std::int64_t chunk) {
              return executor::make_plan(chunk, writes(fo::slot::param, f[0]), reads(fo::slot::grad, f[1]),
                              writes(fo::slot::sum_sq, f[2]));
            },
            [&o](double* v, std::int64_t step) { ref::adagrad_step(v[0], v[1], v[2], step, o); }, seed++);
        }
      }
    }
  }
}

}  // namespace fusedopt_test
