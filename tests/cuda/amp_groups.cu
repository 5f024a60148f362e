// AMP and parameter groups on the CUDA backend:
// - unscale + skip_if_nonfinite + AdamW + grad_scaler_update over 3000 tensors: with finite
//   gradients the same bits as the host backend (the non-finite count is exact, everything
//   else elementwise); one inf or NaN in one element of one tensor leaves every param and
//   state bit for bit unchanged, sets found_inf, takes back the step count, and the scale
//   follows torch.amp.GradScaler (backoff on inf, growth after growth_interval good steps);
// - groups: two groups with different lr / weight decay in one launch equal the host bit for
//   bit (AdamW), and groups<lamb, 2> follows the host within the reduction tolerance
//   (tests/cuda/lamb_lars.cu explains it).
#include "support.cuh"

#include <cfloat>
#include <limits>

using namespace fusedopt_test;

namespace {

using adam_problem = adam_problem_of<float, float>;

std::vector<std::int64_t> many_sizes(std::size_t count, std::uint64_t seed)
{
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> size(0, 700);
  std::vector<std::int64_t> sizes(count);
  for (auto& n : sizes) { n = size(rng); }
  sizes[count / 2] = 20000;  // one tensor of several chunks
  return sizes;
}

/// GradScaler's state, in host or device memory.
struct scaler_state {
  float scale;
  std::int32_t growth_tracker;
  float found_inf;
  double inv_scale;
  std::int64_t step;
};

/// The rule of a complete AMP step over `s` (host or device memory).
auto amp_step(scaler_state* s, std::int32_t growth_interval)
{
  fo::rules::adamw opt;
  opt.lr = 1e-2;
  opt.weight_decay = 0.1;
  return fo::chain(fo::rules::unscale_gradients{fo::scalar<double>::from_pointer(&s->inv_scale)},
                   fo::rules::skip_if_nonfinite(opt, &s->found_inf),
                   fo::rules::grad_scaler_update{&s->scale, &s->growth_tracker, &s->found_inf, 2.0, 0.5,
                                                 growth_interval, &s->inv_scale});
}

/// Device arenas of `p` as bytes, per slot.
template <class Problem, std::size_t... K>
std::vector<std::vector<unsigned char>> device_bytes(Problem& p, std::index_sequence<K...>)
{
  std::vector<std::vector<unsigned char>> out;
  (
    [&] {
      auto& a = p.template slot_arena<K>();
      std::vector<unsigned char> bytes(a.host.size() * sizeof(a.host[0]));
      FO_TEST_CUDA(cudaMemcpy(bytes.data(), a.device, bytes.size(), cudaMemcpyDeviceToHost));
      out.push_back(std::move(bytes));
    }(),
    ...);
  return out;
}

}  // namespace

