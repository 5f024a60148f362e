// The harness of the torch-reference tests of Adagrad, RMSprop, Adadelta and Adamax
// (reference/adaptive.hpp): whole trajectories compared with the references at the end, with
// a tolerance that grows with the steps, on the backend an executor gives
// (tests/rules/executor.hpp). harness.hpp instead checks every step on its own (teacher
// forcing), with tolerances from running error analysis. The tests of tests/rules/ that use
// it include it (and through it the executors) in place of rules/executor.hpp.
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference/adaptive.hpp"
#include "reference/harness.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test::trajectory {

namespace fo = fusedopt;
using ::fusedopt_test::from_double;
using ::fusedopt_test::to_double;

// ---- tolerances -----------------------------------------------------------------------------
// One place for every dtype. An element is accepted when
//     |got - reference| <= steps * (k * u * peak + tiny)
// where u is the unit roundoff of the storage type, peak the largest |reference value| this
// element had in this slot over the trajectory, and tiny the spacing of the type's subnormals.
// Why this shape: the rules are elementwise, so an element's error comes only from its own
// trajectory; each step adds a few roundings relative to the magnitudes it handles (bounded by
// peak), and errors carried over from earlier steps are damped (EMAs with factors < 1) or added
// (Adagrad's sum, momentum), not amplified, so they grow linearly with the number of steps.
// - double, float: arithmetic happens in the storage type. A step is ~10 roundings on one
//   element's path (weight decay, square, EMA, sqrt, divide, lr, add, and the double
//   hyperparameters rounded to the type), most on values smaller than peak: k = 4. Measured
//   worst error / tolerance over all cases: float 0.51 (RMSprop), double 0.18 (Adamax); Adagrad
//   and Adadelta in double follow the reference's operation order and match it exactly.
// - bfloat16: arithmetic happens in float (error ~2^-24, negligible); what counts is the one
//   rounding of each slot when it is stored in 16 bits, plus a stored state's error reaching
//   the next update: k = 2. Measured worst: 0.31 (RMSprop).
// - half: as bfloat16, but Adadelta's acc_delta at torch's default eps (1e-6) lives around
//   1e-6..1e-5, below half's smallest normal (6.1e-5), where a stored value keeps only a few
//   significant bits; that relative error reaches the parameter through the next delta, so
//   k = 4. Measured worst: 0.43 (Adadelta, eps = 1e-6); 0.18 for the other optimizers.
template <class T>
struct tolerance;
template <>
struct tolerance<double> {
  static constexpr double u = 0x1p-53, k = 4, tiny = 0x1p-1074;
};
template <>
struct tolerance<float> {
  static constexpr double u = 0x1p-24, k = 4, tiny = 0x1p-149;
};
template <>
struct tolerance<fo::half> {
  static constexpr double u = 0x1p-11, k = 4, tiny = 0x1p-24;
};
template <>
struct tolerance<fo::bfloat16> {
  static constexpr double u = 0x1p-8, k = 2, tiny = 0x1p-133;
};

// ---- inputs ---------------------------------------------------------------------------------
inline constexpr int num_steps = 12;
// Different sizes in one list, an empty tensor included; the host plan cuts them into
// chunks of chunk_elements, so tensors span several chunks.
inline std::vector<std::int64_t> const tensor_sizes{17, 0, 1000, 1, 129};
inline constexpr std::int64_t chunk_elements = 64;

