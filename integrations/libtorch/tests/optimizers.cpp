// fusedopt::libtorch's optimizers against libtorch's own (torch::optim::AdamW, Adam, SGD): 20 steps from the same parameters and gradients, every parameter and state within a
// few float roundings per step (torch's C++ step rounds after each of its 8-9 operations, the
// fused step once per formula, so the bits differ); param groups with their own options; an lr
// changed through the options (what LR schedulers do) between steps; checkpoints that load
// across the two implementations (torch::save / torch::load) and continue alike; gradients
// that are new tensors every step (zero_grad) rebound, not rebuilt; a parameter without a
// gradient skipped and its step count kept apart; moved parameters and states rebound; refused
// input with nothing written; the cached step path (changed input after cached steps checked
// again); the library's extras (maximize, max_grad_norm, and on CPU bfloat16 parameters with
// stochastic rounding or Kahan compensation, 8-bit states, their checkpoints).
//
// Compiled twice: libtorch_optimizers steps CPU tensors (the host backend), and
// libtorch_optimizers_cuda (FUSEDOPT_LIBTORCH_TEST_CUDA, with make_cuda_steps() from
// tests/cuda_steps.cu) the same cases on CUDA tensors, plus the CUDA-only ones: a group on two
// devices, CUDA parameters without fusedopt's CUDA plans, a step captured in a CUDA graph.
#include <fusedopt/libtorch/optimizers.hpp>

#include <torch/torch.h>

#if defined(FUSEDOPT_LIBTORCH_TEST_CUDA) && FUSEDOPT_LIBTORCH_CUDA_STREAMS && __has_include(<ATen/cuda/CUDAGraph.h>)
#  include <ATen/cuda/CUDAGraph.h>
#  include <c10/cuda/CUDAGuard.h>
#  include <c10/cuda/CUDAStream.h>
#  define FUSEDOPT_LIBTORCH_TEST_GRAPHS 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "catch.hpp"

namespace {

#if defined(FUSEDOPT_LIBTORCH_TEST_CUDA)
torch::Device const device{torch::kCUDA, 0};
fusedopt::libtorch::cuda_config config() { return {fusedopt::libtorch::make_cuda_steps()}; }
#else
torch::Device const device{torch::kCPU};
fusedopt::libtorch::cuda_config config() { return {}; }
#endif

torch::TensorOptions on_device(torch::Dtype dtype = torch::kFloat) { return torch::dtype(dtype).device(device); }

std::vector<torch::Tensor> make_params(std::vector<std::vector<std::int64_t>> const& shapes, torch::Dtype dtype)
{
  torch::manual_seed(0);
  std::vector<torch::Tensor> out;
  for (auto const& s : shapes) { out.push_back(torch::randn(s, on_device(dtype)).set_requires_grad(true)); }
  return out;
}

std::vector<torch::Tensor> clones(std::vector<torch::Tensor> const& ts)
{
  std::vector<torch::Tensor> out;
  for (auto const& t : ts) { out.push_back(t.detach().clone().set_requires_grad(true)); }
  return out;
}

/// New gradient tensors (as after zero_grad()) for both lists, the same values.
void set_grads(std::vector<torch::Tensor>& a, std::vector<torch::Tensor>& b, int step)
{
  torch::manual_seed(1000 + step);
  for (std::size_t k = 0; k < a.size(); ++k) {
    auto g = torch::randn(a[k].sizes(), on_device()).to(a[k].scalar_type());
    a[k].mutable_grad() = g.clone();
    b[k].mutable_grad() = g.clone();
  }
}

/// The largest difference between a and b relative to the largest magnitude of b (or 1 if b is 0).
/// With `least_scale`, relative to that scale where b's largest magnitude is smaller.
double distance(torch::Tensor const& a, torch::Tensor const& b, double least_scale = 0)
{
  auto const scale = std::max(b.abs().max().item<double>(), least_scale);
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

std::vector<std::vector<std::int64_t>> const shapes{{64, 33}, {7}, {3, 5, 9}, {1}, {1000}};

template <class Ours, class Theirs, class Options, class Compare>
void compare_steps(Options const& options, torch::Dtype dtype, double per_step, Compare&& compare_states)
{
  auto a = make_params(shapes, dtype);
  auto b = clones(a);
  Ours ours(a, options, config());
  Theirs theirs(b, options);
  double worst = 0;
  for (int step = 1; step <= 20; ++step) {
    set_grads(a, b, step);
    ours.step();
    theirs.step();
    for (std::size_t k = 0; k < a.size(); ++k) {
      double const d = distance(a[k], b[k]);
      worst = std::max(worst, d);
      REQUIRE(d <= per_step * step);
      // The states' formulas round in other places (the lerp form of the moments): a few more
      // roundings of their largest magnitude than the parameters.
      compare_states(ours, theirs, a[k], b[k], 8 * per_step * step);
    }
  }
  REQUIRE(ours.plan_builds() == 1);  // new gradients every step: rebound
  std::printf("%s vs torch::optim, %s on %s: parameters within %.2e of their largest magnitude over 20 steps\n",
              Ours::name, c10::toString(dtype), device.str().c_str(), worst);
}

template <class State>
State const& state_of(torch::optim::Optimizer& opt, torch::Tensor const& p)
{
  auto& map = opt.state();
  return static_cast<State const&>(*map.at(fusedopt::libtorch::detail::state_key<std::decay_t<decltype(map)>>(p)));
}

/// Lion as lion-pytorch writes it, in libtorch operations (no torch::optim class has it).
struct reference_lion {
  std::vector<torch::Tensor> params, exp_avg;
  fusedopt::libtorch::LionOptions o;
  reference_lion(std::vector<torch::Tensor> ps, fusedopt::libtorch::LionOptions const& options)
      : params(std::move(ps)), exp_avg(params.size()), o(options)
  {
  }
  void step()
  {
    torch::NoGradGuard no_grad;
    auto const [b1, b2] = o.betas();
    for (std::size_t k = 0; k < params.size(); ++k) {
      auto& p = params[k];
      if (!p.grad().defined()) { continue; }
      auto const& g = p.grad();
      if (!exp_avg[k].defined()) { exp_avg[k] = torch::zeros_like(p); }
      p.mul_(1 - o.lr() * o.weight_decay());
      auto const update = (exp_avg[k] * b1).add(g, 1 - b1).sign();
      p.add_(update, -o.lr());
      exp_avg[k].mul_(b2).add_(g, 1 - b2);
    }
  }
};

/// LAMB as apex's FusedLAMB computes it (decoupled decay in adam_w_mode, else L2; the trust
/// ratio ||p|| / ||update|| per tensor while weight_decay is not 0 or with use_nvlamb), in
/// libtorch operations.
struct reference_lamb {
  std::vector<torch::Tensor> params, exp_avg, exp_avg_sq;
  std::int64_t step_count = 0;
  fusedopt::libtorch::LAMBOptions o;
  reference_lamb(std::vector<torch::Tensor> ps, fusedopt::libtorch::LAMBOptions const& options)
      : params(std::move(ps)), exp_avg(params.size()), exp_avg_sq(params.size()), o(options)
  {
  }
  void step()
  {
    torch::NoGradGuard no_grad;
    ++step_count;
    auto const [b1, b2] = o.betas();
    double const bc1 = o.bias_correction() ? 1 - std::pow(b1, step_count) : 1;
    double const bc2 = o.bias_correction() ? 1 - std::pow(b2, step_count) : 1;
    for (std::size_t k = 0; k < params.size(); ++k) {
      auto& p = params[k];
      if (!p.grad().defined()) { continue; }
      auto g = p.grad();
      if (!exp_avg[k].defined()) {
        exp_avg[k] = torch::zeros_like(p);
        exp_avg_sq[k] = torch::zeros_like(p);
      }
      if (!o.adam_w_mode()) { g = g.add(p, o.weight_decay()); }
      exp_avg[k].mul_(b1).add_(g, o.grad_averaging() ? 1 - b1 : 1.0);
      exp_avg_sq[k].mul_(b2).addcmul_(g, g, 1 - b2);
      auto update = (exp_avg[k] / bc1) / ((exp_avg_sq[k] / bc2).sqrt() + o.eps());
      if (o.adam_w_mode()) { update.add_(p, o.weight_decay()); }
      double ratio = 1;
      if (o.use_nvlamb() || o.weight_decay() != 0) {
        double const w = p.to(torch::kDouble).norm().item<double>();
        double const u = update.to(torch::kDouble).norm().item<double>();
        if (w > 0 && u > 0) { ratio = std::min(w / u, o.max_trust_ratio()); }
      }
      p.add_(update, -o.lr() * ratio);
    }
  }
};

}  // namespace

TEST_CASE("AdamW steps as torch::optim::AdamW", "[libtorch]")
{
  bool const amsgrad = GENERATE(false, true);
  auto const options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad);
  compare_steps<fusedopt::libtorch::AdamW, torch::optim::AdamW>(
    options, torch::kFloat, 4e-7, [](auto& ours, auto& theirs, auto const& p, auto const& q, double bound) {
      auto const& s = state_of<torch::optim::AdamWParamState>(ours, p);
      auto const& t = state_of<torch::optim::AdamWParamState>(theirs, q);
      REQUIRE(s.step() == t.step());
      REQUIRE(distance(s.exp_avg(), t.exp_avg()) <= bound);
      REQUIRE(distance(s.exp_avg_sq(), t.exp_avg_sq()) <= bound);
    });
  compare_steps<fusedopt::libtorch::AdamW, torch::optim::AdamW>(options, torch::kDouble, 1e-14,
                                                                [](auto&&...) {});
}