TEST_CASE("AMP: a non-finite gradient among 3000 tensors skips the step, bit for bit", "[cuda][amp]")
{
  std::size_t const count = quick() ? 600 : 3000;
  auto const sizes = many_sizes(count, 77);
  adam_problem p(sizes, shift::same, 78);
  std::int32_t const growth_interval = 3;
  scaler_state host_scaler{1024.f, 0, 0.f, 1.0 / 1024, 0};
  device_array<scaler_state> device_scaler(1);
  device_scaler.set(host_scaler);
  auto const host_rule = amp_step(&host_scaler, growth_interval);
  auto const device_rule = amp_step(device_scaler.get(), growth_interval);
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(device_rule)>> == 1);

  auto host_plan = fo::host::make_plan(p.lists(false));
  auto const device_plan = fo::cuda::make_plan(p.lists(true));
  fo::step_info host_step{fo::scalar<std::int64_t>::from_pointer(&host_scaler.step)};
  host_step.advance = &host_scaler.step;
  fo::step_info device_step{fo::scalar<std::int64_t>::from_pointer(&device_scaler.get()->step)};
  device_step.advance = &device_scaler.get()->step;

  auto const set_grad = [&](std::size_t tensor, std::int64_t element, float value) {
    auto& g = p.slot_arena<1>();
    auto const at = static_cast<std::size_t>(g.offsets[tensor] + element);
    g.host[at] = value;
    upload_bytes(g.device + at, &value, sizeof value);
  };
  std::size_t const victim = count / 2;  // the large tensor
  float const inf = std::numeric_limits<float>::infinity();
  float const nan = std::numeric_limits<float>::quiet_NaN();
  // A schedule: good steps (growth after 3), inf, good, NaN, -inf in a small tensor, good...
  struct planned {
    char const* what;
    bool bad;
    float value;
    std::size_t tensor;
    std::int64_t element;
  };
  std::size_t small = 0;
  while (sizes[small] < 10) { ++small; }
  std::vector<planned> const schedule{
    {"good", false, 0, 0, 0},        {"good", false, 0, 0, 0},       {"good (growth)", false, 0, 0, 0},
    {"inf", true, inf, victim, 12345}, {"good", false, 0, 0, 0},     {"nan", true, nan, victim, 7},
    {"-inf small tensor", true, -inf, small, 3}, {"good", false, 0, 0, 0}, {"good", false, 0, 0, 0},
    {"good (growth)", false, 0, 0, 0}};
  std::int64_t good_steps = 0;
  for (std::size_t s = 0; s < schedule.size(); ++s) {
    planned const& step = schedule[s];
    INFO("step " << s << ": " << step.what);
    p.refresh_inputs();
    if (step.bad) { set_grad(step.tensor, step.element, step.value); }
    auto const before = device_bytes(p, std::make_index_sequence<4>{});
    scaler_state const scaler_before = device_scaler.value();

    host_plan.run(host_rule, host_step);
    device_plan.run(device_rule, device_step);
    FO_TEST_CUDA(cudaDeviceSynchronize());
    scaler_state const now = device_scaler.value();

    // Device and host agree bit for bit in every arena and in the scaler.
    p.require_same_bits(std::string("amp step ") + step.what);
    CHECK(same_bits(now.scale, host_scaler.scale));
    CHECK(now.growth_tracker == host_scaler.growth_tracker);
    CHECK(same_bits(now.found_inf, host_scaler.found_inf));
    CHECK(same_bits(now.inv_scale, host_scaler.inv_scale));
    CHECK(now.step == host_scaler.step);

    if (step.bad) {
      auto const after = device_bytes(p, std::make_index_sequence<4>{});
      for (std::size_t k : {std::size_t{0}, std::size_t{2}, std::size_t{3}}) {
        INFO("slot " << k);
        REQUIRE(after[k] == before[k]);  // params and states untouched
      }
      CHECK(now.found_inf == 1.f);
      CHECK(now.scale == scaler_before.scale * 0.5f);
      CHECK(now.growth_tracker == 0);
      CHECK(now.step == scaler_before.step);  // a skipped step does not count
    } else {
      ++good_steps;
      CHECK(now.found_inf == 0.f);
      CHECK(now.step == scaler_before.step + 1);
      if (scaler_before.growth_tracker + 1 == growth_interval) {
        CHECK(now.scale == scaler_before.scale * 2.f);
        CHECK(now.growth_tracker == 0);
      } else {
        CHECK(now.scale == scaler_before.scale);
        CHECK(now.growth_tracker == scaler_before.growth_tracker + 1);
      }
    }
    CHECK(now.inv_scale == static_cast<double>(static_cast<float>(1.0 / static_cast<double>(now.scale))));
  }
  CHECK(device_scaler.value().step == good_steps);
}

TEST_CASE("GradScaler's fused protocol: divide_gradients and skip_if_set equal the host bit for bit", "[cuda][amp]")
{
  // torch's fused optimizers under GradScaler: grad / grad_scale, the step skipped where
  // found_inf is set when it starts (no pass over the gradients), the step count taken back.
  struct fused_amp {
    float grad_scale;
    float found_inf;
    std::int64_t step;
  };
  std::size_t const count = quick() ? 600 : 3000;
  auto const sizes = many_sizes(count, 91);
  adam_problem p(sizes, shift::same, 92);
  fused_amp host_state{3000.f, 0.f, 0};  // a scale that is not a power of two: the quotient's rounding shows
  device_array<fused_amp> device_state(1);
  device_state.set(host_state);
  auto const rule_over = [](fused_amp* s) {
    fo::rules::adamw opt;
    opt.lr = 1e-2;
    opt.weight_decay = 0.1;
    return fo::chain(fo::rules::divide_gradients{&s->grad_scale}, fo::rules::skip_if_set(opt, &s->found_inf));
  };
  auto const host_rule = rule_over(&host_state);
  auto const device_rule = rule_over(device_state.get());
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(device_rule)>> == 0);
  auto host_plan = fo::host::make_plan(p.lists(false));
  auto const device_plan = fo::cuda::make_plan(p.lists(true));
  fo::step_info host_step{fo::scalar<std::int64_t>::from_pointer(&host_state.step)};
  host_step.advance = &host_state.step;
  fo::step_info device_step{fo::scalar<std::int64_t>::from_pointer(&device_state.get()->step)};
  device_step.advance = &device_state.get()->step;

  std::int64_t good_steps = 0;
  for (int s = 0; s < 6; ++s) {
    bool const skip = s == 1 || s == 2 || s == 4;
    INFO("step " << s << (skip ? " (found_inf set)" : ""));
    p.refresh_inputs();
    host_state.found_inf = skip ? 1.f : 0.f;
    fused_amp now = device_state.value();
    now.found_inf = host_state.found_inf;
    device_state.set(now);
    auto const before = device_bytes(p, std::make_index_sequence<4>{});
    host_plan.run(host_rule, host_step);
    device_plan.run(device_rule, device_step);
    FO_TEST_CUDA(cudaDeviceSynchronize());
    p.require_same_bits("fused amp step");
    now = device_state.value();
    if (skip) {
      auto const after = device_bytes(p, std::make_index_sequence<4>{});
      for (std::size_t k : {std::size_t{0}, std::size_t{2}, std::size_t{3}}) {
        INFO("slot " << k);
        REQUIRE(after[k] == before[k]);
      }
    } else {
      ++good_steps;
    }
    CHECK(now.step == good_steps);
    CHECK(host_state.step == good_steps);
    CHECK(now.found_inf == host_state.found_inf);  // read, never written
  }
}

