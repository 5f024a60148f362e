// How much of a sharded AdamW step's update cuda::bucket_schedule hides behind the collectives
// (issue 41, item 3; docs/sharded.md, "Benchmarks on 2 and 4 GPUs"). One process per GPU over
// NCCL, as examples/sharded_adamw:
//
//   id=/tmp/overlap.$$.id; rm -f $id
//   for r in 0 1; do WORLD_SIZE=2 RANK=$r FUSEDOPT_NCCL_ID=$id ./sharded_overlap --out o.json & done; wait
//
// (bench/run-multi-gpu does this, and kills the other ranks when one fails). Rank 0 writes the
// NCCL id to the file FUSEDOPT_NCCL_ID names (default /tmp/fusedopt_overlap.id); the others read
// it there: remove the file before a run, or a rank may read a stale id.
//
// Workload: GPT-2 medium's 292 parameter tensors (wte 50257x1024, wpe 1024x1024, 24 blocks of
// 12, ln_f; 354,823,168 fp32 elements; --layers/--dim/--vocab change it), fp32 parameters,
// gradients and Adam moments, gradients averaged. Configurations, each with its own layouts,
// buffers and plans:
//   - unbucketed: one sharded plan over every tensor, plan.run on one stream (reduce-scatter,
//     update, all-gather in sequence);
//   - B buckets for each B of --buckets: the tensors cut, in order, into at most B buckets of
//     about equal elements (a tensor is never split; the count made is reported), one sharded
//     plan per bucket, stepped by cuda::bucket_schedule on a compute and a communication stream.
// Measured per configuration, on the compute stream with CUDA events, every step enqueued
// without a host synchronisation in between (the deltas between consecutive events are the
// steps), after --warmup steps, --steps steps per round, --rounds rounds (configurations
// interleaved in each round):
//   step         the whole step (unbucketed: plan.run; bucketed: bucket_schedule::run on the
//                schedule's own communication stream, at the greatest priority: NCCL's kernels
//                then take SMs ahead of the updates' blocks);
//   step_default_priority  bucketed only: the same, the collectives on a communication stream
//                of the caller's at the default priority;
//   collectives  every plan's reduce_scatter then every plan's all_gather, on one stream;
//   update       every plan's update, on one stream (no communication).
// Reported: medians over all steps of all rounds (and per round, in the JSON), the max over the
// ranks; hidden = (collectives + update - step) / update of the same configuration (0: nothing
// overlapped; 1: the whole update hidden behind the collectives); the step's speedup over the
// unbucketed step; a 1 GiB device-to-device copy measured in the same run (bytes read + written)
// and the update's fraction of it (28 bytes per shard element: parameter, m and v read and
// written, gradient shard read).
//
// Check first (--check-steps, default 3; 0 skips it): every configuration starts from the same
// parameters and gradients (a hash of the tensor, element and rank: never zero; the gradients
// multiples of 2^-20, so that their reduction is exact in any order), runs that many steps, and
// each bucketed configuration's parameters must equal the unbucketed one's (largest |difference|
// over the ranks printed; more than 1e-6, or a NaN, fails the run after the timing).
//
// Fails loudly: any CUDA or NCCL error, a NCCL asynchronous error, or a wait longer than
// FUSEDOPT_OVERLAP_TIMEOUT seconds (default 120: another rank failed) prints "sharded_overlap:
// rank R: ..." on stderr and exits 1 (the communicator aborted).
#include <fusedopt/fusedopt.cuh>
#include <fusedopt/nccl.cuh>

#include "../examples/sharded_adamw/nccl_id.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace fo = fusedopt;

