// Adamax, NAdam, RAdam and Lion on the CUDA backend: the same bits as the host backend over
// 10-step trajectories, every dtype, every transport, edge sizes and misalignments.
#include "support.cuh"

using namespace fusedopt_test;
namespace fo = fusedopt;
namespace slot = fusedopt::slot;

TEMPLATE_TEST_CASE("adamax matches the host backend bit for bit", "[cuda][adamax]", f32, f64, f16, bf16, bf16_f32)
{
  using P = typename TestType::param;
  using S = typename TestType::state;
  double const weight_decay = GENERATE(0.0, 0.01);
  sweep<spec<slot::param_t, P>, spec<slot::grad_t, P, fill::symmetric, true>, spec<slot::exp_avg_t, S>,
        spec<slot::exp_inf_t, S, fill::positive>>(
    [&](std::int64_t) {
      fo::rules::adamax opt;
      opt.lr = 0.01;
      opt.weight_decay = weight_decay;
      opt.maximize = weight_decay > 0;
      return opt;
    },
    "adamax");
}

TEMPLATE_TEST_CASE("nadam matches the host backend bit for bit", "[cuda][nadam]", f32, f64, f16, bf16, bf16_f32)
{
  using P = typename TestType::param;
  using S = typename TestType::state;
  bool const decoupled = GENERATE(false, true);
  for (scenario const& how : scenarios()) {
    problem<spec<slot::param_t, P>, spec<slot::grad_t, P, fill::symmetric, true>, spec<slot::exp_avg_t, S>,
            spec<slot::exp_avg_sq_t, S, fill::positive>>
      p(edge_sizes(), how.placement, 77);
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
  using P = typename TestType::param;
  using S = typename TestType::state;
  bool const decoupled = GENERATE(false, true);
  // Steps 1-5 take the unrectified branch (rho_t <= 5), later steps the rectified one.
  sweep<spec<slot::param_t, P>, spec<slot::grad_t, P, fill::symmetric, true>, spec<slot::exp_avg_t, S>,
        spec<slot::exp_avg_sq_t, S, fill::positive>>(
    [&](std::int64_t) {
      fo::rules::radam opt;
      opt.lr = 0.01;
      opt.weight_decay = 0.01;
      opt.decoupled_weight_decay = decoupled;
      return opt;
    },
    "radam");
}

TEMPLATE_TEST_CASE("lion matches the host backend bit for bit", "[cuda][lion]", f32, f64, f16, bf16, bf16_f32)
{
  using P = typename TestType::param;
  using S = typename TestType::state;
  double const weight_decay = GENERATE(0.0, 0.1);
  sweep<spec<slot::param_t, P>, spec<slot::grad_t, P, fill::symmetric, true>, spec<slot::exp_avg_t, S>>(
    [&](std::int64_t) {
      fo::rules::lion opt;
      opt.lr = 0.001;
      opt.weight_decay = weight_decay;
      opt.maximize = weight_decay > 0;
      return opt;
    },
    "lion");
}
