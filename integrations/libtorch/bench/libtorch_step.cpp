// One optimizer step of fusedopt::libtorch::AdamW against torch::optim::AdamW (libtorch's C++
// AdamW: 8-9 operations per tensor), float32, over the benchmarks' workloads W1-W4
// (bench/workloads.hpp: 10 x 1024^2, GPT-2 small's 148 tensors, 2000 tensors of 256..65536
// elements, one tensor of 2^28).
//
//   libtorch_step [repeats] [cpu|cuda|host|all]      (default 10 all; cuda where torch sees a GPU)
//
// host: the adapter's host work per step alone, over W3's count of tensors (2000) of one float
// each, on one thread (at::set_num_threads(1)): the median step() time, per tensor, with the
// gradients kept and with new gradient tensors at every step (as after zero_grad(), made
// outside the timed call), beside fusedopt's own host plan run over the same tensors (the
// fused step itself; the difference is the adapter's bookkeeping). Not part of "all".
//
// CPU: median wall time of `repeats` steps after 3 warm-up steps, and the time of torch's copy_
// of the step's bytes (AdamW reads p, g, m, v and writes p, m, v: 28 bytes per float element)
// over the fused step's, measured in the same run: above 1, the step streams faster than torch
// copies (not a roofline). torch and fusedopt use every hardware thread (at::set_num_threads).
//
// CUDA (cuda_timing.cu): per step, on torch's current stream, medians of `repeats` after 3
// warm-up steps: the step time (the call to the end of a stream synchronisation: what a
// training loop pays), the host time of the call alone, and the device time alone (events
// around the call, queued behind a spin kernel that outlasts the call); the same for
// fusedopt's own CUDA plan over the adapter's tensors (its device time is what the adapter's
// should match: the adapter adds no device work). Gradients stay where they are (no rebind).
#include <fusedopt/libtorch/optimizers.hpp>

#include <torch/torch.h>

#include "workloads.hpp"

#if defined(FUSEDOPT_LIBTORCH_BENCH_CUDA)
#  include "cuda_timing.hpp"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace {

