// 8-bit blockwise-quantized states on the CUDA backend: the same bits as the host backend
// (parameters, codes and scales) for Adam, AdamW, SGD momentum, Lion and a skipped step, over
// fp32 parameters in both shapes with lookahead and over bf16 ones in both shapes without
// (one stages the next block in shared memory), on every transport, sizes that are not multiples of the block and tensors of many chunks;
// blocks of zeros, huge and non-finite values; a tensor of more than 2^31 elements where the
// GPU has the memory. tests/host/quantized_states.cpp checks the host against the reference.
#include "support.cuh"

#include <limits>
#include <memory>
#include <optional>

#include "reference/quantization.hpp"

using namespace fusedopt_test;

namespace {

/// The tensors of one slot end to end in one arena, on the host and on the device; T is the
/// list's element type (a blockwise8 arena holds 16-byte units, each tensor its own). The
/// first tensor starts `shift` units in, each tensor at a multiple of `align` units from there.
template <class T>
struct twin {
  std::vector<std::int64_t> sizes, offsets;  // offsets in units of T
  std::vector<T> host;
  device_array<T> device;

  twin(std::vector<std::int64_t> const& tensor_sizes, std::vector<T> const& initial, std::int64_t shift = 0,
       std::int64_t align = 1)
    : sizes(tensor_sizes), host(initial), device(initial.size())
  {
    std::int64_t at = shift;
    for (auto n : sizes) {
      at = shift + (at - shift + align - 1) / align * align;
      offsets.push_back(at);
      at += fo::detail::storage_units<T>(n);
    }
    REQUIRE(static_cast<std::size_t>(at) <= host.size());
    device.upload(host);
  }
  template <class E = T>
  [[nodiscard]] fo::tensor_list<E> list(bool on_device)
  {
    fo::tensor_list<E> l;
    T* base = on_device ? device.get() : host.data();
    for (std::size_t t = 0; t < sizes.size(); ++t) { l.push_back(base + offsets[t], sizes[t]); }
    return l;
  }
  /// Puts the tensors' values, given end to end, at their places in the arena (host and device).
  void assign(std::vector<T> const& packed)
  {
    std::size_t from = 0;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::copy_n(packed.begin() + static_cast<std::ptrdiff_t>(from), sizes[t], host.begin() + offsets[t]);
      from += static_cast<std::size_t>(sizes[t]);
    }
    device.upload(host);
  }
  /// The device's bytes equal the host's, every byte of the arena (unused codes included).
  void require_same(char const* what) const
  {
    std::vector<T> const d = device.download();
    INFO(what);
    REQUIRE(std::memcmp(d.data(), host.data(), host.size() * sizeof(T)) == 0);
  }
};

/// The storage of quantized tensors of `sizes` end to end, zeros (scale 0, the code of 0) as
/// torch starts them.
template <class Q>
std::vector<Q> zero_blocks(std::vector<std::int64_t> const& sizes)
{
  std::vector<Q> out;
  for (auto n : sizes) {
    q8_storage<Q> const zeros(n);
    out.insert(out.end(), zeros.units.begin(), zeros.units.end());
  }
  return out;
}

std::int64_t total_of(std::vector<std::int64_t> const& sizes)
{
  std::int64_t total = 0;
  for (auto n : sizes) { total += n; }
  return total;
}

fo::cuda::options with_transport(fo::cuda::transport how, fo::cuda::memory_speed memory = fo::cuda::memory_speed::automatic,
                                 std::int64_t max_blocks = 0)
{
  fo::cuda::options opts;
  opts.metadata = how;
  opts.memory = memory;
  opts.max_blocks = max_blocks;
  return opts;
}

