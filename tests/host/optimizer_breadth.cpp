// What the optimizers of issue 42 share beyond their rule tests (tests/rules/): the
// host/device-identical log, exp and pow of numeric/real_power.hpp against glibc, torch's lerp
// (numeric/torch_ops.hpp), and the bytes per element each rule moves (memory_traffic), which
// docs/rules.md and docs/optimizers.md quote.
#include <fusedopt/fusedopt.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

#include "catch.hpp"
#include "reference/harness.hpp"

namespace fo = fusedopt;
namespace math = fusedopt::math;

namespace {

/// |a - b| in units of the last place of b.
double ulps(double a, double b)
{
  if (a == b) { return 0; }
  double const spacing = std::nextafter(std::fabs(b), HUGE_VAL) - std::fabs(b);
  return std::fabs(a - b) / spacing;
}

}  // namespace

TEST_CASE("portable_log, portable_exp and portable_pow are within a few ulp of glibc", "[numeric][real_power]")
{
  fusedopt_test::random r(7);
  double worst_log = 0, worst_exp = 0, worst_pow = 0;
  for (int i = 0; i < 200000; ++i) {
    double const x = std::exp(r.uniform(-700, 700));
    worst_log = std::max(worst_log, ulps(math::portable_log(x), std::log(x)));
    double const y = r.uniform(-745, 709);
    worst_exp = std::max(worst_exp, ulps(math::portable_exp(y), std::exp(y)));
    double const base = std::exp(r.uniform(-5, 5));
    double const exponent = r.uniform(-5, 5);
    double const scaled = 1 + std::fabs(exponent * std::log(base));
    worst_pow = std::max(worst_pow, ulps(math::portable_pow(base, exponent), std::pow(base, exponent)) / scaled);
  }
  INFO("worst: log " << worst_log << " ulp, exp " << worst_exp << " ulp, pow " << worst_pow << " ulp per (1 + |y ln x|)");
  CHECK(worst_log <= 2);
  CHECK(worst_exp <= 2);
  CHECK(worst_pow <= 4);
}

TEST_CASE("portable_pow's special cases are C's", "[numeric][real_power]")
{
  double const tiny = std::numeric_limits<double>::denorm_min();
  CHECK(math::portable_pow(0.0, 0.0) == 1.0);
  CHECK(math::portable_pow(0.0, 2.5) == 0.0);
  CHECK(math::portable_pow(0.0, -0.5) == HUGE_VAL);
  CHECK(math::portable_pow(1.0, 1e300) == 1.0);
  CHECK(math::portable_pow(-2.0, 3.0) == -8.0);
  CHECK(std::isnan(math::portable_pow(-2.0, 0.5)));
  CHECK(std::isnan(math::portable_pow(std::nan(""), 2.0)));
  // Integral exponents by repeated squaring: x^2 is x * x rounded once, as C's pow.
  for (double x : {0.1, 0.3, 1.7, 2.5e-3, 123.456}) {
    CHECK(math::portable_pow(x, 2.0) == x * x);
    CHECK(math::portable_pow(x, -1.0) == 1.0 / x);
  }
  CHECK(math::portable_pow(2.0, 0.5) == std::sqrt(2.0));
  CHECK(math::portable_log(1.0) == 0.0);
  CHECK(math::portable_log(0.5) == -std::log(2.0));
  CHECK(math::portable_log(0.0) == -HUGE_VAL);
  CHECK(math::portable_log(HUGE_VAL) == HUGE_VAL);
  CHECK(std::isnan(math::portable_log(-1.0)));
  CHECK(math::portable_log(tiny) == std::log(tiny));
  CHECK(math::portable_exp(0.0) == 1.0);
  CHECK(math::portable_exp(710.0) == HUGE_VAL);
  CHECK(math::portable_exp(-746.0) == 0.0);
  CHECK(math::portable_exp(-745.0) == tiny);
  CHECK(std::isnan(math::portable_exp(std::nan(""))));
}

TEST_CASE("lerp switches formula at |weight| = 0.5 as torch's", "[numeric][lerp]")
{
  float const a = 0.3f, b = 1.7f;
  CHECK(math::lerp(a, b, 0.25f) == a + 0.25f * (b - a));
  CHECK(math::lerp(a, b, 0.75f) == b - (b - a) * (1.0f - 0.75f));
  CHECK(math::lerp(a, b, 1.0f) == b);
  CHECK(math::lerp(a, b, -0.25f) == a + -0.25f * (b - a));
  CHECK(math::lerp(a, b, -1.0f) == b - (b - a) * 2.0f);
}

