// A libtorch training loop with fusedopt's fused AdamW: a small MLP (torch::nn) learns a
// synthetic regression target; the optimizer is a drop-in for torch::optim::AdamW (the same
// options, state and checkpoints), with a StepLR schedule. Prints the loss every 50 steps and
// exits with 1 when it did not fall.
//   fusedopt_libtorch_train [steps]      (default 400)
#include <fusedopt/libtorch/optimizers.hpp>

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv)
{
  int const steps = argc > 1 ? std::atoi(argv[1]) : 400;
  torch::manual_seed(0);
  auto const inputs = torch::randn({1024, 32});
  auto const teacher = torch::randn({32, 4});
  auto const targets = torch::tanh(inputs.matmul(teacher));

  torch::nn::Sequential model(torch::nn::Linear(32, 128), torch::nn::ReLU(), torch::nn::Linear(128, 128),
                              torch::nn::ReLU(), torch::nn::Linear(128, 4));
  fusedopt::libtorch::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
  torch::optim::StepLR schedule(optimizer, /*step_size=*/150, /*gamma=*/0.5);

  double first = 0, last = 0;
  for (int step = 1; step <= steps; ++step) {
    auto const batch = torch::randint(0, inputs.size(0), {128}, torch::kLong);
    optimizer.zero_grad();
    auto const loss = torch::mse_loss(model->forward(inputs.index_select(0, batch)), targets.index_select(0, batch));
    loss.backward();
    optimizer.step();
    schedule.step();
    last = loss.item<double>();
    if (step == 1) { first = last; }
    if (step % 50 == 0 || step == 1) { std::printf("step %4d  loss %.5f\n", step, last); }
  }
  std::printf("loss %.5f -> %.5f, %lld plan(s) built\n", first, last, static_cast<long long>(optimizer.plan_builds()));
  return last < 0.5 * first ? 0 : 1;
}
