// Bad input gets a fusedopt::error before any memory is touched; failed CUDA calls name the
// call.
#include "support.cuh"

#include <string>

using namespace fusedopt_test;

using adam_problem = adam_problem_of<float, float>;

TEST_CASE("invalid rule options are rejected before anything is enqueued", "[cuda][errors]")
{
  adam_problem p(edge_sizes(), shift::same, 8);
  auto const lists = p.lists(true);
  auto const plan = fo::cuda::make_plan(lists);
  fo::rules::adam opt;
  opt.amsgrad = true;  // max_exp_avg_sq is not bound
  REQUIRE_THROWS_AS(plan.run(opt), fo::error);
  REQUIRE_THROWS_AS(fo::cuda::apply(opt, lists), fo::error);
  fo::rules::adam bad_beta;
  bad_beta.beta1 = 1.5;
  REQUIRE_THROWS_AS(plan.run(bad_beta), fo::error);
  FO_TEST_CUDA(cudaDeviceSynchronize());
  p.require_same_bits("after rejected runs");  // nothing was written
}

TEST_CASE("pointers not aligned to their element size are rejected", "[cuda][errors]")
{
  float* memory = nullptr;
  FO_TEST_CUDA(cudaMalloc(&memory, 1024));
  auto* odd = reinterpret_cast<float*>(reinterpret_cast<char*>(memory) + 2);
  fo::tensor_list<float> params{{memory, 16}}, grads{{odd + 32, 16}};
  auto const lists = fo::bind(slot::param = params, slot::grad = grads);
  std::string const what = message_of([&] { (void)fo::cuda::make_plan(lists); });
  CHECK(what.find("aligned") != std::string::npos);
  CHECK(what.find("grad") != std::string::npos);
  REQUIRE_THROWS_AS(fo::cuda::apply(fo::rules::sgd{}, lists), fo::error);
  FO_TEST_CUDA(cudaFree(memory));
}

TEST_CASE("pageable host memory is rejected", "[cuda][errors]")
{
  std::vector<float> host(64, 1.f);
  fo::tensor_list<float> params{{host.data(), 64}};
  auto const lists = fo::bind(slot::param = params);
  std::string const what = message_of([&] { (void)fo::cuda::make_plan(lists); });
  CHECK(what.find("pageable") != std::string::npos);
}

TEST_CASE("bad options are rejected", "[cuda][errors]")
{
  adam_problem p({5, 100}, shift::none, 9);
  auto const lists = p.lists(true);
  fo::cuda::options opts;
  opts.chunk_elements = -1;
  REQUIRE_THROWS_AS(fo::cuda::make_plan(lists, opts), fo::error);
  opts.chunk_elements = std::int64_t{1} << 31;
  REQUIRE_THROWS_AS(fo::cuda::make_plan(lists, opts), fo::error);
  opts = {};
  opts.max_blocks = -2;
  REQUIRE_THROWS_AS(fo::cuda::make_plan(lists, opts), fo::error);
  opts = {};
  opts.metadata = fo::cuda::transport::device_table;  // apply owns no device memory
  REQUIRE_THROWS_AS(fo::cuda::apply(fo::rules::adam{}, lists, {}, opts), fo::error);
  opts = {};
  opts.memory = static_cast<fo::cuda::memory_speed>(7);  // it chooses every update's shape
  REQUIRE_THROWS_AS(fo::cuda::make_plan(lists, opts), fo::error);
  REQUIRE_THROWS_AS(fo::cuda::apply(fo::rules::adam{}, lists, {}, opts), fo::error);
}

TEST_CASE("FUSEDOPT_CUDA_TRY names the failed call", "[cuda][errors][api-error]")
{
  std::string const what = message_of([] { FUSEDOPT_CUDA_TRY(cudaSetDevice(1 << 20)); });
  CHECK(what.find("cudaSetDevice") != std::string::npos);
  CHECK(what.find("errors.cu") != std::string::npos);
  (void)cudaGetLastError();
  // The runtime's status travels with it: a cuda_error is a fusedopt::error.
  try {
    FUSEDOPT_CUDA_TRY(cudaSetDevice(1 << 20));
    FAIL("no exception");
  } catch (fo::cuda::cuda_error const& e) {
    CHECK(e.status() == cudaErrorInvalidDevice);
    CHECK(dynamic_cast<fo::error const*>(&e) != nullptr);
  }
  (void)cudaGetLastError();
}

TEST_CASE("a moved plan keeps working and a moved-from plan is destroyed safely", "[cuda][errors]")
{
  adam_problem p(edge_sizes(), shift::same, 10);
  auto host_plan = fo::host::make_plan(p.lists(false));
  auto first = fo::cuda::make_plan(p.lists(true));
  auto second = std::move(first);
  fo::rules::adam opt;
  second.run(opt, fo::step_info{1});
  host_plan.run(opt, fo::step_info{1});
  FO_TEST_CUDA(cudaDeviceSynchronize());
  p.require_same_bits("moved plan");
}