namespace {

int env_int(char const* name, int fallback)
{
  char const* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

[[noreturn]] void fail(std::string const& what) { throw fo::error(what); }

// ---- options ------------------------------------------------------------------------------------

struct settings {
  std::vector<int> buckets{2, 4, 8, 16, 32};
  int steps = 30;
  int warmup = 5;
  int rounds = 2;
  int check_steps = 3;
  int layers = 24;
  std::int64_t dim = 1024;
  std::int64_t vocab = 50257;
  std::int64_t context = 1024;
  std::string out;
};

std::vector<int> parse_list(std::string const& text)
{
  std::vector<int> values;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (item.empty()) { continue; }
    int const v = std::atoi(item.c_str());
    if (v < 2) { fail("--buckets: each count must be at least 2 (the unbucketed step is always measured), not '" + item + "'"); }
    values.push_back(v);
  }
  return values;
}

settings parse(int argc, char** argv)
{
  settings s;
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) { fail(arg + " needs a value"); }
      return argv[++i];
    };
    if (arg == "--buckets") {
      s.buckets = parse_list(value());
    } else if (arg == "--steps") {
      s.steps = std::atoi(value().c_str());
    } else if (arg == "--warmup") {
      s.warmup = std::atoi(value().c_str());
    } else if (arg == "--rounds") {
      s.rounds = std::atoi(value().c_str());
    } else if (arg == "--check-steps") {
      s.check_steps = std::atoi(value().c_str());
    } else if (arg == "--layers") {
      s.layers = std::atoi(value().c_str());
    } else if (arg == "--dim") {
      s.dim = std::atoll(value().c_str());
    } else if (arg == "--vocab") {
      s.vocab = std::atoll(value().c_str());
    } else if (arg == "--out") {
      s.out = value();
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: sharded_overlap [--buckets 2,4,8,16,32] [--steps 30] [--warmup 5] [--rounds 2]\n"
                  "                       [--check-steps 3] [--layers 24] [--dim 1024] [--vocab 50257] [--out FILE]\n"
                  "environment: WORLD_SIZE, RANK, LOCAL_RANK, FUSEDOPT_NCCL_ID, FUSEDOPT_OVERLAP_TIMEOUT\n");
      std::exit(0);
    } else {
      fail("unknown argument '" + arg + "' (--help)");
    }
  }
  if (s.steps < 1 || s.warmup < 0 || s.rounds < 1 || s.check_steps < 0 || s.layers < 0 || s.dim < 1 || s.vocab < 1) {
    fail("--steps and --rounds must be at least 1, the others not negative");
  }
  return s;
}

/// GPT-2's parameter tensors in model.parameters() order (bench/workloads.hpp's W2 at another
/// width and depth): wte, wpe, per block ln_1 w/b, attn w/b, proj w/b, ln_2 w/b, fc w/b,
/// mlp proj w/b, then ln_f w/b.
std::vector<std::int64_t> gpt2_sizes(settings const& s)
{
  std::int64_t const d = s.dim;
  std::vector<std::int64_t> sizes{s.vocab * d, s.context * d};
  for (int layer = 0; layer < s.layers; ++layer) {
    for (std::int64_t n : {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d}) { sizes.push_back(n); }
  }
  sizes.push_back(d);
  sizes.push_back(d);
  return sizes;
}

// ---- waits -----------------------------------------------------------------------------

ncclComm_t g_comm = nullptr;  // aborted on a timeout or an asynchronous error
bool g_aborted = false;

/// Waits until `stream` has done what was enqueued, polling: a NCCL asynchronous error or a wait
/// longer than the timeout aborts the communicator and throws (another rank failed or hangs).
void wait(cudaStream_t stream, char const* what)
{
  static double const timeout = env_int("FUSEDOPT_OVERLAP_TIMEOUT", 120);
  cudaEvent_t done = nullptr;
  FUSEDOPT_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  FUSEDOPT_CUDA_TRY(cudaEventRecord(done, stream));
  auto const start = std::chrono::steady_clock::now();
  for (;;) {
    cudaError_t const status = cudaEventQuery(done);
    if (status == cudaSuccess) { break; }
    if (status != cudaErrorNotReady) {
      (void)cudaEventDestroy(done);
      FUSEDOPT_CUDA_TRY(status);
    }
    if (g_comm != nullptr) {
      ncclResult_t async = ncclSuccess;
      FUSEDOPT_NCCL_TRY(ncclCommGetAsyncError(g_comm, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        (void)ncclCommAbort(g_comm);
        g_aborted = true;
        fail(std::string("NCCL asynchronous error during ") + what + ": " + ncclGetErrorString(async));
      }
    }
    double const waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > timeout) {
      if (g_comm != nullptr) {
        (void)ncclCommAbort(g_comm);
        g_aborted = true;
      }
      fail(std::string("waited more than ") + std::to_string(static_cast<int>(timeout)) + " s for " + what +
           " (another rank failed or hangs); communicator aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  FUSEDOPT_CUDA_TRY(cudaEventDestroy(done));
  FUSEDOPT_CUDA_TRY(cudaGetLastError());
}

// ---- data -----------------------------------------------------------------------------------------

__host__ __device__ inline std::uint64_t mix(std::uint64_t z)
{
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// data[i] = scale x a value in (-1, 1), never 0, fixed by (seed, tensor, i): the same values
/// whatever the layout puts the tensor.
__global__ void fill_kernel(float* data, std::int64_t n, std::uint64_t seed, std::uint64_t tensor, float scale)
{
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    std::uint64_t const h = mix(seed * 0x9e3779b97f4a7c15ULL + mix(tensor + 0x632be59bd9b4e019ULL) + static_cast<std::uint64_t>(i));
    float const u = (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1), never 0.5
    data[i] = scale * (2.0f * u - 1.0f);
  }
}

/// data[i] = k x 2^-20 with k a non-zero integer in [-1023, 1023] fixed by (seed, tensor, i):
/// gradients whose sums over up to 2^13 ranks are exact in fp32 in any order, and whose average
/// over a power-of-two number of ranks too, so the reduce-scatter gives the same bits whichever
/// rank owns an element (the check compares layouts that place elements on other ranks).
__global__ void fill_gradient_kernel(float* data, std::int64_t n, std::uint64_t seed, std::uint64_t tensor)
{
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    std::uint64_t const h = mix(seed * 0x9e3779b97f4a7c15ULL + mix(tensor + 0x632be59bd9b4e019ULL) + static_cast<std::uint64_t>(i));
    int const k = 1 + static_cast<int>((h >> 33) % 1023);  // 1..1023
    data[i] = static_cast<float>(((h >> 32) & 1) != 0 ? -k : k) * (1.0f / 1048576.0f);
  }
}

/// *out = max(*out, max |a[i] - b[i]|) as float bits (non-negative floats order as their bits);
/// a NaN on either side counts as infinity.
__global__ void max_diff_kernel(float const* a, float const* b, std::int64_t n, unsigned* out)
{
  float m = 0.f;
  std::int64_t const stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float const x = a[i], y = b[i];
    float const d = (isnan(x) || isnan(y)) ? INFINITY : fabsf(x - y);
    m = fmaxf(m, d);
  }
  for (int offset = 16; offset > 0; offset /= 2) { m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, offset)); }
  if ((threadIdx.x & 31) == 0) { atomicMax(out, __float_as_uint(m)); }
}

