// The CUDA backend's work decomposition: list lengths around the 4 KB table (the N=423/424
// crash of by-value tables), 100 000 tensors, mixed element types in one launch, rules that
// read or write only some slots, launch counts per transport, and a tensor of more than 2^31
// elements.
#include "support.cuh"

#include <limits>

using namespace fusedopt_test;

namespace {

// Reads everything bound (no declarations): param and the two states change, grad is const.
struct mix_all {
  float scale = 0.75f;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const& s) const
  {
    using T = typename E::value_type;
    T const g = e[slot::grad];
    e[slot::exp_avg] = T(0.5) * e[slot::exp_avg] + g;
    e[slot::exp_avg_sq] = e[slot::exp_avg_sq] + g * g;
    e[slot::param] -= T(scale) * e[slot::exp_avg] / (T(1) + e[slot::exp_avg_sq]) +
                      T(1e-3) * static_cast<T>(e.tensor() % 7) + T(1e-4) * static_cast<T>(s.step.get());
  }
};

// Declares a narrow view: exp_avg is bound but neither read (it starts at zero) nor written
// (its changes are dropped); grad is read and changed but never stored.
struct narrow {
  using reads = fo::slots<slot::grad_t, slot::param_t>;
  using writes = fo::slots<slot::param_t, slot::exp_avg_sq_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    using T = typename E::value_type;
    e[slot::grad] *= T(2);
    e[slot::exp_avg] += T(3);  // starts at zero, never stored
    e[slot::exp_avg_sq] = e[slot::grad] + e[slot::exp_avg];
    e[slot::param] += T(0.125) * e[slot::exp_avg_sq];
  }
};

// Uses where the element is: its tensor and its index within the tensor (both paths, vector
// and scalar, must report the host backend's positions).
struct by_position {
  using reads = fo::slots<slot::param_t>;
  using writes = fo::slots<slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    using T = typename E::value_type;
    e[slot::param] += T(1e-3) * static_cast<T>(e.index() % 1021) + T(0.5) * static_cast<T>(e.tensor() % 5);
  }
};

// Depends on the step number (read from device memory when the step is a pointer).
struct by_step {
  using reads = fo::slots<slot::param_t, slot::grad_t>;
  using writes = fo::slots<slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const& s) const
  {
    using T = typename E::value_type;
    e[slot::param] += T(1e-3) * static_cast<T>(s.step.get()) * e[slot::grad];
  }
};

// One 16-bit slot, for the tensor larger than 2^31 elements.
struct halve_plus_one {
  using reads = fo::slots<slot::param_t>;
  using writes = fo::slots<slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    using T = typename E::value_type;
    e[slot::param] = e[slot::param] * T(0.5) + T(1);
  }
};

// A body with a per-tensor form that adds a different amount on purpose (a real hook gives
// the element body's bits): the element body adds 1000, the per-tensor body 0.25 * (tensor % 9).
// The host backend runs the per-tensor form (tests/host/core.cpp); the same bits here mean the
// device kernels (update and reduction pass) run it too.
struct shifted_by_tensor {
  using reads = fo::slots<slot::param_t>;
  using writes = fo::slots<slot::param_t>;
  struct per_tensor {
    float shift;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::param] += static_cast<typename E::value_type>(shift);
    }
  };
  struct prepared {
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      per_tensor{1000.f}(e);
    }
    FUSEDOPT_HOST_DEVICE per_tensor for_tensor(std::int64_t tensor) const
    {
      return {0.25f * static_cast<float>(tensor % 9)};
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(fo::step_info const&) const { return {}; }
};

