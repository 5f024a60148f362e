// libtorch_step's CUDA timing (cuda_timing.hpp): events, a spin kernel, and fusedopt's own plan
// over the adapter's tensors. No torch header: nvcc does not compile them.
#include "cuda_timing.hpp"

#include <fusedopt/fusedopt.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>

namespace fusedopt_libtorch_bench {
namespace {

// Holds the stream for `nanoseconds`: work enqueued after it is queued on the device before it
// starts, so events around that work time the device alone.
__global__ void spin_kernel(std::uint64_t nanoseconds)
{
  std::uint64_t start = 0;
  std::uint64_t now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < nanoseconds);
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n == 0 ? 0 : n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

class events {
 public:
  events()
  {
    FUSEDOPT_CUDA_TRY(cudaEventCreate(&start));
    FUSEDOPT_CUDA_TRY(cudaEventCreate(&stop));
  }
  events(events const&) = delete;
  events& operator=(events const&) = delete;
  ~events()
  {
    static_cast<void>(cudaEventDestroy(start));  // a destructor does not throw
    static_cast<void>(cudaEventDestroy(stop));
  }
  cudaEvent_t start{}, stop{};
};

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

}  // namespace

step_times time_steps(void* stream, std::function<void()> const& step, int warmup, int repeats)
{
  auto const s = static_cast<cudaStream_t>(stream);
  for (int i = 0; i < warmup; ++i) { step(); }
  FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(s));
  std::vector<double> host, wall, device;
  for (int i = 0; i < repeats; ++i) {
    auto const t0 = clock_type::now();
    step();
    host.push_back(seconds_since(t0));
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(s));
    wall.push_back(seconds_since(t0));
  }
  step_times out;
  out.host = median(host);
  out.wall = median(wall);
  // The spin outlasts the enqueueing (twice the slowest call, and 50 us), so the events see
  // the device work with every launch already queued.
  double const slowest = *std::max_element(host.begin(), host.end());
  auto const spin_ns = static_cast<std::uint64_t>(std::max(2 * slowest, 50e-6) * 1e9);
  events e;
  for (int i = 0; i < repeats; ++i) {
    spin_kernel<<<1, 1, 0, s>>>(spin_ns);
    FUSEDOPT_CUDA_TRY(cudaGetLastError());
    FUSEDOPT_CUDA_TRY(cudaEventRecord(e.start, s));
    step();
    FUSEDOPT_CUDA_TRY(cudaEventRecord(e.stop, s));
    FUSEDOPT_CUDA_TRY(cudaEventSynchronize(e.stop));
    float ms = 0;
    FUSEDOPT_CUDA_TRY(cudaEventElapsedTime(&ms, e.start, e.stop));
    device.push_back(static_cast<double>(ms) * 1e-3);
  }
  out.device = median(device);
  return out;
}

step_times time_fused_plan(void* stream, std::vector<void*> const& params, std::vector<void const*> const& grads,
                           std::vector<void*> const& exp_avgs, std::vector<void*> const& exp_avg_sqs,
                           std::vector<std::int64_t> const& sizes, int warmup, int repeats)
{
  namespace slot = fusedopt::slot;
  fusedopt::tensor_list<float> p, m, v;
  fusedopt::tensor_list<float const> g;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    p.push_back(static_cast<float*>(params[t]), sizes[t]);
    g.push_back(static_cast<float const*>(grads[t]), sizes[t]);
    m.push_back(static_cast<float*>(exp_avgs[t]), sizes[t]);
    v.push_back(static_cast<float*>(exp_avg_sqs[t]), sizes[t]);
  }
  auto const s = static_cast<cudaStream_t>(stream);
  fusedopt::cuda::options o;
  o.reduction_capacity = 0;  // as the adapter's plans of AdamW
  auto const plan = fusedopt::cuda::make_plan(
    fusedopt::bind(slot::param = p, slot::grad = g, slot::exp_avg = m, slot::exp_avg_sq = v), o, s);
  fusedopt::rules::adamw rule;
  rule.lr = 1e-3;
  std::int64_t step = 0;
  return time_steps(stream, [&] { plan.run(rule, fusedopt::step_info{++step}, s); }, warmup, repeats);
}

}  // namespace fusedopt_libtorch_bench