int blocks_for(std::int64_t n) { return static_cast<int>(std::min<std::int64_t>(std::max<std::int64_t>((n + 255) / 256, 1), 4096)); }

template <class T>
T* device_zeros(std::int64_t n)
{
  T* p = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&p, static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(T)));
  FUSEDOPT_CUDA_TRY(cudaMemset(p, 0, static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(T)));
  return p;
}

/// One bucket's buffers on this rank (cudaMalloc: 256-byte aligned).
struct bucket_memory {
  float* params = nullptr;      // flat_elements(): every tensor of the bucket
  float* grads = nullptr;       // flat_elements(): this rank's gradients
  float* grad_shard = nullptr;  // shard_elements()
  float* exp_avg = nullptr;     // shard_elements()
  float* exp_avg_sq = nullptr;  // shard_elements()

  explicit bucket_memory(fo::cuda::sharded_layout const& layout)
  {
    params = device_zeros<float>(layout.flat_elements());
    grads = device_zeros<float>(layout.flat_elements());
    grad_shard = device_zeros<float>(layout.shard_elements());
    exp_avg = device_zeros<float>(layout.shard_elements());
    exp_avg_sq = device_zeros<float>(layout.shard_elements());
  }
  ~bucket_memory()
  {
    for (float* p : {params, grads, grad_shard, exp_avg, exp_avg_sq}) { (void)cudaFree(p); }
  }
  bucket_memory(bucket_memory const&) = delete;
  bucket_memory& operator=(bucket_memory const&) = delete;
};

auto build_plan(fo::cuda::sharded_layout const& layout, bucket_memory& m, fo::nccl::communicator comm, int rank,
                cudaStream_t stream)
{
  auto lists = fo::bind(fo::slot::param = layout.shard_list(m.params + layout.shard_begin(rank), rank),
                        fo::slot::grad = layout.shard_list(static_cast<float const*>(m.grad_shard), rank),
                        fo::slot::exp_avg = layout.shard_list(m.exp_avg, rank),
                        fo::slot::exp_avg_sq = layout.shard_list(m.exp_avg_sq, rank));
  return fo::cuda::make_sharded_plan(layout, comm, lists,
                                     fo::cuda::shard_buffers<float, float>{m.grads, m.grad_shard, m.params},
                                     fo::cuda::gradient_reduction::average, {}, stream);
}

using plan_type = decltype(build_plan(std::declval<fo::cuda::sharded_layout const&>(), std::declval<bucket_memory&>(),
                                      std::declval<fo::nccl::communicator>(), 0, cudaStream_t{}));

