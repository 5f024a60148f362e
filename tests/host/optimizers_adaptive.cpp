// Adagrad, RMSprop, Adadelta and Adamax on the host backend against the double-precision
// references of reference_adaptive.hpp, over every combination of their options, typed over the four
// element types; then their option checks.
#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "reference_adaptive.hpp"

namespace fo = fusedopt;
namespace ref = fusedopt_test::ref_a;

namespace {

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
constexpr int num_steps = 12;
// Different sizes in one list, an empty tensor included; the host plan cuts them into
// chunks of chunk_elements, so tensors span several chunks.
std::vector<std::int64_t> const tensor_sizes{17, 0, 1000, 1, 129};
constexpr std::int64_t chunk_elements = 64;

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

template <class T>
double to_double(T x)
{
  return fo::to_opmath<double>(x);
}
template <class T>
T round_to(double x)
{
  return fo::from_opmath<T>(static_cast<fo::opmath_t<T>>(x));
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
      stored.emplace_back(count, round_to<T>(initial));
      reference.emplace_back(count, to_double(round_to<T>(initial)));
      peak.emplace_back(count, std::abs(to_double(round_to<T>(initial))));
    }
  }

  /// Every element set to a value rounded to T, the reference to that rounded value.
  template <class Draw>
  void draw(Draw&& value)
  {
    for (std::size_t t = 0; t < stored.size(); ++t) {
      for (std::size_t i = 0; i < stored[t].size(); ++i) {
        stored[t][i] = round_to<T>(value());
        reference[t][i] = to_double(stored[t][i]);
        peak[t][i] = std::max(peak[t][i], std::abs(reference[t][i]));
      }
    }
  }

  fo::tensor_list<T> list()
  {
    fo::tensor_list<T> l;
    for (auto& v : stored) { l.push_back(v.data(), static_cast<std::int64_t>(v.size())); }
    return l;
  }
  fo::tensor_list<T const> const_list() const
  {
    fo::tensor_list<T const> l;
    for (auto const& v : stored) { l.push_back(v.data(), static_cast<std::int64_t>(v.size())); }
    return l;
  }
};

/// Runs `rule` for num_steps steps over fields {param, grad, states...} on the host backend and
/// the element-wise `reference(values, step)` (values = param, grad, states... in double) on
/// the same rounded inputs, then compares every written slot. `bind_fields(fields)` binds them.
template <class T, class Rule, class BindFields, class Reference>
void check_trajectory(std::string const& label, Rule const& rule, std::vector<field<T>>& fields,
                      BindFields bind_fields, Reference reference, std::uint64_t seed)
{
  random_source random(seed);
  field<T>& param = fields[0];
  field<T>& grad = fields[1];
  param.draw([&] { return random.uniform(-1, 1); });

  fo::host::options opts;
  opts.chunk_elements = chunk_elements;
  auto const plan = fo::host::make_plan(bind_fields(fields), opts);

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

std::string describe(std::initializer_list<std::pair<char const*, double>> options)
{
  std::ostringstream s;
  for (auto const& [name, value] : options) { s << name << '=' << value << ' '; }
  return s.str();
}

}  // namespace

// ---- trajectories ---------------------------------------------------------------------------

