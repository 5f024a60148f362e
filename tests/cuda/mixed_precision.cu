// Mixed precision on the CUDA backend, against the host backend bit for bit (built with
// -fmad=false): with_master (bf16 and half params on an fp32 master), with_remainder (bf16
// param + int16 remainder; the joined pair is the fp32 trajectory of the same rule, bit for
// bit, on the GPU too), and stochastic rounding (the same bits on host and device for the same
// seed, step, tensor and element), through every scenario of the elementwise sweep; plus
// with_master over a chain with a reduction pass (clip + AdamW), within the clip tolerance;
// with_kahan (bf16 and half params with a compensation of their type); and the CUDA backend's
// rounding of four floats to bfloat16 (the hardware's where none is a NaN) against the host's,
// over every float.
#include "support.cuh"

using namespace fusedopt_test;

namespace {

fo::rules::adamw make_adamw()
{
  fo::rules::adamw r;
  r.lr = 1e-2;
  r.weight_decay = 0.1;
  return r;
}

std::uint32_t bits_of(float x)
{
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

/// Every float bit pattern through the CUDA backend's round_to_bfloat16 (the hardware's
/// rounding where no value of the four is a NaN) against float_to_bfloat16_bits, the host's:
/// the count of elements that differ and the smallest such pattern. Each thread rounds f, -f,
/// f's neighbour and a NaN or not (every fourth pattern takes a NaN in the last place, so
/// that quads with a NaN take the other path).
__global__ void bfloat16_rounding_differences(unsigned long long* differences, unsigned* first)
{
  std::uint64_t const stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; i < (std::uint64_t{1} << 32);
       i += stride) {
    auto const u = static_cast<std::uint32_t>(i);
    float const values[4] = {__uint_as_float(u), -__uint_as_float(u), __uint_as_float(u ^ 1u),
                             (u & 3u) == 0 ? __uint_as_float(0x7fc01234u | (u & 0x80000000u)) : 1.f};
    auto const q = fo::cuda::detail::round_to_bfloat16(values[0], values[1], values[2], values[3]);
    for (int j = 0; j < 4; ++j) {
      if (q.v[j].bits != fo::detail::float_to_bfloat16_bits(values[j])) {
        atomicAdd(differences, 1ull);
        atomicMin(first, u);
      }
    }
  }
}

}  // namespace

TEST_CASE("rounding to bfloat16 on the GPU gives the host's bits for every float", "[cuda][bf16]")
{
  device_array<unsigned long long> differences(1);  // zeros
  device_array<unsigned> first(1);
  first.set(0xffffffffu);
  bfloat16_rounding_differences<<<2048, 256>>>(differences.get(), first.get());
  FO_TEST_CUDA(cudaGetLastError());
  INFO("first differing float bits 0x" << std::hex << first.value());
  REQUIRE(differences.value() == 0);
}

TEMPLATE_TEST_CASE("with_master on the GPU equals the host bit for bit", "[cuda][master]", fo::bfloat16, fo::half)
{
  using P = TestType;
  auto const rule = fo::rules::with_master{make_adamw()};
  sweep<spec<slot::param_t, P>, spec<slot::grad_t, P, fill::symmetric, true>, spec<slot::master_t, float>,
        spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>(
    [&](std::int64_t) { return rule; }, std::string("with_master<adamw> ") + fo::dtype_name<P>());
}

TEST_CASE("with_master over clip + AdamW (a reduction pass) follows the host", "[cuda][master][clip]")
{
  fo::rules::clip_by_global_norm clip;
  clip.max_norm = 0.5;
  auto const rule = fo::rules::with_master{fo::chain(clip, make_adamw())};
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(rule)>> == 1);
  std::uint64_t seed = 10;
  for (scenario const& how : plan_scenarios()) {
    problem<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, fo::bfloat16, fill::symmetric, true>,
            spec<slot::master_t, float>, spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>
      p(edge_sizes(), how.placement, seed++);
    // The clip coefficient may differ in its last bits (combine order): master and moments
    // within float tolerance, param within a bfloat16 ulp.
    check_close_trajectory(p, [&](std::int64_t, bool) { return rule; }, how, trajectory_steps(),
                           tolerance{1.0 / 128, 1e-6}, "with_master<clip+adamw>");
  }
}

TEST_CASE("with_remainder on the GPU equals the host bit for bit", "[cuda][remainder]")
{
  auto const rule = fo::rules::with_remainder{make_adamw()};
  sweep<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, float, fill::symmetric, true>,
        spec<slot::remainder_t, std::int16_t>, spec<slot::exp_avg_t, float>,
        spec<slot::exp_avg_sq_t, float, fill::positive>>([&](std::int64_t) { return rule; }, "with_remainder<adamw>");
}

