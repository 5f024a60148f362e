// Benchmarks of the host backend (fusedopt::host): one optimizer step per iteration over
// host memory, reported as time per step, GB/s at the minimum byte count (each loaded slot
// read once, each stored slot written once) and as a fraction of a STREAM-style copy on the
// same number of threads, measured in the same benchmark right after the step's timing.
// Workloads W1 (10 x 1M), W2 (GPT-2 small) and W3 (2000 small tensors) of
// bench/workloads.hpp, the CUDA benchmark's shapes; each case runs once per version of the
// host loops this CPU supports (host/instruction_set.hpp: baseline, avx2, avx512), so that
// one run compares them. Select with --benchmark_filter (e.g. 'avx512|copy').
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
#if defined(__SSE2__)
#  include <emmintrin.h>
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

// STREAM's copy (b[i] = a[i]; GCC turns that loop into one memcpy per thread, as here) over
// two arrays of 1 GiB, several times the last-level cache of the machines we measure (the
// 16-core Xeon's L3 is 300 MB), on `threads` OpenMP threads, each copying its static slice.
// Read + write bytes are counted, as for the optimizer steps. The arrays are allocated once
// and first touched by every thread, with the same static split. On x86 the copy is also
// timed with streaming stores (STREAM built to bypass the cache on writes; memcpy picks its
// store kind by size and cache, and was the slower of the two on the project's machine): the
// yardstick is the faster of the two, so that a fraction of it is never flattered by a slow
// memcpy.
class stream_copy {
 public:
  static constexpr std::size_t bytes = std::size_t{1} << 30;
  enum class method { memcpy, streaming_stores };

  static stream_copy& instance()
  {
    static stream_copy copy;
    return copy;
  }

  // Median bytes per second of `repeats` copies.
  double bytes_per_second(int threads, method how, int repeats = 5)
  {
    std::vector<double> seconds;
    for (int r = 0; r < repeats; ++r) {
      auto const start = std::chrono::steady_clock::now();
      run(threads, how);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(seconds.begin(), seconds.end());
    return 2.0 * static_cast<double>(bytes) / seconds[seconds.size() / 2];
  }

  void run(int threads, method how)
  {
    char* const from = from_.data();
    char* const to = to_.data();
    for_each_slice(threads, [&](std::size_t begin, std::size_t end) {
#if defined(__SSE2__)
      if (how == method::streaming_stores) {
        for (std::size_t i = begin; i < end; i += 16) {
          _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), _mm_load_si128(reinterpret_cast<__m128i const*>(from + i)));
        }
        _mm_sfence();
        return;
      }
#endif
      (void)how;
      std::memcpy(to + begin, from + begin, end - begin);
    });
    benchmark::DoNotOptimize(to);
    benchmark::ClobberMemory();
  }

 private:
  stream_copy() : from_(bytes), to_(bytes)
  {
    char* const from = from_.data();
    char* const to = to_.data();
    for_each_slice(0, [&](std::size_t begin, std::size_t end) {
      std::memset(from + begin, 1, end - begin);
      std::memset(to + begin, 2, end - begin);
    });
  }

  // Thread t of n gets bytes [t * bytes / n, (t + 1) * bytes / n), in 4 KiB pages.
  template <class Work>
  static void for_each_slice(int threads, Work const& work)
  {
#if defined(_OPENMP)
    int const n = threads > 0 ? threads : omp_get_max_threads();
#  pragma omp parallel num_threads(n)
    {
      auto const pages = bytes / 4096;
      auto const t = static_cast<std::size_t>(omp_get_thread_num());
      auto const count = static_cast<std::size_t>(omp_get_num_threads());
      work(pages * t / count * 4096, pages * (t + 1) / count * 4096);
    }
#else
    (void)threads;
    work(0, bytes);
#endif
  }

  // Left uninitialised by the allocation: the constructor touches them in parallel.
  struct buffer {
    explicit buffer(std::size_t size) : data_(static_cast<char*>(::operator new(size, std::align_val_t{4096}))) {}
    buffer(buffer const&) = delete;
    buffer& operator=(buffer const&) = delete;
    ~buffer() { ::operator delete(data_, std::align_val_t{4096}); }
    [[nodiscard]] char* data() const { return data_; }

   private:
    char* data_;
  };
  buffer from_, to_;
};

