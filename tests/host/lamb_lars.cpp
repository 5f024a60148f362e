// LAMB and LARS on the host backend against double-precision references written from the
// published algorithms as apex implements them (FusedLAMB's multi_tensor_lamb stages 1 and 2;
// LARC in front of torch.optim.SGD), for combinations of their options, over 12 steps of
// several tensors of different sizes (one of them all zeros, one of them empty), typed over
// float, double and bfloat16 parameters (with float gradients and states).
//
// Each step is checked from the state the backend left (the reference takes one step from a
// snapshot), so tolerances follow from one step's rounding, not from drift.
#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "prelude.hpp"


namespace {


constexpr std::int64_t steps = 12;
using dvec = std::vector<std::vector<double>>;

// Parameters of type P; gradients and states in S (float for bfloat16 parameters).
template <class P>
using state_t = std::conditional_t<std::is_same_v<P, fo::bfloat16>, float, P>;

template <class T>
double to_double(T x)
{
  return static_cast<double>(static_cast<float>(x));
}
template <>
double to_double<double>(double x)
{
  return x;
}

template <class T>
struct tensors {
  std::vector<std::vector<T>> data;
  explicit tensors(std::vector<std::int64_t> const& sizes)
  {
    for (auto n : sizes) { data.emplace_back(static_cast<std::size_t>(n), fo::from_opmath<T>(0.0f)); }
  }
  template <class U = T>
  fo::tensor_list<U> list()
  {
    fo::tensor_list<U> l;
    for (auto& t : data) { l.push_back(t.data(), static_cast<std::int64_t>(t.size())); }
    return l;
  }
  dvec snapshot() const
  {
    dvec out;
    for (auto const& t : data) {
      out.emplace_back();
      for (T x : t) { out.back().push_back(to_double(x)); }
    }
    return out;
  }
  void fill(std::mt19937& rng, double lo, double hi, std::size_t skip = SIZE_MAX)
  {
    std::uniform_real_distribution<double> u(lo, hi);
    for (std::size_t k = 0; k < data.size(); ++k) {
      for (auto& x : data[k]) { x = k == skip ? fo::from_opmath<T>(0.0) : fo::from_opmath<T>(u(rng)); }
    }
  }
};

// Tensor 2 starts with all-zero parameters (trust ratio 1 at step 1), tensor 3 is empty.
std::vector<std::int64_t> const sizes{257, 1, 64, 0, 1500, 33};
constexpr std::size_t zero_tensor = 2;

// Tolerance of one step: op * (|before| + |after| + operands) for the arithmetic (for these
// updates, sums of terms bounded by |before| + |after|, plus the operands of a cancellation
// that happens before, such as grad + weight_decay * param; the trust ratio comes from norms
// the backend sums in float), plus store * |after| for the rounding to the stored type
// (bfloat16: 2^-8 relative; float and double are in `op`).
struct tolerance {
  double op, store;
};
template <class T>
tolerance tolerance_of()
{
  if constexpr (std::is_same_v<T, double>) {
    return {1e-12, 0};
  } else if constexpr (std::is_same_v<T, float>) {
    return {1e-5, 0};
  } else {
    return {1e-5, 1.0 / 256};
  }
}

struct checker {
  std::string context;
  int failures = 0;
  void operator()(char const* slot, std::size_t k, std::size_t i, double got, double before, double want,
                  tolerance tol, double operands = 0)
  {
    double const bound =
      tol.op * (std::fabs(before) + std::fabs(want) + operands) + tol.store * std::fabs(want) + 1e-300;
    if (std::fabs(got - want) <= bound) { return; }
    if (++failures <= 5) {
      INFO(context << ": " << slot << "[" << k << "][" << i << "] = " << got << ", want " << want << " (before "
                   << before << ", tolerance " << bound << ")");
      CHECK(false);
    }
  }
  ~checker() { CHECK(failures == 0); }
};

// ---- LAMB reference (apex multi_tensor_lamb, in double) -------------------------------------

struct lamb_options {
  double lr = 0.02, beta1 = 0.9, beta2 = 0.999, eps = 1e-6, weight_decay = 0.01;
  bool bias_correction = true, grad_averaging = true, adam_w_mode = true, use_nvlamb = false;
  double max_trust_ratio = DBL_MAX;
  double max_grad_norm = 0;  // 0: no clipping chained in front
};

void lamb_reference(lamb_options const& o, std::int64_t step, dvec& p, dvec g, dvec& m, dvec& v)
{
  if (o.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_ over every gradient.
    double sum = 0;
    for (auto const& t : g) {
      for (double x : t) { sum += x * x; }
    }
    double const coefficient = std::min(1.0, o.max_grad_norm / (std::sqrt(sum) + 1e-6));
    for (auto& t : g) {
      for (double& x : t) { x *= coefficient; }
    }
  }
  double const beta3 = o.grad_averaging ? 1 - o.beta1 : 1.0;
  double const bc1 = o.bias_correction ? 1 - std::pow(o.beta1, static_cast<double>(step)) : 1.0;
  double const bc2 = o.bias_correction ? 1 - std::pow(o.beta2, static_cast<double>(step)) : 1.0;
  for (std::size_t k = 0; k < p.size(); ++k) {
    std::vector<double> u(p[k].size());
    double pn = 0, un = 0;
    for (std::size_t i = 0; i < p[k].size(); ++i) {
      double gi = g[k][i];
      if (!o.adam_w_mode) { gi += o.weight_decay * p[k][i]; }
      m[k][i] = m[k][i] * o.beta1 + beta3 * gi;
      v[k][i] = v[k][i] * o.beta2 + (1 - o.beta2) * gi * gi;
      u[i] = (m[k][i] / bc1) / (std::sqrt(v[k][i] / bc2) + o.eps);
      if (o.adam_w_mode) { u[i] += o.weight_decay * p[k][i]; }
      pn += p[k][i] * p[k][i];
      un += u[i] * u[i];
    }
    pn = std::sqrt(pn);
    un = std::sqrt(un);
    double ratio = 1.0;
    if ((o.use_nvlamb || o.weight_decay != 0) && pn != 0 && un != 0) { ratio = std::min(pn / un, o.max_trust_ratio); }
    for (std::size_t i = 0; i < p[k].size(); ++i) { p[k][i] -= o.lr * ratio * u[i]; }
  }
}

fo::rules::lamb make_lamb(lamb_options const& o)
{
  fo::rules::lamb r;
  r.lr = o.lr;
  r.beta1 = o.beta1;
  r.beta2 = o.beta2;
  r.eps = o.eps;
  r.weight_decay = o.weight_decay;
  r.bias_correction = o.bias_correction;
  r.grad_averaging = o.grad_averaging;
  r.adam_w_mode = o.adam_w_mode;
  r.use_nvlamb = o.use_nvlamb;
  r.max_trust_ratio = o.max_trust_ratio;
  return r;
}

template <class P, class Rule>
void check_lamb(lamb_options const& o, Rule const& rule, std::string const& name)
{
  using S = state_t<P>;
  std::mt19937 rng(7);
  tensors<P> p(sizes);
  tensors<S> g(sizes), m(sizes), v(sizes);
  p.fill(rng, -1, 1, zero_tensor);
  auto plan = fo::host::make_plan(
    fo::bind(param = p.list(), grad = g.template list<S const>(), exp_avg = m.list(), exp_avg_sq = v.list()));
  std::ostringstream context;
  context << name << "<" << fo::dtype_name<P>() << "> wd=" << o.weight_decay << " bias_correction=" << o.bias_correction
          << " grad_averaging=" << o.grad_averaging << " adam_w_mode=" << o.adam_w_mode
          << " use_nvlamb=" << o.use_nvlamb << " max_trust_ratio=" << o.max_trust_ratio
          << " max_grad_norm=" << o.max_grad_norm;
  checker check{context.str()};
  tolerance const ptol = tolerance_of<P>();
  tolerance const stol = tolerance_of<S>();
  for (std::int64_t t = 1; t <= steps; ++t) {
    g.fill(rng, -1, 1);
    dvec const p0 = p.snapshot(), m0 = m.snapshot(), v0 = v.snapshot();
    dvec rp = p0, rm = m0, rv = v0;
    plan.run(rule, fo::step_info{t});
    lamb_reference(o, t, rp, g.snapshot(), rm, rv);
    auto const gp = p.snapshot(), gm = m.snapshot(), gv = v.snapshot(), gg = g.snapshot();
    double const l2 = o.adam_w_mode ? 0.0 : o.weight_decay;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::size_t i = 0; i < rp[k].size(); ++i) {
        // grad + l2 * param may cancel: the moments' error follows its operands.
        double const operand = std::fabs(gg[k][i]) + l2 * std::fabs(p0[k][i]);
        check("param", k, i, gp[k][i], p0[k][i], rp[k][i], ptol);
        check("exp_avg", k, i, gm[k][i], m0[k][i], rm[k][i], stol, 2 * operand);
        check("exp_avg_sq", k, i, gv[k][i], v0[k][i], rv[k][i], stol, 4 * (1 - o.beta2) * operand * operand);
      }
    }
  }
}

