// Adamax, NAdam, RAdam and Lion on the CUDA backend: the same bits as the host backend over
// 10-step trajectories, every dtype, every transport, edge sizes and misalignments.
#include "support.cuh"

using namespace fusedopt_test;

TEMPLATE_TEST_CASE("adamax matches the host backend bit for bit", "[cuda][adamax]", f32, f64, f16, bf16, bf16_f32)
{
  using S = typename TestType::state;
  double const weight_decay = GENERATE(0.0, 0.01);
  sweep_optimizer<TestType, spec<slot::exp_avg_t, S>, spec<slot::exp_inf_t, S, fill::positive>>(
    every_step<fo::rules::adamax>([&](auto& opt) {
      opt.lr = 0.01; opt.weight_decay = weight_decay; opt.maximize = weight_decay > 0;
    }),
    "adamax");
}

TEMPLATE_TEST_CASE("nadam matches the host backend bit for bit", "[cuda][nadam]", f32, f64, f16, bf16, bf16_f32)
{
  using P = typename TestType::param;
  using S = typename TestType::state;
  bool const decoupled = GENERATE(false, true);
  for (scenario const& how : scenarios()) {
    adam_problem_of<P, S> p(edge_sizes(), how.placement, 77);
    fo::rules::nadam opt;
    opt.lr = 0.01;
    opt.weight_decay = 0.01;
    opt.decoupled_weight_decay = decoupled;
    fo::rules::nadam_mu_product mu;
    // make_rule is called once per step, in order: the running product advances with it.
    check_trajectory(
      p,
      [&](std::int64_t) {
        opt.mu_product = mu.value();
        mu.advance(opt);
        return opt;
      },
      how, trajectory_steps(), "nadam");
  }
}

TEMPLATE_TEST_CASE("radam matches the host backend bit for bit", "[cuda][radam]", f32, f64, f16, bf16, bf16_f32)
{
  using S = typename TestType::state;
  bool const decoupled = GENERATE(false, true);
  // Steps 1-5 take the unrectified branch (rho_t <= 5), later steps the rectified one.
  sweep_optimizer<TestType, spec<slot::exp_avg_t, S>, spec<slot::exp_avg_sq_t, S, fill::positive>>(
    every_step<fo::rules::radam>([&](auto& opt) {
      opt.lr = 0.01; opt.weight_decay = 0.01; opt.decoupled_weight_decay = decoupled;
    }),
    "radam");
}

TEMPLATE_TEST_CASE("lion matches the host backend bit for bit", "[cuda][lion]", f32, f64, f16, bf16, bf16_f32)
{
  using S = typename TestType::state;
  double const weight_decay = GENERATE(0.0, 0.1);
  sweep_optimizer<TestType, spec<slot::exp_avg_t, S>>(
    every_step<fo::rules::lion>([&](auto& opt) {
      opt.lr = 0.001; opt.weight_decay = weight_decay; opt.maximize = weight_decay > 0;
    }),
    "lion");
}
