// Benchmarks of the CUDA backend: one optimizer step through a fusedopt::cuda plan, per
// workload of bench/workloads.hpp (W1..W4) and optimizer case of bench/cases.hpp.
//
// Method (docs/performance.md):
// - Each slot's tensors live in one cudaMalloc, each tensor start rounded up to 256 bytes,
//   filled with random non-zero values by a kernel. The plan is built once, outside timing.
// - GPU time per step: a spin kernel first holds the stream, so the step's launch is queued
//   before the start event runs and the events time the step's kernels only; median over all
//   iterations (Google Benchmark's manual time gets each iteration's time too).
// - Bytes per step at the minimum: each slot the rule loads read once, each slot it stores
//   written once, plus each slot a reduction pass reads, once per pass
//   (fusedopt_bench::bytes_per_element<Rule, Lists>(); counter `passes` = passes over memory).
// - The roofline: a 1 GiB cudaMemcpyAsync device-to-device copy measured in the same binary,
//   counting bytes read plus bytes written; pct_copy = achieved GB/s over copy GB/s.
// - Host time per plan.run: wall clock around the call alone (host_run/... benchmarks).
//
// Flags besides Google Benchmark's: --chunk_elements=N and --max_blocks=N set the plan's
// tuning overrides (fusedopt::cuda::options) for tuning sweeps; --transports also registers
// every forced metadata transport for Adam fp32.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <fusedopt/fusedopt.cuh>

#include "cases.hpp"
#include "workloads.hpp"

namespace fo = fusedopt;
namespace fb = fusedopt_bench;

namespace {

// ---- device memory, data and timing helpers ---------------------------------------------------

template <class T>
__global__ void fill_kernel(T* data, std::int64_t n, std::uint64_t seed, fb::value_range values)
{
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    data[i] = T(fb::random_value(seed, static_cast<std::uint64_t>(i), values));
  }
}

// Holds the stream for `nanoseconds`, so that work enqueued after it is queued on the device
// before it starts (the events around it then time device work, not launch latency).
__global__ void spin_kernel(std::uint64_t nanoseconds)
{
  std::uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < nanoseconds);
}

// One device allocation of `elements` T (the Memory of fb::slot_storage).
template <class T>
class device_memory {
 public:
  explicit device_memory(std::int64_t elements) : elements_(elements)
  {
    FUSEDOPT_CUDA_TRY(cudaMalloc(&data_, static_cast<std::size_t>(std::max<std::int64_t>(elements, 1)) * sizeof(T)));
  }
  device_memory(device_memory&& other) noexcept : data_(std::exchange(other.data_, nullptr)), elements_(other.elements_) {}
  device_memory(device_memory const&) = delete;
  device_memory& operator=(device_memory const&) = delete;
  device_memory& operator=(device_memory&&) = delete;
  ~device_memory()
  {
    if (data_ != nullptr) { cudaFree(data_); }
  }

  [[nodiscard]] T* data() const { return data_; }
  void fill(std::uint64_t seed, fb::value_range values)
  {
    fill_kernel<T><<<1024, 256>>>(data_, elements_, seed, values);
    FUSEDOPT_CUDA_TRY(cudaGetLastError());
    FUSEDOPT_CUDA_TRY(cudaDeviceSynchronize());
  }

 private:
  T* data_ = nullptr;
  std::int64_t elements_;
};

class stream_and_events {
 public:
  stream_and_events()
  {
    FUSEDOPT_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    FUSEDOPT_CUDA_TRY(cudaEventCreate(&start));
    FUSEDOPT_CUDA_TRY(cudaEventCreate(&stop));
  }
  stream_and_events(stream_and_events const&) = delete;
  stream_and_events& operator=(stream_and_events const&) = delete;
  ~stream_and_events()
  {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }

