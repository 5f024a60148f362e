// torch.optim.SGD on the CUDA backend: the same bits as the host backend over 10-step
// trajectories, every dtype, every transport, edge sizes and misalignments.
#include "support.cuh"

using namespace fusedopt_test;

TEMPLATE_TEST_CASE("sgd without momentum matches the host backend bit for bit", "[cuda][sgd]", f32, f64, f16, bf16)
{
  bool const maximize = GENERATE(false, true);
  double const weight_decay = GENERATE(0.0, 0.01);
  sweep_optimizer<TestType>(
    [&](std::int64_t) {
      fo::rules::sgd opt;
      opt.lr = 0.05;
      opt.weight_decay = weight_decay;
      opt.maximize = maximize;
      return opt;
    },
    "sgd");
}

TEMPLATE_TEST_CASE("sgd with momentum matches the host backend bit for bit", "[cuda][sgd]", f32, f64, f16, bf16,
                   bf16_f32)
{
  using S = typename TestType::state;
  struct variant {
    double momentum, dampening, weight_decay;
    bool nesterov, maximize;
  };
  auto const v = GENERATE(variant{0.9, 0.0, 0.0, false, false}, variant{0.9, 0.1, 0.01, false, true},
                          variant{0.8, 0.0, 0.001, true, false});
  sweep_optimizer<TestType, spec<slot::momentum_buffer_t, S>>(
    [&](std::int64_t) {
      fo::rules::sgd opt;
      opt.lr = 0.01;
      opt.momentum = v.momentum;
      opt.dampening = v.dampening;
      opt.weight_decay = v.weight_decay;
      opt.nesterov = v.nesterov;
      opt.maximize = v.maximize;
      return opt;
    },
    "sgd momentum");
}