/// The tensors cut, in order, into at most `buckets` buckets: a bucket closes once it holds at
/// least the remaining elements over the remaining buckets (a tensor is never split, so a large
/// one, such as the embedding, makes its bucket larger and the count smaller).
std::vector<std::vector<std::size_t>> split(std::vector<std::int64_t> const& sizes, int buckets)
{
  std::int64_t remaining = 0;
  for (auto n : sizes) { remaining += n; }
  std::vector<std::vector<std::size_t>> out(1);
  std::int64_t in_bucket = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    out.back().push_back(t);
    in_bucket += sizes[t];
    int const left = buckets - static_cast<int>(out.size()) + 1;  // buckets still to fill, this one included
    if (t + 1 < sizes.size() && left > 1 && in_bucket >= (remaining + left - 1) / left) {
      remaining -= in_bucket;
      in_bucket = 0;
      out.emplace_back();
    }
  }
  return out;
}

/// One configuration: its buckets (one for the unbucketed step), their layouts, buffers and plans.
struct configuration {
  int requested = 1;                                 // 1: unbucketed
  std::vector<std::vector<std::size_t>> tensors;     // global tensor indices per bucket
  std::vector<fo::cuda::sharded_layout> layouts;
  std::vector<std::unique_ptr<bucket_memory>> memory;
  std::vector<plan_type> plans;
  std::unique_ptr<fo::cuda::bucket_schedule> schedule;
  std::int64_t t = 0;  // the step count of this configuration's AdamW

  [[nodiscard]] std::string label() const
  {
    return requested == 1 ? std::string("unbucketed") : std::to_string(tensors.size()) + " buckets";
  }
  [[nodiscard]] std::int64_t shard_elements() const
  {
    std::int64_t n = 0;
    for (auto const& l : layouts) { n += l.shard_elements(); }
    return n;
  }
  [[nodiscard]] std::int64_t flat_elements() const
  {
    std::int64_t n = 0;
    for (auto const& l : layouts) { n += l.flat_elements(); }
    return n;
  }
};

configuration make_configuration(std::vector<std::int64_t> const& sizes, int requested, int world, int rank,
                                 ncclComm_t comm, cudaStream_t stream)
{
  configuration c;
  c.requested = requested;
  c.tensors = split(sizes, requested);
  for (auto const& bucket : c.tensors) {
    std::vector<std::int64_t> bucket_sizes;
    for (std::size_t g : bucket) { bucket_sizes.push_back(sizes[g]); }
    c.layouts.emplace_back(bucket_sizes, world);
  }
  for (auto const& layout : c.layouts) {
    c.memory.push_back(std::make_unique<bucket_memory>(layout));
    c.plans.push_back(build_plan(layout, *c.memory.back(), fo::nccl::communicator(comm), rank, stream));
  }
  if (requested > 1) { c.schedule = std::make_unique<fo::cuda::bucket_schedule>(c.plans.size()); }
  return c;
}

/// Every configuration's tensors get the same values: parameters from (seed 1, tensor, i),
/// gradients from (seed 1000 + rank, tensor, i), multiples of 2^-20 under 2^-10 in magnitude;
/// moments zero; the step count 0.
void initialise(configuration& c, int rank, cudaStream_t stream)
{
  for (std::size_t b = 0; b < c.tensors.size(); ++b) {
    auto const& layout = c.layouts[b];
    auto& m = *c.memory[b];
    for (std::size_t t = 0; t < c.tensors[b].size(); ++t) {
      std::int64_t const n = layout.tensor_size(t);
      if (n == 0) { continue; }
      auto const g = static_cast<std::uint64_t>(c.tensors[b][t]);
      fill_kernel<<<blocks_for(n), 256, 0, stream>>>(m.params + layout.offset(t), n, 1, g, 0.05f);
      fill_gradient_kernel<<<blocks_for(n), 256, 0, stream>>>(m.grads + layout.offset(t), n,
                                                              1000 + static_cast<std::uint64_t>(rank), g);
    }
    FUSEDOPT_CUDA_TRY(cudaGetLastError());
    FUSEDOPT_CUDA_TRY(cudaMemsetAsync(m.exp_avg, 0, static_cast<std::size_t>(layout.shard_elements()) * sizeof(float), stream));
    FUSEDOPT_CUDA_TRY(cudaMemsetAsync(m.exp_avg_sq, 0, static_cast<std::size_t>(layout.shard_elements()) * sizeof(float), stream));
  }
  c.t = 0;
}

fo::rules::adamw rule()
{
  fo::rules::adamw r;
  r.lr = 3e-4;
  r.beta1 = 0.9;
  r.beta2 = 0.95;
  r.weight_decay = 0.1;
  return r;
}

// ---- what is timed --------------------------------------------------------------------------------

enum class what { step, step_default_priority, collectives, update };
char const* name_of(what w)
{
  switch (w) {
    case what::step: return "step";
    case what::step_default_priority: return "step_default_priority";
    case what::collectives: return "collectives";
    case what::update: return "update";
  }
  return "?";
}

