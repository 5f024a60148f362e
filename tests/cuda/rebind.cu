// Plans follow moving addresses: a plan rebound to lists of the same geometry at new addresses
// gives the bits of the host backend (every transport, every placement), a changed geometry is
// a clear error that leaves the plan as it was, and a rebind under stream capture is replayed
// with the captured addresses; address sets seen recently switch device copies of the table
// instead of uploading one.
#include "support.cuh"

#include <memory>
#include <string>
#include <utility>
#include <vector>

using namespace fusedopt_test;

namespace {
using adam_problem = adam_problem_of<fo::bfloat16, float>;


/// Copies every device arena of `from` into `to` (same layout): the tensors "move".
template <std::size_t... K>
void move_device_state(adam_problem& from, adam_problem& to, std::index_sequence<K...>)
{
  (
    [&] {
      auto& a = from.slot_arena<K>();
      auto& b = to.slot_arena<K>();
      FO_TEST_CUDA(cudaMemcpy(b.device, a.device, a.host.size() * sizeof(a.host[0]), cudaMemcpyDeviceToDevice));
      b.host = a.host;
    }(),
    ...);
}
}  // namespace

TEST_CASE("a plan rebound to moved tensors gives the host backend's bits", "[cuda][rebind]")
{
  for (scenario const& how : plan_scenarios()) {
    if (!transport_available(how.metadata)) { continue; }
    std::vector<std::int64_t> const sizes = edge_sizes();
    // Two copies of the same problem at different addresses; after every step the state moves
    // from one to the other, as a caching allocator's new buffers would.
    adam_problem a(sizes, how.placement, 21), b(sizes, how.placement, 21);
    adam_problem* here = &a;
    adam_problem* there = &b;
    auto host_plan = fo::host::make_plan(a.lists(false));
    fo::cuda::options const opts = options_of(how);
    auto plan = fo::cuda::make_plan(a.lists(true), opts);
    fo::rules::adamw rule;
    rule.lr = 1e-2;
    for (std::int64_t t = 1; t <= trajectory_steps(); ++t) {
      here->refresh_inputs();
      host_plan.rebind(here->lists(false));
      REQUIRE(plan.can_rebind(here->lists(true)));
      plan.rebind(here->lists(true));
      host_plan.run(rule, fo::step_info{t});
      plan.run(rule, fo::step_info{t});
      FO_TEST_CUDA(cudaDeviceSynchronize());
      here->require_same_bits(std::string("rebind [") + how.name + "] step " + std::to_string(t));
      move_device_state(*here, *there, std::make_index_sequence<4>{});
      std::swap(here, there);
    }
  }
}

/// The element addresses of a bound list, as rebind(slot, addresses) takes them.
template <class T>
std::vector<T*> addresses_of(fo::tensor_list<T> const& list)
{
  std::vector<T*> out;
  for (auto const& t : list) { out.push_back(t.data); }
  return out;
}

TEST_CASE("only the gradients move: the other slots stay where they are", "[cuda][rebind]")
{
  bool const by_slot = GENERATE(false, true);  // rebind(lists), or rebind(slot::grad, addresses)
  CAPTURE(by_slot);
  std::vector<std::int64_t> const sizes = edge_sizes();
  adam_problem p(sizes, shift::same, 5), spare(sizes, shift::same, 6);
  auto host_plan = fo::host::make_plan(p.lists(false));
  auto plan = fo::cuda::make_plan(p.lists(true));
  auto& other_grads = spare.slot_arena<1>();
  auto with_grads_from = [&](auto const& g) {
    return fo::bind(slot::param = p.slot_arena<0>().list(true), slot::grad = g.list(true),
                    slot::exp_avg = p.slot_arena<2>().list(true), slot::exp_avg_sq = p.slot_arena<3>().list(true));
  };
  fo::rules::adam rule;
  for (std::int64_t t = 1; t <= trajectory_steps(); ++t) {
    p.refresh_inputs();
    bool const moved = t % 2 == 1;
    if (moved) {  // the same gradient values in the spare buffer
      auto& g = p.slot_arena<1>();
      FO_TEST_CUDA(cudaMemcpy(other_grads.device, g.device, g.host.size() * sizeof(g.host[0]), cudaMemcpyDeviceToDevice));
      other_grads.host = g.host;  // the spare arena's expected contents, gaps included
      if (by_slot) {
        auto const moved = addresses_of(other_grads.list(true));
        plan.rebind(slot::grad, moved.data(), moved.size());
      } else {
        plan.rebind(with_grads_from(other_grads));
      }
    } else if (by_slot) {
      auto const back = addresses_of(p.slot_arena<1>().list(true));
      plan.rebind(slot::grad, back.data(), back.size());
    } else {
      plan.rebind(p.lists(true));
    }
    host_plan.run(rule, fo::step_info{t});
    plan.run(rule, fo::step_info{t});
    FO_TEST_CUDA(cudaDeviceSynchronize());
    p.require_same_bits("gradients moved at step " + std::to_string(t));
  }
  spare.require_same_bits("the spare buffers (read, never written)");
}