TEST_CASE("Adam steps as torch::optim::Adam (L2 decay in the gradient)", "[libtorch]")
{
  auto const options = torch::optim::AdamOptions(1e-2).weight_decay(0.05);
  compare_steps<fusedopt::libtorch::Adam, torch::optim::Adam>(
    options, torch::kFloat, 4e-7, [](auto& ours, auto& theirs, auto const& p, auto const& q, double bound) {
      auto const& s = state_of<torch::optim::AdamParamState>(ours, p);
      auto const& t = state_of<torch::optim::AdamParamState>(theirs, q);
      REQUIRE(s.step() == t.step());
      REQUIRE(distance(s.exp_avg_sq(), t.exp_avg_sq()) <= bound);
    });
}

TEST_CASE("SGD steps as torch::optim::SGD", "[libtorch]")
{
  auto const nesterov = GENERATE(false, true);
  auto options = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01).nesterov(nesterov);
  if (!nesterov) { options.dampening(0.1); }
  compare_steps<fusedopt::libtorch::SGD, torch::optim::SGD>(
    options, torch::kFloat, 2e-7, [](auto& ours, auto& theirs, auto const& p, auto const& q, double bound) {
      auto const& s = state_of<torch::optim::SGDParamState>(ours, p);
      auto const& t = state_of<torch::optim::SGDParamState>(theirs, q);
      REQUIRE(distance(s.momentum_buffer(), t.momentum_buffer()) <= bound);
    });
  compare_steps<fusedopt::libtorch::SGD, torch::optim::SGD>(torch::optim::SGDOptions(0.05), torch::kFloat, 2e-7,
                                                            [](auto&&...) {});
}

TEST_CASE("Adagrad steps as torch::optim::Adagrad", "[libtorch]")
{
  auto const options =
    torch::optim::AdagradOptions(5e-2).lr_decay(0.01).weight_decay(0.05).initial_accumulator_value(0.1);
  compare_steps<fusedopt::libtorch::Adagrad, torch::optim::Adagrad>(
    options, torch::kFloat, 4e-7, [](auto& ours, auto& theirs, auto const& p, auto const& q, double bound) {
      auto const& s = state_of<torch::optim::AdagradParamState>(ours, p);
      auto const& t = state_of<torch::optim::AdagradParamState>(theirs, q);
      REQUIRE(s.step() == t.step());
      REQUIRE(distance(s.sum(), t.sum()) <= bound);
    });
  compare_steps<fusedopt::libtorch::Adagrad, torch::optim::Adagrad>(options, torch::kDouble, 1e-14,
                                                                    [](auto&&...) {});
}

