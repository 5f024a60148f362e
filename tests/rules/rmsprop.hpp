// RMSprop against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.RMSprop's algorithm) for every combination of its options, typed over the four element
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

TEMPLATE_TEST_CASE("rmsprop matches torch.optim.RMSprop", "[optimizers][rmsprop]" FUSEDOPT_TEST_BACKEND_TAG,
                   float, double, fusedopt::half, fusedopt::bfloat16)
{
  namespace fo = fusedopt;
  namespace ref = ref_a;
  using namespace trajectory;
  using T = TestType;
  std::uint64_t seed = 100;
  for (bool maximize : {false, true}) {
    for (double weight_decay : {0.0, 1e-2}) {
      for (bool centered : {false, true}) {
        for (double momentum : {0.0, 0.9}) {
          ref::rmsprop_options o;
          o.weight_decay = weight_decay;
          o.momentum = momentum;
          o.centered = centered;
          o.maximize = maximize;
          fo::rules::rmsprop rule;
          rule.lr = o.lr;
          rule.alpha = o.alpha;
          rule.eps = o.eps;
          rule.weight_decay = o.weight_decay;
          rule.momentum = o.momentum;
          rule.centered = o.centered;
          rule.maximize = o.maximize;

          // Every state bound whatever the options: a state the options do not use must come
          // back unchanged (zero), which the comparison checks.
          std::vector<field<T>> fields{{"param", 0}, {"grad", 0}, {"square_avg", 0}, {"grad_avg", 0},
                                       {"momentum_buffer", 0}};
          check_trajectory<T>(
            "rmsprop " + describe({{"maximize", maximize}, {"weight_decay", weight_decay}, {"centered", centered},
                                   {"momentum", momentum}}),
            rule, fields,
            [](std::vector<field<T>>& f, std::int64_t chunk) {
              return executor::make_plan(chunk, writes(fo::slot::param, f[0]), reads(fo::slot::grad, f[1]),
                              writes(fo::slot::square_avg, f[2]), writes(fo::slot::grad_avg, f[3]),
                              writes(fo::slot::momentum_buffer, f[4]));
            },
            [&o](double* v, std::int64_t) { ref::rmsprop_step(v[0], v[1], v[2], v[3], v[4], o); }, seed++);
        }
      }
    }
  }
}

}  // namespace fusedopt_test
