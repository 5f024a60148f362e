// Independent double-precision references for SGD, Adam, AdamW, NAdam, RAdam and Lion, and
// the harness that compares a backend's results with them (tests/rules/ runs it on each).
//
// The references follow torch.optim's `_single_tensor_*` code (torch 2.x) and, for Lion,
// the paper's reference implementation (lion-pytorch), statement by statement, on one
// element at a time. They never call fusedopt's rules: they are a second, separate reading
// of the published algorithms.
//
// How results are compared (teacher forcing): before every step the reference reads the
// state the backend holds (converted exactly to double), computes the step in double, and
// every slot the backend wrote is compared with it. Each step is thus checked on its own,
// with tolerances that follow from the arithmetic of that one step, instead of from errors
// compounded over a trajectory; the step-dependent parts (bias corrections, step 1, NAdam's
// momentum product, RAdam's rectification switch) are still exercised over >= 10 steps.
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "rv.hpp"

namespace fusedopt_test {

// ---- element conversions and data -----------------------------------------------------

template <class T>
double to_double(T x)
{
  return static_cast<double>(fusedopt::to_opmath<fusedopt::opmath_t<T>>(x));
}

template <class T>
T from_double(double x)
{
  return fusedopt::from_opmath<T>(static_cast<fusedopt::opmath_t<T>>(x));
}

/// Deterministic uniform numbers in [lo, hi), identical on every platform (the standard
/// distributions are not).
class random {
 public:
  explicit random(std::uint64_t seed) : state_(seed * 0x9e3779b97f4a7c15ull + 1) {}
  double uniform(double lo, double hi)
  {
    // splitmix64
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return lo + (hi - lo) * static_cast<double>(z >> 11) * 0x1p-53;
  }

 private:
  std::uint64_t state_;
};

/// Several tensors of different sizes, small enough for AddressSanitizer runs.
inline std::vector<std::int64_t> mixed_sizes() { return {1, 3, 16, 67, 250, 1031}; }

/// The tensors of one slot, one std::vector<T> each.
template <class T>
class slot_data {
 public:
  slot_data(std::vector<std::int64_t> const& sizes, double fill)
  {
    for (auto n : sizes) { tensors_.emplace_back(static_cast<std::size_t>(n), from_double<T>(fill)); }
  }
  /// Fills with uniform numbers in [lo, hi), rounded to T.
  void randomize(random& r, double lo, double hi)
  {
    for (auto& t : tensors_) {
      for (auto& x : t) { x = from_double<T>(r.uniform(lo, hi)); }
    }
  }
  fusedopt::tensor_list<T> list()
  {
    fusedopt::tensor_list<T> l;
    for (auto& t : tensors_) { l.push_back(t.data(), static_cast<std::int64_t>(t.size())); }
    return l;
  }
  fusedopt::tensor_list<T const> const_list() const
  {
    fusedopt::tensor_list<T const> l;
    for (auto const& t : tensors_) { l.push_back(t.data(), static_cast<std::int64_t>(t.size())); }
    return l;
  }
  /// The tensors themselves (what an executor binds, tests/rules/executor.hpp).
  [[nodiscard]] std::vector<std::vector<T>>& tensors() { return tensors_; }
  [[nodiscard]] std::size_t num_tensors() const { return tensors_.size(); }
  [[nodiscard]] std::size_t size(std::size_t t) const { return tensors_[t].size(); }
  [[nodiscard]] T raw(std::size_t t, std::size_t i) const { return tensors_[t][i]; }
  [[nodiscard]] double at(std::size_t t, std::size_t i) const { return to_double(tensors_[t][i]); }
  /// The current values, exactly, as reference inputs.
  [[nodiscard]] std::vector<std::vector<double>> snapshot() const
  {
    std::vector<std::vector<double>> s;
    for (auto const& t : tensors_) {
      s.emplace_back();
      for (auto x : t) { s.back().push_back(to_double(x)); }
    }
    return s;
  }

 private:
  std::vector<std::vector<T>> tensors_;
};

/// Calls f(tensor, index) for every element of `data` (a slot_data), tensor by tensor.
template <class Data, class F>
void for_each_element(Data const& data, F&& f)
{
  for (std::size_t k = 0; k < data.num_tensors(); ++k) {
    for (std::size_t i = 0; i < data.size(k); ++i) { f(k, i); }
  }
}

// ---- comparison -----------------------------------------------------------------------

/// Compares stored results with reference values, remembering the worst one; `report`
/// makes one Catch2 assertion per (step, slot) so that failures read well and passing runs
/// stay fast.
template <class T>
class checker {
 public:
  explicit checker(std::string context) : context_(std::move(context)) {}

