// Parameter groups (fusedopt::groups) and AMP blocks (rules/amp.hpp) on the host backend:
// - two groups with different lr / weight decay in one run give the same bits as two separate
//   runs, for a rule without passes (AdamW) and with one (LAMB, LARS with exclusion);
// - a step with one infinite or NaN gradient among thousands of tensors leaves every param and
//   state bit for bit unchanged and sets found_inf; with finite gradients the AMP step equals
//   unscaling then the optimizer, bit for bit; GradScaler's growth and backoff follow torch.
#include <fusedopt/fusedopt.hpp>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "bits.hpp"
#include "prelude.hpp"


namespace {


template <class T>
struct tensors {
  std::vector<std::vector<T>> data;
  explicit tensors(std::vector<std::int64_t> const& sizes)
  {
    for (auto n : sizes) { data.emplace_back(static_cast<std::size_t>(n), fo::from_opmath<T>(0.0f)); }
  }
  void fill(std::mt19937& rng, double lo, double hi)
  {
    std::uniform_real_distribution<double> u(lo, hi);
    for (auto& t : data) {
      for (auto& x : t) { x = fo::from_opmath<T>(u(rng)); }
    }
  }
  // All tensors, or those whose index is in [begin, end) with the given stride.
  template <class U = T>
  fo::tensor_list<U> list(std::size_t first = 0, std::size_t stride = 1)
  {
    fo::tensor_list<U> l;
    for (std::size_t k = first; k < data.size(); k += stride) {
      l.push_back(data[k].data(), static_cast<std::int64_t>(data[k].size()));
    }
    return l;
  }
  std::vector<unsigned char> bytes() const
  {
    std::vector<unsigned char> out;
    for (auto const& t : data) {
      auto const* b = reinterpret_cast<unsigned char const*>(t.data());
      out.insert(out.end(), b, b + t.size() * sizeof(T));
    }
    return out;
  }
};

std::vector<std::int64_t> sizes_of(std::size_t count, std::uint32_t seed, std::int64_t largest)
{
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int64_t> size(0, largest);
  std::vector<std::int64_t> sizes(count);
  for (auto& n : sizes) { n = size(rng); }
  return sizes;
}

// ---- groups -------------------------------------------------------------------------------

// Parameters in P, gradients and states in float (or double for double parameters).
template <class P>
using state_t = std::conditional_t<std::is_same_v<P, double>, double, float>;

// Runs `grouped` over all tensors (group = tensor index % 2) and `separate[g]` over the tensors
// of group g alone, from the same data, and requires the same bits.
template <class P, bool WithMoments, class Grouped, class Separate>
void check_groups_equal_separate_runs(Grouped const& grouped, Separate const& separate0, Separate const& separate1)
{
  using S = state_t<P>;
  auto const sizes = sizes_of(41, 5, 3000);  // the groups alternate: group = tensor index % 2

  std::mt19937 rng(9);
  tensors<P> p1(sizes);
  tensors<S> g(sizes), m1(sizes), v1(sizes);
  p1.fill(rng, -1, 1);
  tensors<P> p2 = p1;
  tensors<S> m2 = m1, v2 = v1;

  auto run_all = [&](std::int64_t t) {
    if constexpr (WithMoments) {
      fo::host::make_plan(fo::bind(param = p1.list(), grad = g.template list<S const>(), exp_avg = m1.list(),
                                   exp_avg_sq = v1.list()))
        .run(grouped, fo::step_info{t});
      for (std::size_t gr = 0; gr < 2; ++gr) {
        fo::host::make_plan(fo::bind(param = p2.list(gr, 2), grad = g.template list<S const>(gr, 2),
                                     exp_avg = m2.list(gr, 2), exp_avg_sq = v2.list(gr, 2)))
          .run(gr == 0 ? separate0 : separate1, fo::step_info{t});
      }
    } else {
      fo::host::make_plan(fo::bind(param = p1.list(), grad = g.template list<S const>(), momentum_buffer = m1.list()))
        .run(grouped, fo::step_info{t});
      for (std::size_t gr = 0; gr < 2; ++gr) {
        fo::host::make_plan(fo::bind(param = p2.list(gr, 2), grad = g.template list<S const>(gr, 2),
                                     momentum_buffer = m2.list(gr, 2)))
          .run(gr == 0 ? separate0 : separate1, fo::step_info{t});
      }
    }
  };
  for (std::int64_t t = 1; t <= 5; ++t) {
    g.fill(rng, -1, 1);
    run_all(t);
    REQUIRE(same(p1.bytes(), p2.bytes()));
    REQUIRE(same(m1.bytes(), m2.bytes()));
    REQUIRE(same(v1.bytes(), v2.bytes()));
  }
}

std::vector<std::int32_t> alternating_groups(std::size_t n)
{
  std::vector<std::int32_t> group_of(n);
  for (std::size_t k = 0; k < n; ++k) { group_of[k] = static_cast<std::int32_t>(k % 2); }
  return group_of;
}

}  // namespace

