// Benchmarks of the host backend (fusedopt::host): one optimizer step per iteration over
// host memory, reported as time per step, GB/s at the minimum byte count (each loaded slot
// read once, each stored slot written once) and as a fraction of a large std::memcpy
// measured in the same binary. Workloads: W1 (10 x 1M) and W3 (2000 small tensors) of
// bench/workloads.hpp, the CUDA benchmark's shapes, sized so a laptop or CI machine runs them.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#  include <omp.h>
#endif

#include <fusedopt/fusedopt.hpp>

#include "cases.hpp"
#include "workloads.hpp"

namespace fo = fusedopt;
namespace fb = fusedopt_bench;

namespace {

// One 256-byte-aligned host allocation (the layout of the CUDA benchmark).
template <class T>
class host_memory {
 public:
  explicit host_memory(std::int64_t elements)
      : data_(static_cast<T*>(::operator new[](static_cast<std::size_t>(std::max<std::int64_t>(elements, 1)) * sizeof(T),
                                               std::align_val_t{256}))),
        elements_(elements)
  {
  }
  host_memory(host_memory&& other) noexcept : data_(std::exchange(other.data_, nullptr)), elements_(other.elements_) {}
  host_memory(host_memory const&) = delete;
  host_memory& operator=(host_memory const&) = delete;
  host_memory& operator=(host_memory&&) = delete;
  ~host_memory()
  {
    if (data_ != nullptr) { ::operator delete[](data_, std::align_val_t{256}); }
  }

  [[nodiscard]] T* data() const { return data_; }
  void fill(std::uint64_t seed, fb::value_range values)
  {
    for (std::int64_t i = 0; i < elements_; ++i) {
      data_[i] = T(fb::random_value(seed, static_cast<std::uint64_t>(i), values));
    }
  }

 private:
  T* data_;
  std::int64_t elements_;
};

// Bytes per second of a large memcpy (read + write counted), measured once: the host roofline.
double memcpy_bytes_per_second()
{
  static double const value = [] {
    std::size_t const bytes = std::size_t{256} << 20;
    std::vector<char> a(bytes, 1), b(bytes, 2);
    std::vector<double> seconds;
    for (int i = 0; i < 7; ++i) {
      auto const start = std::chrono::steady_clock::now();
      std::memcpy(b.data(), a.data(), bytes);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      benchmark::DoNotOptimize(b.data());
    }
    std::sort(seconds.begin(), seconds.end());
    return 2.0 * static_cast<double>(bytes) / seconds[seconds.size() / 2];
  }();
  return value;
}

void bm_memcpy(benchmark::State& state)
{
  std::size_t const bytes = std::size_t{256} << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * static_cast<std::int64_t>(bytes));
}

template <class Case>
void bm_step(benchmark::State& state, fb::workload const& w, int threads)
{
  fb::case_state<Case, host_memory> memory(w.sizes);
  fo::host::options opts;
  opts.threads = threads;
  auto plan = fo::host::make_plan(memory.lists(), opts);
  auto const rule = Case::rule();
  constexpr std::size_t per_element = fo::memory_traffic<decltype(rule), std::decay_t<decltype(plan.lists())>>::update_bytes;
  double const bytes = static_cast<double>(per_element) * static_cast<double>(w.elements());

  std::int64_t step = 1;
  plan.run(rule, fo::step_info{step++});  // warm-up: first touch, momentum buffers' step-1 path
  double seconds = 0;
  for (auto _ : state) {
    auto const start = std::chrono::steady_clock::now();
    plan.run(rule, fo::step_info{step++});
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  double const per_step = seconds / static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));

  state.counters["ms_per_step"] = per_step * 1e3;
  state.counters["bytes_per_step"] = bytes;
  state.counters["GBps"] = bytes / per_step * 1e-9;
  state.counters["pct_memcpy"] = 100.0 * bytes / per_step / memcpy_bytes_per_second();
  state.counters["tensors"] = static_cast<double>(w.sizes.size());
  state.counters["elements"] = static_cast<double>(w.elements());
}

template <class Case>
void register_case(fb::workload const& w, int threads)
{
  std::string name = std::string("host/") + Case::name + "/" + w.name;
  if (threads != 0) { name += "/threads:" + std::to_string(threads); }
  benchmark::RegisterBenchmark(name.c_str(), [w, threads](benchmark::State& s) { bm_step<Case>(s, w, threads); })
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv)
{
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) { return 1; }

  benchmark::AddCustomContext("fusedopt_version", FUSEDOPT_VERSION_STRING);
  char const* commit = std::getenv("FUSEDOPT_GIT_COMMIT");
  benchmark::AddCustomContext("git_commit", commit != nullptr ? commit : FUSEDOPT_BENCH_GIT_COMMIT);
#if defined(_OPENMP)
  benchmark::AddCustomContext("openmp_threads", std::to_string(omp_get_max_threads()));
#else
  benchmark::AddCustomContext("openmp_threads", "none (built without OpenMP)");
#endif
  benchmark::AddCustomContext("memcpy_GBps", std::to_string(memcpy_bytes_per_second() * 1e-9));

  benchmark::RegisterBenchmark("host/memcpy/256MiB", bm_memcpy)->UseRealTime()->Unit(benchmark::kMillisecond);
  for (auto const& w : {fb::w1(), fb::w3()}) {
    register_case<fb::adam_fp32>(w, 0);
    register_case<fb::adamw_bf16>(w, 0);
    register_case<fb::sgd_momentum_fp32>(w, 0);
  }
  register_case<fb::adam_fp32>(fb::w1(), 1);

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