TEST_CASE("RMSprop steps as torch::optim::RMSprop", "[libtorch]")
{
  auto const momentum = GENERATE(0.0, 0.9);
  auto const centered = GENERATE(false, true);
  auto const options =
    torch::optim::RMSpropOptions(1e-2).alpha(0.9).weight_decay(0.05).momentum(momentum).centered(centered);
  compare_steps<fusedopt::libtorch::RMSprop, torch::optim::RMSprop>(
    options, torch::kFloat, 4e-7, [](auto& ours, auto& theirs, auto const& p, auto const& q, double bound) {
      auto const& s = state_of<torch::optim::RMSpropParamState>(ours, p);
      auto const& t = state_of<torch::optim::RMSpropParamState>(theirs, q);
      REQUIRE(s.step() == t.step());
      REQUIRE(distance(s.square_avg(), t.square_avg()) <= bound);
      if (t.grad_avg().defined()) { REQUIRE(distance(s.grad_avg(), t.grad_avg()) <= bound); }
      // The buffer's terms (momentum * buffer and grad / avg, about 1 / sqrt(1 - alpha) in
      // magnitude) can cancel to a sum near 0 in a small tensor, where a rounding of a term is a
      // large part of the sum (torch's CUDA kernel rounds them otherwise than its CPU one): the
      // difference is measured against the terms' scale, 1 at least, not the sum's.
      if (t.momentum_buffer().defined()) {
        REQUIRE(distance(s.momentum_buffer(), t.momentum_buffer(), 1.0) <= bound);
      }
    });
}

TEST_CASE("Lion steps as lion-pytorch (a reference in libtorch operations)", "[libtorch]")
{
  // float64: a direction within a rounding of 0 may take the other sign in float32, which moves
  // that element by 2 lr (both are right).
  auto const options = fusedopt::libtorch::LionOptions(3e-3).betas(std::make_tuple(0.9, 0.99)).weight_decay(0.5);
  compare_steps<fusedopt::libtorch::Lion, reference_lion>(options, torch::kDouble, 1e-14, [](auto&&...) {});
}

TEST_CASE("LAMB steps as apex's FusedLAMB (a reference in libtorch operations)", "[libtorch]")
{
  auto const nvlamb = GENERATE(false, true);
  auto const adam_w_mode = GENERATE(true, false);
  auto const options = fusedopt::libtorch::LAMBOptions(1e-2)
                         .weight_decay(nvlamb ? 0.0 : 0.01)
                         .use_nvlamb(nvlamb)
                         .adam_w_mode(adam_w_mode);
  compare_steps<fusedopt::libtorch::LAMB, reference_lamb>(options, torch::kFloat, 1e-6, [](auto&&...) {});
  compare_steps<fusedopt::libtorch::LAMB, reference_lamb>(options, torch::kDouble, 1e-13, [](auto&&...) {});
}

TEST_CASE("Lion and LAMB: groups keep their own options (add_group), checkpoints continue the run", "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a[0], a[1]});
  groups.emplace_back(std::vector<torch::Tensor>{a[2], a[3]},
                      std::make_unique<fusedopt::libtorch::LAMBOptions>(fusedopt::libtorch::LAMBOptions(5e-3)));
  fusedopt::libtorch::LAMB ours(groups, fusedopt::libtorch::LAMBOptions(1e-2), config());
  ours.add_group(torch::optim::OptimizerParamGroup(
    {a[4]}, std::make_unique<fusedopt::libtorch::LAMBOptions>(fusedopt::libtorch::LAMBOptions(2e-3).eps(1e-5))));
  REQUIRE(ours.param_groups().size() == 3);
  REQUIRE(ours.param_groups()[0].options().get_lr() == 1e-2);
  REQUIRE(ours.param_groups()[1].options().get_lr() == 5e-3);
  REQUIRE(static_cast<fusedopt::libtorch::LAMBOptions const&>(ours.param_groups()[2].options()).eps() == 1e-5);
  REQUIRE_THROWS_WITH(ours.add_group(torch::optim::OptimizerParamGroup({a[4]})),
                      fusedopt_test::contains("more than one parameter group"));
  auto b = clones(a);
  for (int step = 1; step <= 3; ++step) {
    set_grads(a, b, step);
    ours.step();
  }
  std::string const path = "fusedopt_libtorch_lamb.pt";
  torch::save(ours, path);
  // The same parameters' values in a second optimizer that loads the checkpoint: both continue alike.
  for (std::size_t k = 0; k < a.size(); ++k) { b[k].detach().copy_(a[k].detach()); }
  // The groups built as before (torch 1.x's load keeps the groups' options; 2.x's also reads them).
  std::vector<torch::optim::OptimizerParamGroup> groups_b;
  groups_b.emplace_back(std::vector<torch::Tensor>{b[0], b[1]});
  groups_b.emplace_back(std::vector<torch::Tensor>{b[2], b[3]},
                        std::make_unique<fusedopt::libtorch::LAMBOptions>(fusedopt::libtorch::LAMBOptions(5e-3)));
  groups_b.emplace_back(std::vector<torch::Tensor>{b[4]},
                        std::make_unique<fusedopt::libtorch::LAMBOptions>(fusedopt::libtorch::LAMBOptions(2e-3).eps(1e-5)));
  fusedopt::libtorch::LAMB loaded(groups_b, fusedopt::libtorch::LAMBOptions(1e-2), config());
  torch::load(loaded, path);
  std::remove(path.c_str());
  REQUIRE(loaded.param_groups()[1].options().get_lr() == 5e-3);
  for (int step = 4; step <= 6; ++step) {
    set_grads(a, b, step);
    ours.step();
    loaded.step();
  }
  for (std::size_t k = 0; k < a.size(); ++k) {
    REQUIRE(torch::equal(a[k], b[k]));
    REQUIRE(state_of<fusedopt::libtorch::LAMBParamState>(loaded, b[k]).step() == 6);
  }
}