TEMPLATE_TEST_CASE("adagrad matches torch.optim.Adagrad", "[optimizers][adagrad]", float, double, fo::half,
                   fo::bfloat16)
{
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
          fo::rules::fill_initial_accumulator(fields[2].list(), initial_accumulator_value);
          CHECK(to_double(fields[2].stored[0][0]) == to_double(round_to<T>(initial_accumulator_value)));

          check_trajectory<T>(
            "adagrad " + describe({{"maximize", maximize}, {"weight_decay", weight_decay}, {"lr_decay", lr_decay},
                                   {"initial_accumulator_value", initial_accumulator_value}}),
            rule, fields,
            [](std::vector<field<T>>& f) {
              return fo::bind(fo::slot::param = f[0].list(), fo::slot::grad = f[1].const_list(),
                              fo::slot::sum_sq = f[2].list());
            },
            [&o](double* v, std::int64_t step) { ref::adagrad_step(v[0], v[1], v[2], step, o); }, seed++);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("rmsprop matches torch.optim.RMSprop", "[optimizers][rmsprop]", float, double, fo::half,
                   fo::bfloat16)
{
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
            [](std::vector<field<T>>& f) {
              return fo::bind(fo::slot::param = f[0].list(), fo::slot::grad = f[1].const_list(),
                              fo::slot::square_avg = f[2].list(), fo::slot::grad_avg = f[3].list(),
                              fo::slot::momentum_buffer = f[4].list());
            },
            [&o](double* v, std::int64_t) { ref::rmsprop_step(v[0], v[1], v[2], v[3], v[4], o); }, seed++);
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("adadelta matches torch.optim.Adadelta", "[optimizers][adadelta]", float, double, fo::half,
                   fo::bfloat16)
{
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
          [](std::vector<field<T>>& f) {
            return fo::bind(fo::slot::param = f[0].list(), fo::slot::grad = f[1].const_list(),
                            fo::slot::square_avg = f[2].list(), fo::slot::acc_delta = f[3].list());
          },
          [&o](double* v, std::int64_t) { ref::adadelta_step(v[0], v[1], v[2], v[3], o); }, seed++);
      }
    }
  }
}

TEMPLATE_TEST_CASE("adamax matches torch.optim.Adamax", "[optimizers][adamax]", float, double, fo::half,
                   fo::bfloat16)
{
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
          [](std::vector<field<T>>& f) {
            return fo::bind(fo::slot::param = f[0].list(), fo::slot::grad = f[1].const_list(),
                            fo::slot::exp_avg = f[2].list(), fo::slot::exp_inf = f[3].list());
          },
          [&o](double* v, std::int64_t step) { ref::adamax_step(v[0], v[1], v[2], v[3], step, o); }, seed++);
      }
    }
  }
}

// ---- structure ------------------------------------------------------------------------------

TEST_CASE("rmsprop runs without the optional states and gives the same bits", "[optimizers][rmsprop]")
{
  std::vector<float> p1(300), p2(300), g(300), sq1(300, 0.f), sq2(300, 0.f), ga(300, 0.f), buf(300, 0.f);
  random_source random(7);
  for (std::size_t i = 0; i < p1.size(); ++i) {
    p1[i] = p2[i] = static_cast<float>(random.uniform(-1, 1));
  }
  fo::tensor_list<float> pl1{{p1.data(), 300}}, pl2{{p2.data(), 300}}, sql1{{sq1.data(), 300}},
    sql2{{sq2.data(), 300}}, gal{{ga.data(), 300}}, bufl{{buf.data(), 300}};
  fo::tensor_list<float const> gl{{g.data(), 300}};
  auto const full = fo::host::make_plan(fo::bind(fo::slot::param = pl1, fo::slot::grad = gl,
                                                 fo::slot::square_avg = sql1, fo::slot::grad_avg = gal,
                                                 fo::slot::momentum_buffer = bufl));
  auto const minimal = fo::host::make_plan(fo::bind(fo::slot::param = pl2, fo::slot::grad = gl,
                                                    fo::slot::square_avg = sql2));
  fo::rules::rmsprop rule;
  rule.weight_decay = 1e-2;
  for (std::int64_t step = 1; step <= 5; ++step) {
    for (float& x : g) { x = static_cast<float>(random.uniform(-1, 1)); }
    fo::step_info info;
    info.step = step;
    full.run(rule, info);
    minimal.run(rule, info);
  }
  CHECK(p1 == p2);
  CHECK(sq1 == sq2);
  CHECK(std::all_of(ga.begin(), ga.end(), [](float x) { return x == 0.f; }));
  CHECK(std::all_of(buf.begin(), buf.end(), [](float x) { return x == 0.f; }));
}

