// A libtorch training loop with fusedopt's fused AdamW: a small MLP (torch::nn) learns a
// synthetic regression target; the optimizer is a drop-in for torch::optim::AdamW (the same
// options, state and checkpoints), with a StepLR schedule. Prints the loss every 50 steps and
// exits with 1 when it did not fall.
//
//   fusedopt_libtorch_train [steps] [cpu|cuda|cuda-graph]      (default 400 cpu)
//
// cuda: the model and data on the GPU, the step on fusedopt's CUDA backend (make_cuda_steps(),
// compiled by nvcc in cuda_steps.cu). cuda-graph: the whole training step (forward, backward,
// optimizer step) captured once in a CUDA graph and replayed, as torch's whole-network capture
// recipe; the optimizer is capturable (its step count and lr in device memory) and the
// scheduler's lr reaches the graph through upload_lr(). Without a CUDA device these exit
// with 77 (reported skipped by CTest).
#include <fusedopt/libtorch/optimizers.hpp>

#include <torch/torch.h>

#if defined(FUSEDOPT_LIBTORCH_TRAIN_CUDA) && FUSEDOPT_LIBTORCH_CUDA_STREAMS && __has_include(<ATen/cuda/CUDAGraph.h>)
#  include <ATen/cuda/CUDAGraph.h>
#  include <c10/cuda/CUDAGuard.h>
#  include <c10/cuda/CUDAStream.h>
#  define FUSEDOPT_LIBTORCH_TRAIN_GRAPH 1
#endif

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

constexpr int skipped = 77;

struct run_result {
  double first = 0, last = 0;
};

torch::nn::Sequential make_model()
{
  return torch::nn::Sequential(torch::nn::Linear(32, 128), torch::nn::ReLU(), torch::nn::Linear(128, 128),
                               torch::nn::ReLU(), torch::nn::Linear(128, 4));
}

fusedopt::libtorch::cuda_config cuda_plans(bool capturable)
{
#if defined(FUSEDOPT_LIBTORCH_TRAIN_CUDA)
  return {fusedopt::libtorch::make_cuda_steps(), capturable};
#else
  static_cast<void>(capturable);
  return {};
#endif
}

/// Eager steps on `device`.
run_result train(int steps, torch::Device device)
{
  auto const inputs = torch::randn({1024, 32}).to(device);
  auto const teacher = torch::randn({32, 4}).to(device);
  auto const targets = torch::tanh(inputs.matmul(teacher));
  auto model = make_model();
  model->to(device);
  fusedopt::libtorch::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01),
                                      cuda_plans(false));
  torch::optim::StepLR schedule(optimizer, /*step_size=*/150, /*gamma=*/0.5);
  run_result r;
  for (int step = 1; step <= steps; ++step) {
    auto const batch = torch::randint(0, inputs.size(0), {128}, torch::dtype(torch::kLong).device(device));
    optimizer.zero_grad();
    auto const loss = torch::mse_loss(model->forward(inputs.index_select(0, batch)), targets.index_select(0, batch));
    loss.backward();
    optimizer.step();
    schedule.step();
    if (step % 50 == 0 || step == 1 || step == steps) {
      r.last = loss.item<double>();
      if (step == 1) { r.first = r.last; }
      std::printf("step %4d  loss %.5f\n", step, r.last);
    }
  }
  std::printf("%lld plan(s) built\n", static_cast<long long>(optimizer.plan_builds()));
  return r;
}