TEST_CASE("param groups keep their own options, and an lr set through the options is read at the next step",
          "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto groups = [](std::vector<torch::Tensor> const& ps) {
    std::vector<torch::optim::OptimizerParamGroup> out;
    out.emplace_back(std::vector<torch::Tensor>{ps[0], ps[1]});
    out.emplace_back(std::vector<torch::Tensor>{ps[2], ps[3], ps[4]},
                     std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(3e-2).weight_decay(0.0)));
    return out;
  };
  fusedopt::libtorch::AdamW ours(groups(a), torch::optim::AdamWOptions(1e-2), config());
  torch::optim::AdamW theirs(groups(b), torch::optim::AdamWOptions(1e-2));
  for (int step = 1; step <= 6; ++step) {
    if (step == 4) {  // as torch::optim::StepLR does
      for (auto* opt : {static_cast<torch::optim::Optimizer*>(&ours), static_cast<torch::optim::Optimizer*>(&theirs)}) {
        for (auto& g : opt->param_groups()) { g.options().set_lr(g.options().get_lr() * 0.1); }
      }
    }
    set_grads(a, b, step);
    ours.step();
    theirs.step();
  }
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(distance(a[k], b[k]) <= 4e-7 * 6); }
}

TEST_CASE("checkpoints load across fusedopt's and torch's AdamW and continue alike", "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto const options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fusedopt::libtorch::AdamW ours(a, options, config());
  torch::optim::AdamW theirs(b, options);
  for (int step = 1; step <= 3; ++step) {
    set_grads(a, b, step);
    ours.step();
    theirs.step();
  }
  std::string const ours_path = "fusedopt_libtorch_ours.pt", theirs_path = "fusedopt_libtorch_theirs.pt";
  torch::save(ours, ours_path);
  torch::save(theirs, theirs_path);
  // Crossed: torch's AdamW continues from fusedopt's checkpoint and fusedopt's from torch's.
  torch::optim::AdamW theirs_from_ours(a, options);
  fusedopt::libtorch::AdamW ours_from_theirs(b, options, config());
  torch::load(theirs_from_ours, ours_path);
  torch::load(ours_from_theirs, theirs_path);
  std::remove(ours_path.c_str());
  std::remove(theirs_path.c_str());
  for (int step = 4; step <= 8; ++step) {
    set_grads(a, b, step);
    theirs_from_ours.step();
    ours_from_theirs.step();
  }
  for (std::size_t k = 0; k < a.size(); ++k) {
    REQUIRE(distance(a[k], b[k]) <= 4e-7 * 8);
    REQUIRE(state_of<torch::optim::AdamWParamState>(ours_from_theirs, b[k]).step() == 8);
  }
}

TEST_CASE("a parameter without a gradient is skipped and keeps its own step count", "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  fusedopt::libtorch::AdamW ours(a, torch::optim::AdamWOptions(1e-2), config());
  torch::optim::AdamW theirs(b, torch::optim::AdamWOptions(1e-2));
  for (int step = 1; step <= 5; ++step) {
    set_grads(a, b, step);
    if (step == 2) {
      a[1].mutable_grad() = torch::Tensor();
      b[1].mutable_grad() = torch::Tensor();
    }
    ours.step();
    theirs.step();
  }
  REQUIRE(state_of<torch::optim::AdamWParamState>(ours, a[1]).step() == 4);
  REQUIRE(state_of<torch::optim::AdamWParamState>(ours, a[0]).step() == 5);
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(distance(a[k], b[k]) <= 4e-7 * 5); }
}

/// The refusals of gradients that the two test cases below check, each a SECTION.
void require_bad_gradients_refused(torch::optim::Optimizer& opt, std::vector<torch::Tensor>& a)
{
  SECTION("a sparse gradient")
  {
    a[4].mutable_grad() = a[4].grad().to_sparse();
    REQUIRE_THROWS_WITH(opt.step(), fusedopt_test::contains("does not support sparse gradients"));
  }
  SECTION("a gradient of another shape")
  {
    a[4].mutable_grad() = torch::zeros({999}, on_device());
    REQUIRE_THROWS_WITH(opt.step(), fusedopt_test::contains("a gradient of"));
  }
  SECTION("a non-contiguous gradient")
  {
    a[0].mutable_grad() = torch::randn({33, 64}, on_device()).t();
    REQUIRE_THROWS_WITH(opt.step(), fusedopt_test::contains("contiguous"));
  }
}

TEST_CASE("refused input raises before anything is written", "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto const before = clones(a);
  fusedopt::libtorch::AdamW opt(a, torch::optim::AdamWOptions(1e-2), config());
  auto b = clones(a);
  set_grads(a, b, 1);
  require_bad_gradients_refused(opt, a);
  SECTION("an integer parameter")
  {
    auto ints = torch::zeros({4}, on_device(torch::kInt64));
    fusedopt::libtorch::AdamW bad(std::vector<torch::Tensor>{ints}, torch::optim::AdamWOptions(1e-2), config());
    ints.mutable_grad() = torch::zeros({4}, on_device(torch::kInt64));
    REQUIRE_THROWS_WITH(bad.step(), fusedopt_test::contains("not supported"));
  }
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(torch::equal(a[k], before[k])); }
  REQUIRE_THROWS_WITH(fusedopt::libtorch::AdamW(a, torch::optim::AdamWOptions(-1.0)),
                      fusedopt_test::contains("Invalid learning rate"));
}

