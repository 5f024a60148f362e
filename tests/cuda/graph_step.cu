// A whole AMP training step (unscale + clip_by_global_norm + skip_if_nonfinite(AdamW) +
// grad_scaler_update; lr, inv_scale and the step count in device memory, the step advancing
// itself) captured once in a CUDA graph and replayed N times gives the bits of N eager
// plan.run calls: reduction passes, their finalize kernels and the after-step hooks replay
// with no host involvement, and their results are the same bits every run. One replayed step
// has an infinite gradient and is skipped in both.
#include "support.cuh"

#include <limits>

using namespace fusedopt_test;

namespace {

using adam_problem = adam_problem_of<fo::bfloat16, float>;

struct step_state {
  double lr;
  double inv_scale;
  float scale;
  float found_inf;
  std::int32_t growth_tracker;
  std::int64_t step;
  double total_norm;
};

auto whole_step(step_state* s)
{
  fo::rules::adamw opt;
  opt.lr = fo::scalar<double>::from_pointer(&s->lr);
  opt.weight_decay = 0.05;
  fo::rules::clip_by_global_norm clip;
  clip.max_norm = 2.0;
  clip.total_norm = &s->total_norm;
  return fo::chain(fo::rules::unscale_gradients{fo::scalar<double>::from_pointer(&s->inv_scale)}, clip,
                   fo::rules::skip_if_nonfinite(opt, &s->found_inf),
                   fo::rules::grad_scaler_update{&s->scale, &s->growth_tracker, &s->found_inf, 2.0, 0.5, 2,
                                                 &s->inv_scale});
}

}  // namespace

TEST_CASE("a captured whole step (clip + unscale + AdamW + scaler) replays with the bits of eager runs",
          "[cuda][graph][reduce]")
{
  auto const how = GENERATE(fo::cuda::transport::device_table, fo::cuda::transport::param_4k);
  int const steps = quick() ? 4 : 12;
  std::vector<std::int64_t> const sizes = edge_sizes();
  adam_problem replayed(sizes, shift::same, 11);
  adam_problem eager(sizes, shift::same, 11);  // same seed: same initial values

  step_state const initial{0, 1.0 / 256, 256.f, 0.f, 0, 0, 0};
  device_array<step_state> replay_state(1), eager_state(1);
  replay_state.set(initial);
  eager_state.set(initial);
  auto const replay_rule = whole_step(replay_state.get());
  auto const eager_rule = whole_step(eager_state.get());
  STATIC_REQUIRE(fo::pass_count_v<std::decay_t<decltype(replay_rule)>> == 2);
  fo::step_info replay_step{fo::scalar<std::int64_t>::from_pointer(&replay_state.get()->step)};
  replay_step.advance = &replay_state.get()->step;
  fo::step_info eager_step{fo::scalar<std::int64_t>::from_pointer(&eager_state.get()->step)};
  eager_step.advance = &eager_state.get()->step;

  cudaStream_t stream = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fo::cuda::options opts;
  opts.metadata = how;
  opts.chunk_elements = 64;  // many chunks: many partials per tensor
  auto const graph_plan = fo::cuda::make_plan(replayed.lists(true), opts, stream);
  auto const eager_plan = fo::cuda::make_plan(eager.lists(true), opts, stream);

  cudaGraph_t graph = nullptr;
  FO_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  graph_plan.run(replay_rule, replay_step, stream);
  FO_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  std::size_t nodes = 0;
  FO_TEST_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
  CHECK(nodes == graph_plan.launches_per_run(replay_rule, true));
  cudaGraphExec_t exec = nullptr;
  FO_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));

  int skipped = 0;
  for (std::int64_t t = 1; t <= steps; ++t) {
    eager.refresh_inputs();
    auto& g_src = eager.slot_arena<1>();
    if (t == 3) {  // an infinite gradient: the step is skipped in both
      float const inf = std::numeric_limits<float>::infinity();
      auto const at = static_cast<std::size_t>(g_src.offsets[sizes.size() - 1] + 100);
      g_src.host[at] = fo::bfloat16(inf);
      FO_TEST_CUDA(cudaMemcpy(g_src.device + at, &g_src.host[at], sizeof(fo::bfloat16), cudaMemcpyHostToDevice));
    }
    auto& g_dst = replayed.slot_arena<1>();
    g_dst.host = g_src.host;
    FO_TEST_CUDA(cudaMemcpy(g_dst.device, g_src.device, g_src.host.size() * sizeof(fo::bfloat16),
                            cudaMemcpyDeviceToDevice));
    double const lr = 1e-2 / static_cast<double>(t);  // a schedule that changes every step
    FO_TEST_CUDA(cudaMemcpy(&replay_state.get()->lr, &lr, sizeof lr, cudaMemcpyHostToDevice));
    FO_TEST_CUDA(cudaMemcpy(&eager_state.get()->lr, &lr, sizeof lr, cudaMemcpyHostToDevice));
    FO_TEST_CUDA(cudaDeviceSynchronize());  // the copies ran on the legacy stream

    FO_TEST_CUDA(cudaGraphLaunch(exec, stream));
    eager_plan.run(eager_rule, eager_step, stream);
    FO_TEST_CUDA(cudaStreamSynchronize(stream));

    std::string const context = "whole step " + std::to_string(t);
    pull(replayed);
    pull(eager);
    // Compare the replayed problem's device arenas with the eager problem's.
    replayed.slot_arena<0>().host = eager.slot_arena<0>().host;
    replayed.slot_arena<2>().host = eager.slot_arena<2>().host;
    replayed.slot_arena<3>().host = eager.slot_arena<3>().host;
    replayed.require_same_bits(context + " (replay vs eager)");
    step_state const a = replay_state.value(), b = eager_state.value();
    CHECK(same_bits(a.scale, b.scale));
    CHECK(same_bits(a.inv_scale, b.inv_scale));
    CHECK(same_bits(a.total_norm, b.total_norm));
    CHECK(a.found_inf == b.found_inf);
    CHECK(a.growth_tracker == b.growth_tracker);
    CHECK(a.step == b.step);
    skipped += a.found_inf != 0.f ? 1 : 0;
    CHECK(a.step == t - skipped);
  }
  CHECK(skipped == 1);
  FO_TEST_CUDA(cudaGraphExecDestroy(exec));
  FO_TEST_CUDA(cudaGraphDestroy(graph));
  FO_TEST_CUDA(cudaStreamDestroy(stream));
}