TEST_CASE("hyperparameters read from memory give the same bits as values", "[optimizers]")
{
  std::vector<float> p1{0.5f, -0.25f, 1.f}, p2 = p1, s1(3, 0.f), s2(3, 0.f), m1(3, 0.f), m2(3, 0.f);
  std::vector<float> const g{0.3f, -0.7f, 0.2f};
  fo::tensor_list<float const> gl{{g.data(), 3}};
  fo::tensor_list<float> pl1{{p1.data(), 3}}, pl2{{p2.data(), 3}}, sl1{{s1.data(), 3}}, sl2{{s2.data(), 3}},
    ml1{{m1.data(), 3}}, ml2{{m2.data(), 3}};
  double const lr = 0.05, momentum = 0.8;
  fo::rules::rmsprop by_value;
  by_value.lr = lr;
  by_value.momentum = momentum;
  fo::rules::rmsprop by_pointer;
  by_pointer.lr = fo::scalar<double>::from_pointer(&lr);
  by_pointer.momentum = fo::scalar<double>::from_pointer(&momentum);
  auto const a = fo::host::make_plan(
    fo::bind(fo::slot::param = pl1, fo::slot::grad = gl, fo::slot::square_avg = sl1, fo::slot::momentum_buffer = ml1));
  auto const b = fo::host::make_plan(
    fo::bind(fo::slot::param = pl2, fo::slot::grad = gl, fo::slot::square_avg = sl2, fo::slot::momentum_buffer = ml2));
  for (std::int64_t step = 1; step <= 3; ++step) {
    fo::step_info info;
    info.step = step;
    a.run(by_value, info);
    b.run(by_pointer, info);
  }
  CHECK(p1 == p2);
  CHECK(m1 == m2);
  CHECK(p1 != std::vector<float>{0.5f, -0.25f, 1.f});
}

// ---- option checks --------------------------------------------------------------------------

namespace {
/// Runs `rule` once over a small float problem with `states` bound; returns whether it threw
/// fusedopt::error, and checks that nothing was written when it did.
struct small_problem {
  std::vector<float> p{0.5f, -0.5f}, g{0.25f, 0.75f}, a{0.f, 0.f}, b{0.f, 0.f}, c{0.f, 0.f};
  fo::tensor_list<float> pl{{p.data(), 2}}, al{{a.data(), 2}}, bl{{b.data(), 2}}, cl{{c.data(), 2}};
  fo::tensor_list<float const> gl{{g.data(), 2}};

  bool untouched() const
  {
    return p == std::vector<float>{0.5f, -0.5f} && a == std::vector<float>{0.f, 0.f} &&
           b == std::vector<float>{0.f, 0.f} && c == std::vector<float>{0.f, 0.f};
  }
};
}  // namespace