TEST_CASE("moved parameters and states rebind the plan, and the steps continue as torch's", "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto const options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fusedopt::libtorch::AdamW ours(a, options, config());
  torch::optim::AdamW theirs(b, options);
  for (int step = 1; step <= 6; ++step) {
    if (step == 3) {
      // New storage under the same tensors (as a module's to() or a checkpoint's copy gives):
      // the state keys stay, the addresses move.
      for (std::size_t k = 0; k < a.size(); ++k) {
        a[k].set_data(a[k].detach().clone());
        b[k].set_data(b[k].detach().clone());
      }
    }
    if (step == 5) {
      auto& state = const_cast<torch::optim::AdamWParamState&>(state_of<torch::optim::AdamWParamState>(ours, a[2]));
      state.exp_avg(state.exp_avg().clone());
    }
    set_grads(a, b, step);
    ours.step();
    theirs.step();
  }
  REQUIRE(ours.plan_builds() == 1);
  REQUIRE(ours.plan_rebinds() == 2);
  REQUIRE(ours.cached_steps() == 3);  // steps 2, 4 and 6: new gradient tensors only
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(distance(a[k], b[k]) <= 4e-7 * 6); }
}

TEST_CASE("after steps on the cached path, changed input is checked again: refused with nothing written, or followed",
          "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto const options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fusedopt::libtorch::AdamW ours(a, options, config());
  torch::optim::AdamW theirs(b, options);
  for (int step = 1; step <= 3; ++step) {
    set_grads(a, b, step);
    ours.step();
    theirs.step();
  }
  REQUIRE(ours.cached_steps() == 2);
  auto const before = clones(a);  // the gradients stay the tensors the last step took
  require_bad_gradients_refused(ours, a);
  SECTION("a gradient resized in place")
  {
    a[4].grad().resize_({999});
    REQUIRE_THROWS_WITH(ours.step(), fusedopt_test::contains("a gradient of"));
  }
  SECTION("a parameter made non-contiguous")
  {
    a[0].set_data(a[0].detach().t().contiguous().t());
    a[0].mutable_grad() = torch::zeros_like(a[0]);
    REQUIRE_THROWS_WITH(ours.step(), fusedopt_test::contains("contiguous"));
  }
  SECTION("a state replaced in the state map by one of another shape")
  {
    auto& slot = ours.state().at(fusedopt::libtorch::detail::state_key<std::decay_t<decltype(ours.state())>>(a[2]));
    auto replaced = std::make_unique<torch::optim::AdamWParamState>(
      static_cast<torch::optim::AdamWParamState const&>(*slot));
    replaced->exp_avg(torch::zeros({7}, on_device()));
    slot = std::move(replaced);
    REQUIRE_THROWS_WITH(ours.step(), fusedopt_test::contains("a state tensor must be"));
  }
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(torch::equal(a[k], before[k])); }
}

TEST_CASE("after steps on the cached path, a state replaced in the state map or a gradient lost is followed as torch",
          "[libtorch]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto const options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fusedopt::libtorch::AdamW ours(a, options, config());
  torch::optim::AdamW theirs(b, options);
  for (int step = 1; step <= 8; ++step) {
    if (step < 8) {
      set_grads(a, b, step);
    } else {
      // The kept gradients accumulated into in place (no new tensors).
      for (std::size_t k = 0; k < a.size(); ++k) {
        a[k].grad().mul_(2);
        b[k].grad().mul_(2);
      }
    }
    if (step == 4) {
      // A new state object with the same values (as a checkpoint tool might put back).
      auto& slot = ours.state().at(fusedopt::libtorch::detail::state_key<std::decay_t<decltype(ours.state())>>(a[1]));
      auto const& old = static_cast<torch::optim::AdamWParamState const&>(*slot);
      auto replaced = std::make_unique<torch::optim::AdamWParamState>();
      replaced->step(old.step());
      replaced->exp_avg(old.exp_avg().clone());
      replaced->exp_avg_sq(old.exp_avg_sq().clone());
      slot = std::move(replaced);
    }
    if (step == 6) {
      a[3].mutable_grad() = torch::Tensor();
      b[3].mutable_grad() = torch::Tensor();
    }
    ours.step();
    theirs.step();
  }
  REQUIRE(ours.cached_steps() >= 3);
  REQUIRE(state_of<torch::optim::AdamWParamState>(ours, a[3]).step() == 7);
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(distance(a[k], b[k]) <= 4e-7 * 8); }
}

// ---- The library's extras (fusedopt::libtorch::extras) ----------------------------------------

TEST_CASE("extras: maximize steps as torch's optimizers on the negated gradients", "[libtorch][extras]")
{
  fusedopt::libtorch::extras ascend;
  ascend.maximize = true;
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto c = clones(a);
  auto d = clones(a);
  auto const adamw_options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto const sgd_options = torch::optim::SGDOptions(1e-2).momentum(0.9).weight_decay(0.1);
  fusedopt::libtorch::AdamW ours(a, adamw_options, config(), ascend);
  torch::optim::AdamW theirs(b, adamw_options);
  fusedopt::libtorch::SGD ours_sgd(c, sgd_options, config(), ascend);
  torch::optim::SGD theirs_sgd(d, sgd_options);
  double worst = 0, worst_sgd = 0;
  for (int step = 1; step <= 20; ++step) {
    set_grads(a, b, step);
    set_grads(c, d, step);
    for (std::size_t k = 0; k < a.size(); ++k) {
      b[k].mutable_grad() = -b[k].grad();
      d[k].mutable_grad() = -d[k].grad();
    }
    ours.step();
    theirs.step();
    ours_sgd.step();
    theirs_sgd.step();
    for (std::size_t k = 0; k < a.size(); ++k) {
      worst = std::max(worst, distance(a[k], b[k]));
      worst_sgd = std::max(worst_sgd, distance(c[k], d[k]));
      REQUIRE(distance(a[k], b[k]) <= 4e-7 * step);
      REQUIRE(distance(c[k], d[k]) <= 2e-7 * step);
    }
  }
  std::printf("maximize: AdamW within %.2e, SGD within %.2e of torch's on negated gradients\n", worst, worst_sgd);
  REQUIRE_THROWS_WITH(fusedopt::libtorch::LAMB(a, {}, config(), ascend), fusedopt_test::contains("takes no maximize"));
}