/// Steps of `make_rule(found_inf)` over params and grads of type P (float or bfloat16) and the
/// quantized `States` (pairs of slot and blockwise8 type) on both backends; every arena the
/// same bits after every step. Step 3 has a NaN gradient: a rule wrapped in skip_if_nonfinite
/// skips it. `aligned`: every param and grad tensor 16-byte aligned, so the CUDA backend takes
/// a whole block four elements per lane; else the params are one element in, misaligned
/// against the grads, and every element goes one by one. `memory`: the policy's shape for
/// fast or slow memory, whatever the GPU (fp32 parameters: one block of lookahead at 4 blocks
/// per SM, or two at 3; 16-bit ones: none, slow memory's staging the next block in shared
/// memory). `max_blocks`: the persistent grid's CTAs (0: sized by the device, a chunk or none
/// each here, the units dealt round-robin; 2: each of their 8 warps walks about 22 units of
/// the 44 chunks, crossing from one to the next of the same tensor and of another, which is
/// where the loops look ahead past a crossing, and takes them from the plan's work queue: the
/// fp32 shape on slow memory a unit a ticket, the 16-bit shapes eight, the last ones one by
/// one). `through_apply`: the steps through cuda::apply, whose warps take their units
/// round-robin (a plan's four steps also check that each launch leaves the queue empty: the
/// next would skip units).
template <class P, class... States, class MakeRule>
void check_host_equals_cuda(MakeRule const& make_rule, fo::cuda::transport how, bool nan_at_step_3, bool aligned,
                            fo::cuda::memory_speed memory, std::int64_t max_blocks, bool through_apply = false)
{
  std::vector<std::int64_t> const sizes = {1, 255, 256, 257, 1000, 4097, 70000, 2048};
  std::int64_t const total = total_of(sizes);
  auto const arena = static_cast<std::size_t>(total + 4 * static_cast<std::int64_t>(sizes.size()) + 1);
  std::int64_t const align = aligned ? 4 : 1;
  auto const as_params = [](std::vector<float> const& values) {
    std::vector<P> out(values.size());
    std::transform(values.begin(), values.end(), out.begin(), [](float x) { return static_cast<P>(x); });
    return out;
  };
  twin<P> param(sizes, as_params(mixed_values(static_cast<std::int64_t>(arena), 11, true)), aligned ? 0 : 1, align);
  twin<P> grad(sizes, std::vector<P>(arena, static_cast<P>(0.f)), 0, align);
  // twin holds a device_array, which does not move: the tuple holds pointers.
  std::tuple<std::unique_ptr<twin<typename States::second_type>>...> states{
    std::make_unique<twin<typename States::second_type>>(sizes, zero_blocks<typename States::second_type>(sizes))...};
  device_array<float> found_inf_device(1);
  float found_inf_host = 0.f;

  auto run = [&](auto&... state) {
    auto host_plan = fo::host::make_plan(fo::bind(fo::slot::param = param.list(false), fo::slot::grad = grad.template list<P const>(false),
                                                  (typename States::first_type{} = state->list(false))...));
    auto const cuda_lists = fo::bind(fo::slot::param = param.list(true), fo::slot::grad = grad.template list<P const>(true),
                                      (typename States::first_type{} = state->list(true))...);
    auto const opts = with_transport(how, memory, max_blocks);
    std::optional<decltype(fo::cuda::make_plan(cuda_lists, opts))> cuda_plan;
    if (!through_apply) { cuda_plan.emplace(fo::cuda::make_plan(cuda_lists, opts)); }
    for (int step = 1; step <= 4; ++step) {
      INFO("step " << step);
      std::vector<float> g = mixed_values(total, 100 + static_cast<std::uint64_t>(step), true);
      for (auto& x : g) { x = std::max(-1.f, std::min(1.f, x)); }
      if (step == 3 && nan_at_step_3) { g[static_cast<std::size_t>(total / 2)] = std::numeric_limits<float>::quiet_NaN(); }
      grad.assign(as_params(g));
      host_plan.run(make_rule(&found_inf_host), fo::step_info{step});
      auto const rule = make_rule(found_inf_device.get());
      if constexpr (fo::detail::pass_count_v<std::decay_t<decltype(rule)>> == 0) {
        if (through_apply) {
          fo::cuda::apply(rule, cuda_lists, fo::step_info{step}, opts);
        } else {
          cuda_plan->run(rule, fo::step_info{step});
        }
      } else {
        REQUIRE_FALSE(through_apply);  // cuda::apply takes no rule with reduction passes
        cuda_plan->run(rule, fo::step_info{step});
      }
      FO_TEST_CUDA(cudaDeviceSynchronize());
      param.require_same("param");
      (state->require_same("state"), ...);
    }
  };
  std::apply(run, states);
}

using m_state = std::pair<fo::slot::exp_avg_t, fo::signed_q8>;
using v_state = std::pair<fo::slot::exp_avg_sq_t, fo::unsigned_q8>;

}  // namespace