// The update's shape by memory speed (cuda/detail/dispatch.cuh): the policy's shape for fast
// memory only there and for tensors of 32 chunks on average or more, or wherever it is forced;
// a second kernel only where the two shapes differ (not for bf16 beside double states, one
// vector a slot in both).
namespace shapes {
namespace detail = fo::cuda::detail;
using policy = detail::default_policy;
static_assert(detail::plain_fast_shape<policy>(true, false, 32 * 10, 10), "long tensors on fast memory");
static_assert(!detail::plain_fast_shape<policy>(true, false, 32 * 10 - 1, 10), "short tensors keep the slow shape");
static_assert(!detail::plain_fast_shape<policy>(false, false, std::int64_t{1} << 20, 1), "slow memory");
static_assert(detail::plain_fast_shape<policy>(false, true, 1, 100), "forced");
template <class P, class G, class S>
using adam_lists = fo::bound_lists<fo::binding<slot::param_t, P>, fo::binding<slot::grad_t, G const>,
                                   fo::binding<slot::exp_avg_t, S>, fo::binding<slot::exp_avg_sq_t, S>>;
static_assert(detail::plain_shapes_differ_v<policy, adam_lists<float, float, float>>, "fp32: 128 x 4 and 256 x 1");
static_assert(detail::plain_shapes_differ_v<policy, adam_lists<fo::bfloat16, fo::bfloat16, float>>, "128 x 2, 128 x 1");
static_assert(!detail::plain_shapes_differ_v<policy, adam_lists<fo::bfloat16, fo::bfloat16, double>>, "128 x 1 twice");
static_assert(detail::plain_shape_v<policy, 4, true> == detail::plain_shape{256, 16}, "fp32: a block iteration of 1024");
static_assert(detail::plain_shape_v<policy, 8, true> == detail::plain_shape{128, 16}, "16-bit slots: 1024 too");
}  // namespace shapes

std::vector<std::int64_t> cycle_sizes(std::size_t count, std::int64_t modulus)
{
  std::vector<std::int64_t> sizes(count);
  for (std::size_t i = 0; i < count; ++i) { sizes[i] = static_cast<std::int64_t>((i * 7 + 3) % modulus); }
  return sizes;
}

}  // namespace

TEST_CASE("list lengths 0, 1, 423, 424 and 100000 on every transport", "[cuda][layout]")
{
  std::size_t const count = GENERATE(std::size_t{0}, std::size_t{1}, std::size_t{423}, std::size_t{424},
                                     std::size_t{100000});
  for (scenario const& how : scenarios()) {
    if (quick() && count == 100000 && how.one_shot) { continue; }
    problem<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, fo::bfloat16, fill::symmetric, true>,
            spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>
      p(cycle_sizes(count, count == 100000 ? 37 : 1500), how.placement, count);
    check_trajectory(p, [](std::int64_t) { return fo::rules::adamw{}; }, how, 2,
                     std::to_string(count) + " tensors");
  }
}