#if !defined(FUSEDOPT_LIBTORCH_TEST_CUDA)
namespace {

/// Mean and largest |a - reference| over `params`, in units of the references' largest magnitude.
std::pair<double, double> errors(std::vector<torch::Tensor> const& a, std::vector<torch::Tensor> const& reference)
{
  double sum = 0, largest = 0, scale = 0;
  std::int64_t count = 0;
  for (std::size_t k = 0; k < a.size(); ++k) {
    auto const diff = (a[k].to(torch::kDouble) - reference[k].to(torch::kDouble)).abs();
    sum += diff.sum().item<double>();
    largest = std::max(largest, diff.max().item<double>());
    scale = std::max(scale, reference[k].abs().max().item<double>());
    count += a[k].numel();
  }
  return {sum / static_cast<double>(count) / scale, largest / scale};
}

/// 100 AdamW steps (lr 1e-3: each update under half a bfloat16 rounding step of parameters
/// above 0.25 in magnitude, which round to nearest would not move) of bfloat16 parameters with `x`, and torch's AdamW on float32 copies with the
/// same gradients (the bfloat16 ones, widened): the bfloat16 parameters, the references, and
/// the optimizer for its states.
struct bf16_run {
  std::vector<torch::Tensor> params, reference;
  std::unique_ptr<fusedopt::libtorch::AdamW> optimizer;

  explicit bf16_run(fusedopt::libtorch::extras const& x)
  {
    params = make_params({{64, 33}, {1000}, {7}}, torch::kBFloat16);
    for (auto const& p : params) { reference.push_back(p.detach().to(torch::kFloat).set_requires_grad(true)); }
    auto const options = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
    optimizer = std::make_unique<fusedopt::libtorch::AdamW>(params, options, config(), x);
    torch::optim::AdamW theirs(reference, options);
    for (int step = 1; step <= 100; ++step) {
      torch::manual_seed(2000 + step);
      for (std::size_t k = 0; k < params.size(); ++k) {
        // A steady direction under noise: the updates add up (about lr a step).
        params[k].mutable_grad() = (0.5 + 0.1 * torch::randn(params[k].sizes())).to(torch::kBFloat16);
        reference[k].mutable_grad() = params[k].grad().to(torch::kFloat);
      }
      optimizer->step();
      theirs.step();
    }
  }
};

}  // namespace

TEST_CASE("extras: bfloat16 parameters with stochastic rounding or Kahan compensation follow a float32 AdamW",
          "[libtorch][extras]")
{
  auto const plain = bf16_run({});
  fusedopt::libtorch::extras rounding;
  rounding.stochastic_rounding = true;
  auto const stochastic = bf16_run(rounding);
  fusedopt::libtorch::extras compensated;
  compensated.kahan = true;
  auto const kahan = bf16_run(compensated);

  auto const [plain_mean, plain_max] = errors(plain.params, plain.reference);
  auto const [sr_mean, sr_max] = errors(stochastic.params, stochastic.reference);
  auto const [kahan_mean, kahan_max] = errors(kahan.params, kahan.reference);
  // What the bfloat16 parameter and its compensation hold together.
  std::vector<torch::Tensor> sums;
  for (auto const& p : kahan.params) {
    auto const c = kahan.optimizer->kahan_compensation(p);
    REQUIRE(c.defined());
    REQUIRE(c.scalar_type() == torch::kBFloat16);
    sums.push_back(p.detach().to(torch::kFloat) + c.to(torch::kFloat));
  }
  auto const [sum_mean, sum_max] = errors(sums, kahan.reference);
  std::printf("bfloat16 AdamW vs float32 torch AdamW, 100 steps, |error| / largest |p| (mean, largest): round to "
              "nearest %.2e %.2e, stochastic rounding %.2e %.2e, Kahan %.2e %.2e (parameter + compensation %.2e %.2e)\n",
              plain_mean, plain_max, sr_mean, sr_max, kahan_mean, kahan_max, sum_mean, sum_max);
  // bfloat16 keeps 8 significant bits: half a rounding step of x is at most 2^-8 |x|.
  double const bf16_step = std::ldexp(1.0, -8);
  // Round to nearest drops the updates of the larger parameters (a bias); both extras keep them.
  REQUIRE(sr_mean < plain_mean / 2);
  REQUIRE(kahan_mean < plain_mean / 2);
  // Stochastic rounding is unbiased but each rounding adds noise: at the largest magnitude m
  // (rounding step u, at most 2^-7 m) 100 updates of about lr = 1e-3 each round up with
  // probability lr / u, a random walk of sqrt(100 lr u) (one standard deviation).
  double largest = 0;
  for (auto const& r : stochastic.reference) { largest = std::max(largest, r.abs().max().item<double>()); }
  double const walk = std::sqrt(100 * 1e-3 * std::ldexp(largest, -7)) / largest;
  REQUIRE(sr_max <= 5 * walk);
  REQUIRE(kahan_max <= bf16_step);  // one rounding of the compensated value
  // The pair holds the float32 value to within a tenth of a rounding step (the compensation is
  // itself bfloat16).
  REQUIRE(sum_max <= 0.1 * bf16_step);
  // No compensation for float parameters, and none without the extra.
  REQUIRE(!plain.optimizer->kahan_compensation(plain.params[0]).defined());
}