void enqueue(configuration& c, what w, cudaStream_t compute, cudaStream_t communication)
{
  auto const adamw = rule();
  switch (w) {
    case what::step:
    case what::step_default_priority:
      ++c.t;
      if (c.schedule == nullptr) {
        c.plans.front().run(adamw, {c.t}, compute);
      } else if (w == what::step) {
        c.schedule->run(c.plans, adamw, {c.t}, compute);
      } else {
        c.schedule->run(c.plans, adamw, {c.t}, compute, communication);
      }
      break;
    case what::collectives:
      for (auto& p : c.plans) { p.reduce_scatter(compute); }
      for (auto& p : c.plans) { p.all_gather(compute); }
      break;
    case what::update:
      ++c.t;
      for (auto& p : c.plans) { p.update(adamw, {c.t}, compute); }
      break;
  }
}

/// Microseconds of each of `steps` consecutive enqueues of `w`, between events on `compute`,
/// after `warmup` untimed ones; no host synchronisation between the timed steps.
std::vector<double> time_steps(configuration& c, what w, settings const& s, cudaStream_t compute,
                               cudaStream_t communication)
{
  for (int i = 0; i < s.warmup; ++i) { enqueue(c, w, compute, communication); }
  wait(compute, "the warm-up steps");
  std::vector<cudaEvent_t> events(static_cast<std::size_t>(s.steps) + 1, nullptr);
  for (auto& e : events) { FUSEDOPT_CUDA_TRY(cudaEventCreate(&e)); }
  FUSEDOPT_CUDA_TRY(cudaEventRecord(events[0], compute));
  for (int i = 0; i < s.steps; ++i) {
    enqueue(c, w, compute, communication);
    FUSEDOPT_CUDA_TRY(cudaEventRecord(events[static_cast<std::size_t>(i) + 1], compute));
  }
  wait(compute, "the timed steps");
  std::vector<double> us;
  for (int i = 0; i < s.steps; ++i) {
    float ms = 0.f;
    FUSEDOPT_CUDA_TRY(cudaEventElapsedTime(&ms, events[static_cast<std::size_t>(i)], events[static_cast<std::size_t>(i) + 1]));
    us.push_back(1e3 * static_cast<double>(ms));
  }
  for (auto& e : events) { FUSEDOPT_CUDA_TRY(cudaEventDestroy(e)); }
  return us;
}

double median(std::vector<double> v)
{
  if (v.empty()) { return std::nan(""); }
  std::sort(v.begin(), v.end());
  std::size_t const n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Bytes per second (read + written) of a 1 GiB device-to-device copy: median of 20.
double copy_bandwidth(cudaStream_t stream)
{
  std::size_t const bytes = std::size_t{1} << 30;
  void *a = nullptr, *b = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&a, bytes));
  FUSEDOPT_CUDA_TRY(cudaMalloc(&b, bytes));
  FUSEDOPT_CUDA_TRY(cudaMemsetAsync(a, 1, bytes, stream));
  cudaEvent_t start = nullptr, stop = nullptr;
  FUSEDOPT_CUDA_TRY(cudaEventCreate(&start));
  FUSEDOPT_CUDA_TRY(cudaEventCreate(&stop));
  std::vector<double> seconds;
  for (int i = 0; i < 23; ++i) {
    FUSEDOPT_CUDA_TRY(cudaEventRecord(start, stream));
    FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    FUSEDOPT_CUDA_TRY(cudaEventRecord(stop, stream));
    wait(stream, "the copy");
    float ms = 0.f;
    FUSEDOPT_CUDA_TRY(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) { seconds.push_back(1e-3 * static_cast<double>(ms)); }
  }
  FUSEDOPT_CUDA_TRY(cudaEventDestroy(start));
  FUSEDOPT_CUDA_TRY(cudaEventDestroy(stop));
  FUSEDOPT_CUDA_TRY(cudaFree(a));
  FUSEDOPT_CUDA_TRY(cudaFree(b));
  return 2.0 * static_cast<double>(bytes) / median(seconds);
}

/// The element-wise maximum of `values` over the ranks (in place), through NCCL.
void max_over_ranks(std::vector<double>& values, ncclComm_t comm, cudaStream_t stream)
{
  double* d = device_zeros<double>(static_cast<std::int64_t>(values.size()));
  FUSEDOPT_CUDA_TRY(cudaMemcpy(d, values.data(), values.size() * sizeof(double), cudaMemcpyHostToDevice));
  FUSEDOPT_NCCL_TRY(ncclAllReduce(d, d, values.size(), ncclFloat64, ncclMax, comm, stream));
  wait(stream, "the all-reduce of the results");
  FUSEDOPT_CUDA_TRY(cudaMemcpy(values.data(), d, values.size() * sizeof(double), cudaMemcpyDeviceToHost));
  FUSEDOPT_CUDA_TRY(cudaFree(d));
}