  /// The tolerance for a reference value (see the top of this file).
  static double tolerance(rv want)
  {
    using p = precision<T>;
    return p::store * std::fabs(want.v) + (1 + p::store) * slack * p::op * want.e + p::floor;
  }

  void operator()(char const* slot, std::size_t tensor, std::size_t index, T got, rv want)
  {
    double const g = to_double(got);
    double const err = std::fabs(g - want.v);
    double const tol = tolerance(want);
    // NaN anywhere fails: !(err <= tol).
    double const ratio = err <= tol ? (tol > 0 ? err / tol : 0.0) : (err == err ? err / tol : 1e300);
    if (ratio > worst_ratio_ || !(err <= tol)) {
      worst_ratio_ = std::max(worst_ratio_, ratio);
      if (!(err <= tol) && failures_ == 0) {
        std::ostringstream s;
        s.precision(17);
        s << context_ << ": slot " << slot << " tensor " << tensor << " element " << index << ": got " << g
          << ", want " << want.v << " (error bound " << want.e << " u," << ", tolerance " << tol << ")";
        first_failure_ = s.str();
      }
    }
    if (!(err <= tol)) { ++failures_; }
    ++checked_;
  }

  /// Passes when `got` matches any of the candidates (checked against the first otherwise).
  void any(char const* slot, std::size_t tensor, std::size_t index, T got, std::vector<rv> const& candidates)
  {
    double const g = to_double(got);
    for (auto const& c : candidates) {
      if (std::fabs(g - c.v) <= tolerance(c)) {
        (*this)(slot, tensor, index, got, c);
        return;
      }
    }
    (*this)(slot, tensor, index, got, candidates.front());
  }

  /// One assertion for everything checked since the last report.
  void report()
  {
    INFO(first_failure_);
    INFO(context_ << ": " << failures_ << " of " << checked_ << " values out of tolerance; worst error/tolerance "
                  << worst_ratio_);
    CHECK(failures_ == 0);
    CHECK(checked_ > 0);
    if (std::getenv("FUSEDOPT_TEST_VERBOSE") != nullptr) { std::fprintf(stderr, "%s: worst %g\n", context_.c_str(), worst_ratio_); }
    failures_ = 0;
    checked_ = 0;
    first_failure_.clear();
  }

  [[nodiscard]] double worst_ratio() const { return worst_ratio_; }

 private:
  std::string context_;
  std::string first_failure_;
  std::size_t failures_ = 0;
  std::size_t checked_ = 0;
  double worst_ratio_ = 0;
};

/// Steps of the trajectories checked against the references: 12, and 6 under AddressSanitizer,
/// whose run is for memory errors and undefined behaviour (every slot is read and written from
/// the first step; 6 still reaches ASGD's averaging from step 5), at a quarter of the speed of
/// the unsanitised -O0 code: the rule tests took 11 of CI's minutes there (docs/decisions.md,
/// "CI: the CUDA units in float32, the sanitizers' trajectories shorter").
#if defined(__SANITIZE_ADDRESS__)
inline constexpr std::int64_t reference_steps = 6;
#else
inline constexpr std::int64_t reference_steps = 12;
#endif

/// "name<dtype> options": what a checker reports its failures in.
template <class T>
std::string context(char const* name, std::string const& options)
{
  return std::string(name) + "<" + fusedopt::dtype_name<T>() + "> " + options;
}

/// The hyperparameters of the Adam-family trajectories (Adam, AdamW, NAdam, RAdam): steps
/// large enough that every term of the update shows within 12 steps; a rule of type Rule
/// with them, and the options that vary between cases.
namespace adam_family {
inline constexpr double lr = 0.05, beta1 = 0.85, beta2 = 0.99, eps = 1e-3;

template <class Rule>
Rule rule(double weight_decay, bool maximize)
{
  Rule opt;
  opt.lr = lr;
  opt.beta1 = beta1;
  opt.beta2 = beta2;
  opt.eps = eps;
  opt.weight_decay = weight_decay;
  opt.maximize = maximize;
  return opt;
}
}  // namespace adam_family

}  // namespace fusedopt_test
