// A quick throughput check of the CUDA backend for scripts/gpu-check (the real benchmark suite
// is bench/cuda_bench): Adam fp32 on the issue's workloads W1-W4 as a fraction of the
// device-to-device copy bandwidth measured here, host time per plan.run, and tuning variants
// (block size, unrolling, chunk size, block cap) on W3 and W4 for docs/tuning.md.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -fmad=true -Iinclude -Ibuild/gpu/include -Ibench \
//        scripts/gpu-throughput.cu -o gpu-throughput && ./gpu-throughput [--variants]
#include <fusedopt/fusedopt.cuh>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "workloads.hpp"

namespace fo = fusedopt;
namespace fb = fusedopt_bench;
namespace slot = fusedopt::slot;

namespace {

template <class T>
__global__ void fill(T* data, std::int64_t n, std::uint32_t salt, bool positive)
{
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < n;
       i += std::int64_t{gridDim.x} * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ salt;
    h ^= h >> 15;
    float const u = static_cast<float>(h & 0xffffff) / 16777216.f;
    data[i] = fo::from_opmath<T>(positive ? 0.01f + u : 2.f * u - 1.f);
  }
}

/// Four arenas (param and grad of type P, exp_avg and exp_avg_sq of type S) holding the
/// tensors of a workload, each tensor starting 16-byte aligned.
template <class P, class S>
struct adam_memory {
  std::vector<std::int64_t> sizes;
  std::vector<std::int64_t> offsets;
  P* params[2] = {};
  S* states[2] = {};

  explicit adam_memory(std::vector<std::int64_t> const& s) : sizes(s)
  {
    std::int64_t cursor = 0;
    for (auto n : sizes) {
      offsets.push_back(cursor);
      cursor += (n + 7) / 8 * 8;
    }
    auto const n = static_cast<std::size_t>(cursor);
    for (int k = 0; k < 2; ++k) {
      FUSEDOPT_CUDA_TRY(cudaMalloc(&params[k], n * sizeof(P)));
      FUSEDOPT_CUDA_TRY(cudaMalloc(&states[k], n * sizeof(S)));
      fill<<<1024, 256>>>(params[k], cursor, 0x9e3779b9u * (k + 1), false);
      fill<<<1024, 256>>>(states[k], cursor, 0x7f4a7c15u * (k + 1), k == 1);
    }
    FUSEDOPT_CUDA_TRY(cudaDeviceSynchronize());
  }
  ~adam_memory()
  {
    for (auto* a : params) { (void)cudaFree(a); }
    for (auto* a : states) { (void)cudaFree(a); }
  }
  auto lists() const
  {
    fo::tensor_list<P> p;
    fo::tensor_list<P const> g;
    fo::tensor_list<S> m, v;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      p.push_back(params[0] + offsets[i], sizes[i]);
      g.push_back(params[1] + offsets[i], sizes[i]);
      m.push_back(states[0] + offsets[i], sizes[i]);
      v.push_back(states[1] + offsets[i], sizes[i]);
    }
    return fo::bind(slot::param = p, slot::grad = g, slot::exp_avg = m, slot::exp_avg_sq = v);
  }
  std::int64_t elements() const
  {
    std::int64_t total = 0;
    for (auto n : sizes) { total += n; }
    return total;
  }
};

/// Median over `batches` of the mean time of `per_batch` back-to-back calls of `f`, in seconds.
template <class F>
double time_gpu(F&& f, int per_batch, int batches = 7)
{
  cudaEvent_t start, stop;
  FUSEDOPT_CUDA_TRY(cudaEventCreate(&start));
  FUSEDOPT_CUDA_TRY(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) { f(); }
  std::vector<double> times;
  for (int b = 0; b < batches; ++b) {
    FUSEDOPT_CUDA_TRY(cudaEventRecord(start));
    for (int i = 0; i < per_batch; ++i) { f(); }
    FUSEDOPT_CUDA_TRY(cudaEventRecord(stop));
    FUSEDOPT_CUDA_TRY(cudaEventSynchronize(stop));
    float ms = 0;
    FUSEDOPT_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms * 1e-3 / per_batch);
  }
  FUSEDOPT_CUDA_TRY(cudaGetLastError());
  FUSEDOPT_CUDA_TRY(cudaEventDestroy(start));
  FUSEDOPT_CUDA_TRY(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double copy_bandwidth()
{
  std::size_t const bytes = std::size_t{1} << 31;
  void *a = nullptr, *b = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&a, bytes));
  FUSEDOPT_CUDA_TRY(cudaMalloc(&b, bytes));
  FUSEDOPT_CUDA_TRY(cudaMemset(a, 1, bytes));
  double const s = time_gpu([&] { FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 5);
  FUSEDOPT_CUDA_TRY(cudaFree(a));
  FUSEDOPT_CUDA_TRY(cudaFree(b));
  return 2.0 * static_cast<double>(bytes) / s;  // read + write
}

/// A variant of the default tuning policy (the members not named here are the default's).
template <int Threads, int Bytes, bool StreamLoads, bool StreamStores, int MinBlocks = 1>
struct policy : fo::cuda::detail::default_policy {
  static constexpr int block_threads = Threads;
  static constexpr int bytes_per_slot = Bytes;
  static constexpr bool streaming_loads = StreamLoads;
  static constexpr bool streaming_stores = StreamStores;
  static constexpr int min_blocks_per_sm = MinBlocks;
};

