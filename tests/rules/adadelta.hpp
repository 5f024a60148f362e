// Adadelta against its double-precision reference (reference/adaptive.hpp, written from
// torch.optim.Adadelta's algorithm) for every combination of its options, typed over the four element
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

TEMPLATE_TEST_CASE("adadelta matches torch.optim.Adadelta", "[optimizers][adadelta]" FUSEDOPT_TEST_BACKEND_TAG,
                   float, double, fusedopt::half, fusedopt::bfloat16)
{
  namespace fo = fusedopt;
  namespace ref = ref_a;
  using namespace trajectory;
  using T = TestType;
  std::uint64_t seed = 200;
  for (bool maximize : {false, true}) {
    for (double weight_decay : {0.0, 1e-2}) {
      // torch's defaults, and a set where the steps are large enough to move 16-bit params.
      for (auto const& [lr, rho, eps] : {std::tuple{1.0, 0.9, 1e-6}, std::tuple{2.0, 0.95, 1e-4}}) {
        ref::adadelta_options o;
        o.lr = lr;
        o.rho = rho;
        o.eps = eps;
        o.weight_decay = weight_decay;
        o.maximize = maximize;
        fo::rules::adadelta rule;
        rule.lr = o.lr;
        rule.rho = o.rho;
        rule.eps = o.eps;
        rule.weight_decay = o.weight_decay;
        rule.maximize = o.maximize;

        std::vector<field<T>> fields{{"param", 0}, {"grad", 0}, {"square_avg", 0}, {"acc_delta", 0}};
        check_trajectory<T>(
          "adadelta " + describe({{"maximize", maximize}, {"weight_decay", weight_decay}, {"lr", lr}, {"rho", rho},
                                  {"eps", eps}}),
          rule, fields,
          [](std::vector<field<T>>& f, std::int64_t chunk) {
            return executor::make_plan(chunk, writes(fo::slot::param, f[0]), reads(fo::slot::grad, f[1]),
                            writes(fo::slot::square_avg, f[2]), writes(fo::slot::acc_delta, f[3]));
          },
          [&o](double* v, std::int64_t) { ref::adadelta_step(v[0], v[1], v[2], v[3], o); }, seed++);
      }
    }
  }
}

}  // namespace fusedopt_test