TEST_CASE("a plan of one tensor computes its chunks: every size edge, placement and shape", "[cuda][layout]")
{
  // The update of a plan with one non-empty tensor reads no chunk entries (tables.cuh,
  // one_tensor_table) where no chunk length or block loop is asked for: chunk 0 holds the
  // head, the others one block iteration each. Empty tensors around it leave it the only one;
  // the element index and tensor must stay the host's (by_position), in both shapes and all
  // three placements, and through the chunk table where the scenario asks for one.
  using fo::cuda::transport;
  auto const automatic = fo::cuda::l2_eviction::automatic;
  auto const fast = fo::cuda::memory_speed::fast;
  std::vector<scenario> cases = {
    {"plan/one-tensor/aligned", false, transport::device_table, 0, 0, shift::none},
    {"plan/one-tensor/same-shift", false, transport::device_table, 0, 0, shift::same},
    {"plan/one-tensor/mixed-shift", false, transport::device_table, 0, 0, shift::mixed},
    {"plan/one-tensor/fast-memory-shape/same-shift", false, transport::device_table, 0, 0, shift::same, automatic, fast},
    {"plan/one-tensor/fast-memory-shape/mixed-shift", false, transport::device_table, 0, 0, shift::mixed, automatic, fast},
  };
  for (scenario const& how : scenarios()) { cases.push_back(how); }
  std::vector<std::vector<std::int64_t>> const lists = {
    {1}, {7}, {1023}, {1024}, {1025}, {2047}, {2049}, {4097}, {0, 16391, 0}, {(std::int64_t{1} << 20) + 3}};
  for (auto const& sizes : lists) {
    std::string const label = "one tensor of " + std::to_string(sizes[sizes.size() / 2]);
    {
      // Which plans take the path: one non-empty tensor, no chunk length, no block cap.
      problem<spec<slot::param_t, float>> p(sizes, shift::none, 30);
      fo::cuda::options opts;
      CHECK(fo::cuda::make_plan(p.lists(true), opts).update_computes_chunks());
      opts.max_blocks = 3;
      CHECK_FALSE(fo::cuda::make_plan(p.lists(true), opts).update_computes_chunks());
      opts.max_blocks = 0;
      opts.chunk_elements = 40;
      CHECK_FALSE(fo::cuda::make_plan(p.lists(true), opts).update_computes_chunks());
      opts.chunk_elements = 0;
      opts.metadata = fo::cuda::transport::param_4k;
      CHECK_FALSE(fo::cuda::make_plan(p.lists(true), opts).update_computes_chunks());
    }
    for (scenario const& how : cases) {
      problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>, spec<slot::exp_avg_t, float>,
              spec<slot::exp_avg_sq_t, float, fill::positive>>
        adam(sizes, how.placement, 31);
      check_trajectory(adam, [](std::int64_t) { return fo::rules::adamw{}; }, how, 2, label + ", fp32 AdamW");
      problem<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, fo::bfloat16, fill::symmetric, true>,
              spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, float, fill::positive>>
        mixed(sizes, how.placement, 32);
      check_trajectory(mixed, [](std::int64_t) { return fo::rules::adamw{}; }, how, 2, label + ", bf16 AdamW");
      problem<spec<slot::param_t, float>, spec<slot::exp_avg_t, fo::bfloat16>> where(sizes, how.placement, 33);
      check_trajectory(where, [](std::int64_t) { return by_position{}; }, how, 2, label + ", positions");
      if (how.one_shot) { continue; }
      // A rule with a reduction pass: its update prepares first (the other branch of the
      // kernel); the pass itself keeps the chunk table. The clip scales (max_norm 0.01), so the
      // combine order of the norm makes the backends differ by rounding.
      fo::rules::clip_by_global_norm clip;
      clip.max_norm = 0.01;
      auto const clipped = fo::chain(clip, fo::rules::adamw{});
      check_close_trajectory(adam, [&](std::int64_t, bool) { return clipped; }, how, 2, tolerance{1e-4, 1e-6},
                             label + ", clip + AdamW");
    }
  }
}

TEST_CASE("a plan of one tensor follows a rebind and a capture", "[cuda][layout][graph]")
{
  // The one tensor's entry is read from the address table's current copy at each launch: a
  // rebind must reach it.
  std::int64_t const n = (std::int64_t{1} << 16) + 5;
  std::vector<float> start(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < start.size(); ++i) { start[i] = 1.0f + static_cast<float>(i % 97) * 0.25f; }
  device_array<float> first(start.size()), second(start.size());
  upload_bytes(first.get(), start.data(), start.size() * sizeof(float));
  upload_bytes(second.get(), start.data(), start.size() * sizeof(float));
  auto const bound = [n](float* data) {
    fo::tensor_list<float> list;
    list.push_back(data, n);
    return fo::bind(slot::param = std::move(list));
  };
  auto plan = fo::cuda::make_plan(bound(first.get()));
  REQUIRE(plan.update_computes_chunks());
  plan.run(halve_plus_one{});
  plan.rebind(bound(second.get()));
  plan.run(halve_plus_one{});
  plan.run(halve_plus_one{});
  FO_TEST_CUDA(cudaDeviceSynchronize());
  std::vector<float> once = start, twice = start;
  fo::tensor_list<float> host_once, host_twice;
  host_once.push_back(once.data(), n);
  host_twice.push_back(twice.data(), n);
  fo::host::apply(halve_plus_one{}, fo::bind(slot::param = host_once));
  fo::host::apply(halve_plus_one{}, fo::bind(slot::param = host_twice));
  fo::host::apply(halve_plus_one{}, fo::bind(slot::param = host_twice));
  CHECK(first.download() == once);
  CHECK(second.download() == twice);

  // Captured: three replays of a one-tensor run are three eager steps.
  cudaStream_t stream = nullptr;
  FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto captured_plan = fo::cuda::make_plan(bound(first.get()), {}, stream);
  REQUIRE(captured_plan.update_computes_chunks());
  {
    captured_graph const graph(stream, [&] { captured_plan.run(halve_plus_one{}, {}, stream); });
    for (int k = 0; k < 3; ++k) { graph.launch(stream); }
    FO_TEST_CUDA(cudaStreamSynchronize(stream));
  }
  FO_TEST_CUDA(cudaStreamDestroy(stream));
  for (int k = 0; k < 3; ++k) { fo::host::apply(halve_plus_one{}, fo::bind(slot::param = host_once)); }
  CHECK(first.download() == once);
}

