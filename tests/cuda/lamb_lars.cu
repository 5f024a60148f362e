// LAMB and LARS on the CUDA backend over 12-step trajectories (3 under FUSEDOPT_TEST_QUICK)
// against the host backend, every plan scenario. Tolerances: the trust ratios come from
// per-tensor sums that the two backends round differently. The host backend accumulates
// each of 8 lanes in the arithmetic type over a 32K-element chunk (4096 float terms per lane:
// a relative error of order 1e-6..1e-5 in a float sum of squares); the GPU sums at most 16
// float terms per thread and the rest in double. Trust ratios of float lists therefore differ
// by up to about 1e-5 relative, which LARS's momentum buffer (proportional to the ratio)
// shows directly: float rtol 1e-4 with atol 1e-6; double rtol 1e-12. bfloat16 params: such a
// difference flips a bfloat16 rounding now and then, by one ulp of the value at that step
// (up to 2^-7 of a magnitude near 1, and a value may cross zero later): rtol 2^-5, atol 2e-3.
// The host backend itself is checked against double references of apex FusedLAMB and
// LARC + SGD in tests/host/lamb_lars.cpp. LARS's per-tensor exclusion: excluded tensors do
// not depend on any reduction, so they must equal the host's bits exactly.
#include "support.cuh"

#include <cfloat>

using namespace fusedopt_test;

namespace {

int long_steps() { return quick() ? 3 : 12; }

template <class T>
tolerance tolerance_for()
{
  if constexpr (std::is_same_v<T, double>) {
    return {1e-12, 1e-14};
  } else if constexpr (std::is_same_v<T, float>) {
    return {1e-4, 1e-6};
  } else {
    return {1.0 / 32, 2e-3};
  }
}

template <class D>
using lamb_problem = problem<spec<slot::param_t, typename D::param>,
                             spec<slot::grad_t, typename D::param, fill::symmetric, true>,
                             spec<slot::exp_avg_t, typename D::state>, spec<slot::exp_avg_sq_t, typename D::state, fill::positive>>;

template <class D>
using lars_problem = problem<spec<slot::param_t, typename D::param>,
                             spec<slot::grad_t, typename D::param, fill::symmetric, true>,
                             spec<slot::momentum_buffer_t, typename D::state>>;

struct lamb_case {
  double weight_decay;
  bool adam_w_mode, use_nvlamb, bias_correction;
  double max_trust_ratio;
};

fo::rules::lamb make_lamb(lamb_case const& c)
{
  fo::rules::lamb r;
  r.lr = 1e-2;
  r.weight_decay = c.weight_decay;
  r.adam_w_mode = c.adam_w_mode;
  r.use_nvlamb = c.use_nvlamb;
  r.bias_correction = c.bias_correction;
  r.max_trust_ratio = c.max_trust_ratio;
  return r;
}

}  // namespace

TEMPLATE_TEST_CASE("lamb on the GPU follows the host backend", "[cuda][lamb]", f32, f64, bf16_f32)
{
  using D = TestType;
  auto const c = GENERATE(lamb_case{0.01, true, false, true, DBL_MAX}, lamb_case{0.01, false, true, true, 0.5},
                          lamb_case{0.0, true, true, false, DBL_MAX}, lamb_case{0.0, true, false, true, DBL_MAX});
  std::uint64_t seed = 100;
  for (scenario const& how : plan_scenarios()) {
    lamb_problem<D> p(edge_sizes(), how.placement, seed++);
    auto const rule = make_lamb(c);
    check_close_trajectory(p, [&](std::int64_t, bool) { return rule; }, how, long_steps(),
                           tolerance_for<typename D::param>(),
                           "lamb wd=" + std::to_string(c.weight_decay) + " adam_w=" + std::to_string(c.adam_w_mode) +
                             " nvlamb=" + std::to_string(c.use_nvlamb));
  }
}

TEST_CASE("clip_by_global_norm + lamb (two passes) on the GPU follows the host backend", "[cuda][lamb][clip]")
{
  double const max_norm = GENERATE(1.0, 1e6);
  fo::rules::clip_by_global_norm clip;
  clip.max_norm = max_norm;
  auto const rule = fo::chain(clip, make_lamb(lamb_case{0.01, true, true, true, DBL_MAX}));
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(rule)>> == 2);
  std::uint64_t seed = 200;
  for (scenario const& how : plan_scenarios()) {
    lamb_problem<f32> p(edge_sizes(), how.placement, seed++);
    check_close_trajectory(p, [&](std::int64_t, bool) { return rule; }, how, long_steps(), tolerance_for<float>(),
                           "clip+lamb max_norm=" + std::to_string(max_norm));
  }
}