TEST_CASE("a changed geometry is a clear error and leaves the plan as it was", "[cuda][rebind][errors]")
{
  auto const how = GENERATE(fo::cuda::transport::device_table, fo::cuda::transport::param_4k);
  std::vector<std::int64_t> const sizes = {3, 64, 1000};
  adam_problem p(sizes, shift::none, 8);
  fo::cuda::options opts;
  opts.metadata = how;
  auto plan = fo::cuda::make_plan(p.lists(true), opts);

  SECTION("another size")
  {
    adam_problem q({3, 65, 1000}, shift::none, 8);
    CHECK_FALSE(plan.can_rebind(q.lists(true)));
    std::string const what = message_of([&] { plan.rebind(q.lists(true)); });
    CHECK(what.find("tensor 1 has 65 elements but the plan was made for 64") != std::string::npos);
  }
  SECTION("another tensor count")
  {
    adam_problem q({3, 64}, shift::none, 8);
    CHECK_FALSE(plan.can_rebind(q.lists(true)));
    CHECK(message_of([&] { plan.rebind(q.lists(true)); }).find("2 tensors but the plan was made for 3") !=
          std::string::npos);
  }
  SECTION("another alignment class")
  {
    adam_problem q(sizes, shift::same, 8);  // tensors start 1, 4, 7 elements past a 64-byte boundary
    CHECK_FALSE(plan.can_rebind(q.lists(true)));
    CHECK(message_of([&] { plan.rebind(q.lists(true)); }).find("alignment class") != std::string::npos);
  }
  SECTION("pageable host memory")
  {
    CHECK(message_of([&] { plan.rebind(p.lists(false)); }).find("pageable") != std::string::npos);
  }
  SECTION("rebind(slot, addresses): another alignment class, an overlap, a count, pageable memory")
  {
    adam_problem q(sizes, shift::same, 8);
    auto const shifted = addresses_of(q.slot_arena<1>().list(true));
    CHECK(message_of([&] { plan.rebind(slot::grad, shifted.data(), shifted.size()); }).find("alignment class") !=
          std::string::npos);
    auto over_state = addresses_of(p.slot_arena<1>().list(true));
    over_state[2] = reinterpret_cast<fo::bfloat16 const*>(p.slot_arena<2>().list(true)[2].data);
    CHECK(message_of([&] { plan.rebind(slot::grad, over_state.data(), over_state.size()); })
            .find("tensor 2 of slot 'grad' overlaps a tensor the rule writes") != std::string::npos);
    CHECK(message_of([&] { plan.rebind(slot::grad, over_state.data(), 2); }).find("2 addresses for a plan of 3") !=
          std::string::npos);
    auto const pageable = addresses_of(p.slot_arena<1>().list(false));
    CHECK(message_of([&] { plan.rebind(slot::grad, pageable.data(), pageable.size()); }).find("pageable") !=
          std::string::npos);
  }
  // The plan still updates the tensors it was bound to, bit for bit.
  auto host_plan = fo::host::make_plan(p.lists(false));
  host_plan.run(fo::rules::adam{}, fo::step_info{1});
  plan.run(fo::rules::adam{}, fo::step_info{1});
  FO_TEST_CUDA(cudaDeviceSynchronize());
  p.require_same_bits("after a rejected rebind");
}