TEMPLATE_TEST_CASE("adamw in two groups equals two separate runs bit for bit", "[groups]", float, double,
                   fo::bfloat16)
{
  fo::rules::adamw decay, no_decay;
  decay.lr = 1e-2;
  decay.weight_decay = 0.1;
  no_decay.lr = 3e-2;
  no_decay.weight_decay = 0.0;
  no_decay.amsgrad = false;
  auto const group_of = alternating_groups(41);
  fo::groups<fo::rules::adamw, 2> const grouped{{decay, no_decay}, group_of.data()};
  STATIC_REQUIRE(std::is_trivially_copyable_v<fo::groups<fo::rules::adamw, 2>>);
  STATIC_REQUIRE(std::is_same_v<decltype(fo::groups{{decay, no_decay}, group_of.data()}), fo::groups<fo::rules::adamw, 2>>);
  STATIC_REQUIRE(fo::pass_count_v<fo::groups<fo::rules::adamw, 2>> == 0);
  check_groups_equal_separate_runs<TestType, true>(grouped, decay, no_decay);
}

TEMPLATE_TEST_CASE("lamb (a reducing rule) in two groups equals two separate runs bit for bit", "[groups]", float,
                   double)
{
  fo::rules::lamb decay, no_decay;
  decay.lr = 1e-2;
  decay.weight_decay = 0.01;
  no_decay.lr = 2e-2;
  no_decay.weight_decay = 0.0;
  no_decay.use_nvlamb = true;
  auto const group_of = alternating_groups(41);
  fo::groups<fo::rules::lamb, 2> const grouped{{decay, no_decay}, group_of.data()};
  STATIC_REQUIRE(fo::pass_count_v<fo::groups<fo::rules::lamb, 2>> == 1);
  check_groups_equal_separate_runs<TestType, true>(grouped, decay, no_decay);
}

TEST_CASE("lars with per-tensor exclusion in two groups equals two separate runs bit for bit", "[groups]")
{
  // Exclusion flags index the lists they are run over: the whole list for the grouped run,
  // each group's own list for the separate runs. Every third tensor is excluded.
  std::vector<std::uint8_t> all(41), even, odd;
  for (std::size_t k = 0; k < all.size(); ++k) {
    all[k] = k % 3 == 0;
    (k % 2 == 0 ? even : odd).push_back(all[k]);
  }
  fo::rules::lars a, b, a_alone, b_alone;
  a.lr = 0.1;
  a.weight_decay = 1e-3;
  a.trust_coefficient = 0.02;
  b.lr = 0.05;
  b.weight_decay = 0.0;
  b.nesterov = true;
  a.exclude = b.exclude = all.data();
  a_alone = a;
  b_alone = b;
  a_alone.exclude = even.data();
  b_alone.exclude = odd.data();
  auto const group_of = alternating_groups(41);
  fo::groups<fo::rules::lars, 2> const grouped{{a, b}, group_of.data()};
  check_groups_equal_separate_runs<float, false>(grouped, a_alone, b_alone);
}