TEST_CASE("grad_scaler_update alone (an after-step hook, no pass) runs through plans and apply", "[cuda][amp]")
{
  std::vector<std::int64_t> sizes{10, 0, 33};
  adam_problem p(sizes, shift::none, 5);
  device_array<scaler_state> s(1);
  s.set(scaler_state{8.f, 0, 1.f, 0.125, 0});
  scaler_state* d = s.get();
  fo::rules::grad_scaler_update update{&d->scale, &d->growth_tracker, &d->found_inf, 2.0, 0.5, 2, &d->inv_scale};
  auto const plan = fo::cuda::make_plan(p.lists(true));
  plan.run(update);  // found_inf set: backoff
  CHECK(s.value().scale == 4.f);
  CHECK(s.value().inv_scale == 0.25);
  FO_TEST_CUDA(cudaMemset(&d->found_inf, 0, sizeof(float)));
  fo::cuda::apply(update, p.lists(true));  // good
  CHECK(s.value().growth_tracker == 1);
  fo::cuda::apply(update, p.lists(true));  // good: growth
  CHECK(s.value().scale == 8.f);
  CHECK(s.value().growth_tracker == 0);
  p.require_same_bits("grad_scaler_update touches no tensor");
  // A scale that would grow to infinity stays.
  s.set(scaler_state{std::numeric_limits<float>::max(), 1, 0.f, 0, 0});
  plan.run(update);
  CHECK(s.value().scale == std::numeric_limits<float>::max());
  CHECK(s.value().growth_tracker == 0);
}

TEST_CASE("groups: two groups of AdamW with different lr and weight decay equal the host bit for bit",
          "[cuda][groups]")
{
  std::vector<std::int64_t> const sizes = edge_sizes();
  std::vector<std::int32_t> group_of(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) { group_of[t] = static_cast<std::int32_t>((t * 7 / 3) % 2); }
  device_array<std::int32_t> group_on_device(sizes.size());
  group_on_device.upload(group_of);
  fo::rules::adamw decay, no_decay;
  decay.lr = 1e-2;
  decay.weight_decay = 0.1;
  no_decay.lr = 3e-2;
  no_decay.weight_decay = 0.0;
  auto const make = [&](std::int64_t, bool on_device) {
    return fo::groups<fo::rules::adamw, 2>{{decay, no_decay}, on_device ? group_on_device.get() : group_of.data()};
  };
  std::uint64_t seed = 500;
  for (scenario const& how : plan_scenarios()) {
    adam_problem p(sizes, how.placement, seed++);
    check_close_trajectory(p, make, how, trajectory_steps(), tolerance{}, "groups<adamw, 2>");
  }
  // apply takes groups of a rule without passes too.
  adam_problem p(sizes, shift::same, 600);
  fo::cuda::apply(make(1, true), p.lists(true), fo::step_info{1});
  fo::host::apply(make(1, false), p.lists(false), fo::step_info{1});
  FO_TEST_CUDA(cudaDeviceSynchronize());
  p.require_same_bits("groups<adamw, 2> through apply");
}

TEST_CASE("groups: lamb (a reducing rule) in two groups follows the host", "[cuda][groups][lamb]")
{
  std::vector<std::int64_t> const sizes = edge_sizes();
  std::vector<std::int32_t> group_of(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) { group_of[t] = static_cast<std::int32_t>(t % 2); }
  device_array<std::int32_t> group_on_device(sizes.size());
  group_on_device.upload(group_of);
  fo::rules::lamb decay, no_decay;
  decay.lr = 1e-2;
  decay.weight_decay = 0.05;
  decay.use_nvlamb = true;
  no_decay.lr = 2e-2;
  no_decay.weight_decay = 0.0;
  auto const make = [&](std::int64_t, bool on_device) {
    return fo::groups<fo::rules::lamb, 2>{{decay, no_decay}, on_device ? group_on_device.get() : group_of.data()};
  };
  std::uint64_t seed = 700;
  for (scenario const& how : plan_scenarios()) {
    adam_problem p(sizes, how.placement, seed++);
    check_close_trajectory(p, make, how, trajectory_steps(), tolerance{1e-4, 1e-6}, "groups<lamb, 2>");
  }
}