TEST_CASE("mixed element types in one launch (half, bfloat16, float, double)", "[cuda][layout]")
{
  for (scenario const& how : scenarios()) {
    problem<spec<slot::param_t, fo::bfloat16>, spec<slot::grad_t, fo::half, fill::symmetric, true>,
            spec<slot::exp_avg_t, float>, spec<slot::exp_avg_sq_t, double, fill::positive>>
      p(edge_sizes(), how.placement, 99);
    check_trajectory(p, [](std::int64_t) { return mix_all{}; }, how, trajectory_steps(), "mixed types");
  }
}

TEST_CASE("only declared slots are loaded and stored", "[cuda][layout]")
{
  for (scenario const& how : scenarios()) {
    problem<spec<slot::param_t, float>, spec<slot::grad_t, float>, spec<slot::exp_avg_t, float>,
            spec<slot::exp_avg_sq_t, float>>
      p(edge_sizes(), how.placement, 5);
    check_trajectory(p, [](std::int64_t) { return narrow{}; }, how, 2, "narrow rule");
  }
}

TEST_CASE("elements know their tensor and their index", "[cuda][layout]")
{
  for (scenario const& how : scenarios()) {
    problem<spec<slot::param_t, float>, spec<slot::exp_avg_t, fo::bfloat16>> p(edge_sizes(), how.placement, 6);
    check_trajectory(p, [](std::int64_t) { return by_position{}; }, how, 2, "positions");
  }
}

TEST_CASE("kernels run a body's per-tensor form", "[cuda][layout]")
{
  for (scenario const& how : scenarios()) {
    problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>> p(edge_sizes(), how.placement, 8);
    check_trajectory(p, [](std::int64_t) { return fo::chain(shifted_by_tensor{}, by_position{}); }, how, 2,
                     "per-tensor body");
  }
  // Through a reduction pass (the parts in front of it) and the update kernel of a reducing rule.
  using norm = fo::rules::norm_of<slot::param_t>;
  std::size_t const tensors = edge_sizes().size();
  device_array<double> device_norms(tensors);
  std::vector<double> host_norms(tensors);
  for (scenario const& how : plan_scenarios()) {
    problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>> p(edge_sizes(), how.placement, 9);
    auto const rule = [&](std::int64_t, bool on_device) {
      norm n{fo::norm_kind::inf, on_device ? device_norms.get() : host_norms.data(), nullptr};
      return fo::chain(shifted_by_tensor{}, n, shifted_by_tensor{});
    };
    check_close_trajectory(p, rule, how, 2, tolerance{0, 0}, "per-tensor body around a reduction pass");
    CHECK(device_norms.download() == host_norms);  // max-abs: exact on both backends
  }
}