TEST_CASE("groups: identical groups inside a chain with clipping equal the plain rule", "[groups]")
{
  auto const sizes = sizes_of(30, 2, 2000);
  std::mt19937 rng(4);
  tensors<float> p1(sizes), g(sizes), m1(sizes), v1(sizes);
  p1.fill(rng, -1, 1);
  g.fill(rng, -1, 1);
  auto p2 = p1;
  auto m2 = m1, v2 = v1;
  fo::rules::lamb l;
  l.use_nvlamb = true;
  fo::rules::clip_by_global_norm clip;
  clip.max_norm = 0.5;
  std::vector<std::int32_t> group_of(sizes.size(), 1);
  group_of[3] = 0;
  auto const grouped = fo::chain(clip, fo::groups<fo::rules::lamb, 3>{{l, l, l}, group_of.data()});
  auto const plain = fo::chain(clip, l);
  for (std::int64_t t = 1; t <= 3; ++t) {
    fo::host::make_plan(fo::bind(param = p1.list(), grad = g.list<float const>(), exp_avg = m1.list(),
                                 exp_avg_sq = v1.list()))
      .run(grouped, fo::step_info{t});
    fo::host::make_plan(fo::bind(param = p2.list(), grad = g.list<float const>(), exp_avg = m2.list(),
                                 exp_avg_sq = v2.list()))
      .run(plain, fo::step_info{t});
    REQUIRE(same(p1.bytes(), p2.bytes()));
    REQUIRE(same(m1.bytes(), m2.bytes()));
  }
}

TEST_CASE("groups: a tensor with a group outside [0, G) is left unchanged", "[groups]")
{
  auto const sizes = sizes_of(6, 3, 500);
  std::mt19937 rng(1);
  tensors<float> p(sizes), g(sizes), m(sizes), v(sizes);
  p.fill(rng, -1, 1);
  g.fill(rng, -1, 1);
  std::vector<std::int32_t> group_of{0, 1, 2, -1, 1, 0};
  auto const before = p.data;
  fo::rules::adamw a;
  fo::host::make_plan(fo::bind(param = p.list(), grad = g.list<float const>(), exp_avg = m.list(), exp_avg_sq = v.list()))
    .run(fo::groups<fo::rules::adamw, 2>{{a, a}, group_of.data()});
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    bool const outside = group_of[k] < 0 || group_of[k] >= 2;
    if (sizes[k] > 0) { REQUIRE((p.data[k] == before[k]) == outside); }
  }
}

TEST_CASE("groups: bad options are rejected naming the group, before any write", "[groups][errors]")
{
  auto const sizes = sizes_of(4, 3, 100);
  std::mt19937 rng(1);
  tensors<float> p(sizes), g(sizes), m(sizes), v(sizes);
  p.fill(rng, -1, 1);
  auto const before = p.data;
  auto plan =
    fo::host::make_plan(fo::bind(param = p.list(), grad = g.list<float const>(), exp_avg = m.list(), exp_avg_sq = v.list()));
  std::vector<std::int32_t> group_of{0, 1, 0, 1};
  fo::rules::adamw good, bad;
  bad.beta1 = 1.5;
  try {
    plan.run(fo::groups<fo::rules::adamw, 2>{{good, bad}, group_of.data()});
    FAIL("no error");
  } catch (fo::error const& e) {
    std::string const what = e.what();
    INFO(what);
    REQUIRE(what.find("group 1") != std::string::npos);
    REQUIRE(what.find("beta1") != std::string::npos);
  }
  REQUIRE_THROWS_AS(plan.run(fo::groups<fo::rules::adamw, 2>{{good, good}, nullptr}), fo::error);
  REQUIRE(same(p.data, before));
}

// ---- AMP ----------------------------------------------------------------------------------

namespace {

// torch.amp.GradScaler's update, written from torch's _amp_update_scale_ (CPU kernel).
struct scaler_reference {
  float scale;
  std::int32_t tracker = 0;
  double growth = 2.0, backoff = 0.5;
  std::int32_t interval = 2000;
  void update(bool found_inf)
  {
    if (found_inf) {
      scale = static_cast<float>(static_cast<double>(scale) * backoff);
      tracker = 0;
      return;
    }
    if (tracker + 1 == interval) {
      float const grown = static_cast<float>(static_cast<double>(scale) * growth);
      if (std::isfinite(grown)) { scale = grown; }
      tracker = 0;
    } else {
      ++tracker;
    }
  }
  double inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(scale)); }
};