  /// Seconds the device spends on `work(stream)`, with the launch queued behind a spin.
  template <class Work>
  double time(Work&& work, std::uint64_t spin_ns)
  {
    spin_kernel<<<1, 1, 0, stream>>>(spin_ns);
    FUSEDOPT_CUDA_TRY(cudaGetLastError());
    FUSEDOPT_CUDA_TRY(cudaEventRecord(start, stream));
    work(stream);
    FUSEDOPT_CUDA_TRY(cudaEventRecord(stop, stream));
    FUSEDOPT_CUDA_TRY(cudaEventSynchronize(stop));
    float ms = 0;
    FUSEDOPT_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop));
    return static_cast<double>(ms) * 1e-3;
  }

  cudaStream_t stream{};
  cudaEvent_t start{}, stop{};
};

double median(std::vector<double> v)
{
  if (v.empty()) { return 0; }
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

constexpr std::size_t copy_bytes = std::size_t{1} << 30;

// Median bytes per second (read + write) of a 1 GiB device-to-device cudaMemcpyAsync.
double measure_copy_bandwidth(int repetitions)
{
  device_memory<char> a(static_cast<std::int64_t>(copy_bytes)), b(static_cast<std::int64_t>(copy_bytes));
  a.fill(11, fb::param_values);
  stream_and_events timer;
  auto const copy = [&](cudaStream_t s) {
    FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(b.data(), a.data(), copy_bytes, cudaMemcpyDeviceToDevice, s));
  };
  for (int i = 0; i < 3; ++i) { timer.time(copy, 20000); }
  std::vector<double> seconds;
  for (int i = 0; i < repetitions; ++i) { seconds.push_back(timer.time(copy, 20000)); }
  return 2.0 * static_cast<double>(copy_bytes) / median(seconds);
}

double g_copy_bytes_per_second = 0;  // measured in main, before any benchmark
fo::cuda::options g_tuning{};        // --chunk_elements / --max_blocks

bool enough_memory(std::size_t bytes)
{
  std::size_t free = 0, total = 0;
  FUSEDOPT_CUDA_TRY(cudaMemGetInfo(&free, &total));
  return bytes + (std::size_t{256} << 20) < free;
}

char const* transport_name(fo::cuda::transport t)
{
  switch (t) {
    case fo::cuda::transport::automatic: return "automatic";
    case fo::cuda::transport::param_4k: return "param_4k";
    case fo::cuda::transport::param_32k: return "param_32k";
    case fo::cuda::transport::device_table: return "device_table";
  }
  return "?";
}

// ---- the benchmarks -----------------------------------------------------------------------------

void bm_copy(benchmark::State& state)
{
  try {
    device_memory<char> a(static_cast<std::int64_t>(copy_bytes)), b(static_cast<std::int64_t>(copy_bytes));
    a.fill(11, fb::param_values);
    stream_and_events timer;
    auto const copy = [&](cudaStream_t s) {
      FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(b.data(), a.data(), copy_bytes, cudaMemcpyDeviceToDevice, s));
    };
    timer.time(copy, 20000);
    std::vector<double> seconds;
    for (auto _ : state) {
      seconds.push_back(timer.time(copy, 20000));
      state.SetIterationTime(seconds.back());
    }
    double const t = median(seconds);
    state.counters["gpu_us"] = t * 1e6;
    state.counters["bytes_per_step"] = 2.0 * static_cast<double>(copy_bytes);
    state.counters["GBps"] = 2.0 * static_cast<double>(copy_bytes) / t * 1e-9;
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
  }
}

/// Calls `body(plan, timer)` with a plan over Case's tensors for workload w on the timer's stream,
/// or marks the benchmark skipped: when the device lacks the memory, or with the message of
/// an error.
template <class Case, class Body>
void with_plan(benchmark::State& state, fb::workload const& w, fo::cuda::options opts, Body&& body)
{
  using memory_type = fb::case_state<Case, device_memory>;
  try {
    if (!enough_memory(memory_type::bytes_needed(w.sizes))) {
      state.SkipWithError("not enough free device memory for this workload");
      return;
    }
    memory_type memory(w.sizes);
    stream_and_events timer;
    auto const plan = fo::cuda::make_plan(memory.lists(), opts, timer.stream);
    body(plan, timer);
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
  }
}