TEST_CASE("step_info::advance counts steps on the device", "[cuda][layout]")
{
  problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>> p({1000, 17}, shift::none, 7);
  std::int64_t* counter = nullptr;
  FO_TEST_CUDA(cudaMalloc(&counter, sizeof *counter));
  FO_TEST_CUDA(cudaMemset(counter, 0, sizeof *counter));
  fo::step_info step{fo::scalar<std::int64_t>::from_pointer(counter)};
  step.advance = counter;
  auto const plan = fo::cuda::make_plan(p.lists(true));
  auto host_plan = fo::host::make_plan(p.lists(false));
  by_step opt;
  for (std::int64_t t = 1; t <= 3; ++t) {
    plan.run(opt, step);
    fo::cuda::apply(opt, p.lists(true), step);
    host_plan.run(opt, fo::step_info{2 * t - 1});
    host_plan.run(opt, fo::step_info{2 * t});
  }
  std::int64_t count = 0;
  FO_TEST_CUDA(cudaMemcpy(&count, counter, sizeof count, cudaMemcpyDeviceToHost));
  CHECK(count == 6);
  p.require_same_bits("advance");
  FO_TEST_CUDA(cudaFree(counter));
}

TEST_CASE("launches per run follow the transport", "[cuda][layout]")
{
  problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>> p(cycle_sizes(5000, 300),
                                                                                          shift::none, 3);
  auto const lists = p.lists(true);
  fo::cuda::options opts;
  CHECK(fo::cuda::make_plan(lists, opts).launches_per_run() == 1);
  CHECK(fo::cuda::make_plan(lists, opts).metadata() == fo::cuda::transport::device_table);
  CHECK_FALSE(fo::cuda::make_plan(lists, opts).update_computes_chunks());  // 5000 tensors: the chunk table
  opts.metadata = fo::cuda::transport::param_4k;
  auto const small = fo::cuda::make_plan(lists, opts).launches_per_run();
  CHECK(small > 1);
  if (transport_available(fo::cuda::transport::param_32k)) {
    opts.metadata = fo::cuda::transport::param_32k;
    auto const large = fo::cuda::make_plan(lists, opts).launches_per_run();
    CHECK(large < small);
    CHECK(large >= 1);
  }
  problem<spec<slot::param_t, float>> empty(std::vector<std::int64_t>{0, 0, 0}, shift::none, 4);
  CHECK(fo::cuda::make_plan(empty.lists(true)).launches_per_run() == 0);
  fo::cuda::make_plan(empty.lists(true)).run(halve_plus_one{});
  FO_TEST_CUDA(cudaDeviceSynchronize());
}

namespace {
// Initial bits of element i: bfloat16 values in [1, 2), from integer arithmetic so host and
// device agree.
FUSEDOPT_HOST_DEVICE std::uint16_t initial_bits(std::int64_t i)
{
  return static_cast<std::uint16_t>(0x3f80u + static_cast<std::uint32_t>((i * 7919) % 127));
}

__global__ void fill_big(fo::bfloat16* data, std::int64_t n)
{
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    data[i] = fo::bfloat16::from_bits(initial_bits(i));
  }
}

// Counts elements whose bits are not those of one halve_plus_one step from initial_bits.
__global__ void count_wrong(fo::bfloat16 const* data, std::int64_t n, unsigned long long* wrong)
{
  unsigned long long local = 0;
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    float const x = static_cast<float>(fo::bfloat16::from_bits(initial_bits(i)));
    fo::bfloat16 const expected(x * 0.5f + 1.0f);
    local += data[i].bits != expected.bits ? 1 : 0;
  }
  if (local != 0) { atomicAdd(wrong, local); }
}
}  // namespace