TEST_CASE("with_remainder on the GPU: param + remainder reconstruct the fp32 trajectory exactly", "[cuda][remainder]")
{
  std::vector<std::int64_t> const sizes = edge_sizes();
  using lowp_problem = problem<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, float, fill::symmetric, true>,
                               spec<slot::remainder_t, std::int16_t>, spec<slot::exp_avg_t, float>,
                               spec<slot::exp_avg_sq_t, float, fill::positive>>;
  using full_problem = problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>,
                               spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>;
  lowp_problem lowp(sizes, shift::same, 31);
  full_problem full(sizes, shift::same, 32);
  // Start the fp32 model from the split one: param = join(param, remainder), same moments.
  auto& lp = lowp.slot_arena<0>();
  auto& lr = lowp.slot_arena<2>();
  auto& fp = full.slot_arena<0>();
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    for (std::int64_t i = 0; i < sizes[t]; ++i) {
      fp.host[static_cast<std::size_t>(fp.offsets[t] + i)] =
        fo::join_float(lp.host[static_cast<std::size_t>(lp.offsets[t] + i)].bits, lr.host[static_cast<std::size_t>(lr.offsets[t] + i)]);
    }
  }
  full.slot_arena<2>().host = lowp.slot_arena<3>().host;
  full.slot_arena<3>().host = lowp.slot_arena<4>().host;
  push(full);

  fo::rules::clip_by_global_norm clip;
  clip.max_norm = 1e9;  // never reached: exercises the pass, coefficient exactly 1
  auto const adamw = make_adamw();
  auto const lowp_plan = fo::cuda::make_plan(lowp.lists(true));
  auto const full_plan = fo::cuda::make_plan(full.lists(true));
  for (std::int64_t t = 1; t <= trajectory_steps(); ++t) {
    lowp.refresh_inputs();
    full.slot_arena<1>().host = lowp.slot_arena<1>().host;
    push(full);
    if (t % 2 == 0) {
      lowp_plan.run(fo::rules::with_remainder{fo::chain(clip, adamw)}, fo::step_info{t});
      full_plan.run(fo::chain(clip, adamw), fo::step_info{t});
    } else {
      lowp_plan.run(fo::rules::with_remainder{adamw}, fo::step_info{t});
      full_plan.run(adamw, fo::step_info{t});
    }
    FO_TEST_CUDA(cudaDeviceSynchronize());
    pull(lowp);
    pull(full);
    std::size_t inexact = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      for (std::int64_t i = 0; i < sizes[k]; ++i) {
        float const joined = fo::join_float(lp.host[static_cast<std::size_t>(lp.offsets[k] + i)].bits,
                                            lr.host[static_cast<std::size_t>(lr.offsets[k] + i)]);
        inexact += bits_of(joined) != bits_of(fp.host[static_cast<std::size_t>(fp.offsets[k] + i)]) ? 1 : 0;
      }
    }
    INFO("step " << t);
    REQUIRE(inexact == 0);
    // Moments: same layout and data, same bits.
    REQUIRE(std::memcmp(full.slot_arena<2>().host.data(), lowp.slot_arena<3>().host.data(),
                        full.slot_arena<2>().host.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("stochastic rounding gives the same bits on host and device", "[cuda][sr]")
{
  auto const rule = fo::chain(make_adamw(), fo::rules::stochastic_round_param{20240404});
  sweep<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, fo::bfloat16, fill::symmetric, true>,
        spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>(
    [&](std::int64_t) { return rule; }, "adamw + stochastic_round_param");
  // Two slots rounded with one seed, bf16 states: independent streams, still the host's bits.
  auto const both = fo::chain(make_adamw(), fo::rules::stochastic_round<slot::param_t>{7},
                              fo::rules::stochastic_round<slot::exp_avg_t>{7});
  sweep<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, fo::bfloat16, fill::symmetric, true>,
        spec<slot::exp_avg_t, fo::bfloat16>, spec<slot::exp_avg_sq_t, float, fill::positive>>(
    [&](std::int64_t) { return both; }, "adamw + stochastic rounding of param and exp_avg", 99);
}

TEMPLATE_TEST_CASE("with_kahan on the GPU equals the host bit for bit", "[cuda][kahan]", fo::bfloat16, fo::half)
{
  using P = TestType;
  auto const rule = fo::rules::with_kahan<fo::rules::adamw, P>{make_adamw()};
  sweep<spec<slot::param_t, P>, spec<slot::grad_t, P, fill::symmetric, true>, spec<slot::compensation_t, P>,
        spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>(
    [&](std::int64_t) { return rule; }, std::string("with_kahan<adamw> ") + fo::dtype_name<P>());
}
