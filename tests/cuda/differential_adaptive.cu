// Adagrad, Adadelta and RMSprop on the CUDA backend: the same bits as the host backend over
// 10-step trajectories, every dtype, every transport, edge sizes and misalignments.
#include "support.cuh"

using namespace fusedopt_test;

TEMPLATE_TEST_CASE("adagrad matches the host backend bit for bit", "[cuda][adagrad]", f32, f64, f16, bf16, bf16_f32)
{
  using S = typename TestType::state;
  double const lr_decay = GENERATE(0.0, 0.01);
  sweep_optimizer<TestType, spec<slot::sum_sq_t, S, fill::positive>>(
    every_step<fo::rules::adagrad>([&](auto& opt) {
      opt.lr = 0.05; opt.lr_decay = lr_decay; opt.weight_decay = lr_decay > 0 ? 0.01 : 0.0;
      opt.maximize = lr_decay > 0;
    }),
    "adagrad");
}

TEMPLATE_TEST_CASE("adadelta matches the host backend bit for bit", "[cuda][adadelta]", f32, f64, f16, bf16, bf16_f32)
{
  using S = typename TestType::state;
  double const weight_decay = GENERATE(0.0, 0.01);
  sweep_optimizer<TestType, spec<slot::square_avg_t, S, fill::positive>, spec<slot::acc_delta_t, S, fill::positive>>(
    every_step<fo::rules::adadelta>([&](auto& opt) {
      opt.lr = 0.5; opt.rho = 0.9; opt.weight_decay = weight_decay; opt.maximize = weight_decay > 0;
    }),
    "adadelta");
}

TEMPLATE_TEST_CASE("rmsprop matches the host backend bit for bit", "[cuda][rmsprop]", f32, f64, f16, bf16, bf16_f32)
{
  using S = typename TestType::state;
  auto const make = [](bool centered, double momentum) {
    return [=](std::int64_t) {
      fo::rules::rmsprop opt;
      opt.lr = 0.01;
      opt.alpha = 0.9;
      opt.centered = centered;
      opt.momentum = momentum;
      opt.weight_decay = momentum > 0 ? 0.01 : 0.0;
      return opt;
    };
  };
  SECTION("plain")
  {
    sweep_optimizer<TestType, spec<slot::square_avg_t, S, fill::positive>>(make(false, 0.0), "rmsprop");
  }
  SECTION("centered with momentum")
  {
    sweep_optimizer<TestType, spec<slot::square_avg_t, S, fill::positive>, spec<slot::grad_avg_t, S, fill::small>,
          spec<slot::momentum_buffer_t, S>>(make(true, 0.9), "rmsprop centered momentum");
  }
}