TEST_CASE("rebind under stream capture: the graph writes the captured addresses", "[cuda][rebind][graph]")
{
  // torch's CUDA-graph recipe captures a step whose gradients were just allocated: the rebind
  // happens inside the capture. 300 tensors: the table travels in several by-value pieces.
  std::vector<std::int64_t> sizes(300);
  for (std::size_t k = 0; k < sizes.size(); ++k) { sizes[k] = static_cast<std::int64_t>(1 + (k * 37) % 900); }
  adam_problem p(sizes, shift::none, 3), q(sizes, shift::none, 4);
  cudaStream_t stream = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto plan = fo::cuda::make_plan(p.lists(true), {}, stream);
  REQUIRE(plan.metadata() == fo::cuda::transport::device_table);

  cudaGraph_t graph = nullptr;
  // torch.cuda.graph's default mode: the strictest about calls made while capturing.
  FO_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  REQUIRE_NOTHROW(plan.rebind(p.lists(true), stream));  // the addresses already bound: nothing enqueued
  REQUIRE_NOTHROW(plan.rebind(q.lists(true), stream));
  plan.run(fo::rules::sgd{}, fo::step_info{1}, stream);
  FO_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  FO_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  FO_TEST_CUDA(cudaStreamSynchronize(stream));
  p.require_same_bits("nothing ran during the capture (p)");
  q.require_same_bits("nothing ran during the capture (q)");

  // An eager run before any replay writes the table first: it updates q, not p.
  plan.run(fo::rules::sgd{}, fo::step_info{1}, stream);
  FO_TEST_CUDA(cudaStreamSynchronize(stream));
  fo::host::apply(fo::rules::sgd{}, q.lists(false), fo::step_info{1});
  q.require_same_bits("an eager run after the capture");
  p.require_same_bits("p is no longer bound");

  // Each replay writes the captured table, then steps q.
  for (int replay = 0; replay < 2; ++replay) {
    FO_TEST_CUDA(cudaGraphLaunch(exec, stream));
    FO_TEST_CUDA(cudaStreamSynchronize(stream));
    fo::host::apply(fo::rules::sgd{}, q.lists(false), fo::step_info{1});
    q.require_same_bits("a replay");
    p.require_same_bits("p untouched by replays");
  }
  FO_TEST_CUDA(cudaGraphExecDestroy(exec));
  FO_TEST_CUDA(cudaGraphDestroy(graph));
  FO_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("many rebinds in a row on one stream (the upload ring wraps)", "[cuda][rebind]")
{
  std::vector<std::int64_t> const sizes = {17, 4096, 3000, 1};
  adam_problem a(sizes, shift::none, 9), b(sizes, shift::none, 9);
  auto host_plan = fo::host::make_plan(a.lists(false));
  cudaStream_t stream = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto plan = fo::cuda::make_plan(a.lists(true), {}, stream);
  // Only the gradients alternate; the host never waits, so uploads pile up on the stream.
  auto grads_of = [&](adam_problem& g) {
    return fo::bind(slot::param = a.slot_arena<0>().list(true), slot::grad = g.slot_arena<1>().list(true),
                    slot::exp_avg = a.slot_arena<2>().list(true), slot::exp_avg_sq = a.slot_arena<3>().list(true));
  };
  fo::rules::sgd rule;
  int const steps = 23;
  for (std::int64_t t = 1; t <= steps; ++t) {
    plan.rebind(grads_of(t % 2 == 0 ? a : b), stream);
    plan.run(rule, fo::step_info{t}, stream);
    host_plan.run(rule, fo::step_info{t});
  }
  FO_TEST_CUDA(cudaStreamSynchronize(stream));
  a.require_same_bits("23 steps with gradients from alternating buffers (equal values)");
  FO_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("address sets seen recently switch device copies: no upload, the same bits", "[cuda][rebind]")
{
  // A caching allocator cycles through a few gradient buffers (PyTorch under
  // zero_grad(set_to_none=True)). `sets` buffers in turn, with `copies` address tables.
  auto const shape = GENERATE(std::pair{3, 4}, std::pair{3, 2}, std::pair{2, 1});
  int const sets = shape.first;
  int const copies = shape.second;
  CAPTURE(sets, copies);
  bool const by_slot = GENERATE(false, true);
  CAPTURE(by_slot);
  std::vector<std::int64_t> const sizes = edge_sizes();
  adam_problem p(sizes, shift::same, 31);
  std::vector<std::unique_ptr<adam_problem>> spares;
  for (int k = 0; k < sets; ++k) { spares.push_back(std::make_unique<adam_problem>(sizes, shift::same, 40 + k)); }
  auto host_plan = fo::host::make_plan(p.lists(false));
  fo::cuda::options opts;
  opts.address_tables = copies;
  cudaStream_t stream = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto plan = fo::cuda::make_plan(p.lists(true), opts, stream);
  CHECK(plan.table_uploads() == 1);  // the plan's own
  fo::rules::adamw rule;
  int const steps = quick() ? 2 * sets : 4 * sets;
  for (std::int64_t t = 1; t <= steps; ++t) {
    p.refresh_inputs();
    auto& g = spares[static_cast<std::size_t>(t % sets)]->slot_arena<1>();
    auto& mine = p.slot_arena<1>();
    // On the plan's stream: a device-to-device cudaMemcpy may return before the copy is done,
    // and the non-blocking stream does not wait for the legacy one.
    FO_TEST_CUDA(cudaMemcpyAsync(g.device, mine.device, mine.host.size() * sizeof(mine.host[0]),
                                 cudaMemcpyDeviceToDevice, stream));
    g.host = mine.host;
    std::uint64_t const before = plan.table_uploads();
    if (by_slot) {
      auto const moved = addresses_of(g.list(true));
      plan.rebind(slot::grad, moved.data(), moved.size(), stream);
    } else {
      plan.rebind(fo::bind(slot::param = p.slot_arena<0>().list(true), slot::grad = g.list(true),
                           slot::exp_avg = p.slot_arena<2>().list(true), slot::exp_avg_sq = p.slot_arena<3>().list(true)),
                  stream);
    }
    // The first round uploads each set; later rounds find them while there are copies enough.
    bool const seen = t > sets && copies >= sets;
    CHECK(plan.table_uploads() - before == (seen ? 0u : 1u));
    host_plan.run(rule, fo::step_info{t});
    plan.run(rule, fo::step_info{t}, stream);
    FO_TEST_CUDA(cudaStreamSynchronize(stream));
    p.require_same_bits("gradient set " + std::to_string(t % sets) + " at step " + std::to_string(t));
  }
  FO_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("address_tables below 1 is a clear error", "[cuda][rebind][errors]")
{
  adam_problem p({5, 64}, shift::none, 2);
  fo::cuda::options opts;
  opts.address_tables = 0;
  CHECK(message_of([&] { (void)fo::cuda::make_plan(p.lists(true), opts); }).find("address_tables") !=
        std::string::npos);
}