// Thousands of tensors of 0..40 elements: params P, grads G, states S; adamw with amsgrad.
template <class P, class G, class S>
struct amp_model {
  std::vector<std::int64_t> sizes = sizes_of(3000, 17, 40);
  tensors<P> p{sizes};
  tensors<G> g{sizes};
  tensors<S> m{sizes}, v{sizes}, vmax{sizes};
  std::mt19937 rng{23};

  amp_model()
  {
    p.fill(rng, -1, 1);
    m.fill(rng, -0.1, 0.1);
    v.fill(rng, 0, 0.01);
    vmax.fill(rng, 0.01, 0.02);
  }
  auto lists()
  {
    return fo::bind(param = p.list(), grad = g.template list<G const>(), exp_avg = m.list(), exp_avg_sq = v.list(),
                    max_exp_avg_sq = vmax.list());
  }
  std::vector<unsigned char> memory() const
  {
    auto out = p.bytes();
    for (auto const* t : {&m, &v, &vmax}) {
      auto const b = t->bytes();
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
};

fo::rules::adamw amsgrad_adamw()
{
  fo::rules::adamw a;
  a.lr = 1e-2;
  a.amsgrad = true;
  return a;
}

}  // namespace

TEMPLATE_TEST_CASE("a non-finite gradient skips the step: every param and state bitwise unchanged", "[amp]", float,
                   double, fo::half, fo::bfloat16)
{
  using P = TestType;
  using S = std::conditional_t<std::is_same_v<P, double>, double, std::conditional_t<std::is_same_v<P, fo::half>, fo::half, float>>;
  double const bad = GENERATE(std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                              std::numeric_limits<double>::quiet_NaN());
  bool const int_flag = GENERATE(false, true);

  amp_model<P, P, S> model;
  model.g.fill(model.rng, -1000, 1000);
  // one element of one tensor among thousands
  std::size_t victim = 1234;
  while (model.g.data[victim].empty()) { ++victim; }
  model.g.data[victim][model.g.data[victim].size() / 2] = fo::from_opmath<P>(bad);

  float scale = 1024.f;
  std::int32_t tracker = 7;
  float found_f = -1.f;
  std::int32_t found_i = -1;
  fo::flag_pointer const found = int_flag ? fo::flag_pointer(&found_i) : fo::flag_pointer(&found_f);
  double inv_scale = 1.0 / 1024;
  std::int64_t step = 4;
  fo::step_info info;
  info.step = fo::scalar<std::int64_t>::from_pointer(&step);
  info.advance = &step;

  auto const amp_step = fo::chain(fo::rules::unscale_gradients{fo::scalar<double>::from_pointer(&inv_scale)},
                                  fo::rules::skip_if_nonfinite(amsgrad_adamw(), found),
                                  fo::rules::grad_scaler_update{&scale, &tracker, found, 2.0, 0.5, 2000, &inv_scale});
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(amp_step)>> == 1);
  auto const before = model.memory();
  fo::host::make_plan(model.lists()).run(amp_step, info);

  REQUIRE(same(model.memory(), before));
  REQUIRE(found.get());
  REQUIRE((int_flag ? found_i == 1 : found_f == 1.f));
  REQUIRE(scale == 512.f);
  REQUIRE(tracker == 0);
  REQUIRE(inv_scale == 1.0 / 512);
  REQUIRE(step == 4);  // a skipped step does not count
}