/// The largest |difference| between the parameters of `a` and `b` (the same tensors, other
/// layouts), on this rank.
float max_param_diff(configuration const& a, configuration const& b, std::size_t num_tensors, cudaStream_t stream)
{
  struct where {
    float const* data;
    std::int64_t n;
  };
  auto locate = [&](configuration const& c) {
    std::vector<where> w(num_tensors, where{nullptr, 0});
    for (std::size_t k = 0; k < c.tensors.size(); ++k) {
      for (std::size_t t = 0; t < c.tensors[k].size(); ++t) {
        w[c.tensors[k][t]] = where{c.memory[k]->params + c.layouts[k].offset(t), c.layouts[k].tensor_size(t)};
      }
    }
    return w;
  };
  auto const wa = locate(a), wb = locate(b);
  unsigned* out = device_zeros<unsigned>(1);
  for (std::size_t g = 0; g < num_tensors; ++g) {
    if (wa[g].n != wb[g].n) { fail("internal error: tensor " + std::to_string(g) + " has two sizes"); }
    if (wa[g].n == 0) { continue; }
    max_diff_kernel<<<blocks_for(wa[g].n), 256, 0, stream>>>(wa[g].data, wb[g].data, wa[g].n, out);
  }
  FUSEDOPT_CUDA_TRY(cudaGetLastError());
  wait(stream, "the comparison");
  unsigned bits = 0;
  FUSEDOPT_CUDA_TRY(cudaMemcpy(&bits, out, sizeof bits, cudaMemcpyDeviceToHost));
  FUSEDOPT_CUDA_TRY(cudaFree(out));
  float d = 0.f;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

std::string json_number(double x)
{
  if (!std::isfinite(x)) { return "null"; }
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.3f", x);
  return buffer;
}

}  // namespace