int thread_count(int threads)
{
#if defined(_OPENMP)
  return threads > 0 ? threads : omp_get_max_threads();
#else
  (void)threads;
  return 1;
#endif
}

void bm_copy(benchmark::State& state, int threads, stream_copy::method how)
{
  auto& copy = stream_copy::instance();
  for (auto _ : state) { copy.run(threads, how); }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * static_cast<std::int64_t>(stream_copy::bytes));
  state.counters["threads"] = thread_count(threads);
}

template <class Case>
void bm_step(benchmark::State& state, fb::workload const& w, int threads, fo::host::instruction_set set)
{
  fb::case_state<Case, host_memory> memory(w.sizes);
  fo::host::options opts;
  opts.threads = threads;
  opts.widest_instruction_set = set;
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
  auto& yardstick = stream_copy::instance();
  double const copy_memcpy = yardstick.bytes_per_second(threads, stream_copy::method::memcpy);
#if defined(__SSE2__)
  double const copy_streaming = yardstick.bytes_per_second(threads, stream_copy::method::streaming_stores);
#else
  double const copy_streaming = 0;
#endif
  double const copy = std::max(copy_memcpy, copy_streaming);

  state.SetLabel(fo::host::instruction_set_name(plan.used_instruction_set()));
  state.counters["ms_per_step"] = per_step * 1e3;
  state.counters["bytes_per_step"] = bytes;
  state.counters["GBps"] = bytes / per_step * 1e-9;
  state.counters["copy_GBps"] = copy * 1e-9;
  state.counters["copy_memcpy_GBps"] = copy_memcpy * 1e-9;
  state.counters["copy_streaming_GBps"] = copy_streaming * 1e-9;
  state.counters["pct_copy"] = 100.0 * bytes / per_step / copy;
  state.counters["threads"] = thread_count(threads);
  state.counters["tensors"] = static_cast<double>(w.sizes.size());
  state.counters["elements"] = static_cast<double>(w.elements());
}

template <class Case>
void register_case(fb::workload const& w, int threads)
{
  for (auto set : fo::host::runnable_instruction_sets()) {
    std::string name = std::string("host/") + Case::name + "/" + w.name + "/" + fo::host::instruction_set_name(set);
    if (threads != 0) { name += "/threads:" + std::to_string(threads); }
    benchmark::RegisterBenchmark(name.c_str(), [w, threads, set](benchmark::State& s) { bm_step<Case>(s, w, threads, set); })
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  }
}

void register_copy(int threads)
{
  for (auto how : {stream_copy::method::memcpy, stream_copy::method::streaming_stores}) {
    std::string name = std::string("host/copy/1GiB/") + (how == stream_copy::method::memcpy ? "memcpy" : "streaming_stores");
    if (threads != 0) { name += "/threads:" + std::to_string(threads); }
    benchmark::RegisterBenchmark(name.c_str(), [threads, how](benchmark::State& s) { bm_copy(s, threads, how); })
      ->UseRealTime()
      ->Unit(benchmark::kMillisecond);
  }
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
  benchmark::AddCustomContext("host_instruction_set", fo::host::instruction_set_name(fo::host::supported_instruction_set()));

  register_copy(0);
  for (auto const& w : {fb::w1(), fb::w2(), fb::w3()}) {
    register_case<fb::adam_fp32>(w, 0);
    register_case<fb::adamw_bf16>(w, 0);
    register_case<fb::sgd_momentum_fp32>(w, 0);
  }
  register_copy(1);
  register_case<fb::adam_fp32>(fb::w1(), 1);
  register_case<fb::adamw_bf16>(fb::w1(), 1);
  register_case<fb::sgd_momentum_fp32>(fb::w1(), 1);

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