// GPU time of one step of Case over workload w through a plan.
template <class Case>
void bm_step(benchmark::State& state, fb::workload const& w, fo::cuda::options opts)
{
  with_plan<Case>(state, w, opts, [&](auto const& plan, stream_and_events& timer) {
    device_memory<fb::step_scalars> scalars(1);
    fb::step_scalars const initial{};
    FUSEDOPT_CUDA_TRY(cudaMemcpy(scalars.data(), &initial, sizeof initial, cudaMemcpyHostToDevice));
    auto const rule = fb::rule_of<Case>(scalars.data());
    using rule_type = std::decay_t<decltype(rule)>;
    double const bytes = static_cast<double>(fb::bytes_per_element<rule_type, std::decay_t<decltype(plan.lists())>>()) *
                         static_cast<double>(w.elements());

    // Warm-up (module load, first-step paths), measuring the host time of run() so the spin
    // that hides launch latency outlasts it.
    std::int64_t step = 1;
    double host_seconds = 0;
    for (int i = 0; i < 10; ++i) {
      auto const start = std::chrono::steady_clock::now();
      plan.run(rule, fo::step_info{step++}, timer.stream);
      host_seconds = std::max(host_seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(timer.stream));
    auto const spin_ns = static_cast<std::uint64_t>(std::max(20e-6, 3 * host_seconds + 10e-6) * 1e9);

    std::vector<double> seconds;
    seconds.reserve(static_cast<std::size_t>(state.max_iterations));
    auto const work = [&](cudaStream_t s) { plan.run(rule, fo::step_info{step}, s); };
    for (auto _ : state) {
      seconds.push_back(timer.time(work, spin_ns));
      ++step;
      state.SetIterationTime(seconds.back());
    }

    double const t = median(seconds);
    state.counters["gpu_us"] = t * 1e6;
    state.counters["gpu_us_min"] = *std::min_element(seconds.begin(), seconds.end()) * 1e6;
    state.counters["bytes_per_step"] = bytes;
    state.counters["GBps"] = bytes / t * 1e-9;
    state.counters["pct_copy"] = 100.0 * bytes / t / g_copy_bytes_per_second;
    state.counters["launches"] = static_cast<double>(plan.launches_per_run(rule));
    state.counters["passes"] = fb::passes_over_memory<rule_type>;
    state.counters["bytes_per_element"] = bytes / static_cast<double>(w.elements());
    state.counters["tensors"] = static_cast<double>(w.sizes.size());
    state.counters["elements"] = static_cast<double>(w.elements());
    state.SetLabel(transport_name(plan.metadata()));
  });
}

/// Host wall time of each `call()` (one iteration each), median and largest as counters. The
/// stream is synchronised every 16 calls outside the timed region, so a full launch queue
/// never blocks a call.
template <class Call>
void time_host_calls(benchmark::State& state, cudaStream_t stream, Call&& call)
{
  std::vector<double> seconds;
  seconds.reserve(static_cast<std::size_t>(state.max_iterations));
  for (auto _ : state) {
    auto const start = std::chrono::steady_clock::now();
    call();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    state.SetIterationTime(seconds.back());
    if (seconds.size() % 16 == 0) { FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream)); }
  }
  FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));
  state.counters["host_us"] = median(seconds) * 1e6;
  state.counters["host_us_max"] = *std::max_element(seconds.begin(), seconds.end()) * 1e6;
}

__global__ void empty_kernel() {}

/// The launch floor next to host_run: one cudaLaunchKernel of an empty kernel, timed the same
/// way, so that host_run's figure reads against what the driver alone costs on this machine.
void bm_launch_floor(benchmark::State& state)
{
  try {
    stream_and_events timer;
    auto const launch = [&] {
      void* no_args[] = {nullptr};
      FUSEDOPT_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<void const*>(&empty_kernel), dim3(1), dim3(128), no_args, 0,
                                         timer.stream));
    };
    for (int i = 0; i < 10; ++i) { launch(); }
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(timer.stream));
    time_host_calls(state, timer.stream, launch);
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
  }
}