// ---- LARS reference (LARC + torch.optim.SGD, in double) -------------------------------------

struct lars_options {
  double lr = 0.1, momentum = 0.9, dampening = 0, weight_decay = 0.05, trust_coefficient = 0.02, eps = 1e-8;
  bool nesterov = false, clip = false, exclude = false;
};

// Tensor 1 (one element: a "bias") and tensor 5 are excluded when o.exclude.
std::vector<std::uint8_t> const exclusions{0, 1, 0, 0, 0, 1};

void lars_reference(lars_options const& o, std::int64_t step, dvec& p, dvec g, dvec& buf)
{
  for (std::size_t k = 0; k < p.size(); ++k) {
    double pn = 0, gn = 0;
    for (std::size_t i = 0; i < p[k].size(); ++i) {
      pn += p[k][i] * p[k][i];
      gn += g[k][i] * g[k][i];
    }
    pn = std::sqrt(pn);
    gn = std::sqrt(gn);
    if (!(o.exclude && exclusions[k]) && pn != 0 && gn != 0) {
      double local = o.trust_coefficient * pn / (gn + pn * o.weight_decay + o.eps);
      if (o.clip) { local = std::min(local / o.lr, 1.0); }
      for (std::size_t i = 0; i < p[k].size(); ++i) { g[k][i] = (g[k][i] + o.weight_decay * p[k][i]) * local; }
    }
    for (std::size_t i = 0; i < p[k].size(); ++i) {
      double d = g[k][i];
      if (o.momentum != 0) {
        buf[k][i] = step == 1 ? g[k][i] : o.momentum * buf[k][i] + (1 - o.dampening) * g[k][i];
        d = o.nesterov ? g[k][i] + o.momentum * buf[k][i] : buf[k][i];
      }
      p[k][i] -= o.lr * d;
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("lamb matches apex FusedLAMB's algorithm step by step", "[lamb]", float, double, fo::bfloat16)
{
  using P = TestType;
  lamb_options o;
  o.weight_decay = GENERATE(0.0, 0.01);
  o.bias_correction = GENERATE(true, false);
  o.grad_averaging = GENERATE(true, false);
  o.adam_w_mode = GENERATE(true, false);
  o.use_nvlamb = GENERATE(false, true);
  o.max_trust_ratio = GENERATE(DBL_MAX, 0.5);
  check_lamb<P>(o, make_lamb(o), "lamb");
}

TEMPLATE_TEST_CASE("lamb with clip_by_global_norm in front (apex's max_grad_norm)", "[lamb]", float, double)
{
  using P = TestType;
  lamb_options o;
  o.use_nvlamb = true;
  o.max_grad_norm = GENERATE(1.0, 1e6);
  fo::rules::clip_by_global_norm clip;
  clip.max_norm = o.max_grad_norm;
  auto const rule = fo::chain(clip, make_lamb(o));
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(rule)>> == 2);
  check_lamb<P>(o, rule, "clip+lamb");
}

TEST_CASE("lamb moves at most 1.6x the bytes of adam", "[lamb]")
{
  using lists = decltype(fo::bind(param = fo::tensor_list<float>{}, grad = fo::tensor_list<float const>{},
                                  exp_avg = fo::tensor_list<float>{}, exp_avg_sq = fo::tensor_list<float>{}));
  STATIC_REQUIRE(fo::pass_count_v<fo::rules::lamb> == 1);
  // The reduction pass reads what its parts read: param, grad, exp_avg, exp_avg_sq.
  using pass_reads = fo::pass_reads_t<fo::rules::lamb, 0>;
  STATIC_REQUIRE(pass_reads::size == 4);
  std::size_t const lamb_bytes = fo::bytes_per_element_v<fo::rules::lamb, lists>;
  std::size_t const adam_bytes = fo::bytes_per_element_v<fo::rules::adam, lists>;
  REQUIRE(fo::memory_traffic<fo::rules::lamb, lists>::update_bytes == 7 * sizeof(float));
  REQUIRE(adam_bytes == 7 * sizeof(float));
  REQUIRE(lamb_bytes == 11 * sizeof(float));
  REQUIRE(static_cast<double>(lamb_bytes) <= 1.6 * static_cast<double>(adam_bytes));
}

TEST_CASE("lamb rejects bad options before writing anything", "[lamb][errors]")
{
  tensors<float> p(sizes), g(sizes), m(sizes), v(sizes);
  std::mt19937 rng(3);
  p.fill(rng, -1, 1);
  auto const before = p.data;
  auto plan = fo::host::make_plan(
    fo::bind(param = p.list(), grad = g.list<float const>(), exp_avg = m.list(), exp_avg_sq = v.list()));
  auto bad = [&](auto mutate) {
    fo::rules::lamb r;
    mutate(r);
    REQUIRE_THROWS_AS(plan.run(r), fo::error);
    REQUIRE(same(p.data, before));
  };
  bad([](fo::rules::lamb& r) { r.lr = -1.0; });
  bad([](fo::rules::lamb& r) { r.beta1 = 1.0; });
  bad([](fo::rules::lamb& r) { r.beta2 = -0.1; });
  bad([](fo::rules::lamb& r) { r.eps = -1e-6; });
  bad([](fo::rules::lamb& r) { r.weight_decay = -0.1; });
  bad([](fo::rules::lamb& r) {
    r.weight_decay = -0.1;
    r.adam_w_mode = false;
  });
  bad([](fo::rules::lamb& r) { r.max_trust_ratio = 0.0; });
}

TEMPLATE_TEST_CASE("lars matches LARC + torch.optim.SGD step by step", "[lars]", float, double, fo::bfloat16)
{
  using P = TestType;
  using S = state_t<P>;
  struct momentum_case {
    double momentum, dampening;
    bool nesterov;
  };
  lars_options o;
  auto const mc = GENERATE(momentum_case{0.0, 0.0, false}, momentum_case{0.9, 0.0, false},
                           momentum_case{0.8, 0.2, false}, momentum_case{0.9, 0.0, true});
  o.momentum = mc.momentum;
  o.dampening = mc.dampening;
  o.nesterov = mc.nesterov;
  o.weight_decay = GENERATE(0.0, 0.05);
  o.clip = GENERATE(false, true);
  o.exclude = GENERATE(false, true);

  fo::rules::lars rule;
  rule.lr = o.lr;
  rule.momentum = o.momentum;
  rule.dampening = o.dampening;
  rule.nesterov = o.nesterov;
  rule.weight_decay = o.weight_decay;
  rule.trust_coefficient = o.trust_coefficient;
  rule.eps = o.eps;
  rule.clip = o.clip;
  rule.exclude = o.exclude ? exclusions.data() : nullptr;

  std::mt19937 rng(11);
  tensors<P> p(sizes);
  tensors<S> g(sizes), buf(sizes);
  p.fill(rng, -1, 1, zero_tensor);
  buf.fill(rng, -100, 100);  // torch has no buffer before step 1: its content must not matter
  auto plan = fo::host::make_plan(fo::bind(param = p.list(), grad = g.template list<S const>(), momentum_buffer = buf.list()));
  std::ostringstream context;
  context << "lars<" << fo::dtype_name<P>() << "> momentum=" << o.momentum << " dampening=" << o.dampening
          << " nesterov=" << o.nesterov << " wd=" << o.weight_decay << " clip=" << o.clip << " exclude=" << o.exclude;
  checker check{context.str()};
  tolerance const ptol = tolerance_of<P>();
  tolerance const stol = tolerance_of<S>();
  for (std::int64_t t = 1; t <= steps; ++t) {
    g.fill(rng, -1, 1);
    // Tensor 4's gradients are small, so LARC's clip (local / lr > 1) is taken there.
    for (auto& x : g.data[4]) { x = fo::from_opmath<S>(1e-3 * to_double(x)); }
    dvec const p0 = p.snapshot(), b0 = buf.snapshot();
    dvec rp = p0, rb = b0;
    plan.run(rule, fo::step_info{t});
    lars_reference(o, t, rp, g.snapshot(), rb);
    auto const gp = p.snapshot(), gb = buf.snapshot();
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::size_t i = 0; i < rp[k].size(); ++i) {
        check("param", k, i, gp[k][i], p0[k][i], rp[k][i], ptol);
        // At step 1 the buffer's old content is garbage that torch does not have.
        if (o.momentum != 0) { check("momentum_buffer", k, i, gb[k][i], t == 1 ? 0.0 : b0[k][i], rb[k][i], stol); }
      }
    }
  }
}