TEST_CASE("a skipped step keeps special values bit for bit where the stored types can", "[amp]")
{
  // NaN payloads, signed zeros, subnormals and infinities in params and states: stored back as
  // loaded (float and double keep every NaN's bits, bfloat16 every quiet NaN's).
  float const float_specials[] = {std::numeric_limits<float>::quiet_NaN(), -0.f, std::numeric_limits<float>::denorm_min(),
                                  -std::numeric_limits<float>::infinity(), 1.f};
  std::uint32_t const float_nan_payload = 0xffc01234u;
  std::uint64_t const double_nan_payload = 0x7ff8000000abcdefull;
  std::uint16_t const bf16_quiet_nan = 0xffc5u;

  auto const sizes = std::vector<std::int64_t>{5, 3000};
  tensors<float> pf(sizes), gf(sizes), mf(sizes), vf(sizes);
  tensors<double> pd(sizes), gd(sizes), md(sizes), vd(sizes);
  tensors<fo::bfloat16> pb(sizes), gb(sizes), mb(sizes), vb(sizes);
  std::mt19937 rng(2);
  for (auto* t : {&pf, &gf, &mf, &vf}) { t->fill(rng, 0, 1); }
  for (auto* t : {&pd, &gd, &md, &vd}) { t->fill(rng, 0, 1); }
  for (auto* t : {&pb, &gb, &mb, &vb}) { t->fill(rng, 0, 1); }
  for (std::size_t i = 0; i < 5; ++i) {
    pf.data[0][i] = mf.data[0][i] = vf.data[0][i] = float_specials[i];
    pd.data[0][i] = md.data[0][i] = vd.data[0][i] = static_cast<double>(float_specials[i]);
    pb.data[0][i] = mb.data[0][i] = vb.data[0][i] = fo::bfloat16(float_specials[i]);
  }
  std::memcpy(&pf.data[0][0], &float_nan_payload, sizeof(float));
  std::memcpy(&pd.data[0][0], &double_nan_payload, sizeof(double));
  pb.data[0][0] = fo::bfloat16::from_bits(bf16_quiet_nan);
  gf.data[1][77] = std::numeric_limits<float>::infinity();
  gd.data[1][77] = std::numeric_limits<double>::quiet_NaN();
  gb.data[1][77] = fo::bfloat16(-std::numeric_limits<float>::infinity());

  float found = 0;
  auto const rule = fo::rules::skip_if_nonfinite(fo::rules::adamw{}, &found);
  auto const bf = pf.bytes(), bmf = mf.bytes(), bvf = vf.bytes();
  fo::host::apply(rule, fo::bind(param = pf.list(), grad = gf.list<float const>(), exp_avg = mf.list(), exp_avg_sq = vf.list()));
  REQUIRE(found == 1.f);
  REQUIRE((pf.bytes() == bf && mf.bytes() == bmf && vf.bytes() == bvf));

  found = 0;
  auto const bd = pd.bytes(), bmd = md.bytes(), bvd = vd.bytes();
  fo::host::apply(rule, fo::bind(param = pd.list(), grad = gd.list<double const>(), exp_avg = md.list(), exp_avg_sq = vd.list()));
  REQUIRE(found == 1.f);
  REQUIRE((pd.bytes() == bd && md.bytes() == bmd && vd.bytes() == bvd));

  found = 0;
  auto const bb = pb.bytes(), bmb = mb.bytes(), bvb = vb.bytes();
  fo::host::apply(rule, fo::bind(param = pb.list(), grad = gb.list<fo::bfloat16 const>(), exp_avg = mb.list(),
                                 exp_avg_sq = vb.list()));
  REQUIRE(found == 1.f);
  REQUIRE((pb.bytes() == bb && mb.bytes() == bmb && vb.bytes() == bvb));
}

TEST_CASE("a skipped step around master weights (param written, never read) leaves param unchanged", "[amp]")
{
  // with_master stores param as the rounded master without loading it; the skip wrapper must
  // load it so that a skipped step stores it back unchanged.
  auto const sizes = sizes_of(500, 4, 64);
  std::mt19937 rng(8);
  tensors<fo::bfloat16> p(sizes), g(sizes);
  tensors<float> master(sizes), m(sizes), v(sizes);
  master.fill(rng, -1, 1);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    for (std::size_t i = 0; i < p.data[k].size(); ++i) { p.data[k][i] = fo::bfloat16(master.data[k][i]); }
  }
  g.fill(rng, -1, 1);
  std::size_t victim = 321;
  while (g.data[victim].empty()) { ++victim; }
  g.data[victim].back() = fo::bfloat16(std::numeric_limits<float>::quiet_NaN());
  float found = 0;
  auto const rule = fo::rules::skip_if_nonfinite(fo::rules::with_master{fo::rules::adamw{}}, &found);
  using reads = fo::reads_t<std::decay_t<decltype(rule)>>;
  STATIC_REQUIRE(fo::contains_v<reads, fo::slot::param_t>);
  auto const before = p.bytes(), before_master = master.bytes();
  fo::host::apply(rule, fo::bind(param = p.list(), fo::slot::master = master.list(), grad = g.list<fo::bfloat16 const>(),
                                 exp_avg = m.list(), exp_avg_sq = v.list()));
  REQUIRE(found == 1.f);
  REQUIRE(same(p.bytes(), before));
  REQUIRE(same(master.bytes(), before_master));
}