namespace {
template <class... Slots>
using fp32_lists = decltype(fo::bind(fo::slot::param = fo::tensor_list<float>{},
                                     fo::slot::grad = fo::tensor_list<float const>{},
                                     (Slots{} = fo::tensor_list<float>{})...));
template <class Rule, class... Slots>
constexpr std::size_t fp32_bytes = fo::bytes_per_element_v<Rule, fp32_lists<Slots...>>;
namespace s = fo::slot;
namespace r = fo::rules;
}  // namespace

TEST_CASE("the new optimizers move the bytes docs/rules.md states (fp32)", "[optimizers][traffic]")
{
  STATIC_REQUIRE(fp32_bytes<r::rprop, s::prev_t, s::step_size_t> == 28);
  STATIC_REQUIRE(fp32_bytes<r::asgd, s::ax_t> == 20);
  STATIC_REQUIRE(fp32_bytes<r::schedule_free_adamw, s::z_t, s::exp_avg_sq_t> == 28);
  STATIC_REQUIRE(fp32_bytes<r::schedule_free_adamw, s::z_t, s::exp_avg_sq_t, s::exp_avg_t> == 36);
  STATIC_REQUIRE(fp32_bytes<r::schedule_free_sgd, s::z_t> == 20);
  STATIC_REQUIRE(fp32_bytes<r::schedule_free_eval, s::z_t> == 12);
  STATIC_REQUIRE(fp32_bytes<r::ademamix, s::exp_avg_t, s::exp_avg_slow_t, s::exp_avg_sq_t> == 36);
  STATIC_REQUIRE(fp32_bytes<r::ademamix, s::exp_avg_slow_t, s::exp_avg_sq_t> == 28);
  STATIC_REQUIRE(fp32_bytes<r::adan, s::exp_avg_t, s::exp_avg_diff_t, s::exp_avg_sq_t, s::neg_pre_grad_t> == 44);
  STATIC_REQUIRE(fp32_bytes<r::adopt, s::exp_avg_t, s::exp_avg_sq_t> == 28);
  // Reduction passes: StableAdamW's reads grad and exp_avg_sq (8), the cautious mask's what
  // AdamW's parts before it read (16), Prodigy's every slot its block reads (24).
  STATIC_REQUIRE(fp32_bytes<r::stable_adamw, s::exp_avg_t, s::exp_avg_sq_t> == 8 + 28);
  STATIC_REQUIRE(fp32_bytes<r::cautious<r::adamw>, s::exp_avg_t, s::exp_avg_sq_t> == 16 + 28);
  STATIC_REQUIRE(fp32_bytes<r::cautious_weight_decay<r::adamw>, s::exp_avg_t, s::exp_avg_sq_t> == 28);
  STATIC_REQUIRE(fp32_bytes<r::prodigy, s::p0_t, s::s_t, s::exp_avg_t, s::exp_avg_sq_t> == 24 + 40);
  STATIC_REQUIRE(fp32_bytes<r::prodigy, s::p0_t, s::s_t, s::exp_avg_sq_t> == 20 + 32);
  // Factored passes count their slot reads (not the tile partials and statistics, docs/rules.md):
  // Adafactor's reads grad (4), its reduction pass param and grad (8); CAME's first factored
  // pass grad, its reduction pass grad, its second factored pass grad and exp_avg and stores
  // exp_avg; its update reads param and exp_avg and stores param.
  STATIC_REQUIRE(fp32_bytes<r::adafactor> == 4 + 8 + 12);
  STATIC_REQUIRE(fp32_bytes<r::came, s::exp_avg_t> == 4 + 4 + 12 + 12);
}

TEST_CASE("the new optimizers are trivially copyable", "[optimizers]")
{
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::rprop>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::basic_rprop<fo::bfloat16>>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::asgd>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::schedule_free_adamw>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::schedule_free_sgd>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::ademamix>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::adan>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::adopt>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::stable_adamw>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::cautious<r::lion>>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::cautious_weight_decay<r::adamw>>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::prodigy>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::adafactor>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<r::basic_came<double>>);
}
