// Benchmarks of the host backend (fusedopt::host): one optimizer step per iteration over
// host memory, reported as time per step, GB/s at the minimum byte count (each loaded slot
// read once, each stored slot written once) and as a fraction of a STREAM-style copy on the
// same number of threads, measured in the same benchmark right after the step's timing.
// Workloads W1 (10 x 1M), W2 (GPT-2 small) and W3 (2000 small tensors) of
// bench/workloads.hpp, the CUDA benchmark's shapes; each case runs once per version of the
// host loops this CPU supports (host/instruction_set.hpp: baseline, avx2, avx512), so that
// one run compares them. Select with --benchmark_filter (e.g. 'avx512|copy'). The
// host/states/... rows run each optimizer with fp32 and with 8-bit states (issue 41).
// host_bench_no_math_errno is this source built with -fno-math-errno (bench/CMakeLists.txt);
// the context's math_errno says which build ran.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <type_traits>
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

// The mean time of the benchmark's steps, after one warm-up step: first touch, momentum
// buffers' step-1 path, 8-bit states' first scales.
template <class Plan, class Rule>
double seconds_per_step(benchmark::State& state, Plan const& plan, Rule const& rule)
{
  std::int64_t step = 1;
  plan.run(rule, fo::step_info{step++});
  double seconds = 0;
  for (auto _ : state) {
    auto const start = std::chrono::steady_clock::now();
    plan.run(rule, fo::step_info{step++});
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return seconds / static_cast<double>(std::max<benchmark::IterationCount>(state.iterations(), 1));
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

  double const per_step = seconds_per_step(state, plan, rule);
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

// ---- 8-bit states beside full states (issue 41) --------------------------------------------
// The same optimizer over the same tensors with fp32 states and with 8-bit blockwise states
// (signed_q8 for first moments and momentum, unsigned_q8 for second moments), parameters and
// gradients fp32 or bf16, compared by elements per second (the 8-bit step moves fewer bytes
// per element, so GB/s would not compare them).

/// A slot of 8-bit states: its tensors' storage end to end in one allocation (each tensor's
/// `bytes_for` is a multiple of 256, so every tensor's codes stay 256-byte aligned), zeros.
template <class Q>
class q8_slot {
 public:
  explicit q8_slot(std::vector<std::int64_t> const& sizes) : sizes_(sizes), memory_(units(sizes))
  {
    std::memset(static_cast<void*>(memory_.data()), 0, static_cast<std::size_t>(units(sizes)) * sizeof(Q));
  }
  [[nodiscard]] fo::tensor_list<Q> list() const
  {
    fo::tensor_list<Q> l;
    std::int64_t at = 0;
    for (auto n : sizes_) {
      l.push_back(memory_.data() + at, n);
      at += Q::units_for(n);
    }
    return l;
  }

 private:
  static std::int64_t units(std::vector<std::int64_t> const& sizes)
  {
    std::int64_t total = 0;
    for (auto n : sizes) { total += Q::units_for(n); }
    return total;
  }
  std::vector<std::int64_t> sizes_;
  host_memory<Q> memory_;
};

/// The optimizers: their rule, their state slots and the 8-bit storage each slot takes.
struct q8_adam {
  static constexpr char const* name = "adam";
  using state_slots = std::tuple<fo::slot::exp_avg_t, fo::slot::exp_avg_sq_t>;
  using q8_types = std::tuple<fo::signed_q8, fo::unsigned_q8>;
  static fo::rules::adam rule() { return fb::adam_fp32::rule(); }
};
struct q8_adamw {
  static constexpr char const* name = "adamw";
  using state_slots = std::tuple<fo::slot::exp_avg_t, fo::slot::exp_avg_sq_t>;
  using q8_types = std::tuple<fo::signed_q8, fo::unsigned_q8>;
  static fo::rules::adamw rule() { return fb::adamw_bf16::rule(); }
};
struct q8_lion {
  static constexpr char const* name = "lion";
  using state_slots = std::tuple<fo::slot::exp_avg_t>;
  using q8_types = std::tuple<fo::signed_q8>;
  static fo::rules::lion rule()
  {
    fo::rules::lion r;
    r.lr = 1e-4;
    r.weight_decay = 1e-2;
    return r;
  }
};
struct q8_sgd {
  static constexpr char const* name = "sgd_momentum";
  using state_slots = std::tuple<fo::slot::momentum_buffer_t>;
  using q8_types = std::tuple<fo::signed_q8>;
  static fo::rules::sgd rule() { return fb::sgd_momentum_fp32::rule(); }
};

/// Parameters and gradients of type P, and the states of `Optimizer`: fp32 (filled as the other
/// cases' states) or 8-bit (zeros, as torch starts them; the warm-up step fills them).
template <class Optimizer, class P, bool Quantized>
class states_case {
  static constexpr std::size_t num_states = std::tuple_size_v<typename Optimizer::state_slots>;
  template <std::size_t K>
  using state_storage = std::conditional_t<Quantized, q8_slot<std::tuple_element_t<K, typename Optimizer::q8_types>>,
                                           fb::slot_storage<host_memory, float>>;
  template <std::size_t... K>
  static std::tuple<state_storage<K>...> states_of(std::index_sequence<K...>);
  using states_type = decltype(states_of(std::make_index_sequence<num_states>{}));

 public:
  explicit states_case(std::vector<std::int64_t> const& sizes)
      : param_(sizes, 1, fb::param_values), grad_(sizes, 2, fb::grad_values),
        states_(make_states(sizes, std::make_index_sequence<num_states>{}))
  {
  }
  [[nodiscard]] auto lists() const { return lists(std::make_index_sequence<num_states>{}); }

 private:
  template <std::size_t... K>
  static states_type make_states(std::vector<std::int64_t> const& sizes, std::index_sequence<K...>)
  {
    constexpr fb::value_range values[] = {fb::first_moment_values, fb::second_moment_values};
    if constexpr (Quantized) {
      return states_type(state_storage<K>(sizes)...);
    } else {
      return states_type(state_storage<K>(sizes, 3 + K, values[K])...);
    }
  }
  template <std::size_t... K>
  auto lists(std::index_sequence<K...>) const
  {
    return fo::bind(fo::slot::param = param_.list(), fo::slot::grad = grad_.template list<P const>(),
                    (std::tuple_element_t<K, typename Optimizer::state_slots>{} = std::get<K>(states_).list())...);
  }

  fb::slot_storage<host_memory, P> param_;
  fb::slot_storage<host_memory, P> grad_;
  states_type states_;
};

template <class Optimizer, class P, bool Quantized>
void bm_states(benchmark::State& state, fb::workload const& w, int threads, fo::host::instruction_set set)
{
  states_case<Optimizer, P, Quantized> memory(w.sizes);
  fo::host::options opts;
  opts.threads = threads;
  opts.widest_instruction_set = set;
  auto plan = fo::host::make_plan(memory.lists(), opts);
  auto const rule = Optimizer::rule();
  using traffic = fo::memory_traffic<decltype(rule), std::decay_t<decltype(plan.lists())>>;

  double const per_step = seconds_per_step(state, plan, rule);
  double const elements = static_cast<double>(w.elements());
  state.SetLabel(fo::host::instruction_set_name(plan.used_instruction_set()));
  state.counters["ms_per_step"] = per_step * 1e3;
  state.counters["Melem_per_s"] = elements / per_step * 1e-6;
  state.counters["bytes_per_element"] = traffic::exact_bytes;
  state.counters["GBps"] = traffic::exact_bytes * elements / per_step * 1e-9;
  state.counters["threads"] = thread_count(threads);
}

/// host/states/<optimizer>_<params>/<fp32|q8>/<workload>/<instruction set>[/threads:n]
template <class Optimizer, class P>
void register_states(fb::workload const& w, int threads)
{
  char const* const params = std::is_same_v<P, float> ? "fp32" : "bf16";
  for (auto set : fo::host::runnable_instruction_sets()) {
    for (bool quantized : {false, true}) {
      std::string name = std::string("host/states/") + Optimizer::name + "_" + params + (quantized ? "/q8/" : "/fp32/") +
                         w.name + "/" + fo::host::instruction_set_name(set);
      if (threads != 0) { name += "/threads:" + std::to_string(threads); }
      auto const run = quantized ? bm_states<Optimizer, P, true> : bm_states<Optimizer, P, false>;
      benchmark::RegisterBenchmark(name.c_str(), [w, threads, set, run](benchmark::State& s) { run(s, w, threads, set); })
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
    }
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
#if defined(__NO_MATH_ERRNO__)
  benchmark::AddCustomContext("math_errno", "off (-fno-math-errno)");
#else
  benchmark::AddCustomContext("math_errno", "on (the compiler's default)");
#endif

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

  // 8-bit states beside fp32 states: host/states/... (issue 41), W1 and W2 on every thread,
  // W1 on one thread too.
  for (auto const& [w, threads] : {std::pair{fb::w1(), 0}, std::pair{fb::w2(), 0}, std::pair{fb::w1(), 1}}) {
    register_states<q8_adam, float>(w, threads);
    register_states<q8_adamw, float>(w, threads);
    register_states<q8_adamw, fo::bfloat16>(w, threads);
    register_states<q8_lion, float>(w, threads);
    register_states<q8_lion, fo::bfloat16>(w, threads);
    register_states<q8_sgd, float>(w, threads);
    register_states<q8_sgd, fo::bfloat16>(w, threads);
  }

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