TEMPLATE_TEST_CASE("with finite gradients the AMP step equals unscaling then the optimizer, bit for bit", "[amp]",
                   float, double)
{
  using T = TestType;
  amp_model<T, T, T> a, b;
  a.g.fill(a.rng, -1000, 1000);
  b.g = a.g;
  // b: gradients unscaled in memory first (torch's unscale_: grad * float(inv_scale) in opmath).
  float scale = 65536.f;
  double inv_scale = static_cast<float>(1.0 / 65536);
  for (auto& t : b.g.data) {
    for (auto& x : t) { x = static_cast<T>(x * static_cast<T>(inv_scale)); }
  }
  std::int32_t tracker = 0;
  float found = -1.f;
  auto const amp_step = fo::chain(fo::rules::unscale_gradients{fo::scalar<double>::from_pointer(&inv_scale)},
                                  fo::rules::skip_if_nonfinite(amsgrad_adamw(), &found),
                                  fo::rules::grad_scaler_update{&scale, &tracker, &found, 2.0, 0.5, 2000, &inv_scale});
  auto plan_a = fo::host::make_plan(a.lists());
  auto plan_b = fo::host::make_plan(b.lists());
  for (std::int64_t t = 1; t <= 3; ++t) {
    plan_a.run(amp_step, fo::step_info{t});
    plan_b.run(amsgrad_adamw(), fo::step_info{t});
    REQUIRE(same(a.memory(), b.memory()));
    REQUIRE(found == 0.f);
    REQUIRE(tracker == t);
    REQUIRE(scale == 65536.f);
  }
}

TEST_CASE("divide_gradients divides floats in float, with the bits of torch's double quotient", "[amp]")
{
  // The rule takes the correctly rounded float quotient where torch rounds the double one to
  // float: the same number for every pair of floats (double rounding of a quotient is
  // innocuous at 53 >= 2 x 24 + 2 bits). Checked over random bit patterns (subnormals,
  // infinities and NaNs included) against scales of every kind.
  float scales[] = {3000.f, 65536.f, 1.f / 3.f, 7.f, 1e-30f, 1e30f, 1.5e-41f /* subnormal */, 0.f, -2.5f,
                    std::numeric_limits<float>::infinity()};
  std::mt19937 rng(20261126);
  for (float const scale : scales) {
    fo::rules::divide_gradients::prepared const divide{static_cast<double>(scale)};
    for (int k = 0; k < 200000; ++k) {
      std::uint32_t const bits = static_cast<std::uint32_t>(rng());
      float x;
      std::memcpy(&x, &bits, sizeof x);
      fo::element<float, fo::slots<fo::slot::grad_t>, fo::slots<>> e{};
      e[fo::slot::grad] = x;
      divide(e);
      float const torch_bits = static_cast<float>(static_cast<double>(x) / static_cast<double>(scale));
      INFO("x bits " << bits << ", scale " << scale);
      if (std::isnan(torch_bits)) {
        REQUIRE(std::isnan(e[fo::slot::grad]));
      } else {
        REQUIRE(fusedopt_test::bits_of(e[fo::slot::grad]) == fusedopt_test::bits_of(torch_bits));
      }
    }
  }
}