TEST_CASE("extras: 8-bit AdamW states are the bits of fusedopt's own host step", "[libtorch][extras]")
{
  auto const dtype = GENERATE(torch::kFloat, torch::kBFloat16);
  auto a = make_params(shapes, dtype);
  auto b = clones(a);
  fusedopt::libtorch::extras eight;
  eight.states_8bit = true;
  auto const options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fusedopt::libtorch::AdamW ours(a, options, config(), eight);
  // The library's step over the same tensors: 8-bit moments of its own.
  std::vector<torch::Tensor> m, v;
  for (auto const& p : b) {
    m.push_back(torch::zeros({fusedopt::libtorch::quantized_state_bytes(p.numel())}, torch::kByte));
    v.push_back(torch::zeros({fusedopt::libtorch::quantized_state_bytes(p.numel())}, torch::kByte));
  }
  auto const library_step = [&](auto element, int step) {
    using T = decltype(element);
    fusedopt::tensor_list<T> params;
    fusedopt::tensor_list<T const> grads;
    fusedopt::tensor_list<fusedopt::signed_q8> moments;
    fusedopt::tensor_list<fusedopt::unsigned_q8> squares;
    for (std::size_t k = 0; k < b.size(); ++k) {
      params.push_back(static_cast<T*>(b[k].data_ptr()), b[k].numel());
      grads.push_back(static_cast<T const*>(b[k].grad().data_ptr()), b[k].numel());
      moments.push_back(static_cast<fusedopt::signed_q8*>(m[k].data_ptr()), b[k].numel());
      squares.push_back(static_cast<fusedopt::unsigned_q8*>(v[k].data_ptr()), b[k].numel());
    }
    auto plan = fusedopt::host::make_plan(fusedopt::bind(fusedopt::slot::param = params, fusedopt::slot::grad = grads,
                                                         fusedopt::slot::exp_avg = moments,
                                                         fusedopt::slot::exp_avg_sq = squares));
    fusedopt::rules::adamw rule;
    rule.lr = 1e-2;
    rule.weight_decay = 0.1;
    plan.run(rule, fusedopt::step_info{step});
  };
  for (int step = 1; step <= 20; ++step) {
    set_grads(a, b, step);
    ours.step();
    if (dtype == torch::kFloat) {
      library_step(float{}, step);
    } else {
      library_step(fusedopt::bfloat16{}, step);
    }
  }
  for (std::size_t k = 0; k < a.size(); ++k) {
    auto const& s = state_of<torch::optim::AdamWParamState>(ours, a[k]);
    REQUIRE(s.exp_avg().scalar_type() == torch::kByte);
    REQUIRE(s.step() == 20);
    REQUIRE(torch::equal(a[k], b[k]));
    REQUIRE(torch::equal(s.exp_avg(), m[k]));
    REQUIRE(torch::equal(s.exp_avg_sq(), v[k]));
  }
  REQUIRE(ours.plan_builds() == 1);
  REQUIRE_THROWS_WITH(fusedopt::libtorch::Lion(a, {}, config(), eight), fusedopt_test::contains("takes no states_8bit"));
}

TEST_CASE("extras: max_grad_norm steps as torch::nn::utils::clip_grad_norm_ then torch's AdamW or SGD",
          "[libtorch][extras]")
{
  fusedopt::libtorch::extras clip;
  clip.max_grad_norm = 1.0;  // the gradients' norm is about 57: clipped at every step
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto c = clones(a);
  auto d = clones(a);
  auto const adamw_options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  auto const sgd_options = torch::optim::SGDOptions(1e-1).momentum(0.9);
  fusedopt::libtorch::AdamW ours(a, adamw_options, config(), clip);
  torch::optim::AdamW theirs(b, adamw_options);
  fusedopt::libtorch::SGD ours_sgd(c, sgd_options, config(), clip);
  torch::optim::SGD theirs_sgd(d, sgd_options);
  double worst = 0, worst_sgd = 0;
  for (int step = 1; step <= 20; ++step) {
    set_grads(a, b, step);
    set_grads(c, d, step);
    torch::nn::utils::clip_grad_norm_(b, 1.0);
    torch::nn::utils::clip_grad_norm_(d, 1.0);
    ours.step();
    theirs.step();
    ours_sgd.step();
    theirs_sgd.step();
    for (std::size_t k = 0; k < a.size(); ++k) {
      worst = std::max(worst, distance(a[k], b[k]));
      worst_sgd = std::max(worst_sgd, distance(c[k], d[k]));
      REQUIRE(distance(a[k], b[k]) <= 4e-7 * step);
      REQUIRE(distance(c[k], d[k]) <= 4e-7 * step);
    }
  }
  std::printf("max_grad_norm: AdamW within %.2e, SGD within %.2e of clip_grad_norm_ and torch's step\n", worst,
              worst_sgd);
  // One fused pass clips: two param groups are refused, with nothing written.
  auto e = clones(a);
  auto const before = clones(e);
  fusedopt::libtorch::AdamW two_groups({torch::optim::OptimizerParamGroup({e[0], e[1]}),
                                        torch::optim::OptimizerParamGroup({e[2], e[3], e[4]})},
                                       adamw_options, config(), clip);
  set_grads(e, b, 21);
  REQUIRE_THROWS_WITH(two_groups.step(), fusedopt_test::contains("max_grad_norm clips the global norm of one"));
  for (std::size_t k = 0; k < e.size(); ++k) { REQUIRE(torch::equal(e[k], before[k])); }
}

TEST_CASE("extras: Kahan compensations and 8-bit states are saved and loaded with the optimizer", "[libtorch][extras]")
{
  bool const kahan = GENERATE(false, true);
  fusedopt::libtorch::extras x;
  x.kahan = kahan;
  x.states_8bit = !kahan;
  auto a = make_params(shapes, torch::kBFloat16);
  auto b = clones(a);
  auto const options = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  fusedopt::libtorch::AdamW uninterrupted(a, options, config(), x);
  auto interrupted = std::make_unique<fusedopt::libtorch::AdamW>(b, options, config(), x);
  std::string const path = "fusedopt_libtorch_extras.pt";
  for (int step = 1; step <= 8; ++step) {
    set_grads(a, b, step);
    if (step == 5) {
      torch::save(*interrupted, path);
      interrupted = std::make_unique<fusedopt::libtorch::AdamW>(b, options, config(), x);
      torch::load(*interrupted, path);
      std::remove(path.c_str());
    }
    uninterrupted.step();
    interrupted->step();
  }
  for (std::size_t k = 0; k < a.size(); ++k) {
    REQUIRE(torch::equal(a[k], b[k]));
    auto const& s = state_of<torch::optim::AdamWParamState>(*interrupted, b[k]);
    REQUIRE(s.step() == 8);
    REQUIRE((s.exp_avg().scalar_type() == torch::kByte) == !kahan);
    if (kahan) { REQUIRE(torch::equal(uninterrupted.kahan_compensation(a[k]), interrupted->kahan_compensation(b[k]))); }
  }
  fusedopt::libtorch::extras both;
  both.kahan = both.stochastic_rounding = true;
  REQUIRE_THROWS_WITH(fusedopt::libtorch::AdamW(a, options, config(), both), fusedopt_test::contains("choose one"));
}
#endif