// Host time of one plan.run call (wall clock around the call alone; the device runs behind).
template <class Case>
void bm_host_run(benchmark::State& state, fb::workload const& w, fo::cuda::options opts)
{
  with_plan<Case>(state, w, opts, [&](auto const& plan, stream_and_events& timer) {
    auto const rule = Case::rule();
    std::int64_t step = 1;
    for (int i = 0; i < 10; ++i) { plan.run(rule, fo::step_info{step++}, timer.stream); }
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(timer.stream));

    time_host_calls(state, timer.stream, [&] { plan.run(rule, fo::step_info{step++}, timer.stream); });
    state.counters["launches"] = static_cast<double>(plan.launches_per_run());
    state.counters["tensors"] = static_cast<double>(w.sizes.size());
    state.SetLabel(transport_name(plan.metadata()));
  });
}

/// How bm_host_rebind hands the plan the moved gradients.
enum class rebind_how { bound_lists, bind_and_lists, grad_addresses };

/// Host time of plan.rebind when the gradients move (zero_grad(set_to_none=True)): the plan
/// alternates between two gradient sets, given as lists bound beforehand, as lists bound in the
/// timed call (fusedopt::bind validates them: sizes, overlaps), as a caller with new tensors
/// does, or as the gradient addresses alone (rebind(slot::grad, addresses)).
template <class Case>
void bm_host_rebind(benchmark::State& state, fb::workload const& w, fo::cuda::options opts, rebind_how how)
{
  using memory_type = fb::case_state<Case, device_memory>;
  try {
    if (!enough_memory(2 * memory_type::bytes_needed(w.sizes))) {
      state.SkipWithError("not enough free device memory for this workload");
      return;
    }
    memory_type memory(w.sizes);
    memory_type other(w.sizes);
    stream_and_events timer;
    auto plan = fo::cuda::make_plan(memory.lists(), opts, timer.stream);
    auto const bound = std::array{memory.lists(), memory.lists_with_gradients_of(other)};
    using grad_pointer = typename decltype(plan)::template slot_pointer_t<fo::slot::grad_t>;
    std::array<std::vector<grad_pointer>, 2> grads;
    for (std::size_t j = 0; j < 2; ++j) {
      for (auto const& t : bound[j].template list<1>()) { grads[j].push_back(t.data); }
    }
    std::size_t k = 0;
    time_host_calls(state, timer.stream, [&] {
      k ^= 1;
      switch (how) {
        case rebind_how::bound_lists: plan.rebind(bound[k], timer.stream); break;
        case rebind_how::bind_and_lists:
          plan.rebind(k == 0 ? memory.lists() : memory.lists_with_gradients_of(other), timer.stream);
          break;
        case rebind_how::grad_addresses: plan.rebind(fo::slot::grad, grads[k].data(), grads[k].size(), timer.stream); break;
      }
    });
    state.counters["tensors"] = static_cast<double>(w.sizes.size());
    state.SetLabel(transport_name(plan.metadata()));
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
  }
}

/// Host time of single runtime calls a rebind makes, to read bm_host_rebind against.
void bm_runtime_calls(benchmark::State& state, int which)
{
  try {
    stream_and_events timer;
    void* device = nullptr;
    void* pinned = nullptr;
    std::size_t const bytes = 148 * 40;  // GPT-2 small's tensor table (148 tensors, 4 slots)
    FUSEDOPT_CUDA_TRY(cudaMalloc(&device, bytes));
    FUSEDOPT_CUDA_TRY(cudaMallocHost(&pinned, bytes));
    cudaEvent_t event = nullptr;
    FUSEDOPT_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    auto const call = [&] {
      switch (which) {
        case 0: {
          cudaPointerAttributes attributes{};
          FUSEDOPT_CUDA_TRY(cudaPointerGetAttributes(&attributes, device));
          break;
        }
        case 1: {
          cudaStreamCaptureStatus status{};
          FUSEDOPT_CUDA_TRY(cudaStreamIsCapturing(timer.stream, &status));
          break;
        }
        case 2: {
          cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
          FUSEDOPT_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
          FUSEDOPT_CUDA_TRY(cudaThreadExchangeStreamCaptureMode(&mode));
          break;
        }
        default:
          FUSEDOPT_CUDA_TRY(cudaEventSynchronize(event));
          FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(device, pinned, bytes, cudaMemcpyHostToDevice, timer.stream));
          FUSEDOPT_CUDA_TRY(cudaEventRecord(event, timer.stream));
          break;
      }
    };
    for (int i = 0; i < 10; ++i) { call(); }
    time_host_calls(state, timer.stream, call);
    FUSEDOPT_CUDA_TRY(cudaEventDestroy(event));
    FUSEDOPT_CUDA_TRY(cudaFreeHost(pinned));
    FUSEDOPT_CUDA_TRY(cudaFree(device));
  } catch (std::exception const& e) {
    state.SkipWithError(e.what());
  }
}