TEMPLATE_TEST_CASE("GradScaler's fused protocol: divide_gradients and skip_if_set follow torch's fused Adam", "[amp]",
                   float, double)
{
  // torch's fused Adam under GradScaler: grad / grad_scale (in double, rounded to the compute
  // type), the whole step skipped when found_inf is set when the step starts (no pass over the
  // gradients: the scaler checked them), and a skipped step does not count.
  using P = TestType;
  amp_model<P, P, P> a, b;
  a.g.fill(a.rng, -1000, 1000);
  b.g = a.g;
  float const grad_scale = 3000.f;  // not a power of two: the quotient's rounding shows
  for (auto& t : b.g.data) {
    for (auto& x : t) {
      x = static_cast<P>(static_cast<double>(x) / grad_scale);
    }
  }
  float found_inf = 0.f;
  std::int64_t counter = 0;
  fo::step_info info;
  info.step = fo::scalar<std::int64_t>::from_pointer(&counter);
  info.advance = &counter;
  auto const amp_step = fo::chain(fo::rules::divide_gradients{&grad_scale},
                                  fo::rules::skip_if_set(amsgrad_adamw(), fo::flag_pointer(&found_inf)));
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(amp_step)>> == 0);
  auto plan_a = fo::host::make_plan(a.lists());
  auto plan_b = fo::host::make_plan(b.lists());
  std::int64_t expected_step = 0;
  for (int call = 1; call <= 5; ++call) {
    bool const skip = call == 2 || call == 3;
    found_inf = skip ? 1.f : 0.f;
    auto const before = a.memory();
    plan_a.run(amp_step, info);
    if (skip) {
      REQUIRE(same(a.memory(), before));
    } else {
      ++expected_step;
      plan_b.run(amsgrad_adamw(), fo::step_info{expected_step});
      REQUIRE(same(a.memory(), b.memory()));
    }
    REQUIRE(counter == expected_step);
    REQUIRE(found_inf == (skip ? 1.f : 0.f));  // read, never written
  }
  // No scale and no flag: the plain rule's bits.
  auto const plain = fo::chain(fo::rules::divide_gradients{}, fo::rules::skip_if_set(amsgrad_adamw(), nullptr));
  amp_model<P, P, P> c;
  c.g = a.g;
  auto d = c;
  fo::host::make_plan(c.lists()).run(plain, fo::step_info{3});
  fo::host::make_plan(d.lists()).run(amsgrad_adamw(), fo::step_info{3});
  REQUIRE(same(c.memory(), d.memory()));
}

TEST_CASE("skip_if_nonfinite around a reducing rule (lamb), with clipping in front and the scaler after", "[amp]")
{
  auto const sizes = sizes_of(200, 8, 300);
  std::mt19937 rng(31);
  fo::rules::lamb lamb;
  lamb.use_nvlamb = true;
  fo::rules::clip_by_global_norm clip;
  clip.max_norm = 1.0;
  double inv_scale = 0.25;
  auto const unscale = fo::rules::unscale_gradients{fo::scalar<double>::from_pointer(&inv_scale)};
  for (bool with_clip : {false, true}) {
    tensors<float> p1(sizes), g(sizes), m1(sizes), v1(sizes);
    p1.fill(rng, -1, 1);
    auto p2 = p1;
    auto m2 = m1, v2 = v1;
    std::int32_t found = -1;
    float scale = 1024.f;
    std::int32_t tracker = 0;
    std::int64_t counter = 0;
    fo::step_info info;
    info.step = fo::scalar<std::int64_t>::from_pointer(&counter);
    info.advance = &counter;
    std::int64_t plain_steps = 0;
    for (int s = 0; s < 6; ++s) {
      bool const poison = s == 2 || s == 3;
      g.fill(rng, -4, 4);
      if (poison) { g.data[150][0] = s == 2 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN(); }
      auto const before = p1.bytes();
      auto const before_m = m1.bytes();
      auto lists1 = fo::bind(param = p1.list(), grad = g.list<float const>(), exp_avg = m1.list(), exp_avg_sq = v1.list());
      if (with_clip) {
        // The documented complete step: unscale, clip, skip-guarded optimizer, loss-scale update.
        fo::host::make_plan(lists1).run(fo::chain(unscale, clip, fo::rules::skip_if_nonfinite(lamb, &found),
                                                  fo::rules::grad_scaler_update{&scale, &tracker, &found}),
                                        info);
        REQUIRE(scale == (poison ? 512.f : 1024.f));
        scale = 1024.f;
      } else {
        fo::host::make_plan(lists1).run(fo::chain(unscale, fo::rules::skip_if_nonfinite(lamb, &found)), info);
      }
      REQUIRE(found == (poison ? 1 : 0));
      if (poison) {
        REQUIRE(same(p1.bytes(), before));
        REQUIRE(same(m1.bytes(), before_m));
        continue;
      }
      // The plain optimizer on gradients unscaled in memory, counting only the steps taken.
      tensors<float> gu = g;
      for (auto& t : gu.data) {
        for (auto& x : t) { x *= static_cast<float>(inv_scale); }
      }
      ++plain_steps;
      auto lists2 = fo::bind(param = p2.list(), grad = gu.list<float const>(), exp_avg = m2.list(), exp_avg_sq = v2.list());
      if (with_clip) {
        fo::host::make_plan(lists2).run(fo::chain(clip, lamb), fo::step_info{plain_steps});
      } else {
        fo::host::make_plan(lists2).run(lamb, fo::step_info{plain_steps});
      }
      REQUIRE(counter == plain_steps);
      REQUIRE(same(p1.bytes(), p2.bytes()));
      REQUIRE(same(m1.bytes(), m2.bytes()));
      REQUIRE(same(v1.bytes(), v2.bytes()));
    }
  }
}