TEST_CASE("adagrad rejects bad options as torch does", "[optimizers][adagrad][errors]")
{
  small_problem s;
  auto const lists = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::sum_sq = s.al);
  fo::rules::adagrad rule;
  REQUIRE_NOTHROW(fo::host::make_plan(lists).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = {0.f, 0.f};
  SECTION("negative lr") { rule.lr = -1e-2; }
  SECTION("negative lr_decay") { rule.lr_decay = -0.1; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  SECTION("negative eps") { rule.eps = -1e-10; }
  REQUIRE_THROWS_AS(fo::host::make_plan(lists).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("fill_initial_accumulator rejects a negative value", "[optimizers][adagrad][errors]")
{
  small_problem s;
  REQUIRE_THROWS_AS(fo::rules::fill_initial_accumulator(s.al, -0.1), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("rmsprop rejects bad options and missing states", "[optimizers][rmsprop][errors]")
{
  small_problem s;
  auto const minimal = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::square_avg = s.al);
  fo::rules::rmsprop rule;
  REQUIRE_NOTHROW(fo::host::make_plan(minimal).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = {0.f, 0.f};
  SECTION("centered without grad_avg") { rule.centered = true; }
  SECTION("momentum without momentum_buffer") { rule.momentum = 0.9; }
  SECTION("momentum from memory without momentum_buffer")
  {
    static double const momentum = 0.0;
    rule.momentum = fo::scalar<double>::from_pointer(&momentum);
  }
  SECTION("negative lr") { rule.lr = -1e-2; }
  SECTION("negative alpha") { rule.alpha = -0.5; }
  SECTION("negative eps") { rule.eps = -1e-8; }
  SECTION("negative momentum") { rule.momentum = -0.9; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  REQUIRE_THROWS_AS(fo::host::make_plan(minimal).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("rmsprop accepts its options when the states are bound", "[optimizers][rmsprop]")
{
  small_problem s;
  auto const full = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::square_avg = s.al,
                             fo::slot::grad_avg = s.bl, fo::slot::momentum_buffer = s.cl);
  fo::rules::rmsprop rule;
  rule.centered = true;
  rule.momentum = 0.9;
  REQUIRE_NOTHROW(fo::host::make_plan(full).run(rule));
  CHECK_FALSE(s.untouched());
}

TEST_CASE("adadelta rejects bad options as torch does", "[optimizers][adadelta][errors]")
{
  small_problem s;
  auto const lists = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::square_avg = s.al,
                              fo::slot::acc_delta = s.bl);
  fo::rules::adadelta rule;
  rule.rho = 1.0;  // allowed by torch (0 <= rho <= 1)
  REQUIRE_NOTHROW(fo::host::make_plan(lists).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = s.b = {0.f, 0.f};
  SECTION("negative lr") { rule.lr = -1.0; }
  SECTION("rho below 0") { rule.rho = -0.1; }
  SECTION("rho above 1") { rule.rho = 1.5; }
  SECTION("negative eps") { rule.eps = -1e-6; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  REQUIRE_THROWS_AS(fo::host::make_plan(lists).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("adamax rejects bad options as torch does", "[optimizers][adamax][errors]")
{
  small_problem s;
  auto const lists = fo::bind(fo::slot::param = s.pl, fo::slot::grad = s.gl, fo::slot::exp_avg = s.al,
                              fo::slot::exp_inf = s.bl);
  fo::rules::adamax rule;
  REQUIRE_NOTHROW(fo::host::make_plan(lists).run(rule));
  s.p = {0.5f, -0.5f};
  s.a = s.b = {0.f, 0.f};
  SECTION("negative lr") { rule.lr = -2e-3; }
  SECTION("beta1 of 1") { rule.beta1 = 1.0; }
  SECTION("negative beta1") { rule.beta1 = -0.1; }
  SECTION("beta2 of 1") { rule.beta2 = 1.0; }
  SECTION("negative beta2") { rule.beta2 = -0.1; }
  SECTION("negative eps") { rule.eps = -1e-8; }
  SECTION("negative weight_decay") { rule.weight_decay = -0.1; }
  REQUIRE_THROWS_AS(fo::host::make_plan(lists).run(rule), fo::error);
  CHECK(s.untouched());
}

TEST_CASE("the named optimizers are trivially copyable chains", "[optimizers]")
{
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::adagrad>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::rmsprop>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::adadelta>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::adamax>);
  // Only the states are stored; the gradient is read, never written.
  STATIC_REQUIRE_FALSE(fo::contains_v<fo::rules::rmsprop::writes, fo::slot::grad_t>);
  STATIC_REQUIRE(fo::contains_v<fo::rules::rmsprop::writes, fo::slot::grad_avg_t>);
  STATIC_REQUIRE(fo::contains_v<fo::rules::adamax::reads, fo::slot::exp_inf_t>);
}