/// splitmix64: the same numbers on every platform (std distributions are not portable).
class random_source {
 public:
  explicit random_source(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next()
  {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  /// Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1p-53; }

 private:
  std::uint64_t state_;
};

/// Every combination of the values of some options, in the order of nested loops over them
/// (the first option varies slowest): `for (auto [a, b] : combinations({false, true}, {0.0, 0.1}))`.
template <class First, class... Rest>
std::vector<std::tuple<First, Rest...>> combinations(std::initializer_list<First> first,
                                                     std::initializer_list<Rest>... rest)
{
  std::vector<std::tuple<First, Rest...>> all;
  if constexpr (sizeof...(Rest) == 0) {
    for (auto const& f : first) { all.emplace_back(f); }
  } else {
    auto const tails = combinations(rest...);
    for (auto const& f : first) {
      for (auto const& tail : tails) { all.push_back(std::tuple_cat(std::tuple<First>(f), tail)); }
    }
  }
  return all;
}

/// One slot over all tensors: what the rule updates (stored, in T), what the reference updates
/// (in double), and the largest magnitude the reference saw (for the tolerance).
template <class T>
struct field {
  std::string name;
  std::vector<std::vector<T>> stored;
  std::vector<std::vector<double>> reference;
  std::vector<std::vector<double>> peak;

  field(std::string n, double initial) : name(std::move(n))
  {
    for (std::int64_t size : tensor_sizes) {
      auto const count = static_cast<std::size_t>(size);
      stored.emplace_back(count, from_double<T>(initial));
      reference.emplace_back(count, to_double(from_double<T>(initial)));
      peak.emplace_back(count, std::abs(to_double(from_double<T>(initial))));
    }
  }

  /// Every element set to a value rounded to T, the reference to that rounded value.
  template <class Draw>
  void draw(Draw&& value)
  {
    for (std::size_t t = 0; t < stored.size(); ++t) {
      for (std::size_t i = 0; i < stored[t].size(); ++i) {
        stored[t][i] = from_double<T>(value());
        reference[t][i] = to_double(stored[t][i]);
        peak[t][i] = std::max(peak[t][i], std::abs(reference[t][i]));
      }
    }
  }

  /// The tensors the rule updates (what an executor binds, tests/rules/executor.hpp).
  std::vector<std::vector<T>>& tensors() { return stored; }
};

/// A plan of `Executor` over fields {param, grad, states...}: param and the states written,
/// grad read.
template <class Executor, class T, class... States, std::size_t... K>
auto bind_fields(std::vector<field<T>>& f, fo::slots<States...>, std::index_sequence<K...>)
{
  return Executor::make_plan(chunk_elements, writes(fo::slot::param, f[0]), reads(fo::slot::grad, f[1]),
                             writes(States{}, f[K + 2])...);
}

/// Runs `rule` for num_steps steps over fields {param, grad, states...} on the backend of
/// `Executor` (tests/rules/executor.hpp) and the element-wise `reference(values, step)` (values
/// = param, grad, states... in double) on the same rounded inputs, then compares every written
/// slot. `fields` are param, grad, then one per slot of `States...`, bound in that order.
template <class Executor, class T, class Rule, class... States, class Reference>
void check_trajectory(std::string const& label, Rule const& rule, std::vector<field<T>>& fields,
                      fo::slots<States...> states, Reference reference, std::uint64_t seed)
{
  random_source random(seed);
  field<T>& param = fields[0];
  field<T>& grad = fields[1];
  param.draw([&] { return random.uniform(-1, 1); });

  auto const plan = bind_fields<Executor>(fields, states, std::index_sequence_for<States...>{});

  std::vector<double> values(fields.size());
  for (std::int64_t step = 1; step <= num_steps; ++step) {
    // Fresh gradients every step, |g| in [0.1, 1) with a random sign: away from zero so
    // that 16-bit states (g^2 times 1 - alpha) stay normal numbers, where rounding is relative.
    grad.draw([&] {
      double const magnitude = random.uniform(0.1, 1);
      return (random.next() & 1) != 0 ? magnitude : -magnitude;
    });
    fo::step_info info;
    info.step = step;
    plan.run(rule, info);
    for (std::size_t t = 0; t < tensor_sizes.size(); ++t) {
      for (std::size_t i = 0; i < param.reference[t].size(); ++i) {
        for (std::size_t f = 0; f < fields.size(); ++f) { values[f] = fields[f].reference[t][i]; }
        reference(values.data(), step);
        for (std::size_t f = 0; f < fields.size(); ++f) {
          fields[f].reference[t][i] = values[f];
          fields[f].peak[t][i] = std::max(fields[f].peak[t][i], std::abs(values[f]));
        }
      }
    }
  }

  using tol = tolerance<T>;
  std::int64_t failures = 0;
  double worst_ratio = 0;
  std::string first_failure;
  for (std::size_t f = 0; f < fields.size(); ++f) {
    if (f == 1) { continue; }  // the gradient is an input
    for (std::size_t t = 0; t < tensor_sizes.size(); ++t) {
      for (std::size_t i = 0; i < fields[f].stored[t].size(); ++i) {
        double const got = to_double(fields[f].stored[t][i]);
        double const want = fields[f].reference[t][i];
        double const bound = num_steps * (tol::k * tol::u * fields[f].peak[t][i] + tol::tiny);
        double const error = std::abs(got - want);
        worst_ratio = std::max(worst_ratio, error / bound);
        if (!(error <= bound)) {
          if (failures++ == 0) {
            std::ostringstream s;
            s.precision(17);
            s << label << " [" << fo::dtype_name<T>() << "]: slot " << fields[f].name << ", tensor " << t
              << ", element " << i << ": got " << got << ", reference " << want << ", error " << error
              << " > tolerance " << bound;
            first_failure = s.str();
          }
        }
      }
    }
  }
  INFO(first_failure);
  INFO(label << " [" << fo::dtype_name<T>() << "]: worst error / tolerance = " << worst_ratio);
  CHECK(failures == 0);
}

inline std::string describe(std::initializer_list<std::pair<char const*, double>> options)
{
  std::ostringstream s;
  for (auto const& [name, value] : options) { s << name << '=' << value << ' '; }
  return s.str();
}

}  // namespace fusedopt_test::trajectory
