// Core vocabulary: binding validation, chain's derived declarations, the host backend.
#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bits.hpp"
#include "catch.hpp"
#include "prelude.hpp"


namespace {
struct scale_param {
  double factor = 2.0;
  using reads = fo::slots<fo::slot::param_t>;
  using writes = fo::slots<fo::slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    e[param] *= static_cast<typename E::value_type>(factor);
  }
};

// A body with a per-tensor hook that gives different values on purpose, so that a test sees
// which one ran: the element body writes -1, the per-tensor body 10 + tensor. (A real hook,
// such as LAMB's trust ratio, gives the bits of the element body.)
struct tagged_by_tensor {
  double offset = 0;  // added to the per-tensor tag (tells groups apart)
  using reads = fo::slots<fo::slot::param_t>;
  using writes = fo::slots<fo::slot::param_t>;
  struct per_tensor {
    double tag;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[param] = static_cast<typename E::value_type>(tag);
    }
  };
  struct prepared {
    double offset;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[param] = -1;
    }
    FUSEDOPT_HOST_DEVICE per_tensor for_tensor(std::int64_t tensor) const
    {
      return {offset + 10.0 + static_cast<double>(tensor)};
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(fo::step_info const&) const { return {offset}; }
};
}  // namespace

TEST_CASE("chain derives reads and writes from its parts", "[core]")
{
  using c = fo::chain_rule<fo::rules::add_weight_decay, fo::rules::apply_update>;
  STATIC_REQUIRE(fo::contains_v<c::reads, fo::slot::grad_t>);
  STATIC_REQUIRE(fo::contains_v<c::reads, fo::slot::param_t>);
  STATIC_REQUIRE(fo::contains_v<c::writes, fo::slot::param_t>);
  STATIC_REQUIRE_FALSE(fo::contains_v<c::writes, fo::slot::grad_t>);
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::rules::adamw>);
}

TEST_CASE("host backend runs a user rule over every element", "[core]")
{
  std::vector<float> a(100, 1.f), b(37, 3.f);
  fo::tensor_list<float> params;
  params.push_back(a.data(), 100);
  params.push_back(b.data(), 37);
  auto lists = fo::bind(param = params);
  fo::host::options opts;
  opts.chunk_elements = 16;
  fo::host::apply(scale_param{}, lists, {}, opts);
  for (float x : a) { REQUIRE(x == 2.f); }
  for (float x : b) { REQUIRE(x == 6.f); }
}

TEST_CASE("sgd matches the formula for one step", "[core]")
{
  std::vector<float> p{1.f, 2.f}, g{0.5f, -1.f};
  fo::tensor_list<float> pl{{p.data(), 2}};
  fo::tensor_list<float const> gl{{g.data(), 2}};
  fo::rules::sgd opt;
  opt.lr = 0.1;
  fo::host::apply(opt, fo::bind(param = pl, grad = gl));
  REQUIRE(p[0] == fusedopt_test::Approx(1.f - 0.05f));
  REQUIRE(p[1] == fusedopt_test::Approx(2.f + 0.1f));
}

TEST_CASE("binding rejects bad lists before touching memory", "[core][errors]")
{
  std::vector<float> p(10), g(10);
  fo::tensor_list<float> pl{{p.data(), 10}};
  SECTION("different lengths")
  {
    fo::tensor_list<float> gl{{g.data(), 5}, {g.data() + 5, 5}};
    REQUIRE_THROWS_AS(fo::bind(param = pl, grad = gl), fo::error);
  }
  SECTION("different sizes")
  {
    fo::tensor_list<float> gl{{g.data(), 9}};
    REQUIRE_THROWS_AS(fo::bind(param = pl, grad = gl), fo::error);
  }
  SECTION("null with a size")
  {
    fo::tensor_list<float> gl{{nullptr, 10}};
    REQUIRE_THROWS_AS(fo::bind(param = pl, grad = gl), fo::error);
  }
  SECTION("overlapping output")
  {
    fo::tensor_list<float> gl{{p.data() + 3, 10 - 3}};
    fo::tensor_list<float> pl2{{p.data(), 7}};
    REQUIRE_THROWS_AS(fo::bind(param = pl2, grad = gl), fo::error);
  }
  SECTION("read-only lists may share memory")
  {
    fo::tensor_list<float const> a{{g.data(), 10}};
    fo::tensor_list<float const> b{{g.data(), 10}};
    REQUIRE_NOTHROW(fo::bind(grad = a, fo::slot::exp_avg = b, param = pl));
  }
}