#if defined(FUSEDOPT_LIBTORCH_TEST_CUDA)

TEST_CASE("CUDA: a param group on two devices, or CUDA parameters without CUDA plans, are refused with nothing written",
          "[libtorch][cuda]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  set_grads(a, b, 1);
  auto const before = clones(a);
  SECTION("a group with a CPU parameter beside CUDA ones")
  {
    auto host = torch::randn({8}).set_requires_grad(true);
    host.mutable_grad() = torch::randn({8});
    auto const host_before = host.detach().clone();
    auto all = a;
    all.push_back(host);
    fusedopt::libtorch::AdamW opt(all, torch::optim::AdamWOptions(1e-2), config());
    REQUIRE_THROWS_WITH(opt.step(), fusedopt_test::contains("must be on one device"));
    REQUIRE(torch::equal(host, host_before));
  }
  SECTION("no cuda_config::steps")
  {
    fusedopt::libtorch::AdamW opt(a, torch::optim::AdamWOptions(1e-2));
    REQUIRE_THROWS_WITH(opt.step(), fusedopt_test::contains("make_cuda_steps"));
  }
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(torch::equal(a[k], before[k])); }
}

TEST_CASE("CUDA: groups on the CPU and on CUDA in one optimizer step on their own backends", "[libtorch][cuda]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto host_a = torch::randn({300}).set_requires_grad(true);
  auto host_b = host_a.detach().clone().set_requires_grad(true);
  auto groups = [](std::vector<torch::Tensor> const& ps, torch::Tensor const& host) {
    std::vector<torch::optim::OptimizerParamGroup> out;
    out.emplace_back(ps);
    out.emplace_back(std::vector<torch::Tensor>{host});
    return out;
  };
  fusedopt::libtorch::AdamW ours(groups(a, host_a), torch::optim::AdamWOptions(1e-2), config());
  torch::optim::AdamW theirs(groups(b, host_b), torch::optim::AdamWOptions(1e-2));
  for (int step = 1; step <= 5; ++step) {
    set_grads(a, b, step);
    auto const g = torch::randn({300});
    host_a.mutable_grad() = g.clone();
    host_b.mutable_grad() = g.clone();
    ours.step();
    theirs.step();
  }
  REQUIRE(ours.plan_builds() == 2);
  REQUIRE(distance(host_a, host_b) <= 4e-7 * 5);
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(distance(a[k], b[k]) <= 4e-7 * 5); }
}

#  if defined(FUSEDOPT_LIBTORCH_TEST_GRAPHS)

TEST_CASE("CUDA: a step captured in a CUDA graph replays as torch's eager steps (capturable), an lr changed between "
          "replays included",
          "[libtorch][cuda]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  auto const options = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  fusedopt::libtorch::cuda_config capturable = config();
  capturable.capturable = true;
  fusedopt::libtorch::AdamW ours(a, options, capturable);
  torch::optim::AdamW theirs(b, options);
  // The graph reads the gradients where they were at the capture: fixed tensors, refilled.
  for (std::size_t k = 0; k < a.size(); ++k) {
    a[k].mutable_grad() = torch::zeros_like(a[k]);
    b[k].mutable_grad() = torch::zeros_like(b[k]);
  }
  auto fill = [&](int step) {
    torch::manual_seed(1000 + step);
    for (std::size_t k = 0; k < a.size(); ++k) {
      auto const g = torch::randn(a[k].sizes(), on_device());
      a[k].grad().copy_(g);
      b[k].grad().copy_(g);
    }
  };
  for (int step = 1; step <= 2; ++step) {  // outside the capture: the plans, states and device memory are made
    fill(step);
    ours.step();
    theirs.step();
  }
  at::cuda::CUDAGraph graph;
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    ours.step();
    graph.capture_end();
  }
  for (int step = 3; step <= 8; ++step) {
    if (step == 6) {  // as torch::optim::StepLR does, then the device copy a replay reads
      ours.param_groups()[0].options().set_lr(3e-3);
      theirs.param_groups()[0].options().set_lr(3e-3);
      ours.upload_lr();
    }
    fill(step);
    graph.replay();
    theirs.step();
    for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(distance(a[k], b[k]) <= 4e-7 * step); }
  }
  ours.sync_steps();
  for (std::size_t k = 0; k < a.size(); ++k) {
    REQUIRE(state_of<torch::optim::AdamWParamState>(ours, a[k]).step() == 8);
  }
}

TEST_CASE("CUDA: a step under capture is refused without cuda_config::capturable", "[libtorch][cuda]")
{
  auto a = make_params(shapes, torch::kFloat);
  auto b = clones(a);
  set_grads(a, b, 1);
  fusedopt::libtorch::AdamW ours(a, torch::optim::AdamWOptions(1e-2), config());
  ours.step();
  auto const before = clones(a);
  at::cuda::CUDAGraph graph;
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    REQUIRE_THROWS_WITH(ours.step(), fusedopt_test::contains("cuda_config::capturable"));
    graph.capture_end();  // an empty graph (torch warns)
  }
  for (std::size_t k = 0; k < a.size(); ++k) { REQUIRE(torch::equal(a[k], before[k])); }
}

#  endif
#endif