#if defined(FUSEDOPT_LIBTORCH_TRAIN_GRAPH)
/// The whole training step captured once in a CUDA graph (torch's recipe: warm-up steps on a
/// side stream, gradients set to none before the capture so that backward allocates them in
/// the graph's memory pool), then replayed with each batch copied into the static inputs.
run_result train_graph(int steps, torch::Device device)
{
  auto const inputs = torch::randn({1024, 32}).to(device);
  auto const teacher = torch::randn({32, 4}).to(device);
  auto const targets = torch::tanh(inputs.matmul(teacher));
  auto model = make_model();
  model->to(device);
  fusedopt::libtorch::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01),
                                      cuda_plans(/*capturable=*/true));
  torch::optim::StepLR schedule(optimizer, /*step_size=*/150, /*gamma=*/0.5);
  auto static_input = torch::zeros({128, 32}, inputs.options());
  auto static_target = torch::zeros({128, 4}, targets.options());
  auto next_batch = [&] {
    auto const batch = torch::randint(0, inputs.size(0), {128}, torch::dtype(torch::kLong).device(device));
    static_input.copy_(inputs.index_select(0, batch));
    static_target.copy_(targets.index_select(0, batch));
  };
  auto none = [&] {  // zero_grad(set_to_none), whatever torch's default
    for (auto& p : model->parameters()) { p.mutable_grad() = torch::Tensor(); }
  };
  auto training_step = [&] {
    auto loss = torch::mse_loss(model->forward(static_input), static_target);
    loss.backward();
    optimizer.step();
    return loss;
  };
  run_result r;
  int const warmup = 3;  // counted as training steps, with the scheduler
  auto side = c10::cuda::getStreamFromPool();
  torch::cuda::synchronize();
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    for (int step = 1; step <= warmup; ++step) {
      next_batch();
      none();
      auto const loss = training_step();
      schedule.step();
      if (step == 1) { r.first = loss.item<double>(); }
    }
  }
  torch::cuda::synchronize();
  at::cuda::CUDAGraph graph;
  torch::Tensor static_loss;
  none();  // backward allocates the gradients in the graph's memory pool
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    graph.capture_begin();
    static_loss = training_step();
    graph.capture_end();
  }
  for (int step = warmup + 1; step <= steps; ++step) {
    next_batch();
    optimizer.upload_lr();  // the scheduler's lr, where the graph reads it
    graph.replay();
    schedule.step();
    if (step % 50 == 0 || step == steps) {
      r.last = static_loss.item<double>();
      std::printf("step %4d  loss %.5f (replay)\n", step, r.last);
    }
  }
  optimizer.sync_steps();
  auto const& state = static_cast<torch::optim::AdamWParamState const&>(
    *optimizer.state().begin()->second);
  std::printf("%lld plan(s) built; the states' step count after the replays: %lld\n",
              static_cast<long long>(optimizer.plan_builds()), static_cast<long long>(state.step()));
  return r;
}
#endif

}  // namespace

int main(int argc, char** argv)
{
  int const steps = argc > 1 ? std::atoi(argv[1]) : 400;
  std::string const mode = argc > 2 ? argv[2] : "cpu";
  if (mode != "cpu" && mode != "cuda" && mode != "cuda-graph") {
    std::fprintf(stderr, "usage: fusedopt_libtorch_train [steps] [cpu|cuda|cuda-graph]\n");
    return 2;
  }
  torch::manual_seed(0);
  run_result r;
  if (mode == "cpu") {
    r = train(steps, torch::kCPU);
  } else {
#if defined(FUSEDOPT_LIBTORCH_TRAIN_CUDA)
    if (!torch::cuda::is_available()) {
      std::printf("SKIPPED: torch sees no CUDA device\n");
      return skipped;
    }
    torch::cuda::manual_seed_all(0);
    if (mode == "cuda") {
      r = train(steps, torch::Device(torch::kCUDA, 0));
    } else {
#  if defined(FUSEDOPT_LIBTORCH_TRAIN_GRAPH)
      r = train_graph(steps, torch::Device(torch::kCUDA, 0));
#  else
      std::printf("SKIPPED: built without torch's CUDA headers (ATen/cuda/CUDAGraph.h): no graph variant\n");
      return skipped;
#  endif
    }
#else
    std::printf("SKIPPED: built without nvcc (no make_cuda_steps()): CUDA parameters cannot step\n");
    return skipped;
#endif
  }
  std::printf("loss %.5f -> %.5f\n", r.first, r.last);
  return r.last < 0.5 * r.first ? 0 : 1;
}