TEST_CASE("grad_scaler_update follows torch.amp.GradScaler over a sequence of steps", "[amp]")
{
  std::vector<std::int64_t> const sizes{10, 3};
  tensors<float> p(sizes), g(sizes);
  std::mt19937 rng(5);
  p.fill(rng, -1, 1);
  auto plan = fo::host::make_plan(fo::bind(param = p.list(), grad = g.list<float const>()));

  struct run_case {
    float start;
    double growth, backoff;
    std::int32_t interval;
  };
  for (auto const& c : {run_case{65536.f, 2.0, 0.5, 3}, run_case{1.f, 1.5, 0.25, 1},
                        run_case{FLT_MAX / 3, 2.0, 0.5, 2} /* growth would overflow: kept */}) {
    scaler_reference ref{c.start};
    ref.growth = c.growth;
    ref.backoff = c.backoff;
    ref.interval = c.interval;
    float scale = c.start;
    std::int32_t tracker = 0;
    float found_inf = 0;
    double inv_scale = 1.0 / c.start;
    fo::rules::sgd sgd;
    sgd.lr = 1e-3;
    auto const step = fo::chain(fo::rules::unscale_gradients{fo::scalar<double>::from_pointer(&inv_scale)},
                                fo::rules::skip_if_nonfinite(sgd, &found_inf),
                                fo::rules::grad_scaler_update{&scale, &tracker, &found_inf, c.growth, c.backoff,
                                                              c.interval, &inv_scale});
    for (int s = 0; s < 40; ++s) {
      bool const overflow = s % 7 == 3 || s == 20 || s == 21;
      g.fill(rng, -1, 1);
      if (overflow) { g.data[1][2] = std::numeric_limits<float>::infinity(); }
      plan.run(step, fo::step_info{s + 1});
      ref.update(overflow);
      INFO("step " << s);
      REQUIRE(found_inf == (overflow ? 1.f : 0.f));
      REQUIRE(scale == ref.scale);
      REQUIRE(tracker == ref.tracker);
      REQUIRE(inv_scale == ref.inv_scale());
    }
  }
}

TEST_CASE("grad_scaler_update rejects bad options", "[amp][errors]")
{
  std::vector<std::int64_t> const sizes{4};
  tensors<float> p(sizes), g(sizes);
  auto plan = fo::host::make_plan(fo::bind(param = p.list(), grad = g.list<float const>()));
  float scale = 1.f, found = 0.f;
  std::int32_t tracker = 0;
  auto bad = [&](fo::rules::grad_scaler_update u) { REQUIRE_THROWS_AS(plan.run(u), fo::error); };
  bad({nullptr, &tracker, &found});
  bad({&scale, nullptr, &found});
  bad({&scale, &tracker, nullptr});
  bad({&scale, &tracker, &found, 1.0});
  bad({&scale, &tracker, &found, 2.0, 1.0});
  bad({&scale, &tracker, &found, 2.0, 0.5, 0});
  REQUIRE_NOTHROW(plan.run(fo::rules::grad_scaler_update{&scale, &tracker, &found}));
  REQUIRE(tracker == 1);
}
