// NAdam with its running product in device memory, advanced by the step itself
// (rules::advance_mu_product, as fusedopt_torch's NAdam under capturable=True): a step
// captured once in a CUDA graph and replayed N times gives the bits of N host-backend steps
// whose product the host helper (rules::nadam_mu_product) keeps, and the device's product is
// the helper's, bit for bit; in double and rounded to float as torch's float32 state.
#include "support.cuh"
#include "reference/nadam_product.hpp"

#include <cmath>

using namespace fusedopt_test;
namespace fo = fusedopt;
namespace slot = fusedopt::slot;

namespace {

using nadam_problem = problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>,
                              spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>;

struct device_state {
  double product;
  std::int64_t step;
};

}  // namespace

TEST_CASE("nadam with advance_mu_product, captured and replayed, equals host steps with the host helper",
          "[cuda][graph][nadam]")
{
  bool const single = GENERATE(false, true);
  int const steps = quick() ? 4 : 12;
  std::vector<std::int64_t> const sizes = edge_sizes();
  nadam_problem p(sizes, shift::same, 21);

  device_array<device_state> state(1);
  state.set(device_state{1.0, 0});
  fo::rules::nadam device_opt = fusedopt_test::nadam_with_moving_mu();
  device_opt.mu_product = fo::scalar<double>::from_pointer(&state.get()->product);
  auto const device_rule = fo::chain(
    device_opt, fo::rules::advance_mu_product{&state.get()->product, device_opt.beta1, device_opt.momentum_decay, single});
  fo::step_info device_step{fo::scalar<std::int64_t>::from_pointer(&state.get()->step)};
  device_step.advance = &state.get()->step;

  cudaStream_t stream = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto const device_plan = fo::cuda::make_plan(p.lists(true), {}, stream);
  auto const host_plan = fo::host::make_plan(p.lists(false));

  captured_graph const graph(stream, [&] { device_plan.run(device_rule, device_step, stream); });

  double product = 1.0;  // the host's: torch's state['mu_product'] before the step
  fo::rules::nadam host_opt = fusedopt_test::nadam_with_moving_mu();
  for (std::int64_t t = 1; t <= steps; ++t) {
    p.refresh_inputs();
    FO_TEST_CUDA(cudaDeviceSynchronize());
    graph.launch(stream);
    host_opt.mu_product = product;
    host_plan.run(host_opt, fo::step_info{t});
    product = fo::rules::advance_mu_product::advanced(
      product, fo::rules::scale_by_nadam::mu(host_opt.beta1.value, host_opt.momentum_decay.value, t), single);
    FO_TEST_CUDA(cudaStreamSynchronize(stream));
    p.require_same_bits("nadam replay " + std::to_string(t) + (single ? " (float product)" : " (double product)"));
    device_state const s = state.value();
    CHECK(s.step == t);
    CHECK(same_bits(s.product, product));
    if (single) { CHECK(static_cast<double>(static_cast<float>(s.product)) == s.product); }
  }
  // The helper keeps the double product the same way.
  if (!single) {
    fo::rules::nadam_mu_product helper;
    for (int t = 0; t < steps; ++t) { helper.advance(host_opt); }
    CHECK(same_bits(helper.value(), product));
  }
  FO_TEST_CUDA(cudaStreamDestroy(stream));
}
