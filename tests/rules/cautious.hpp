// The cautious modifiers: cautious{adamw} (C-AdamW: torch.optim.AdamW with C-Optim's and timm's
// mask, mean over each tensor), cautious{lion} (timm's C-Lion) and cautious_weight_decay{adamw}
// (the paper's decay where update and parameter agree in sign) against double-precision
// references (reference/breadth.hpp) step by step, with maximize, over tensors of edge sizes
// typed over float, double, half and bfloat16; the insertion point and bad options. On the
// backend of `executor` (executor.hpp).
#pragma once

#include "reference/breadth.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {
namespace {

// The mask goes in front of the learning-rate block, whatever the rule's chain holds.
static_assert(std::is_same_v<fo::rules::cautious<fo::rules::adamw>::chain_type,
                             fo::chain_rule<fo::rules::negate_gradient_if, fo::rules::decoupled_weight_decay,
                                            fo::rules::scale_by_adam, fo::rules::cautious_mask, fo::rules::scale_by_lr,
                                            fo::rules::apply_update>>);
static_assert(std::is_same_v<fo::rules::cautious_weight_decay<fo::rules::lion>::chain_type,
                             fo::chain_rule<fo::rules::negate_gradient_if, fo::rules::decoupled_weight_decay,
                                            fo::rules::scale_by_lion, fo::rules::cautious_decay, fo::rules::scale_by_lr,
                                            fo::rules::apply_update>>);
static_assert(fo::pass_count_v<fo::rules::cautious<fo::rules::adamw>> == 1);
static_assert(fo::pass_count_v<fo::rules::cautious_weight_decay<fo::rules::adamw>> == 0);
static_assert(std::is_trivially_copyable_v<fo::rules::cautious<fo::rules::adamw>>);

/// Runs `rule` and the tensor-wide reference `step(t, p, g, m, v, candidates)` (returning the
/// mask counts) for reference_steps steps over param, grad, exp_avg and (SecondMoment)
/// exp_avg_sq. A parameter may match any of its candidates: elements whose mask the reference
/// cannot decide may go either way, and move their tensor's scale (breadth::masked_candidates).
/// Tensors with more than 64 such elements are not compared at that step; they must be rare
/// (bfloat16's coarse values make exact ties such as Lion's 0.8 m + 0.2 g = 0 common).
template <class T, bool SecondMoment, class Rule, class Step>
void cautious_trajectory(Rule const& rule, std::string const& label, Step&& step)
{
  checker<T> check(context<T>("cautious", label));
  random r(91);
  auto const sizes = breadth::trajectory_sizes();
  slot_data<T> param(sizes, 0), grad(sizes, 0), m(sizes, 0), v(sizes, 0);
  param.randomize(r, -1, 1);
  std::size_t skipped = 0, compared = 0;
  auto run = [&](auto const& plan) {
    for (std::int64_t t = 1; t <= reference_steps; ++t) {
      grad.randomize(r, -1, 1);
      auto const p0 = param.snapshot();
      auto const m0 = m.snapshot();
      auto const v0 = v.snapshot();
      auto const g = grad.snapshot();
      plan.run(rule, fo::step_info{t});
      for (std::size_t k = 0; k < param.num_tensors(); ++k) {
        auto const p = breadth::exact_values(p0[k]);
        auto mm = breadth::exact_values(m0[k]), vv = breadth::exact_values(v0[k]);
        std::vector<std::vector<rv>> candidates;
        if (step(t, p, g[k], mm, vv, candidates).undecided > 64) {
          ++skipped;
          continue;
        }
        ++compared;
        for (std::size_t i = 0; i < param.size(k); ++i) {
          check.any("param", k, i, param.raw(k, i), candidates[i]);
          check("exp_avg", k, i, m.raw(k, i), mm[i]);
          if constexpr (SecondMoment) { check("exp_avg_sq", k, i, v.raw(k, i), vv[i]); }
        }
      }
      INFO("step " << t);
      check.report();
    }
  };
  if constexpr (SecondMoment) {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                            writes(fo::slot::exp_avg, m), writes(fo::slot::exp_avg_sq, v)));
  } else {
    run(executor::make_plan(0, writes(fo::slot::param, param), reads(fo::slot::grad, grad),
                            writes(fo::slot::exp_avg, m)));
  }
  INFO(label << ": " << skipped << " tensor-steps with many undecided signs, " << compared << " compared");
  CHECK(skipped * 20 <= compared);
}