TEST_CASE("lars rejects bad options before writing anything", "[lars][errors]")
{
  tensors<float> p(sizes), g(sizes), buf(sizes);
  std::mt19937 rng(3);
  p.fill(rng, -1, 1);
  auto const before = p.data;
  auto plan = fo::host::make_plan(fo::bind(param = p.list(), grad = g.list<float const>(), momentum_buffer = buf.list()));
  auto bad = [&](auto mutate) {
    fo::rules::lars r;
    mutate(r);
    REQUIRE_THROWS_AS(plan.run(r), fo::error);
    REQUIRE(same(p.data, before));
  };
  bad([](fo::rules::lars& r) { r.lr = -1.0; });
  bad([](fo::rules::lars& r) { r.weight_decay = -1.0; });
  bad([](fo::rules::lars& r) { r.trust_coefficient = 0.0; });
  bad([](fo::rules::lars& r) { r.eps = -1.0; });
  bad([](fo::rules::lars& r) { r.momentum = -0.5; });
  bad([](fo::rules::lars& r) {
    r.clip = true;
    r.lr = 0.0;
  });

  // momentum != 0 needs the buffer
  auto plain = fo::host::make_plan(fo::bind(param = p.list(), grad = g.list<float const>()));
  REQUIRE_THROWS_AS(plain.run(fo::rules::lars{}), fo::error);
  fo::rules::lars no_momentum;
  no_momentum.momentum = 0.0;
  REQUIRE_NOTHROW(plain.run(no_momentum));
}