/// Times a plan with policy P (block size, unrolling) and the given chunk and block cap: the
/// policy reaches the chunking and every kernel through make_plan<P>.
template <class P, class Rule, class... B>
double time_variant(Rule const& rule, fo::bound_lists<B...> const& lists, std::int64_t chunk, std::int64_t max_blocks,
                    int per_batch)
{
  fo::cuda::options opts;
  opts.chunk_elements = chunk;
  opts.max_blocks = max_blocks;
  auto const plan = fo::cuda::make_plan<P>(lists, opts);
  return time_gpu([&] { plan.run(rule, fo::step_info{3}); }, per_batch);
}

struct result {
  std::string name;
  double seconds, bytes, copy;
};

void print(result const& r)
{
  double const rate = r.bytes / r.seconds;
  std::printf("%-44s %10.1f us %8.3f TB/s %7.1f%% of copy\n", r.name.c_str(), r.seconds * 1e6, rate * 1e-12,
              100.0 * rate / r.copy);
}

}  // namespace

/// Every variant on one workload: block size, bytes per slot, streaming hints, chunk, cap.
template <class Rule, class Lists>
void variants(std::string const& prefix, Rule const& rule, Lists const& lists, double bytes, double copy, int pb,
              std::int64_t sms)
{
  auto run = [&](char const* label, double t) { print({prefix + " " + label, t, bytes, copy}); };
  run("t256 b64 c4096 plain", time_variant<policy<256, 64, false, false>>(rule, lists, 4096, 0, pb));
  run("t256 b64 c4096 stream L+S", time_variant<policy<256, 64, true, true>>(rule, lists, 4096, 0, pb));
  run("t256 b64 c4096 stream L", time_variant<policy<256, 64, true, false>>(rule, lists, 4096, 0, pb));
  run("t256 b64 c4096 stream S", time_variant<policy<256, 64, false, true>>(rule, lists, 4096, 0, pb));
  run("t128 b64 c2048 stream L+S", time_variant<policy<128, 64, true, true>>(rule, lists, 2048, 0, pb));
  run("t128 b64 c4096 stream L+S", time_variant<policy<128, 64, true, true>>(rule, lists, 4096, 0, pb));
  run("t128 b32 c2048 stream L+S", time_variant<policy<128, 32, true, true>>(rule, lists, 2048, 0, pb));
  run("t256 b32 c4096 stream L+S", time_variant<policy<256, 32, true, true>>(rule, lists, 4096, 0, pb));
  run("t256 b64 c3072 stream L+S", time_variant<policy<256, 64, true, true>>(rule, lists, 3072, 0, pb));
  run("t256 b64 c4096 stream L+S min3", time_variant<policy<256, 64, true, true, 3>>(rule, lists, 4096, 0, pb));
  run("t128 b64 c2048 stream L+S min6", time_variant<policy<128, 64, true, true, 6>>(rule, lists, 2048, 0, pb));
}

int main(int argc, char** argv)
{
  bool const tune = argc > 1 && std::strcmp(argv[1], "--variants") == 0;
  cudaDeviceProp prop{};
  FUSEDOPT_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  double const copy = copy_bandwidth();
  std::printf("device %s, %d SMs; D2D copy %.3f TB/s (read + write)\n", prop.name, prop.multiProcessorCount,
              copy * 1e-12);
  std::int64_t const sms = prop.multiProcessorCount;

  std::vector<result> headline;
  for (auto const& w : fb::all_workloads()) {
    int const pb = w.name == "W4" ? 10 : 50;
    {
      adam_memory<float, float> memory(w.sizes);
      auto const lists = memory.lists();
      auto const plan = fo::cuda::make_plan(lists);
      fo::rules::adam rule;
      double const bytes = 28.0 * static_cast<double>(memory.elements());  // 4 reads, 3 writes of 4 bytes
      double const s = time_gpu([&] { plan.run(rule, fo::step_info{3}); }, pb);
      headline.push_back({"adam fp32 " + w.name + " (" + w.description + ")", s, bytes, copy});
      print(headline.back());
      if (w.name == "W3") {
        // Host time of plan.run: enqueue only (the queue is drained every 64 calls).
        std::vector<double> host;
        for (int i = 0; i < 512; ++i) {
          auto const t0 = std::chrono::steady_clock::now();
          plan.run(rule, fo::step_info{3});
          host.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          if (i % 64 == 63) { FUSEDOPT_CUDA_TRY(cudaDeviceSynchronize()); }
        }
        std::sort(host.begin(), host.end());
        std::printf("%-44s %10.2f us (median host time per plan.run, 2000 tensors)\n", "host time W3",
                    host[host.size() / 2] * 1e6);
      }
      if (tune) { variants(w.name + " adam fp32", rule, lists, bytes, copy, pb, sms); }
    }
    {
      adam_memory<fo::bfloat16, float> memory(w.sizes);
      auto const lists = memory.lists();
      auto const plan = fo::cuda::make_plan(lists);
      fo::rules::adamw rule;
      double const bytes = 20.0 * static_cast<double>(memory.elements());  // bf16 p (rw), g (r); fp32 m, v (rw)
      double const s = time_gpu([&] { plan.run(rule, fo::step_info{3}); }, pb);
      print({"adamw bf16/fp32 " + w.name, s, bytes, copy});
      if (tune) { variants(w.name + " adamw bf16", rule, lists, bytes, copy, pb, sms); }
    }
  }
  std::printf("\nheadline (Adam fp32, fraction of D2D copy):");
  for (auto const& r : headline) { std::printf(" %s %.1f%%", r.name.substr(10, 2).c_str(), 100.0 * r.bytes / r.seconds / r.copy); }
  std::printf("\n");
  return 0;
}