TEMPLATE_TEST_CASE("lars on the GPU follows the host backend", "[cuda][lars]", f32, f64, bf16_f32)
{
  using D = TestType;
  struct lars_case {
    double momentum, weight_decay;
    bool nesterov, clip, exclude;
  };
  auto const c = GENERATE(lars_case{0.9, 0.05, false, false, false}, lars_case{0.9, 0.05, true, true, true},
                          lars_case{0.0, 0.0, false, false, true}, lars_case{0.8, 0.05, false, true, false});
  std::vector<std::int64_t> const sizes = edge_sizes();
  std::vector<std::uint8_t> exclude(sizes.size(), 0);
  for (std::size_t t = 0; t < sizes.size(); t += 3) { exclude[t] = 1; }  // e.g. biases and norms
  device_array<std::uint8_t> exclude_on_device(sizes.size());
  exclude_on_device.upload(exclude);
  auto const make = [&](std::int64_t, bool on_device) {
    fo::rules::lars r;
    r.lr = 0.1;
    r.momentum = c.momentum;
    r.weight_decay = c.weight_decay;
    r.trust_coefficient = 0.02;
    r.nesterov = c.nesterov;
    r.clip = c.clip;
    r.exclude = c.exclude ? (on_device ? exclude_on_device.get() : exclude.data()) : nullptr;
    return r;
  };
  std::uint64_t seed = 300;
  for (scenario const& how : plan_scenarios()) {
    lars_problem<D> p(sizes, how.placement, seed++);
    check_close_trajectory(p, make, how, long_steps(), tolerance_for<typename D::param>(),
                           "lars momentum=" + std::to_string(c.momentum) + " exclude=" + std::to_string(c.exclude));
  }
}

TEST_CASE("lars: excluded tensors are plain SGD with momentum, bit for bit the host's", "[cuda][lars]")
{
  std::vector<std::int64_t> const sizes = edge_sizes();
  std::vector<std::uint8_t> exclude(sizes.size(), 0);
  for (std::size_t t = 0; t < sizes.size(); t += 2) { exclude[t] = 1; }
  device_array<std::uint8_t> exclude_on_device(sizes.size());
  exclude_on_device.upload(exclude);
  lars_problem<f32> p(sizes, shift::same, 400);
  auto host_plan = fo::host::make_plan(p.lists(false));
  auto const device_plan = fo::cuda::make_plan(p.lists(true));
  fo::rules::lars rule;
  rule.lr = 0.1;
  rule.weight_decay = 0.05;
  rule.trust_coefficient = 0.02;
  auto device_rule = rule;
  rule.exclude = exclude.data();
  device_rule.exclude = exclude_on_device.get();
  for (std::int64_t t = 1; t <= long_steps(); ++t) {
    p.refresh_inputs();
    host_plan.run(rule, fo::step_info{t});
    device_plan.run(device_rule, fo::step_info{t});
    FO_TEST_CUDA(cudaDeviceSynchronize());
    std::vector<float> device_param, device_buffer;
    (void)p.slot_arena<0>().first_difference(device_param);
    (void)p.slot_arena<2>().first_difference(device_buffer);
    auto const& pa = p.slot_arena<0>();
    auto const& ba = p.slot_arena<2>();
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      if (exclude[k] == 0) { continue; }
      for (std::int64_t i = 0; i < sizes[k]; ++i) {
        auto const at = static_cast<std::size_t>(pa.offsets[k] + i);
        INFO("step " << t << " tensor " << k << " element " << i);
        REQUIRE(same_bits(device_param[at], pa.host[at]));
        REQUIRE(same_bits(device_buffer[static_cast<std::size_t>(ba.offsets[k] + i)],
                          ba.host[static_cast<std::size_t>(ba.offsets[k] + i)]));
      }
    }
    // The others: within the float tolerance.
    require_close(p, tolerance_for<float>(), "lars with exclusions step " + std::to_string(t));
  }
}