int main(int argc, char** argv)
{
  int const world = env_int("WORLD_SIZE", 1);
  int const rank = env_int("RANK", 0);
  try {
    settings const s = parse(argc, argv);
    int devices = 0;
    cudaError_t const probe = cudaGetDeviceCount(&devices);
    if (probe != cudaSuccess || devices == 0) {
      fail(std::string("no CUDA device (") + cudaGetErrorString(probe) + ")");
    }
    // NVLink multicast stays off (shared hosts: docs/sharded.md); the launcher sets it too.
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    int const device = env_int("LOCAL_RANK", rank) % devices;
    FUSEDOPT_CUDA_TRY(cudaSetDevice(device));
    cudaDeviceProp prop{};
    FUSEDOPT_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    char const* id_path = std::getenv("FUSEDOPT_NCCL_ID");
    ncclComm_t comm = nullptr;
    FUSEDOPT_NCCL_TRY(ncclCommInitRank(&comm, world, fusedopt_examples::shared_nccl_id(rank, world, id_path ? id_path : "/tmp/fusedopt_overlap.id"), rank));
    g_comm = comm;
    int nccl_version = 0;
    FUSEDOPT_NCCL_TRY(ncclGetVersion(&nccl_version));

    cudaStream_t compute = nullptr, communication = nullptr;  // communication: the default priority
    FUSEDOPT_CUDA_TRY(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    FUSEDOPT_CUDA_TRY(cudaStreamCreateWithFlags(&communication, cudaStreamNonBlocking));

    std::vector<std::int64_t> const sizes = gpt2_sizes(s);
    std::int64_t elements = 0;
    for (auto n : sizes) { elements += n; }
    if (rank == 0) {
      std::printf("sharded_overlap: sharded AdamW (fp32, averaged gradients) over GPT-2-shaped tensors: %lld elements in "
                  "%zu tensors (%d layers, d %lld, vocab %lld); %d ranks; %s; NCCL %d\n",
                  static_cast<long long>(elements), sizes.size(), s.layers, static_cast<long long>(s.dim),
                  static_cast<long long>(s.vocab), world, prop.name, nccl_version);
      std::fflush(stdout);
    }

    // The configurations: unbucketed first, then each bucket count.
    std::vector<configuration> configs;
    configs.push_back(make_configuration(sizes, 1, world, rank, comm, compute));
    for (int b : s.buckets) { configs.push_back(make_configuration(sizes, b, world, rank, comm, compute)); }
    wait(compute, "the plans' construction");

    // ---- check: every bucketed configuration gives the unbucketed parameters ----
    std::vector<double> diffs;
    if (s.check_steps > 0) {
      for (auto& c : configs) {
        initialise(c, rank, compute);
        for (int i = 0; i < s.check_steps; ++i) { enqueue(c, what::step, compute, communication); }
        wait(compute, "the check's steps");
      }
      for (std::size_t k = 1; k < configs.size(); ++k) {
        diffs.push_back(static_cast<double>(max_param_diff(configs[0], configs[k], sizes.size(), compute)));
      }
      for (auto& d : diffs) {
        if (std::isnan(d)) { d = INFINITY; }
      }
      if (!diffs.empty()) { max_over_ranks(diffs, comm, compute); }
    }
    for (auto& c : configs) { initialise(c, rank, compute); }  // the timed steps start afresh
    wait(compute, "the initialisation");

    double const copy_bps = copy_bandwidth(compute);

    // ---- timing: rounds x configurations x measurements ----
    std::vector<what> const measured_bucketed = {what::step, what::step_default_priority, what::collectives, what::update};
    std::vector<what> const measured_unbucketed = {what::step, what::collectives, what::update};
    // samples[config][measurement index][round] = the round's step times (us)
    std::vector<std::vector<std::vector<std::vector<double>>>> samples(configs.size());
    for (std::size_t k = 0; k < configs.size(); ++k) {
      samples[k].assign(4, std::vector<std::vector<double>>(static_cast<std::size_t>(s.rounds)));
    }
    for (int r = 0; r < s.rounds; ++r) {
      for (std::size_t k = 0; k < configs.size(); ++k) {
        auto const& list = k == 0 ? measured_unbucketed : measured_bucketed;
        for (what w : list) {
          samples[k][static_cast<std::size_t>(w)][static_cast<std::size_t>(r)] =
            time_steps(configs[k], w, s, compute, communication);
        }
      }
    }
    // Per configuration and measurement: the pooled median, then each round's; the max over ranks.
    std::vector<double> results;
    for (std::size_t k = 0; k < configs.size(); ++k) {
      for (std::size_t w = 0; w < 4; ++w) {
        std::vector<double> pooled;
        for (auto const& round : samples[k][w]) { pooled.insert(pooled.end(), round.begin(), round.end()); }
        results.push_back(pooled.empty() ? -1.0 : median(pooled));
        for (auto const& round : samples[k][w]) { results.push_back(round.empty() ? -1.0 : median(round)); }
      }
    }
    max_over_ranks(results, comm, compute);
    std::vector<double> copies{copy_bps};
    max_over_ranks(copies, comm, compute);  // the fastest rank's copy (they should agree)

    bool ok = true;
    for (double d : diffs) { ok = ok && d <= 1e-6; }

    if (rank == 0) {
      std::size_t const per_config = 4 * (1 + static_cast<std::size_t>(s.rounds));
      auto at = [&](std::size_t k, what w, int round = -1) {
        return results[k * per_config + static_cast<std::size_t>(w) * (1 + static_cast<std::size_t>(s.rounds)) +
                       static_cast<std::size_t>(round + 1)];
      };
      double const unbucketed_step = at(0, what::step);
      auto hidden = [&](std::size_t k, what step) {
        return (at(k, what::collectives) + at(k, what::update) - at(k, step)) / at(k, what::update);
      };
      std::printf("copy: %.0f GB/s (1 GiB device to device, bytes read + written, median of 20)\n", copies[0] * 1e-9);
      if (!diffs.empty()) {
        std::printf("check after %d steps from the same values: bucketed parameters - unbucketed, max |diff| over ranks:",
                    s.check_steps);
        for (std::size_t k = 1; k < configs.size(); ++k) { std::printf(" %s %.3g;", configs[k].label().c_str(), diffs[k - 1]); }
        std::printf(" %s\n", ok ? "ok" : "FAILED (over 1e-6)");
      }
      std::printf("\nmedians over %d steps x %d rounds, the max over the %d ranks (us); hidden = (collectives + update - "
                  "step) / update\n\n",
                  s.steps, s.rounds, world);
      std::printf("| configuration | tensors per bucket | step | step, comm stream at default priority | collectives alone | "
                  "update alone | update %% of copy | hidden | hidden (default priority) | speedup over unbucketed |\n");
      std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
      for (std::size_t k = 0; k < configs.size(); ++k) {
        auto const& c = configs[k];
        std::size_t lo = sizes.size(), hi = 0;
        for (auto const& b : c.tensors) {
          lo = std::min(lo, b.size());
          hi = std::max(hi, b.size());
        }
        double const update_pct = 100.0 * 28.0 * static_cast<double>(c.shard_elements()) /
                                  (at(k, what::update) * 1e-6) / copies[0];
        bool const bucketed = k > 0;
        std::printf("| %s | %zu-%zu | %.1f | %s | %.1f | %.1f | %.1f%% | %.1f%% | %s | %.2fx |\n", c.label().c_str(), lo, hi,
                    at(k, what::step), bucketed ? json_number(at(k, what::step_default_priority)).c_str() : "-",
                    at(k, what::collectives), at(k, what::update), update_pct, 100.0 * hidden(k, what::step),
                    bucketed ? (json_number(100.0 * hidden(k, what::step_default_priority)) + "%").c_str() : "-",
                    unbucketed_step / at(k, what::step));
      }
      std::printf("\n");
      for (std::size_t k = 0; k < configs.size(); ++k) {
        std::printf("OVERLAP %s: step %.1f us, collectives %.1f us, update %.1f us, hidden %.1f%% of the update%s, "
                    "%.2fx the unbucketed step\n",
                    configs[k].label().c_str(), at(k, what::step), at(k, what::collectives), at(k, what::update),
                    100.0 * hidden(k, what::step),
                    k > 0 ? (" (comm stream at the default priority: step " +
                             json_number(at(k, what::step_default_priority)) + " us, hidden " +
                             json_number(100.0 * hidden(k, what::step_default_priority)) + "%)")
                              .c_str()
                          : "",
                    unbucketed_step / at(k, what::step));
      }
      std::fflush(stdout);
      if (!s.out.empty()) {
        std::ofstream out(s.out);
        out << "{\n \"benchmark\": \"sharded_overlap\",\n \"device\": \"" << prop.name << "\",\n \"world_size\": " << world
            << ",\n \"nccl_version\": " << nccl_version << ",\n \"elements\": " << elements
            << ",\n \"tensors\": " << sizes.size() << ",\n \"layers\": " << s.layers << ",\n \"dim\": " << s.dim
            << ",\n \"vocab\": " << s.vocab << ",\n \"steps\": " << s.steps << ",\n \"warmup\": " << s.warmup
            << ",\n \"rounds\": " << s.rounds << ",\n \"copy_GBps\": " << json_number(copies[0] * 1e-9)
            << ",\n \"method\": \"CUDA events between consecutive steps on the compute stream, no host synchronisation "
               "between timed steps; median over steps x rounds, then the max over ranks; hidden = (collectives + "
               "update - step) / update\",\n \"check_steps\": "
            << s.check_steps << ",\n \"check_max_abs_diff\": [";
        for (std::size_t i = 0; i < diffs.size(); ++i) { out << (i ? ", " : "") << json_number(diffs[i]); }
        out << "],\n \"check_ok\": " << (ok ? "true" : "false") << ",\n \"configurations\": [\n";
        for (std::size_t k = 0; k < configs.size(); ++k) {
          auto const& c = configs[k];
          out << "  {\"label\": \"" << c.label() << "\", \"requested_buckets\": " << c.requested
              << ", \"buckets\": " << c.tensors.size() << ", \"shard_elements\": " << c.shard_elements()
              << ", \"flat_elements\": " << c.flat_elements();
          for (what w : {what::step, what::step_default_priority, what::collectives, what::update}) {
            if (k == 0 && w == what::step_default_priority) { continue; }
            out << ", \"" << name_of(w) << "_us\": " << json_number(at(k, w)) << ", \"" << name_of(w) << "_us_rounds\": [";
            for (int r = 0; r < s.rounds; ++r) { out << (r ? ", " : "") << json_number(at(k, w, r)); }
            out << "]";
          }
          out << ", \"hidden\": " << json_number(hidden(k, what::step));
          if (k > 0) { out << ", \"hidden_default_priority\": " << json_number(hidden(k, what::step_default_priority)); }
          out << ", \"speedup_over_unbucketed\": " << json_number(unbucketed_step / at(k, what::step)) << "}"
              << (k + 1 < configs.size() ? "," : "") << "\n";
        }
        out << " ]\n}\n";
        if (!out) { fail("cannot write " + s.out); }
      }
    }

    configs.clear();  // the plans and buffers, before the communicator
    FUSEDOPT_CUDA_TRY(cudaStreamDestroy(compute));
    FUSEDOPT_CUDA_TRY(cudaStreamDestroy(communication));
    g_comm = nullptr;
    FUSEDOPT_NCCL_TRY(ncclCommDestroy(comm));
    if (!ok) {
      std::fprintf(stderr, "sharded_overlap: rank %d: the bucketed parameters differ from the unbucketed ones\n", rank);
      return 1;
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "sharded_overlap: rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    if (g_comm != nullptr && !g_aborted) { (void)ncclCommAbort(g_comm); }
    return 1;
  }
  return 0;
}