// Iterations for about `seconds` of device time at a predicted 3 TB/s (fixed counts keep
// Google Benchmark from re-running the setup to find one).
benchmark::IterationCount iterations_for(double bytes, double seconds)
{
  double const predicted = bytes / 3e12 + 30e-6;  // + spin and synchronisation per iteration
  return static_cast<benchmark::IterationCount>(std::clamp(seconds / predicted, 30.0, 3000.0));
}

template <class Case>
double case_bytes(fb::workload const& w)
{
  using lists_type = decltype(std::declval<fb::case_state<Case, device_memory> const&>().lists());
  using rule_type = decltype(fb::rule_of<Case>(nullptr));
  return static_cast<double>(fb::bytes_per_element<rule_type, lists_type>()) * static_cast<double>(w.elements());
}

template <class Case>
void register_step(fb::workload const& w, fo::cuda::options opts, std::string const& suffix = "")
{
  std::string const name = std::string(Case::name) + "/" + w.name + suffix;
  benchmark::RegisterBenchmark(name.c_str(), [w, opts](benchmark::State& s) { bm_step<Case>(s, w, opts); })
    ->UseManualTime()
    ->Iterations(iterations_for(case_bytes<Case>(w), 0.4))
    ->Unit(benchmark::kMicrosecond);
}

template <class Case>
void register_host_run(fb::workload const& w, fo::cuda::options opts)
{
  std::string const name = std::string("host_run/") + Case::name + "/" + w.name;
  benchmark::RegisterBenchmark(name.c_str(), [w, opts](benchmark::State& s) { bm_host_run<Case>(s, w, opts); })
    ->UseManualTime()
    ->Iterations(2000)
    ->Unit(benchmark::kMicrosecond);
}

std::string commit()
{
  char const* env = std::getenv("FUSEDOPT_GIT_COMMIT");
  return env != nullptr && *env != '\0' ? env : FUSEDOPT_BENCH_GIT_COMMIT;
}

// Removes --name=value from argv (before Google Benchmark sees it); returns the value.
bool take_flag(int& argc, char** argv, char const* name, std::string& value)
{
  std::string const prefix = std::string("--") + name;
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    if (arg == prefix || arg.rfind(prefix + "=", 0) == 0) {
      value = arg.size() > prefix.size() ? arg.substr(prefix.size() + 1) : "1";
      std::copy(argv + i + 1, argv + argc, argv + i);
      --argc;
      return true;
    }
  }
  return false;
}

}  // namespace

