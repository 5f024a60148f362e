// torch.optim.Adam and AdamW on the CUDA backend: the same bits as the host backend over
// 10-step trajectories, every dtype, every transport, edge sizes and misalignments.
#include "support.cuh"

using namespace fusedopt_test;

namespace {
struct variant {
  double weight_decay;
  bool maximize;
};

template <class Rule>
Rule configure(variant v, bool amsgrad)
{
  Rule opt;
  opt.lr = 0.01;
  opt.beta1 = 0.9;
  opt.beta2 = 0.99;
  opt.eps = 1e-6;
  opt.weight_decay = v.weight_decay;
  opt.maximize = v.maximize;
  opt.amsgrad = amsgrad;
  return opt;
}

template <class Rule, class D>
void adam_sweep(variant v, char const* label)
{
  using S = typename D::state;
  sweep_optimizer<D, spec<slot::exp_avg_t, S>,
        spec<slot::exp_avg_sq_t, S, fill::positive>>([&](std::int64_t) { return configure<Rule>(v, false); }, label);
}

template <class Rule, class D>
void amsgrad_sweep(variant v, char const* label)
{
  using S = typename D::state;
  sweep_optimizer<D, spec<slot::exp_avg_t, S>,
        spec<slot::exp_avg_sq_t, S, fill::positive>, spec<slot::max_exp_avg_sq_t, S, fill::positive>>(
    [&](std::int64_t) { return configure<Rule>(v, true); }, label);
}
}  // namespace

TEMPLATE_TEST_CASE("adam matches the host backend bit for bit", "[cuda][adam]", f32, f64, f16, bf16, bf16_f32)
{
  auto const v = GENERATE(variant{0.0, false}, variant{0.01, true});
  adam_sweep<fo::rules::adam, TestType>(v, "adam");
}

TEMPLATE_TEST_CASE("adamw matches the host backend bit for bit", "[cuda][adamw]", f32, f64, f16, bf16, bf16_f32)
{
  auto const v = GENERATE(variant{0.01, false}, variant{0.1, true});
  adam_sweep<fo::rules::adamw, TestType>(v, "adamw");
}

TEMPLATE_TEST_CASE("amsgrad matches the host backend bit for bit", "[cuda][adam][amsgrad]", f32, bf16_f32)
{
  auto const v = GENERATE(variant{0.01, false});
  amsgrad_sweep<fo::rules::adam, TestType>(v, "adam amsgrad");
  amsgrad_sweep<fo::rules::adamw, TestType>(v, "adamw amsgrad");
}