TEST_CASE("8-bit Adam, AdamW (also over bf16 parameters), SGD momentum, Lion and AdEMAMix: the host backend's bits on every "
          "transport",
          "[cuda][quantized]")
{
  auto const how = GENERATE(fo::cuda::transport::device_table, fo::cuda::transport::param_4k,
                            fo::cuda::transport::param_32k);
  bool const aligned = GENERATE(true, false);
  auto const memory = GENERATE(fo::cuda::memory_speed::fast, fo::cuda::memory_speed::slow);
  std::int64_t const max_blocks = GENERATE(0, 2);
  if (!transport_available(how)) { return; }
  INFO("aligned params and grads: " << aligned << "; shape for " << (memory == fo::cuda::memory_speed::fast ? "fast" : "slow")
                                    << " memory; grid of " << (max_blocks > 0 ? std::to_string(max_blocks) : "the device's")
                                    << " CTAs");
  SECTION("Adam")
  {
    fo::rules::adam adam;
    adam.lr = 1e-2;
    check_host_equals_cuda<float, m_state, v_state>([&](float*) { return adam; }, how, false, aligned, memory, max_blocks);
  }
  SECTION("AdamW, a NaN gradient skipped by skip_if_nonfinite")
  {
    fo::rules::adamw adamw;
    adamw.lr = 1e-2;
    adamw.weight_decay = 0.1;
    check_host_equals_cuda<float, m_state, v_state>([&](float* found_inf) { return fo::rules::skip_if_nonfinite(adamw, found_inf); },
                                             how, true, aligned, memory, max_blocks);
  }
  SECTION("SGD with Nesterov momentum")
  {
    fo::rules::sgd sgd;
    sgd.lr = 0.1;
    sgd.momentum = 0.9;
    sgd.nesterov = true;
    check_host_equals_cuda<float, std::pair<fo::slot::momentum_buffer_t, fo::signed_q8>>([&](float*) { return sgd; }, how, false,
                                                                                 aligned, memory, max_blocks);
  }
  SECTION("Lion")
  {
    fo::rules::lion lion;
    lion.lr = 1e-3;
    lion.weight_decay = 0.5;
    check_host_equals_cuda<float, m_state>([&](float*) { return lion; }, how, false, aligned, memory, max_blocks);
  }
  SECTION("AdEMAMix, its three EMAs 8-bit")
  {
    check_host_equals_cuda<float, m_state, std::pair<fo::slot::exp_avg_slow_t, fo::signed_q8>, v_state>(
      [&](float*) { return fusedopt_test::scheduled_ademamix(); }, how, false, aligned, memory, max_blocks);
  }
  SECTION("AdamW over bf16 parameters and gradients, a NaN gradient skipped")
  {
    // The 16-bit shapes: slow memory's stages a warp's next block in shared memory, fast
    // memory's does not.
    fo::rules::adamw adamw;
    adamw.lr = 1e-2;
    adamw.weight_decay = 0.1;
    check_host_equals_cuda<fo::bfloat16, m_state, v_state>(
      [&](float* found_inf) { return fo::rules::skip_if_nonfinite(adamw, found_inf); }, how, true, aligned, memory, max_blocks);
  }
}

TEST_CASE("8-bit Adam over fp32 and bf16 parameters through cuda::apply (units dealt round-robin): the host backend's bits",
          "[cuda][quantized][apply]")
{
  auto const how = GENERATE(fo::cuda::transport::param_4k, fo::cuda::transport::param_32k);
  bool const aligned = GENERATE(true, false);
  auto const memory = GENERATE(fo::cuda::memory_speed::fast, fo::cuda::memory_speed::slow);
  std::int64_t const max_blocks = GENERATE(0, 3);
  if (!transport_available(how)) { return; }
  INFO("aligned params and grads: " << aligned << "; shape for " << (memory == fo::cuda::memory_speed::fast ? "fast" : "slow")
                                    << " memory; grid of " << max_blocks << " CTAs (0: the device's)");
  fo::rules::adam adam;
  adam.lr = 1e-2;
  adam.weight_decay = 0.01;
  auto const rule = [&](float*) { return adam; };
  SECTION("fp32 parameters") { check_host_equals_cuda<float, m_state, v_state>(rule, how, false, aligned, memory, max_blocks, true); }
  SECTION("bf16 parameters")
  {
    check_host_equals_cuda<fo::bfloat16, m_state, v_state>(rule, how, false, aligned, memory, max_blocks, true);
  }
}