// The per-tensor bodies the backends run (for_tensor) against the element bodies they replace:
// the same bits for every element, over norms that exercise each branch (a plain ratio, a zero
// norm on either side, a clamped ratio, NaN and infinite norms, an excluded tensor).
namespace {
template <class T>
bool same_bits(T a, T b)  // NaN results must match too
{
  return std::memcmp(&a, &b, sizeof a) == 0;
}
}  // namespace

TEMPLATE_TEST_CASE("trust-ratio bodies per tensor give the bits of the element bodies", "[lamb][lars]", float, double)
{
  using T = TestType;
  using e_type = fo::element<T, fo::slots<fo::slot::param_t, fo::slot::grad_t>, fo::slots<fo::slot::update_t>>;
  double const nan = std::nan("");
  double const inf = HUGE_VAL;
  // Per tensor: ||param||^2, then ||update||^2 (LAMB) or ||grad||^2 (LARS).
  std::vector<double> const norms{4, 9, 0, 1, 1, 0, 1e4, 1e-8, nan, 1, inf, 4, 2.5, 0.5};
  auto const tensors = static_cast<std::int64_t>(norms.size() / 2);
  fo::reduced const results{norms.data(), nullptr, 2, tensors};
  std::uint8_t const exclude[] = {0, 0, 0, 0, 0, 0, 1};

  std::mt19937_64 rng(99);
  std::uniform_real_distribution<double> value(-2, 2);
  auto const check = [&](auto const& body, char const* what) {
    for (std::int64_t t = 0; t < tensors; ++t) {
      auto const per_tensor = body.for_tensor(t);
      for (int i = 0; i < 64; ++i) {
        e_type a;
        a.set_position(t, i);
        a[param] = static_cast<T>(value(rng));
        a[grad] = static_cast<T>(value(rng));
        a[fo::slot::update] = static_cast<T>(value(rng));
        e_type b = a;
        body(a);
        per_tensor(b);
        INFO(what << ", tensor " << t << ", element " << i);
        REQUIRE(same_bits(a[param], b[param]));
        REQUIRE(same_bits(a[grad], b[grad]));
        REQUIRE(same_bits(a[fo::slot::update], b[fo::slot::update]));
      }
    }
  };
  for (bool nvlamb : {true, false}) {
    fo::rules::scale_by_trust_ratio ratio;
    ratio.max_trust_ratio = 10.0;
    ratio.always_adapt = nvlamb;
    check(ratio.prepare(fo::step_info{3}, results), nvlamb ? "LAMB, NVLAMB" : "LAMB, no decay");
  }
  for (bool clip : {false, true}) {
    fo::rules::scale_by_lars lars;
    lars.lr = 0.1;
    lars.weight_decay = 1e-2;
    lars.clip = clip;
    lars.exclude = exclude;
    check(lars.prepare(fo::step_info{3}, results), clip ? "LARS, clip" : "LARS");
  }
}
