// One optimizer step of fusedopt::libtorch::AdamW against torch::optim::AdamW (libtorch's C++
// AdamW: 8-9 operations per tensor), CPU tensors, float32, over the benchmarks' workloads W1-W4
// (bench/workloads.hpp: 10 x 1024^2, GPT-2 small's 148 tensors, 2000 tensors of 256..65536
// elements, one tensor of 2^28), median wall time of `repeats`
// steps after 3 warm-up steps, and the time of torch's copy_ of the step's bytes (AdamW reads p,
// g, m, v and writes p, m, v: 28 bytes per float element) over the fused step's, measured in the
// same run: above 1, the step streams faster than torch copies (not a roofline). torch and
// fusedopt use every hardware thread (at::set_num_threads).
//   libtorch_step [repeats]      (default 10)
#include <fusedopt/libtorch/optimizers.hpp>

#include <torch/torch.h>

#include "workloads.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <string>
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

template <class Optimizer>
double time_optimizer(std::vector<std::int64_t> const& sizes, int repeats)
{
  std::vector<torch::Tensor> params;
  for (auto n : sizes) {
    params.push_back(torch::randn({n}).set_requires_grad(true));
    params.back().mutable_grad() = torch::randn({n});
  }
  Optimizer opt(params, torch::optim::AdamWOptions(1e-3));
  return median_seconds([&] { opt.step(); }, repeats);
}

}  // namespace

int main(int argc, char** argv)
{
  int const repeats = argc > 1 ? std::max(1, std::atoi(argv[1])) : 10;
  torch::manual_seed(0);
  at::set_num_threads(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  std::printf("libtorch_step: CPU, float32, %d threads (at::get_num_threads), median of %d steps\n\n",
              at::get_num_threads(), repeats);
  std::printf("| workload | elements | fusedopt ms | torch::optim::AdamW ms | speedup | torch copy_ of the bytes / fusedopt |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (auto const& w : fusedopt_bench::all_workloads()) {
    std::int64_t n = 0;
    for (auto s : w.sizes) { n += s; }
    // torch's copy of the step's bytes (28 per element, read + write) on the same threads: the
    // reference rate.
    auto const from = torch::randn({n * 7 / 2}), to = torch::empty_like(from);
    double const copy = median_seconds([&] { to.copy_(from); }, repeats);
    double const ours = time_optimizer<fusedopt::libtorch::AdamW>(w.sizes, repeats);
    double const theirs = time_optimizer<torch::optim::AdamW>(w.sizes, repeats);
    std::printf("| %s %s | %lld | %.2f | %.2f | %.2fx | %.2f |\n", w.name.c_str(), w.description.c_str(),
                static_cast<long long>(n),
                ours * 1e3, theirs * 1e3, theirs / ours, copy / ours);
  }
  return 0;
}
