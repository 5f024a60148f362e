// Adamax against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.Adamax's algorithm) for every combination of its options, typed over the four element
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

TEMPLATE_TEST_CASE("adamax matches torch.optim.Adamax", "[optimizers][adamax]" FUSEDOPT_TEST_BACKEND_TAG,
                   float, double, fusedopt::half, fusedopt::bfloat16)
{
  namespace fo = fusedopt;
  namespace ref = ref_a;
  using namespace trajectory;
  using T = TestType;
  std::uint64_t seed = 300;
  for (bool maximize : {false, true}) {
    for (double weight_decay : {0.0, 1e-2}) {
      for (auto const& [beta1, beta2] : {std::pair{0.9, 0.999}, std::pair{0.5, 0.9}}) {
        ref::adamax_options o;
        o.lr = 2e-2;
        o.beta1 = beta1;
        o.beta2 = beta2;
        o.weight_decay = weight_decay;
        o.maximize = maximize;
        fo::rules::adamax rule;
        rule.lr = o.lr;
        rule.beta1 = o.beta1;
        rule.beta2 = o.beta2;
        rule.eps = o.eps;
        rule.weight_decay = o.weight_decay;
        rule.maximize = o.maximize;

        std::vector<field<T>> fields{{"param", 0}, {"grad", 0}, {"exp_avg", 0}, {"exp_inf", 0}};
        check_trajectory<T>(
          "adamax " + describe({{"maximize", maximize}, {"weight_decay", weight_decay}, {"beta1", beta1},
                                {"beta2", beta2}}),
          rule, fields,
          [](std::vector<field<T>>& f, std::int64_t chunk) {
            return executor::make_plan(chunk, writes(fo::slot::param, f[0]), reads(fo::slot::grad, f[1]),
                            writes(fo::slot::exp_avg, f[2]), writes(fo::slot::exp_inf, f[3]));
          },
          [&o](double* v, std::int64_t step) { ref::adamax_step(v[0], v[1], v[2], v[3], step, o); }, seed++);
      }
    }
  }
}

}  // namespace fusedopt_test