TEST_CASE("backends run a body's per-tensor form, through every wrapper", "[core]")
{
  std::vector<std::int64_t> const sizes{100, 37, 0, 5};
  std::vector<std::vector<float>> p, g;
  fo::tensor_list<float> params;
  fo::tensor_list<float const> grads;
  for (auto n : sizes) {
    p.emplace_back(static_cast<std::size_t>(n), 0.f);
    g.emplace_back(static_cast<std::size_t>(n), 1.f);
    params.push_back(p.back().data(), n);
    grads.push_back(g.back().data(), n);
  }
  auto const lists = fo::bind(param = params, grad = grads);
  fo::host::options opts;
  opts.chunk_elements = 16;  // several chunks per tensor
  auto const plan = fo::host::make_plan(lists, opts);
  auto const require_tagged = [&](char const* what, std::int32_t const* group = nullptr) {
    INFO(what);
    for (std::size_t t = 0; t < p.size(); ++t) {
      float const offset = group != nullptr ? 100.f * static_cast<float>(group[t]) : 0.f;
      for (float x : p[t]) { REQUIRE(x == offset + static_cast<float>(10 + t)); }
      std::fill(p[t].begin(), p[t].end(), 0.f);
    }
  };
  using tagged = tagged_by_tensor;
  STATIC_REQUIRE(fo::has_tensor_body_v<tagged::prepared>);
  STATIC_REQUIRE(fo::has_tensor_body_v<fo::body_t<tagged>>);
  STATIC_REQUIRE_FALSE(fo::has_tensor_body_v<fo::body_t<scale_param>>);

  plan.run(tagged{});
  require_tagged("the rule alone");
  plan.run(fo::chain(scale_param{1.0}, tagged{}, scale_param{1.0}));
  require_tagged("a chain");
  float found_inf = -1.f;
  plan.run(fo::rules::skip_if_nonfinite(fo::chain(tagged{}), &found_inf));
  require_tagged("skip_if_nonfinite's guarded parts");
  REQUIRE(found_inf == 0.f);
  std::int32_t const group_of[] = {1, 0, 1, 0};
  plan.run(fo::groups<tagged, 2>{{tagged{0}, tagged{100}}, group_of});
  require_tagged("groups", group_of);

  // A reduction pass runs the parts before it in their per-tensor form too: the norm of
  // tensor t is measured on values 10 + t.
  std::vector<double> norms(sizes.size(), -1.0);
  plan.run(fo::chain(tagged{}, fo::rules::norm_of<fo::slot::param_t>{fo::norm_kind::inf, norms.data(), nullptr}));
  for (std::size_t t = 0; t < sizes.size(); ++t) { CHECK(norms[t] == (sizes[t] > 0 ? 10.0 + static_cast<double>(t) : 0.0)); }
  require_tagged("a chain with a reduction pass");
}

namespace {
// The half conversions as first written, with a branch per case: the specification the
// branch-free host conversions in numeric/dtypes.hpp must meet bit for bit.
using fusedopt_test::bits_of;
using fusedopt_test::float_of;
std::uint16_t reference_float_to_half(float f)
{
  std::uint32_t x = bits_of(f);
  std::uint32_t const sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) { return 0x7fffu; }
  if (x >= 0x477ff000u) { return static_cast<std::uint16_t>(sign | 0x7c00u); }
  if (x < 0x38800000u) { return static_cast<std::uint16_t>(sign | (bits_of(float_of(x) + 0.5f) - 0x3f000000u)); }
  x += 0xc8000fffu + ((x >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (x >> 13));
}
float reference_half_to_float(std::uint16_t h)
{
  std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t const magnitude = h & 0x7fffu;
  if (magnitude >= 0x7c00u) { return float_of(sign | 0x7f800000u | ((magnitude & 0x3ffu) << 13)); }
  if (magnitude >= 0x0400u) { return float_of(sign | ((magnitude << 13) + 0x38000000u)); }
  return float_of(sign | bits_of(static_cast<float>(magnitude) * 5.9604644775390625e-8f));
}
}  // namespace

TEST_CASE("half conversions: every half, and floats around every boundary and across the range", "[dtypes]")
{
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    auto const value = static_cast<float>(fo::half::from_bits(static_cast<std::uint16_t>(h)));
    if (bits_of(value) != bits_of(reference_half_to_float(static_cast<std::uint16_t>(h)))) { FAIL("half " << h); }
  }
  std::uint64_t checked = 0;
  auto const check = [&](std::uint32_t u) {
    ++checked;
    if (fo::half(float_of(u)).bits != reference_float_to_half(float_of(u))) { FAIL("float bits " << u); }
  };
  // Every float near the cases' boundaries (subnormal, normal, overflow, inf and NaN), both signs.
  for (std::uint32_t boundary : {0u, 0x33000000u, 0x38800000u, 0x477ff000u, 0x7f800000u, 0x7fc00000u}) {
    for (std::uint32_t d = 0; d < (1u << 16); ++d) {
      for (std::uint32_t sign : {0u, 0x80000000u}) {
        check(sign | ((boundary + d) & 0x7fffffffu));
        check(sign | ((boundary - d) & 0x7fffffffu));
      }
    }
  }
  // A stride through all 2^32 patterns (odd, so every low-bit pattern is reached).
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 4099) { check(static_cast<std::uint32_t>(u)); }
  CHECK(checked > 1000000);
}