/// Lion with timm's cautious mask on its update: the mask of sign(c), c = beta1 m + (1 - beta1) g.
template <class T>
breadth::mask_counts cautious_lion_step(lion_reference const& ref, breadth::tensor_values const& param,
                                        std::vector<double> const& grad, breadth::tensor_values& exp_avg,
                                        std::vector<std::vector<rv>>& candidates)
{
  breadth::mask_counts counts;
  std::size_t const n = param.size();
  std::vector<double> direction(n), gradient(n);
  std::vector<bool> certain(n);
  for (std::size_t i = 0; i < n; ++i) {
    rv const g = exact(ref.maximize ? -grad[i] : grad[i]);
    rv const c = coefficient<T>(ref.beta1) * exp_avg[i] + coefficient<T>(1 - ref.beta1) * g;
    exp_avg[i] = coefficient<T>(ref.beta2) * exp_avg[i] + coefficient<T>(1 - ref.beta2) * g;
    certain[i] = breadth::sign_certain<T>(c);
    direction[i] = breadth::sign_of(c.v);
    gradient[i] = g.v;
    counts.kept += certain[i] && direction[i] * g.v > 0 ? 1 : 0;
    counts.undecided += certain[i] ? 0 : 1;
  }
  candidates.assign(n, {});
  for (std::size_t i = 0; i < n; ++i) {
    // Where the sign of c is undecided, the direction may be -1, 0 or +1; a kept one agrees
    // with the gradient.
    double const kept_direction = certain[i] ? direction[i] : breadth::sign_of(gradient[i]);
    candidates[i] = breadth::masked_candidates<T>(
      counts, n, direction[i] * gradient[i] > 0, certain[i], param[i],
      [&](rv scale) { return param[i] - coefficient<T>(ref.lr) * (exact(kept_direction) * scale); });
  }
  return counts;
}

}  // namespace

FUSEDOPT_RULE_TEST("cautious adamw matches AdamW with the cautious mask step by step", "[optimizers][cautious]")
{
  using T = TestType;
  auto const [maximize, weight_decay] = GENERATE(table<bool, double>({{false, 0.1}, {true, 0.0}}));
  namespace af = adam_family;
  breadth::cautious_adamw_reference const ref{af::lr, af::beta1, af::beta2, af::eps, weight_decay, maximize, true, false};
  fo::rules::cautious const rule{adam_family::rule<fo::rules::adamw>(weight_decay, maximize)};
  std::ostringstream label;
  label << "adamw maximize=" << maximize << " weight_decay=" << weight_decay;
  cautious_trajectory<T, true>(rule, label.str(),
                               [&](std::int64_t t, auto const& p, auto const& g, auto& m, auto& v, auto& candidates) {
                                 return ref.step<T>(t, p, g, m, v, candidates);
                               });
}

FUSEDOPT_RULE_TEST("cautious adamw comparing exp_avg matches C-Optim's C-AdamW step by step", "[optimizers][cautious]")
{
  // The reference decides the mask by exp_avg's sign (undecided where rounding could flip it),
  // which is what this form compares.
  using T = TestType;
  namespace af = adam_family;
  breadth::cautious_adamw_reference const ref{af::lr, af::beta1, af::beta2, af::eps, 0.1, false, true, false};
  fo::rules::cautious<fo::rules::adamw, fo::rules::cautious_sign_of::exp_avg> const rule{
    adam_family::rule<fo::rules::adamw>(0.1, false)};
  cautious_trajectory<T, true>(rule, "adamw exp_avg sign",
                               [&](std::int64_t t, auto const& p, auto const& g, auto& m, auto& v, auto& candidates) {
                                 return ref.step<T>(t, p, g, m, v, candidates);
                               });
}

FUSEDOPT_RULE_TEST("cautious lion matches Lion with the cautious mask step by step", "[optimizers][cautious]")
{
  using T = TestType;
  bool const maximize = true;
  lion_reference const ref{0.01, 0.8, 0.95, 0.0, maximize};
  fo::rules::lion lion;
  lion.lr = ref.lr;
  lion.beta1 = ref.beta1;
  lion.beta2 = ref.beta2;
  lion.maximize = maximize;
  std::ostringstream label;
  label << "lion maximize=" << maximize;
  cautious_trajectory<T, false>(fo::rules::cautious{lion}, label.str(),
                          [&](std::int64_t, auto const& p, auto const& g, auto& m, auto&, auto& candidates) {
                            return cautious_lion_step<T>(ref, p, g, m, candidates);
                          });
}

FUSEDOPT_RULE_TEST("cautious_weight_decay adamw decays where update and parameter agree", "[optimizers][cautious]")
{
  using T = TestType;
  bool const maximize = false;
  namespace af = adam_family;
  breadth::cautious_adamw_reference const ref{af::lr, af::beta1, af::beta2, af::eps, 0.5, maximize, false, true};
  fo::rules::cautious_weight_decay const rule{adam_family::rule<fo::rules::adamw>(0.0, maximize), 0.5};
  std::ostringstream label;
  label << "cautious weight decay maximize=" << maximize;
  cautious_trajectory<T, true>(rule, label.str(),
                               [&](std::int64_t t, auto const& p, auto const& g, auto& m, auto& v, auto& candidates) {
                                 return ref.step<T>(t, p, g, m, v, candidates);
                               });
}

FUSEDOPT_RULE_TEST("the cautious modifiers reject bad options before writing", "[optimizers][cautious][errors]")
{
  fo::rules::cautious mask{fo::rules::adamw{}};
  fo::rules::cautious_weight_decay decay{fo::rules::adamw{}, 0.1};
  breadth::moments_problem<TestType> problem;
  SECTION("a mean clamp of 0")
  {
    mask.min_mean = 0.0;
    problem.template rejects<executor>(mask);
  }
  SECTION("the inner rule's options")
  {
    mask.rule.beta1 = 1.0;
    problem.template rejects<executor>(mask);
  }
  SECTION("a negative cautious weight decay")
  {
    decay.weight_decay = -0.1;
    problem.template rejects<executor>(decay);
  }
}

}  // namespace fusedopt_test