int main(int argc, char** argv)
{
  std::string value;
  bool const transports = take_flag(argc, argv, "transports", value);
  if (take_flag(argc, argv, "chunk_elements", value)) { g_tuning.chunk_elements = std::stoll(value); }
  if (take_flag(argc, argv, "max_blocks", value)) { g_tuning.max_blocks = std::stoll(value); }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) { return 1; }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("cuda_bench: no CUDA device, nothing to measure\n");
    return 0;
  }
  try {
    int device = 0, driver = 0, runtime = 0;
    FUSEDOPT_CUDA_TRY(cudaGetDevice(&device));
    cudaDeviceProp prop{};
    FUSEDOPT_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    FUSEDOPT_CUDA_TRY(cudaDriverGetVersion(&driver));
    FUSEDOPT_CUDA_TRY(cudaRuntimeGetVersion(&runtime));
    g_copy_bytes_per_second = measure_copy_bandwidth(20);

    benchmark::AddCustomContext("gpu", prop.name);
    benchmark::AddCustomContext("gpu_sm", std::to_string(prop.major) + "." + std::to_string(prop.minor) + ", " +
                                            std::to_string(prop.multiProcessorCount) + " SMs, " +
                                            std::to_string(prop.totalGlobalMem >> 20) + " MiB");
    benchmark::AddCustomContext("cuda_driver_runtime", std::to_string(driver) + " / " + std::to_string(runtime));
    benchmark::AddCustomContext("git_commit", commit());
    benchmark::AddCustomContext("fusedopt_version", FUSEDOPT_VERSION_STRING);
    benchmark::AddCustomContext("copy_GBps", std::to_string(g_copy_bytes_per_second * 1e-9));
    benchmark::AddCustomContext("tuning_overrides", "chunk_elements=" + std::to_string(g_tuning.chunk_elements) +
                                                      " max_blocks=" + std::to_string(g_tuning.max_blocks));
  } catch (std::exception const& e) {
    std::fprintf(stderr, "cuda_bench: %s\n", e.what());
    return 1;
  }

  benchmark::RegisterBenchmark("copy_d2d/1GiB", bm_copy)->UseManualTime()->Iterations(50)->Unit(benchmark::kMicrosecond);
  for (auto const& w : fb::all_workloads()) {
    register_step<fb::adam_fp32>(w, g_tuning);
    register_step<fb::adamw_bf16>(w, g_tuning);
    register_step<fb::sgd_momentum_fp32>(w, g_tuning);
  }
  // Issue 5: reduction passes (clip, LAMB, AMP skip) on the two multi-tensor workloads.
  for (auto const& w : {fb::w2(), fb::w3()}) {
    register_step<fb::adamw_clip_bf16>(w, g_tuning);
    register_step<fb::lamb_fp32>(w, g_tuning);
    register_step<fb::amp_adam_fp32>(w, g_tuning);
  }
  // Issue 45: Optax's AdamW as fusedopt_jax runs it, where XLA's own fusion is the peer.
  for (auto const& w : {fb::w2(), fb::w4()}) { register_step<fb::optax_adamw_fp32>(w, g_tuning); }
  if (transports) {
    for (auto const& w : fb::all_workloads()) {
      for (auto t : {fo::cuda::transport::device_table, fo::cuda::transport::param_32k, fo::cuda::transport::param_4k}) {
        fo::cuda::options opts = g_tuning;
        opts.metadata = t;
        register_step<fb::adam_fp32>(w, opts, std::string("/") + transport_name(t));
      }
    }
  }
  benchmark::RegisterBenchmark("host_run/launch_floor", bm_launch_floor)
    ->UseManualTime()
    ->Iterations(2000)
    ->Unit(benchmark::kMicrosecond);
  register_host_run<fb::adam_fp32>(fb::w3(), g_tuning);
  register_host_run<fb::adamw_bf16>(fb::w3(), g_tuning);
  register_host_run<fb::sgd_momentum_fp32>(fb::w3(), g_tuning);
  // Issue 11: the host time of following moved gradients (GPT-2 small's 148 tensors).
  for (auto const& [how, suffix] : {std::pair{rebind_how::bound_lists, ""}, std::pair{rebind_how::bind_and_lists, "/with_bind"},
                                     std::pair{rebind_how::grad_addresses, "/grad_addresses"}}) {
    std::string const name = std::string("host_rebind/adam_fp32/W2") + suffix;
    benchmark::RegisterBenchmark(name.c_str(), [how = how](benchmark::State& s) {
      bm_host_rebind<fb::adam_fp32>(s, fb::w2(), g_tuning, how);
    })->UseManualTime()->Iterations(2000)->Unit(benchmark::kMicrosecond);
  }
  char const* const calls[] = {"cudaPointerGetAttributes", "cudaStreamIsCapturing",
                               "cudaThreadExchangeStreamCaptureMode_x2", "upload_5920B_pinned"};
  for (int which = 0; which < 4; ++which) {
    benchmark::RegisterBenchmark((std::string("host_call/") + calls[which]).c_str(),
                                 [which](benchmark::State& s) { bm_runtime_calls(s, which); })
      ->UseManualTime()
      ->Iterations(2000)
      ->Unit(benchmark::kMicrosecond);
  }

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
