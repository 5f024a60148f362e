// Built WITHOUT -fmad=false (tests/CMakeLists.txt): nvcc contracts a*b+c into FMAs, the host
// backend (g++ on x86-64) does not, so results may differ in the last bits. This test bounds
// the difference for Adam in float over 10 steps (docs/cuda.md, "Bit identity").
#include "support.cuh"

#include <cmath>

using namespace fusedopt_test;

namespace {
// |a - b| in units of the last place of max(|a|, |b|, floor): a relative ulp distance that
// does not explode where a state happens to cancel to almost zero.
double ulps(float a, float b, float floor)
{
  float const scale = std::fmax(std::fmax(std::fabs(a), std::fabs(b)), floor);
  float const ulp = std::nextafter(scale, INFINITY) - scale;
  return std::fabs(static_cast<double>(a) - static_cast<double>(b)) / ulp;
}
}  // namespace

TEST_CASE("with FMA contraction adam stays within a few ulp of the host backend", "[cuda][fmad]")
{
  // The bound of docs/cuda.md: at most this many ulp (relative to max(|x|, 2^-6)) per slot
  // after 10 steps. Measured on the H100: param 8, exp_avg 30.5, exp_avg_sq 2.
  constexpr double bound = 64;
  std::vector<std::int64_t> const sizes = {1, 7, 1000, 4097, 65537};
  problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>, spec<slot::exp_avg_t, float>,
          spec<slot::exp_avg_sq_t, float, fill::positive>>
    p(sizes, shift::none, 42);
  auto host_plan = fo::host::make_plan(p.lists(false));
  auto device_plan = fo::cuda::make_plan(p.lists(true));
  fo::rules::adamw opt;
  opt.lr = 0.01;
  for (std::int64_t t = 1; t <= 10; ++t) {
    p.refresh_inputs();
    host_plan.run(opt, fo::step_info{t});
    device_plan.run(opt, fo::step_info{t});
  }
  FO_TEST_CUDA(cudaDeviceSynchronize());
  char const* names[] = {"param", "grad", "exp_avg", "exp_avg_sq"};
  double worst[4] = {};
  std::size_t differing[4] = {};
  auto measure = [&](auto& arena, int k) {
    std::vector<float> device_values(arena.host.size());
    FO_TEST_CUDA(cudaMemcpy(device_values.data(), arena.device, device_values.size() * sizeof(float),
                            cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < device_values.size(); ++i) {
      double const d = ulps(device_values[i], arena.host[i], 1.f / 64);
      worst[k] = std::fmax(worst[k], d);
      differing[k] += d > 0 ? 1 : 0;
    }
  };
  measure(p.slot_arena<0>(), 0);
  measure(p.slot_arena<1>(), 1);
  measure(p.slot_arena<2>(), 2);
  measure(p.slot_arena<3>(), 3);
  for (int k = 0; k < 4; ++k) {
    std::printf("fmad: %-10s worst %.3g ulp, %zu elements differ\n", names[k], worst[k], differing[k]);
    CHECK(worst[k] <= bound);
  }
  CHECK(worst[1] == 0);  // the gradient is never written
}