template <class F>
double median_seconds(F&& step, int repeats)
{
  for (int i = 0; i < 3; ++i) { step(); }
  std::vector<double> times;
  for (int i = 0; i < repeats; ++i) {
    auto const start = std::chrono::steady_clock::now();
    step();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

std::vector<torch::Tensor> make_params(std::vector<std::int64_t> const& sizes, torch::Device device)
{
  std::vector<torch::Tensor> params;
  for (auto n : sizes) {
    params.push_back(torch::randn({n}, torch::device(device)).set_requires_grad(true));
    params.back().mutable_grad() = torch::randn({n}, torch::device(device));
  }
  return params;
}

template <class Optimizer>
double time_optimizer(std::vector<std::int64_t> const& sizes, int repeats)
{
  auto params = make_params(sizes, torch::kCPU);
  Optimizer opt(params, torch::optim::AdamWOptions(1e-3));
  return median_seconds([&] { opt.step(); }, repeats);
}

void cpu(int repeats)
{
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  std::printf("libtorch_step: CPU, float32, %d threads (at::get_num_threads), median of %d steps\n\n",
              at::get_num_threads(), repeats);
  std::printf("| workload | elements | fusedopt ms | torch::optim::AdamW ms | speedup | torch copy_ of the bytes / fusedopt |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (auto const& w : fusedopt_bench::all_workloads()) {
    std::int64_t const n = w.elements();
    // torch's copy of the step's bytes (28 per element, read + write) on the same threads: the
    // reference rate.
    auto const from = torch::randn({n * 7 / 2}), to = torch::empty_like(from);
    double const copy = median_seconds([&] { to.copy_(from); }, repeats);
    double const ours = time_optimizer<fusedopt::libtorch::AdamW>(w.sizes, repeats);
    double const theirs = time_optimizer<torch::optim::AdamW>(w.sizes, repeats);
    std::printf("| %s %s | %lld | %.2f | %.2f | %.2fx | %.2f |\n", w.name.c_str(), w.description.c_str(),
                static_cast<long long>(n), ours * 1e3, theirs * 1e3, theirs / ours, copy / ours);
    std::fflush(stdout);
  }
}

/// The adapter's host work per step over `count` one-element float tensors (see the top).
void host_bookkeeping(int repeats, std::size_t count)
{
  at::set_num_threads(1);
  std::vector<std::int64_t> const sizes(count, 1);
  auto params = make_params(sizes, torch::kCPU);
  std::vector<std::vector<torch::Tensor>> grad_sets(2);
  for (auto& set : grad_sets) {
    for (std::size_t i = 0; i < count; ++i) { set.push_back(torch::randn({1})); }
  }
  fusedopt::libtorch::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
  auto const per_tensor_ns = [&](double seconds) { return seconds * 1e9 / static_cast<double>(count); };
  double const kept = median_seconds([&] { opt.step(); }, repeats);
  // New gradient tensors at every step, set outside the timed call.
  std::vector<double> times;
  for (int i = 0; i < repeats + 3; ++i) {
    auto const& set = grad_sets[static_cast<std::size_t>(i) % 2];
    for (std::size_t k = 0; k < count; ++k) { params[k].mutable_grad() = set[k]; }
    auto const start = std::chrono::steady_clock::now();
    opt.step();
    if (i >= 3) { times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()); }
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  double const renewed = times[times.size() / 2];
  // fusedopt's own host plan over the same tensors: the fused step without the adapter.
  fusedopt::libtorch::plan_tensors x;
  x.states.resize(2);
  for (auto const& p : params) {
    auto const& s = static_cast<torch::optim::AdamWParamState const&>(
      *opt.state().at(fusedopt::libtorch::detail::state_key<std::decay_t<decltype(opt.state())>>(p)));
    x.sizes.push_back(p.numel());
    x.params.push_back(p.data_ptr());
    x.grads.push_back(p.grad().data_ptr());
    x.states[0].push_back(s.exp_avg().data_ptr());
    x.states[1].push_back(s.exp_avg_sq().data_ptr());
  }
  fusedopt::libtorch::plan_request request;
  request.tensors = &x;
  auto const plan = fusedopt::libtorch::make_plan<fusedopt::rules::adamw>(
    [] { return fusedopt::libtorch::host_backend{1}; }, request);
  fusedopt::rules::adamw rule;
  rule.lr = 1e-3;
  std::int64_t step = 100;
  fusedopt::libtorch::step_extras const no_extras;
  double const own =
    median_seconds([&] { plan->run(rule, no_extras, fusedopt::step_info{++step}, nullptr); }, repeats);
  // What torch's in-place operations do per tensor and the step does too: one version-counter
  // bump of each parameter and state tensor (an atomic increment each).
  std::vector<c10::TensorImpl*> bumped;
  for (auto const& p : params) {
    auto const& s = static_cast<torch::optim::AdamWParamState const&>(
      *opt.state().at(fusedopt::libtorch::detail::state_key<std::decay_t<decltype(opt.state())>>(p)));
    bumped.push_back(p.unsafeGetTensorImpl());
    bumped.push_back(s.exp_avg().unsafeGetTensorImpl());
    bumped.push_back(s.exp_avg_sq().unsafeGetTensorImpl());
  }
  double const bumps = median_seconds([&] { for (auto* impl : bumped) { impl->bump_version(); } }, repeats);
  std::printf("libtorch_step host: %zu float tensors of 1 element, 1 thread, median of %d steps\n\n", count, repeats);
  std::printf("| what | us per step | ns per tensor |\n| --- | --- | --- |\n");
  std::printf("| AdamW step(), gradients kept | %.1f | %.1f |\n", kept * 1e6, per_tensor_ns(kept));
  std::printf("| AdamW step(), new gradient tensors | %.1f | %.1f |\n", renewed * 1e6, per_tensor_ns(renewed));
  std::printf("| fusedopt's host plan run alone | %.1f | %.1f |\n", own * 1e6, per_tensor_ns(own));
  std::printf("| version bumps alone (parameter, exp_avg, exp_avg_sq) | %.1f | %.1f |\n", bumps * 1e6,
              per_tensor_ns(bumps));
  std::printf("| adapter's bookkeeping (kept / new gradients) | %.1f / %.1f | %.1f / %.1f |\n", (kept - own) * 1e6,
              (renewed - own) * 1e6, per_tensor_ns(kept - own), per_tensor_ns(renewed - own));
  std::printf("plans built: %lld, rebinds: %lld, steps on the cached path: %lld\n",
              static_cast<long long>(opt.plan_builds()), static_cast<long long>(opt.plan_rebinds()),
              static_cast<long long>(opt.cached_steps()));
}

#if defined(FUSEDOPT_LIBTORCH_BENCH_CUDA)
namespace lb = fusedopt_libtorch_bench;

void cuda(int repeats)
{
  torch::Device const device(torch::kCUDA, 0);
  std::printf("\nlibtorch_step: CUDA (device 0), float32, torch's current stream, medians of %d steps after 3\n\n",
              repeats);
  std::printf("| workload | elements | fusedopt step ms | torch::optim::AdamW step ms | speedup | fusedopt device ms | "
              "fusedopt plan device ms | adapter / plan | fusedopt host us | torch host ms | plans built |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (auto const& w : fusedopt_bench::all_workloads()) {
    void* const stream = fusedopt::libtorch::detail::current_cuda_stream(device, "libtorch_step");
    lb::step_times ours, plan, theirs;
    std::int64_t builds = 0;
    {
      auto params = make_params(w.sizes, device);
      fusedopt::libtorch::AdamW opt(params, torch::optim::AdamWOptions(1e-3),
                                    {fusedopt::libtorch::make_cuda_steps()});
      ours = lb::time_steps(stream, [&] { opt.step(); }, 3, repeats);
      builds = opt.plan_builds();
      // fusedopt's own plan over the same tensors (the states exist now).
      std::vector<void*> p, m, v;
      std::vector<void const*> g;
      for (auto const& t : params) {
        auto const& s = static_cast<torch::optim::AdamWParamState const&>(*opt.state().at(
          fusedopt::libtorch::detail::state_key<std::decay_t<decltype(opt.state())>>(t)));
        p.push_back(t.data_ptr());
        g.push_back(t.grad().data_ptr());
        m.push_back(s.exp_avg().data_ptr());
        v.push_back(s.exp_avg_sq().data_ptr());
      }
      plan = lb::time_fused_plan(stream, p, g, m, v, w.sizes, 3, repeats);
    }
    {
      auto params = make_params(w.sizes, device);
      torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-3));
      theirs = lb::time_steps(stream, [&] { opt.step(); }, 3, repeats);
    }
    std::printf("| %s %s | %lld | %.3f | %.3f | %.1fx | %.3f | %.3f | %.3f | %.1f | %.2f | %lld |\n", w.name.c_str(),
                w.description.c_str(), static_cast<long long>(w.elements()), ours.wall * 1e3, theirs.wall * 1e3,
                theirs.wall / ours.wall, ours.device * 1e3, plan.device * 1e3, ours.device / plan.device,
                ours.host * 1e6, theirs.host * 1e3, static_cast<long long>(builds));
    std::fflush(stdout);
  }
}
#endif

}  // namespace

int main(int argc, char** argv)
{
  int const repeats = argc > 1 ? std::max(1, std::atoi(argv[1])) : 10;
  std::string const what = argc > 2 ? argv[2] : "all";
  torch::manual_seed(0);
  if (what == "cpu" || what == "all") { cpu(repeats); }
  if (what == "host") { host_bookkeeping(repeats, fusedopt_bench::w3().sizes.size()); }
  if (what == "cuda" || what == "all") {
#if defined(FUSEDOPT_LIBTORCH_BENCH_CUDA)
    if (torch::cuda::is_available()) {
      cuda(repeats);
    } else {
      std::printf("\nlibtorch_step: CUDA skipped (torch sees no CUDA device)\n");
    }
#else
    std::printf("\nlibtorch_step: CUDA skipped (built without nvcc)\n");
#endif
  }
  return 0;
}
