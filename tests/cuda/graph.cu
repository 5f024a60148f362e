// CUDA graphs and streams: a plan.run captured once and replayed N times (hyperparameters and
// the step read from device memory) gives the bits of N eager runs and of the host backend;
// two plans on two streams at once give the bits of the host backend.
#include "support.cuh"

using namespace fusedopt_test;

namespace {
using adam_problem = adam_problem_of<fo::bfloat16, float>;

double lr_at(std::int64_t t) { return 1e-2 / static_cast<double>(t); }  // a schedule that changes every step
}  // namespace

TEST_CASE("a captured plan.run replays with the bits of eager runs", "[cuda][graph]")
{
  auto const how = GENERATE(fo::cuda::transport::device_table, fo::cuda::transport::param_4k);
  int const steps = trajectory_steps();
  std::vector<std::int64_t> sizes = edge_sizes();
  adam_problem replayed(sizes, shift::same, 11);
  adam_problem eager(sizes, shift::same, 11);  // same seed: same initial values

  double* lr = nullptr;
  std::int64_t* step = nullptr;
  FO_TEST_CUDA(cudaMalloc(&lr, sizeof *lr));
  FO_TEST_CUDA(cudaMalloc(&step, sizeof *step));
  FO_TEST_CUDA(cudaMemset(step, 0, sizeof *step));

  fo::rules::adamw device_rule;
  device_rule.lr = fo::scalar<double>::from_pointer(lr);
  // The step counts itself: step_info::advance adds 1 on the device before each replayed step.
  fo::step_info device_step{fo::scalar<std::int64_t>::from_pointer(step)};
  device_step.advance = step;

  cudaStream_t stream = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fo::cuda::options opts;
  opts.metadata = how;
  opts.chunk_elements = 64;  // many chunks, so a replay covers many blocks
  auto const graph_plan = fo::cuda::make_plan(replayed.lists(true), opts, stream);
  auto const eager_plan = fo::cuda::make_plan(eager.lists(true), opts, stream);
  auto host_plan = fo::host::make_plan(eager.lists(false));

  captured_graph const graph(stream, [&] { graph_plan.run(device_rule, device_step, stream); });

  for (std::int64_t t = 1; t <= steps; ++t) {
    // The same gradients for both device problems and the host reference.
    eager.refresh_inputs();
    auto& g_src = eager.slot_arena<1>();
    auto& g_dst = replayed.slot_arena<1>();
    g_dst.host = g_src.host;
    FO_TEST_CUDA(cudaMemcpy(g_dst.device, g_src.device, g_src.host.size() * sizeof(fo::bfloat16),
                            cudaMemcpyDeviceToDevice));
    FO_TEST_CUDA(cudaDeviceSynchronize());  // the copy ran on the legacy stream, which `stream` does not wait for
    double const lr_now = lr_at(t);
    upload_bytes(lr, &lr_now, sizeof lr_now);

    graph.launch(stream);
    fo::rules::adamw host_rule;
    host_rule.lr = lr_now;
    eager_plan.run(host_rule, fo::step_info{t}, stream);
    host_plan.run(host_rule, fo::step_info{t});
    FO_TEST_CUDA(cudaStreamSynchronize(stream));

    std::string const context = "graph step " + std::to_string(t);
    eager.require_same_bits(context + " (eager vs host)");
    // The replayed problem must hold the host's bits too: copy the reference over and compare.
    replayed.slot_arena<0>().host = eager.slot_arena<0>().host;
    replayed.slot_arena<2>().host = eager.slot_arena<2>().host;
    replayed.slot_arena<3>().host = eager.slot_arena<3>().host;
    replayed.require_same_bits(context + " (replay vs host)");
  }
  std::int64_t final_step = 0;
  FO_TEST_CUDA(cudaMemcpy(&final_step, step, sizeof final_step, cudaMemcpyDeviceToHost));
  CHECK(final_step == steps);
  FO_TEST_CUDA(cudaStreamDestroy(stream));
  FO_TEST_CUDA(cudaFree(lr));
  FO_TEST_CUDA(cudaFree(step));
}

TEST_CASE("two plans on two streams at once", "[cuda][graph][streams]")
{
  int const steps = trajectory_steps();
  adam_problem a(edge_sizes(), shift::same, 21);
  adam_problem b(edge_sizes(), shift::mixed, 22);
  cudaStream_t sa = nullptr, sb = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  auto const plan_a = fo::cuda::make_plan(a.lists(true), {}, sa);
  fo::cuda::options small_chunks;
  small_chunks.chunk_elements = 128;
  auto const plan_b = fo::cuda::make_plan(b.lists(true), small_chunks, sb);
  auto host_a = fo::host::make_plan(a.lists(false));
  auto host_b = fo::host::make_plan(b.lists(false));
  fo::rules::adamw rule;
  // Gradients stay fixed so that no copy synchronises the streams between steps.
  for (std::int64_t t = 1; t <= steps; ++t) {
    plan_a.run(rule, fo::step_info{t}, sa);
    plan_b.run(rule, fo::step_info{t}, sb);
    host_a.run(rule, fo::step_info{t});
    host_b.run(rule, fo::step_info{t});
  }
  FO_TEST_CUDA(cudaStreamSynchronize(sa));
  FO_TEST_CUDA(cudaStreamSynchronize(sb));
  a.require_same_bits("stream a");
  b.require_same_bits("stream b");
  FO_TEST_CUDA(cudaStreamDestroy(sa));
  FO_TEST_CUDA(cudaStreamDestroy(sb));
}