TEST_CASE("blocks of zeros, huge and non-finite values: the host backend's bits", "[cuda][quantized][nonfinite]")
{
  std::vector<std::int64_t> const sizes = {1, 255, 257, 4097, 6000};
  std::int64_t const total = total_of(sizes);
  std::vector<std::int64_t> offsets{0};
  for (auto n : sizes) { offsets.push_back(offsets.back() + n); }
  device_array<std::int64_t> offsets_device(offsets.size());
  offsets_device.upload(offsets);
  twin<fo::signed_q8> state(sizes, zero_blocks<fo::signed_q8>(sizes));
  device_array<float> values_device(static_cast<std::size_t>(total));
  using assign = assign_state<fo::slot::momentum_buffer_t>;

  std::vector<float> values = mixed_values(total, 5, true);
  std::int64_t const last = total - 6000;
  std::fill(values.begin() + last, values.begin() + last + 256, 0.f);  // a block of zeros
  values[static_cast<std::size_t>(last + 256 + 3)] = 3e38f;            // one huge value
  values[static_cast<std::size_t>(last + 512 + 9)] = -3e38f;
  for (int round = 0; round < 2; ++round) {
    INFO("round " << round);
    if (round == 1) {  // non-finite values: their blocks keep the first round's codes and scale
      values = mixed_values(total, 6, true);
      values[static_cast<std::size_t>(last + 1000)] = std::numeric_limits<float>::quiet_NaN();
      values[static_cast<std::size_t>(last + 2000)] = std::numeric_limits<float>::infinity();
      values[static_cast<std::size_t>(total - 1)] = -std::numeric_limits<float>::infinity();
      values[0] = std::numeric_limits<float>::quiet_NaN();
    }
    values_device.upload(values);
    fo::host::apply(assign{values.data(), offsets.data()}, fo::bind(fo::slot::momentum_buffer = state.list(false)));
    fo::cuda::make_plan(fo::bind(fo::slot::momentum_buffer = state.list(true)))
      .run(assign{values_device.get(), offsets_device.get()});
    state.require_same("momentum_buffer");
  }
}

TEST_CASE("a memory speed that is not one of memory_speed's is rejected", "[cuda][quantized][errors]")
{
  std::vector<std::int64_t> const sizes = {300};
  twin<fo::signed_q8> state(sizes, zero_blocks<fo::signed_q8>(sizes));
  fo::cuda::options opts;
  opts.memory = static_cast<fo::cuda::memory_speed>(7);
  REQUIRE_THROWS_AS(fo::cuda::make_plan(fo::bind(fo::slot::momentum_buffer = state.list(true)), opts), fo::error);
  opts.memory = fo::cuda::memory_speed::slow;
  REQUIRE_NOTHROW(fo::cuda::make_plan(fo::bind(fo::slot::momentum_buffer = state.list(true)), opts));
}

namespace {
/// momentum = values[index % 1024] (device memory): only the position decides.
struct by_position {
  float const* values;
  using reads = fo::slots<>;
  using writes = fo::slots<fo::slot::momentum_buffer_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    e[fo::slot::momentum_buffer] = values[e.index() % 1024];
  }
};
}  // namespace

TEST_CASE("a quantized tensor of more than 2^31 elements", "[cuda][quantized][big]")
{
  std::int64_t const n = (std::int64_t{1} << 31) + 300;
  using Q = fo::signed_q8;
  std::size_t const bytes = static_cast<std::size_t>(Q::bytes_for(n));
  std::size_t free_bytes = 0, total_bytes = 0;
  FO_TEST_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < bytes + (std::size_t{1} << 30)) {
    WARN("skipped: the GPU has " << free_bytes / (1 << 20) << " MiB free, the test needs " << bytes / (1 << 20) << " MiB");
    return;
  }
  std::vector<float> values(1024);
  for (std::size_t i = 0; i < values.size(); ++i) { values[i] = static_cast<float>(i % 97) - 48.f; }
  device_array<float> values_device(values.size());
  values_device.upload(values);
  device_array<Q> storage(static_cast<std::size_t>(Q::units_for(n)));
  fo::tensor_list<Q> list{{storage.get(), n}};
  fo::cuda::make_plan(fo::bind(fo::slot::momentum_buffer = list)).run(by_position{values_device.get()});
  FO_TEST_CUDA(cudaDeviceSynchronize());
  auto const* device_bytes = reinterpret_cast<unsigned char const*>(storage.get());
  std::int64_t const count = Q::blocks_in(n);
  std::int64_t const around = (std::int64_t{1} << 31) / 256;  // the block at 2^31
  for (std::int64_t b : {std::int64_t{0}, around - 1, around, count - 2, count - 1}) {
    INFO("block " << b);
    std::int64_t const used = b + 1 < count ? 256 : n - b * 256;
    std::vector<float> const block_values(values.begin() + static_cast<std::ptrdiff_t>((b * 256) % 1024),
                                          values.begin() + static_cast<std::ptrdiff_t>((b * 256) % 1024 + used));
    // Block b's scale and codes, copied into a one-block tensor's places.
    q8_storage<Q> got(used);
    FO_TEST_CUDA(cudaMemcpy(got.raw() + got.scale_byte_of(used, 0), device_bytes + q8_storage<Q>::scale_byte_of(n, b),
                            4, cudaMemcpyDeviceToHost));
    FO_TEST_CUDA(cudaMemcpy(got.raw() + got.code_byte_of(used, 0), device_bytes + q8_storage<Q>::code_byte_of(n, b * 256),
                            256, cudaMemcpyDeviceToHost));
    CHECK(same_block(got, 0, reference_quantize<Q>(block_values), 0));
  }
}