TEST_CASE("one tensor of more than 2^31 elements between small ones, every transport", "[cuda][layout][big]")
{
  // Issue 15's red-team item: 64-bit element indices next to tensors whose chunks are short,
  // in one launch table.
  std::int64_t const offset = GENERATE(0, 1);  // 1: misaligned by one element (head path)
  std::int64_t const n = (std::int64_t{1} << 31) + 4099;
  std::size_t const bytes = static_cast<std::size_t>(n + offset) * sizeof(fo::bfloat16);
  std::size_t free_bytes = 0, total_bytes = 0;
  FO_TEST_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < bytes + (std::size_t{1} << 30)) {
    WARN("skipped: the GPU has " << free_bytes / (1 << 20) << " MiB free, the test needs " << bytes / (1 << 20)
                                 << " MiB");
    return;
  }
  fo::bfloat16* base = nullptr;
  FO_TEST_CUDA(cudaMalloc(&base, bytes));
  fo::bfloat16* data = base + offset;
  fill_big<<<1024, 256>>>(data, n);
  FO_TEST_CUDA(cudaGetLastError());

  auto const how = GENERATE(fo::cuda::transport::device_table, fo::cuda::transport::param_4k,
                            fo::cuda::transport::param_32k);
  if (!transport_available(how)) {
    FO_TEST_CUDA(cudaFree(base));
    return;
  }
  // Small tensors before and after the big one (their own allocation).
  std::int64_t const small_sizes[] = {1, 3, 4097, 100};
  std::int64_t small_total = 0;
  for (auto k : small_sizes) { small_total += k; }
  std::vector<fo::bfloat16> small_host(static_cast<std::size_t>(small_total));
  for (std::size_t i = 0; i < small_host.size(); ++i) { small_host[i] = fo::bfloat16::from_bits(initial_bits(static_cast<std::int64_t>(i) * 7)); }
  fo::bfloat16* small = nullptr;
  FO_TEST_CUDA(cudaMalloc(&small, small_host.size() * sizeof(fo::bfloat16)));
  FO_TEST_CUDA(cudaMemcpy(small, small_host.data(), small_host.size() * sizeof(fo::bfloat16), cudaMemcpyHostToDevice));
  fo::tensor_list<fo::bfloat16> list, host_small_list;
  std::int64_t at = 0;
  for (std::size_t k = 0; k < 4; ++k) {
    if (k == 2) { list.push_back(data, n); }
    list.push_back(small + at, small_sizes[k]);
    host_small_list.push_back(small_host.data() + at, small_sizes[k]);
    at += small_sizes[k];
  }
  fo::cuda::options opts;
  opts.metadata = how;
  fo::cuda::make_plan(fo::bind(slot::param = list), opts).run(halve_plus_one{});
  fo::host::apply(halve_plus_one{}, fo::bind(slot::param = host_small_list));
  std::vector<fo::bfloat16> small_device(small_host.size());
  FO_TEST_CUDA(cudaMemcpy(small_device.data(), small, small_device.size() * sizeof(fo::bfloat16), cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < small_host.size(); ++i) {
    INFO("small tensors, element " << i);
    REQUIRE(small_device[i].bits == small_host[i].bits);
  }
  FO_TEST_CUDA(cudaFree(small));

  unsigned long long* wrong = nullptr;
  FO_TEST_CUDA(cudaMalloc(&wrong, sizeof *wrong));
  FO_TEST_CUDA(cudaMemset(wrong, 0, sizeof *wrong));
  count_wrong<<<1024, 256>>>(data, n, wrong);
  FO_TEST_CUDA(cudaGetLastError());
  unsigned long long host_wrong = 1;
  FO_TEST_CUDA(cudaMemcpy(&host_wrong, wrong, sizeof host_wrong, cudaMemcpyDeviceToHost));
  CHECK(host_wrong == 0);

  // The elements around 2^31 against the host backend, bit for bit.
  std::int64_t const window = 4096;
  std::int64_t const starts[] = {0, (std::int64_t{1} << 31) - window / 2, n - window};
  for (std::int64_t start : starts) {
    std::vector<fo::bfloat16> device_values(window), expected(window);
    FO_TEST_CUDA(cudaMemcpy(device_values.data(), data + start, window * sizeof(fo::bfloat16), cudaMemcpyDeviceToHost));
    for (std::int64_t i = 0; i < window; ++i) { expected[i] = fo::bfloat16::from_bits(initial_bits(start + i)); }
    fo::tensor_list<fo::bfloat16> host_list;
    host_list.push_back(expected.data(), window);
    fo::host::apply(halve_plus_one{}, fo::bind(slot::param = host_list));
    for (std::int64_t i = 0; i < window; ++i) {
      INFO("element " << start + i);
      REQUIRE(device_values[i].bits == expected[i].bits);
    }
  }
  FO_TEST_CUDA(cudaFree(wrong));
  FO_TEST_CUDA(cudaFree(base));
}
