// The library rows of issue 15 on the CUDA backend (the host side is tests/host/red_team.cpp):
// a step below 1 given as a value is rejected before anything is enqueued, by plans and by
// apply, and a step in device memory is not read on the host (no synchronisation), with the
// rules' arithmetic defined whatever int64 it holds.
#include "support.cuh"

#include <cstdint>
#include <limits>
#include <string>

using namespace fusedopt_test;

using adam_problem = adam_problem_of<float, float>;

TEST_CASE("a step value below 1 is rejected before anything is enqueued", "[cuda][errors][red_team]")
{
  std::int64_t const t = GENERATE(as<std::int64_t>{}, 0, -1, std::numeric_limits<std::int64_t>::min());
  INFO("step " << t);
  adam_problem p(edge_sizes(), shift::same, 15);
  auto const lists = p.lists(true);
  auto const plan = fo::cuda::make_plan(lists);
  device_array<std::int64_t> counter(1);
  counter.set(41);
  fo::step_info const step{fo::scalar<std::int64_t>(t), counter.get()};
  CHECK(message_of([&] { plan.run(fo::rules::adamw{}, step); }).find("1-based") != std::string::npos);
  CHECK(message_of([&] { plan.run(fo::chain(fo::rules::clip_by_global_norm{1.0}, fo::rules::adamw{}), step); })
          .find("1-based") != std::string::npos);
  CHECK(message_of([&] { fo::cuda::apply(fo::rules::nadam{}, lists, step); }).find("1-based") != std::string::npos);
  FO_TEST_CUDA(cudaDeviceSynchronize());
  p.require_same_bits("after rejected steps");  // nothing was written
  CHECK(counter.value() == 41);                 // nor advanced
}

TEST_CASE("a step in device memory is not checked on the host, and stays defined", "[cuda][red_team]")
{
  // INT64_MAX and INT64_MIN reach nadam's and adagrad's arithmetic only this way; the host
  // backend gives the same bits for INT64_MAX (it refuses INT64_MIN).
  adam_problem p(edge_sizes(), shift::same, 16);
  device_array<std::int64_t> device_step(1);
  device_step.set(std::numeric_limits<std::int64_t>::max());
  auto const plan = fo::cuda::make_plan(p.lists(true));
  fo::step_info const step{fo::scalar<std::int64_t>::from_pointer(device_step.get())};
  REQUIRE_NOTHROW(plan.run(fo::rules::nadam{}, step));
  adam_problem q(edge_sizes(), shift::same, 16);
  fo::host::make_plan(q.lists(false)).run(fo::rules::nadam{}, fo::step_info{std::numeric_limits<std::int64_t>::max()});
  pull(p);
  for (std::size_t i = 0; i < p.slot_arena<0>().host.size(); ++i) {
    REQUIRE(same_bits(p.slot_arena<0>().host[i], q.slot_arena<0>().host[i]));
  }
  device_step.set(std::numeric_limits<std::int64_t>::min());
  REQUIRE_NOTHROW(plan.run(fo::rules::nadam{}, step));
  FO_TEST_CUDA(cudaDeviceSynchronize());
}
