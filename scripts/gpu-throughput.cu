// A quick throughput check of the CUDA backend for scripts/gpu-check (the real benchmark suite
// is bench/cuda_bench): Adam fp32 on the issue's workloads W1-W4 as a fraction of the
// device-to-device copy bandwidth measured here, host time per plan.run, and tuning variants
// (block size, unrolling, chunk size, block cap) on W3 and W4 for docs/tuning.md.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -fmad=true -Iinclude -Ibuild/gpu/include -Ibench \
//        scripts/gpu-throughput.cu -o gpu-throughput && ./gpu-throughput [--variants | --plain | --shapes | --probe | --w1 | --q8 [W [bf16]] | --launch [W] | --passes]
#include <fusedopt/fusedopt.cuh>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
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
  std::int64_t padded = 0;  // elements of each arena

  explicit adam_memory(std::vector<std::int64_t> const& s) : sizes(s)
  {
    std::int64_t cursor = 0;
    for (auto n : sizes) {
      offsets.push_back(cursor);
      cursor += (n + 7) / 8 * 8;
    }
    auto const n = static_cast<std::size_t>(cursor);
    padded = cursor;
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

/// Adam with parameters and gradients of type P and 8-bit blockwise states (issue 16): the
/// states of each tensor are its own run of 16-byte units (blockwise8's storage).
template <class P>
struct q8_adam_memory {
  std::vector<std::int64_t> sizes;
  adam_memory<P, P> dense;  // params and grads (its fp32-or-P states are unused)
  fo::signed_q8* m = nullptr;
  fo::unsigned_q8* v = nullptr;
  std::vector<std::int64_t> first_unit;
  std::int64_t units = 0;

  explicit q8_adam_memory(std::vector<std::int64_t> const& s) : sizes(s), dense(s)
  {
    for (auto n : sizes) {
      first_unit.push_back(units);
      units += fo::signed_q8::units_for(n);
    }
    FUSEDOPT_CUDA_TRY(cudaMalloc(&m, static_cast<std::size_t>(units) * sizeof(fo::signed_q8)));
    FUSEDOPT_CUDA_TRY(cudaMalloc(&v, static_cast<std::size_t>(units) * sizeof(fo::unsigned_q8)));
    FUSEDOPT_CUDA_TRY(cudaMemset(m, 0, static_cast<std::size_t>(units) * sizeof(fo::signed_q8)));
    FUSEDOPT_CUDA_TRY(cudaMemset(v, 0, static_cast<std::size_t>(units) * sizeof(fo::unsigned_q8)));
  }
  ~q8_adam_memory()
  {
    (void)cudaFree(m);
    (void)cudaFree(v);
  }
  auto lists() const
  {
    fo::tensor_list<P> p;
    fo::tensor_list<P const> g;
    fo::tensor_list<fo::signed_q8> mm;
    fo::tensor_list<fo::unsigned_q8> vv;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      p.push_back(dense.params[0] + dense.offsets[i], sizes[i]);
      g.push_back(dense.params[1] + dense.offsets[i], sizes[i]);
      mm.push_back(m + first_unit[i], sizes[i]);
      vv.push_back(v + first_unit[i], sizes[i]);
    }
    return fo::bind(slot::param = p, slot::grad = g, slot::exp_avg = mm, slot::exp_avg_sq = vv);
  }
  std::int64_t elements() const { return dense.elements(); }

  /// What a step writes: the parameters and both states' storage (device address, bytes).
  std::array<std::pair<void*, std::size_t>, 3> written() const
  {
    std::size_t const states = static_cast<std::size_t>(units) * sizeof(fo::signed_q8);
    return {{{dense.params[0], static_cast<std::size_t>(dense.padded) * sizeof(P)}, {m, states}, {v, states}}};
  }
  /// Those bytes, on the host.
  std::vector<unsigned char> snapshot() const
  {
    std::vector<unsigned char> bytes;
    for (auto const& [at, n] : written()) {
      bytes.resize(bytes.size() + n);
      FUSEDOPT_CUDA_TRY(cudaMemcpy(bytes.data() + bytes.size() - n, at, n, cudaMemcpyDeviceToHost));
    }
    return bytes;
  }
  void restore(std::vector<unsigned char> const& bytes) const
  {
    std::size_t offset = 0;
    for (auto const& [at, n] : written()) {
      FUSEDOPT_CUDA_TRY(cudaMemcpy(at, bytes.data() + offset, n, cudaMemcpyHostToDevice));
      offset += n;
    }
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

/// Read + write bandwidth of a device-to-device copy of `bytes` (2 GiB: the yardstick).
double copy_bandwidth(std::size_t bytes = std::size_t{1} << 31)
{
  void *a = nullptr, *b = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&a, bytes));
  FUSEDOPT_CUDA_TRY(cudaMalloc(&b, bytes));
  FUSEDOPT_CUDA_TRY(cudaMemset(a, 1, bytes));
  int const per_batch = bytes >= (std::size_t{1} << 30) ? 5 : 50;
  double const s =
    time_gpu([&] { FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, per_batch);
  FUSEDOPT_CUDA_TRY(cudaFree(a));
  FUSEDOPT_CUDA_TRY(cudaFree(b));
  return 2.0 * static_cast<double>(bytes) / s;  // read + write
}

/// The step the timed plans run (bias corrections of 1 - beta^step): FUSEDOPT_GT_STEP, 3 by
/// default. A training run sits at thousands to millions, where the rule's prepare takes longer.
std::int64_t const timed_step = [] {
  char const* env = std::getenv("FUSEDOPT_GT_STEP");
  return env != nullptr ? std::atoll(env) : std::int64_t{3};
}();

/// The update's shapes the timed plans take: FUSEDOPT_GT_MEMORY=fast or slow forces the
/// policy's shapes for that memory speed (cuda::options::memory), else the device decides.
fo::cuda::memory_speed const timed_memory = [] {
  char const* env = std::getenv("FUSEDOPT_GT_MEMORY");
  if (env == nullptr) { return fo::cuda::memory_speed::automatic; }
  if (std::strcmp(env, "fast") == 0) { return fo::cuda::memory_speed::fast; }
  if (std::strcmp(env, "slow") == 0) { return fo::cuda::memory_speed::slow; }
  std::fprintf(stderr, "FUSEDOPT_GT_MEMORY must be fast or slow, not '%s'\n", env);
  std::exit(2);
}();

fo::cuda::options timed_options()
{
  fo::cuda::options opts;
  opts.memory = timed_memory;
  return opts;
}

/// A variant of the default tuning policy (the members not named here are the default's).
template <int Threads, int Bytes, bool StreamLoads, bool StreamStores, int MinBlocks = 1, int QuantizedBlocks = 4,
          bool Lookahead = true, int PassBytes = fo::cuda::detail::default_policy::pass_bytes_per_lane,
          int LookaheadBlocks = 1, bool StagedNext = false, bool TailsInLanes = false>
struct policy : fo::cuda::detail::default_policy {
  static constexpr int pass_bytes_per_lane = PassBytes;
  static constexpr int block_threads = Threads;
  static constexpr int bytes_per_slot = Bytes;
  static constexpr fo::cuda::detail::plain_shape plain_fast_update(int) { return {Threads, Bytes}; }  // on any GPU
  static constexpr bool streaming_loads = StreamLoads;
  static constexpr bool streaming_stores = StreamStores;
  static constexpr int min_blocks_per_sm = MinBlocks;
  static constexpr fo::cuda::detail::quantized_shape quantized_update(std::size_t, bool)
  {
    return {QuantizedBlocks, Lookahead, LookaheadBlocks, StagedNext, TailsInLanes};
  }
};

/// Times a plan with policy P (block size, unrolling) and the given chunk and block cap: the
/// policy reaches the chunking and every kernel through make_plan<P>.
template <class P, class Rule, class... B>
double time_variant(Rule const& rule, fo::bound_lists<B...> const& lists, std::int64_t chunk, std::int64_t max_blocks,
                    int per_batch, fo::cuda::l2_eviction eviction = fo::cuda::l2_eviction::automatic,
                    bool dependent_launch = true, std::int64_t step = timed_step)
{
  fo::cuda::options opts = timed_options();
  opts.chunk_elements = chunk;
  opts.max_blocks = max_blocks;
  opts.eviction = eviction;
  opts.dependent_launch = dependent_launch;
  auto const plan = fo::cuda::make_plan<P>(lists, opts);
  return time_gpu([&] { plan.run(rule, fo::step_info{step}); }, per_batch);
}

/// Bytes a step moves: the library's own count for the rule and the bound lists.
template <class Rule, class Lists>
double bytes_of(Rule const&, Lists const&, std::int64_t elements)
{
  return static_cast<double>(fo::bytes_per_element_v<Rule, Lists>) * static_cast<double>(elements);
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


// ---- --probe: yardsticks for one huge tensor (issue 13). Hand-written kernels that index by
// blockIdx (no chunk or tensor table), so that the library's kernel can be compared with the
// same loads, stores and arithmetic minus its table lookups, and with a pure data mover of the
// same byte mix (4 reads, 3 writes) that does no arithmetic at all.

template <bool Stream, class V>
__device__ __forceinline__ V load_v(V const* p)
{
  if constexpr (Stream) { return __ldcs(p); } else { return *p; }
}
template <bool Stream, class V>
__device__ __forceinline__ void store_v(V* p, V v)
{
  if constexpr (Stream) { __stcs(p, v); } else { *p = v; }
}

struct adam_consts {
  float lr, beta1, beta2, eps, bc1, bc2_sqrt;
};

__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v, adam_consts const& c)
{
  m = c.beta1 * m + (1.f - c.beta1) * g;
  v = c.beta2 * v + (1.f - c.beta2) * g * g;
  p -= c.lr / c.bc1 * m / (sqrtf(v) / c.bc2_sqrt + c.eps);
}

/// Adam fp32 on the Threads * Vectors float4 of a block starting at float4 `base`: thread t
/// takes vectors t, t + Threads, ... Math = false moves the same bytes without arithmetic
/// (p <- p + g, m <- v, v <- m). Predicated: each access checks its vector against `vectors`
/// (as the library's last iteration of a chunk does).
template <int Threads, int Vectors, bool Stream, bool Math, bool Predicated = false>
__device__ __forceinline__ void adam_block(float4* p, float4 const* g, float4* m, float4* v, std::int64_t base,
                                           std::int64_t vectors, adam_consts const& c)
{
  bool ok[Vectors];
#pragma unroll
  for (int u = 0; u < Vectors; ++u) { ok[u] = !Predicated || u * Threads + threadIdx.x < vectors; }
  base += threadIdx.x;
  float4 rp[Vectors], rg[Vectors], rm[Vectors], rv[Vectors];
#pragma unroll
  for (int u = 0; u < Vectors; ++u) { if (ok[u]) { rp[u] = load_v<Stream>(p + base + u * Threads); } }
#pragma unroll
  for (int u = 0; u < Vectors; ++u) { if (ok[u]) { rg[u] = load_v<Stream>(g + base + u * Threads); } }
#pragma unroll
  for (int u = 0; u < Vectors; ++u) { if (ok[u]) { rm[u] = load_v<Stream>(m + base + u * Threads); } }
#pragma unroll
  for (int u = 0; u < Vectors; ++u) { if (ok[u]) { rv[u] = load_v<Stream>(v + base + u * Threads); } }
#pragma unroll
  for (int u = 0; u < Vectors; ++u) {
    if (!ok[u]) { continue; }
    if constexpr (Math) {
      adam_element(rp[u].x, rg[u].x, rm[u].x, rv[u].x, c);
      adam_element(rp[u].y, rg[u].y, rm[u].y, rv[u].y, c);
      adam_element(rp[u].z, rg[u].z, rm[u].z, rv[u].z, c);
      adam_element(rp[u].w, rg[u].w, rm[u].w, rv[u].w, c);
    } else {
      rp[u] = float4{rp[u].x + rg[u].x, rp[u].y + rg[u].y, rp[u].z + rg[u].z, rp[u].w + rg[u].w};
      float4 const t = rm[u];
      rm[u] = rv[u];
      rv[u] = t;
    }
    store_v<Stream>(p + base + u * Threads, rp[u]);
    store_v<Stream>(m + base + u * Threads, rm[u]);
    store_v<Stream>(v + base + u * Threads, rv[u]);
  }
}

/// Adam on one tensor (its size a multiple of Threads * Vectors * 4), block b at float4
/// b * Threads * Vectors: no table.
template <int Threads, int Vectors, bool Stream, bool Math, bool Pdl = false>
__global__ void __launch_bounds__(Threads) raw_adam(float4* p, float4 const* g, float4* m, float4* v, adam_consts c)
{
  if constexpr (Pdl) { fo::cuda::detail::await_predecessor(); }
  adam_block<Threads, Vectors, Stream, Math>(p, g, m, v, blockIdx.x * std::int64_t{Threads * Vectors},
                                             Threads * Vectors, c);
}

/// The same with the library's block prologue: the block reads its chunk (16 bytes) from a
/// table in device memory, then its tensor's four base pointers, before the first data load.
struct raw_chunk {
  std::int64_t begin;  // in float4
  std::int32_t tensor, vectors;
};
struct raw_tensor {
  float4* p;
  float4 const* g;
  float4* m;
  float4* v;
};
template <int Threads, int Vectors, bool Stream, bool Predicated, bool Pdl = false>
__global__ void __launch_bounds__(Threads)
  raw_adam_table(raw_chunk const* chunks, raw_tensor const* tensors, adam_consts c)
{
  if constexpr (Pdl) { fo::cuda::detail::await_predecessor(); }
  raw_chunk const ch = chunks[blockIdx.x];
  raw_tensor const t = tensors[ch.tensor];
  adam_block<Threads, Vectors, Stream, true, Predicated>(t.p, t.g, t.m, t.v, ch.begin, ch.vectors, c);
}

/// A copy kernel of the same shape: the roofline of a 1:1 read/write mix through the SMs.
template <int Threads, int Vectors, bool Stream, bool Pdl = false>
__global__ void __launch_bounds__(Threads) raw_copy(float4* out, float4 const* in)
{
  if constexpr (Pdl) { fo::cuda::detail::await_predecessor(); }
  std::int64_t const base = blockIdx.x * std::int64_t{Threads * Vectors} + threadIdx.x;
  float4 r[Vectors];
#pragma unroll
  for (int u = 0; u < Vectors; ++u) { r[u] = load_v<Stream>(in + base + u * Threads); }
#pragma unroll
  for (int u = 0; u < Vectors; ++u) { store_v<Stream>(out + base + u * Threads, r[u]); }
}

adam_consts const probe_consts{1e-3f, 0.9f, 0.999f, 1e-8f, 0.271f, 0.0547f};

/// Pdl: launched with programmatic dependent launch, as the library's kernels are on sm_90.
template <int Threads, int Vectors, bool Stream, bool Math, bool Pdl = false>
double time_raw_adam(adam_memory<float, float> const& mem, std::int64_t n, int per_batch = 10)
{
  auto* p = reinterpret_cast<float4*>(mem.params[0]);
  auto const* g = reinterpret_cast<float4 const*>(mem.params[1]);
  auto* m = reinterpret_cast<float4*>(mem.states[0]);
  auto* v = reinterpret_cast<float4*>(mem.states[1]);
  auto const blocks = static_cast<unsigned>(n / (std::int64_t{Threads} * Vectors * 4));
  return time_gpu(
    [&] {
      fo::cuda::detail::launch_kernel(&raw_adam<Threads, Vectors, Stream, Math, Pdl>, dim3(blocks), dim3(Threads),
                                      nullptr, Pdl, p, g, m, v, probe_consts);
    },
    per_batch);
}

/// The table-driven raw kernel; the last `split_chunks` chunks are cut into `split` pieces each
/// (shorter blocks for the end of the launch, when the grid drains).
template <int Threads, int Vectors, bool Stream, bool Predicated, bool Pdl = false>
double time_raw_adam_table(adam_memory<float, float> const& mem, std::int64_t n, int per_batch = 10,
                           std::int64_t split_chunks = 0, int split = 1)
{
  std::int64_t const per_block = std::int64_t{Threads} * Vectors;  // float4 per chunk
  std::int64_t const whole = n / (per_block * 4);
  std::vector<raw_chunk> chunks;
  for (std::int64_t b = 0; b < whole; ++b) {
    if (b < whole - split_chunks) {
      chunks.push_back(raw_chunk{b * per_block, 0, static_cast<std::int32_t>(per_block)});
      continue;
    }
    for (int k = 0; k < split; ++k) {
      chunks.push_back(raw_chunk{b * per_block + k * per_block / split, 0, static_cast<std::int32_t>(per_block / split)});
    }
  }
  raw_tensor const tensor{reinterpret_cast<float4*>(mem.params[0]), reinterpret_cast<float4 const*>(mem.params[1]),
                          reinterpret_cast<float4*>(mem.states[0]), reinterpret_cast<float4*>(mem.states[1])};
  raw_chunk* d_chunks = nullptr;
  raw_tensor* d_tensor = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&d_chunks, chunks.size() * sizeof(raw_chunk)));
  FUSEDOPT_CUDA_TRY(cudaMalloc(&d_tensor, sizeof(raw_tensor)));
  FUSEDOPT_CUDA_TRY(cudaMemcpy(d_chunks, chunks.data(), chunks.size() * sizeof(raw_chunk), cudaMemcpyHostToDevice));
  FUSEDOPT_CUDA_TRY(cudaMemcpy(d_tensor, &tensor, sizeof tensor, cudaMemcpyHostToDevice));
  auto const blocks = static_cast<unsigned>(chunks.size());
  raw_chunk const* const table = d_chunks;
  raw_tensor const* const tensors = d_tensor;
  double const s = time_gpu(
    [&] {
      fo::cuda::detail::launch_kernel(&raw_adam_table<Threads, Vectors, Stream, Predicated, Pdl>, dim3(blocks),
                                      dim3(Threads), nullptr, Pdl, table, tensors, probe_consts);
    },
    per_batch);
  FUSEDOPT_CUDA_TRY(cudaFree(d_chunks));
  FUSEDOPT_CUDA_TRY(cudaFree(d_tensor));
  return s;
}

template <int Threads, int Vectors, bool Stream, bool Pdl = false>
double time_raw_copy(float* a, float* b, std::int64_t n, int per_batch = 10)
{
  auto const blocks = static_cast<unsigned>(n / (std::int64_t{Threads} * Vectors * 4));
  auto* const out = reinterpret_cast<float4*>(b);
  auto const* const in = reinterpret_cast<float4 const*>(a);
  return time_gpu(
    [&] {
      fo::cuda::detail::launch_kernel(&raw_copy<Threads, Vectors, Stream, Pdl>, dim3(blocks), dim3(Threads), nullptr,
                                      Pdl, out, in);
    },
    per_batch);
}

/// A data mover of the 8-bit AdamW's byte mix (fp32 params read and written, fp32 grads read,
/// two code arrays read and written, one scale of each per 256 elements read and written), in
/// the library's access pattern: a warp takes Blocks consecutive blocks of 256 elements, lane l
/// elements 4 l .. + 3 and 128 + 4 l .. + 3 of each (two 16-byte accesses per fp32 slot) and
/// its 8 codes of each state (one 8-byte access), lane 0 the scales; every load of the warp's
/// blocks is issued before the first store. No table, next to no arithmetic: what a kernel of
/// this mix reaches without the update's work.
template <int Threads, int Blocks>
__global__ void __launch_bounds__(Threads)
  raw_q8_mover(float4* p, float4 const* g, uint2* m, uint2* v, float* m_scales, float* v_scales)
{
  std::int64_t const first = (blockIdx.x * std::int64_t{Threads} + threadIdx.x) / 32 * Blocks;
  int const lane = static_cast<int>(threadIdx.x % 32);
  float4 p0[Blocks], p1[Blocks], g0[Blocks], g1[Blocks];
  uint2 cm[Blocks], cv[Blocks];
  float sm[Blocks] = {}, sv[Blocks] = {};
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
    std::int64_t const w = first + b;
    p0[b] = p[w * 64 + lane], p1[b] = p[w * 64 + 32 + lane];
    g0[b] = g[w * 64 + lane], g1[b] = g[w * 64 + 32 + lane];
    cm[b] = m[w * 32 + lane], cv[b] = v[w * 32 + lane];
    if (lane == 0) { sm[b] = m_scales[w], sv[b] = v_scales[w]; }
  }
#pragma unroll
  for (int b = 0; b < Blocks; ++b) {
    std::int64_t const w = first + b;
    p[w * 64 + lane] = float4{p0[b].x + g0[b].x, p0[b].y + g0[b].y, p0[b].z + g0[b].z, p0[b].w + g0[b].w};
    p[w * 64 + 32 + lane] = float4{p1[b].x + g1[b].x, p1[b].y + g1[b].y, p1[b].z + g1[b].z, p1[b].w + g1[b].w};
    m[w * 32 + lane] = uint2{cv[b].x ^ 1u, cv[b].y};
    v[w * 32 + lane] = cm[b];
    if (lane == 0) { m_scales[w] = sv[b] + 1.f, v_scales[w] = sm[b]; }
  }
}

/// The mover over n elements (a multiple of Threads * 8 * Blocks): codes at the start of each
/// state's arena, scales after them (every array 256-byte aligned).
template <int Threads, int Blocks>
double time_raw_q8_mover(adam_memory<float, float> const& mem, std::int64_t n)
{
  auto* const m = reinterpret_cast<unsigned char*>(mem.states[0]);
  auto* const v = reinterpret_cast<unsigned char*>(mem.states[1]);
  auto const blocks = static_cast<unsigned>(n / (std::int64_t{Threads} * 8 * Blocks));
  return time_gpu(
    [&] {
      raw_q8_mover<Threads, Blocks><<<blocks, Threads>>>(
        reinterpret_cast<float4*>(mem.params[0]), reinterpret_cast<float4 const*>(mem.params[1]),
        reinterpret_cast<uint2*>(m), reinterpret_cast<uint2*>(v), reinterpret_cast<float*>(m + n),
        reinterpret_cast<float*>(v + n));
    },
    10);
}

/// W4 (one tensor of 2^28 floats): the library's kernel beside table-free kernels of the same
/// shape, a data mover of Adam's byte mix and copy kernels, every figure against the D2D copy.
int probe(double copy)
{
  auto const w4 = fb::all_workloads().back();
  std::int64_t const n = w4.sizes.front();
  adam_memory<float, float> memory(w4.sizes);
  double const adam_bytes = 28.0 * static_cast<double>(n);
  auto row = [&](char const* label, double s, double bytes) { print({std::string("W4 ") + label, s, bytes, copy}); };
  auto const lists = memory.lists();
  fo::rules::adam const rule;
  auto library = [&](char const* label, auto policy_tag, std::int64_t chunk,
                     fo::cuda::l2_eviction eviction = fo::cuda::l2_eviction::automatic) {
    using P = decltype(policy_tag);
    row(label, time_variant<P>(rule, lists, chunk, 0, 10, eviction), adam_bytes);
  };
  auto const first = fo::cuda::l2_eviction::evict_first;
  fo::cuda::detail::default_policy const standard{};
  library("library default (t128 b64 c2048, automatic)", standard, 2048);
  library("library t128 b64 c2048 evict-first", standard, 2048, first);
  library("library t128 b32 c2048", policy<128, 32, true, true>{}, 2048);
  library("library t256 b32 c2048", policy<256, 32, true, true>{}, 2048);
  library("library t256 b16 c2048", policy<256, 16, true, true>{}, 2048);
  library("library t256 b16 c4096", policy<256, 16, true, true>{}, 4096);
  library("library t512 b16 c4096", policy<512, 16, true, true>{}, 4096);
  row("raw adam t128 v4 .cs", time_raw_adam<128, 4, true, true>(memory, n), adam_bytes);
  row("raw adam t128 v4 plain", time_raw_adam<128, 4, false, true>(memory, n), adam_bytes);
  row("raw adam t256 v4 plain", time_raw_adam<256, 4, false, true>(memory, n), adam_bytes);
  row("raw adam t256 v2 plain", time_raw_adam<256, 2, false, true>(memory, n), adam_bytes);
  row("raw adam t256 v1 plain", time_raw_adam<256, 1, false, true>(memory, n), adam_bytes);
  row("raw adam t512 v1 plain", time_raw_adam<512, 1, false, true>(memory, n), adam_bytes);
  row("raw adam t128 v4 .cs + table", time_raw_adam_table<128, 4, true, false>(memory, n), adam_bytes);
  row("raw adam t256 v1 plain + table", time_raw_adam_table<256, 1, false, false>(memory, n), adam_bytes);
  row("raw 4r3w mover t128 v4 plain", time_raw_adam<128, 4, false, false>(memory, n), adam_bytes);
  row("raw 4r3w mover t256 v1 plain", time_raw_adam<256, 1, false, false>(memory, n), adam_bytes);
  library("library default again", fo::cuda::detail::default_policy{}, 2048);
  double const q8_bytes = (16.0 + 16.0 / 256) * static_cast<double>(n);
  row("raw 8-bit mover t128, 1 block a warp (16.06 B/element)", time_raw_q8_mover<128, 1>(memory, n), q8_bytes);
  row("raw 8-bit mover t128, 2 blocks a warp", time_raw_q8_mover<128, 2>(memory, n), q8_bytes);
  row("raw 8-bit mover t128, 4 blocks a warp", time_raw_q8_mover<128, 4>(memory, n), q8_bytes);
  row("raw 8-bit mover t256, 2 blocks a warp", time_raw_q8_mover<256, 2>(memory, n), q8_bytes);
  double const copy_bytes = 8.0 * static_cast<double>(n);
  row("raw copy t128 v4 plain", time_raw_copy<128, 4, false>(memory.params[0], memory.states[0], n), copy_bytes);
  row("raw copy t256 v1 plain", time_raw_copy<256, 1, false>(memory.params[0], memory.states[0], n), copy_bytes);
  return 0;
}

/// Where evict-first stops paying: Adam fp32 with each L2 eviction priority on one tensor
/// and on lists of 1M-element tensors of growing total size.
int eviction_sweep(double copy)
{
  auto const first = fo::cuda::l2_eviction::evict_first;
  auto const normal = fo::cuda::l2_eviction::evict_normal;
  auto one = [&](std::string const& name, std::vector<std::int64_t> const& sizes) {
    adam_memory<float, float> memory(sizes);
    auto const lists = memory.lists();
    fo::rules::adam const rule;
    double const bytes = bytes_of(rule, lists, memory.elements());
    double const mb = 16.0 * static_cast<double>(memory.elements()) / 1e6;
    int const pb = std::max(5, static_cast<int>(2e9 / bytes));
    using P = fo::cuda::detail::default_policy;
    double const f = time_variant<P>(rule, lists, 2048, 0, pb, first);
    double const nn = time_variant<P>(rule, lists, 2048, 0, pb, normal);
    std::printf("sweep %-28s %8.0f MB bound  evict-first %5.1f%%  evict-normal %5.1f%%  -> %s\n", name.c_str(), mb,
                100.0 * bytes / f / copy, 100.0 * bytes / nn / copy, f < nn ? "first" : "normal");
  };
  for (int log2 = 21; log2 <= 27; ++log2) { one("1 x 2^" + std::to_string(log2), {std::int64_t{1} << log2}); }
  for (int count : {4, 10, 20, 40, 80, 160}) {
    one(std::to_string(count) + " x 2^20", std::vector<std::int64_t>(static_cast<std::size_t>(count), std::int64_t{1} << 20));
  }
  for (int count : {500, 2000, 8000}) {
    one(std::to_string(count) + " x 2^14", std::vector<std::int64_t>(static_cast<std::size_t>(count), std::int64_t{1} << 14));
  }
  return 0;
}

/// Adam whose per-step constants were formed on the host (what the per-thread `prepare` of
/// the library's kernels costs: two integer powers, a root and a division in double).
struct adam_preformed : fo::rules::adam {
  using prepared_t = decltype(std::declval<fo::rules::adam const&>().prepare(std::declval<fo::step_info const&>()));
  prepared_t formed;
  explicit adam_preformed(fo::step_info const& step) : formed(fo::rules::adam{}.prepare(step)) {}
  FUSEDOPT_HOST_DEVICE prepared_t prepare(fo::step_info const&) const { return formed; }
};

/// --w1: what a step of W1's bytes (Adam fp32, 10 x 2^20 elements, 294 MB) reaches in any
/// shape we know, against the 2 GiB copy: the library on W1's ten tensors and on one tensor of
/// their size, table-free kernels of several shapes with and without programmatic dependent
/// launch, the last blocks of a launch cut shorter, copy kernels and a D2D copy of those bytes.
int w1_ceiling(double copy, int sms)
{
  auto const w1 = fb::w1();
  int const pb = 50;
  fo::rules::adam const rule;
  using P = fo::cuda::detail::default_policy;
  adam_memory<float, float> ten(w1.sizes);
  std::int64_t const n = ten.elements();
  double const bytes = 28.0 * static_cast<double>(n);
  auto row = [&](std::string const& label, double s, double b) { print({"W1 " + label, s, b, copy}); };
  auto const ten_lists = ten.lists();
  row("library, 10 tensors", time_variant<P>(rule, ten_lists, 0, 0, pb), bytes);
  row("library, 10 tensors, ordinary launch", time_variant<P>(rule, ten_lists, 0, 0, pb, fo::cuda::l2_eviction::automatic, false), bytes);
  auto const automatic = fo::cuda::l2_eviction::automatic;
  row("library, 10 tensors, step 100000", time_variant<P>(rule, ten_lists, 0, 0, pb, automatic, true, 100000), bytes);
  adam_preformed const preformed{fo::step_info{3}};
  row("library, 10 tensors, constants from the host", time_variant<P>(preformed, ten_lists, 0, 0, pb), bytes);
  using small = policy<256, 16, true, true>;
  row("library t256 b16 c1024", time_variant<small>(rule, ten_lists, 1024, 0, pb), bytes);
  row("library t256 b16 c1024, constants from the host", time_variant<small>(preformed, ten_lists, 1024, 0, pb), bytes);
  row("library t256 b16 c1024, step 100000", time_variant<small>(rule, ten_lists, 1024, 0, pb, automatic, true, 100000),
      bytes);
  // Six blocks of 256 per SM (40 registers, no spill since stop 36): the table-free t256 v1's
  // occupancy (38 registers).
  row("library t256 b16 c1024 6/SM", time_variant<policy<256, 16, true, true, 6>>(rule, ten_lists, 1024, 0, pb), bytes);
  row("library t256 b16 c1024 5/SM", time_variant<policy<256, 16, true, true, 5>>(rule, ten_lists, 1024, 0, pb), bytes);
  {
    adam_memory<float, float> w3(fb::w3().sizes);
    auto const lists = w3.lists();
    double const w3_bytes = 28.0 * static_cast<double>(w3.elements());
    print({"W3 library", time_variant<P>(rule, lists, 0, 0, pb), w3_bytes, copy});
    print({"W3 library, step 100000", time_variant<P>(rule, lists, 0, 0, pb, automatic, true, 100000), w3_bytes, copy});
    adam_preformed const at_100k{fo::step_info{100000}};
    print({"W3 library, step 100000 constants from the host", time_variant<P>(at_100k, lists, 0, 0, pb, automatic, true, 100000), w3_bytes, copy});
  }
  adam_memory<float, float> one({n});
  auto const one_lists = one.lists();
  row("library, 1 tensor", time_variant<P>(rule, one_lists, 0, 0, pb), bytes);
  row("raw t128 v4 .cs", time_raw_adam<128, 4, true, true>(one, n, pb), bytes);
  row("raw t128 v4 .cs, pdl", time_raw_adam<128, 4, true, true, true>(one, n, pb), bytes);
  row("raw t128 v4 plain, pdl", time_raw_adam<128, 4, false, true, true>(one, n, pb), bytes);
  row("raw t256 v2 .cs, pdl", time_raw_adam<256, 2, true, true, true>(one, n, pb), bytes);
  row("raw t256 v1 plain", time_raw_adam<256, 1, false, true>(one, n, pb), bytes);
  row("raw t256 v1 plain, pdl", time_raw_adam<256, 1, false, true, true>(one, n, pb), bytes);
  row("raw t256 v1 .cs, pdl", time_raw_adam<256, 1, true, true, true>(one, n, pb), bytes);
  row("raw t512 v1 .cs, pdl", time_raw_adam<512, 1, true, true, true>(one, n, pb), bytes);
  row("raw t128 v2 .cs, pdl", time_raw_adam<128, 2, true, true, true>(one, n, pb), bytes);
  row("raw t128 v1 .cs, pdl", time_raw_adam<128, 1, true, true, true>(one, n, pb), bytes);
  row("raw table t256 v1 .cs unpredicated, pdl", time_raw_adam_table<256, 1, true, false, true>(one, n, pb), bytes);
  row("raw table t128 v4 .cs unpredicated, pdl", time_raw_adam_table<128, 4, true, false, true>(one, n, pb), bytes);
  row("raw mover t128 v4 .cs, pdl", time_raw_adam<128, 4, true, false, true>(one, n, pb), bytes);
  std::int64_t const resident = 4 * std::int64_t{sms};  // t128 v4 blocks resident at once
  row("raw table t128 v4 .cs, pdl", time_raw_adam_table<128, 4, true, true, true>(one, n, pb), bytes);
  row("raw table, last wave in halves", time_raw_adam_table<128, 4, true, true, true>(one, n, pb, resident, 2), bytes);
  row("raw table, last wave in quarters", time_raw_adam_table<128, 4, true, true, true>(one, n, pb, resident, 4), bytes);
  row("raw table, last 2 waves in quarters",
      time_raw_adam_table<128, 4, true, true, true>(one, n, pb, 2 * resident, 4), bytes);
  double const same = copy_bandwidth(static_cast<std::size_t>(bytes / 2));
  std::printf("%-44s %10.1f us %8.3f TB/s %7.1f%% of copy\n", "W1 D2D copy of the bytes", bytes / same * 1e6,
              same * 1e-12, 100.0 * same / copy);
  std::int64_t const half = static_cast<std::int64_t>(bytes / 2 / sizeof(float)) / 4096 * 4096;
  float *a = nullptr, *b = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&a, static_cast<std::size_t>(half) * sizeof(float)));
  FUSEDOPT_CUDA_TRY(cudaMalloc(&b, static_cast<std::size_t>(half) * sizeof(float)));
  FUSEDOPT_CUDA_TRY(cudaMemset(a, 0, static_cast<std::size_t>(half) * sizeof(float)));
  double const copy_bytes = 8.0 * static_cast<double>(half);
  row("copy kernel t256 v1 plain", time_raw_copy<256, 1, false>(a, b, half, pb), copy_bytes);
  row("copy kernel t256 v1 plain, pdl", time_raw_copy<256, 1, false, true>(a, b, half, pb), copy_bytes);
  row("copy kernel t128 v4 .cs, pdl", time_raw_copy<128, 4, true, true>(a, b, half, pb), copy_bytes);
  FUSEDOPT_CUDA_TRY(cudaFree(a));
  FUSEDOPT_CUDA_TRY(cudaFree(b));
  row("library, 10 tensors, again", time_variant<P>(rule, ten_lists, 0, 0, pb), bytes);
  return 0;
}

}  // namespace

/// --launch: each workload with programmatic dependent launch on and off (the same kernels),
/// back to back, beside a D2D copy that moves the step's bytes (half read, half written): what
/// a copy of that size reaches against the 2 GiB yardstick.
template <class Rule, class Lists>
void launch_modes(std::string const& name, Rule const& rule, Lists const& lists, double bytes, double copy, int pb)
{
  using P = fo::cuda::detail::default_policy;
  auto const normal = fo::cuda::l2_eviction::automatic;
  double const on = time_variant<P>(rule, lists, 0, 0, pb, normal, true);
  double const off = time_variant<P>(rule, lists, 0, 0, pb, normal, false);
  double const on_again = time_variant<P>(rule, lists, 0, 0, pb, normal, true);
  print({name + " dependent launch", std::min(on, on_again), bytes, copy});
  print({name + " ordinary launch", off, bytes, copy});
}

/// LAMB as the reducing cases time it: a reduction pass reading all four slots (16 bytes per
/// element), the fold of its partials, the update.
fo::rules::lamb timed_lamb()
{
  fo::rules::lamb lamb;
  lamb.weight_decay = 1e-2;
  return lamb;
}

/// clip_by_global_norm (max_norm 1) before AdamW: a reduction pass over the gradients (2 more
/// bytes per element for bf16), the fold, the update; the norm goes to a device double owned here.
class clipped_adamw {
 public:
  clipped_adamw() { FUSEDOPT_CUDA_TRY(cudaMalloc(&total_norm_, sizeof(double))); }
  clipped_adamw(clipped_adamw const&) = delete;
  clipped_adamw& operator=(clipped_adamw const&) = delete;
  ~clipped_adamw() { (void)cudaFree(total_norm_); }
  auto rule() const
  {
    fo::rules::clip_by_global_norm clip;
    clip.total_norm = total_norm_;
    return fo::chain(clip, fo::rules::adamw{});
  }

 private:
  double* total_norm_ = nullptr;
};

/// --passes: the reducing steps (LAMB fp32, clip + AdamW bf16) with a reduction pass loading
/// 64 to 512 bytes per lane and iteration (Policy::pass_bytes_per_lane).
template <class Rule, class Lists>
void pass_shapes(std::string const& name, Rule const& rule, Lists const& lists, double bytes, double copy, int pb)
{
  using fo::cuda::detail::default_policy;
  constexpr int t = default_policy::block_threads, b = default_policy::bytes_per_slot;
  auto run = [&](char const* label, double s) { print({name + " " + label, s, bytes, copy}); };
  run("pass 64 B/lane", time_variant<policy<t, b, true, true, 1, 4, true, 64>>(rule, lists, 0, 0, pb));
  run("pass 128 B/lane", time_variant<policy<t, b, true, true, 1, 4, true, 128>>(rule, lists, 0, 0, pb));
  run("pass 256 B/lane", time_variant<policy<t, b, true, true, 1, 4, true, 256>>(rule, lists, 0, 0, pb));
  run("pass 512 B/lane", time_variant<policy<t, b, true, true, 1, 4, true, 512>>(rule, lists, 0, 0, pb));
}

int pass_sweep(double copy)
{
  for (auto const& w : fb::all_workloads()) {
    int const pb = w.name == "W4" ? 10 : 50;
    {
      adam_memory<float, float> memory(w.sizes);
      auto const lists = memory.lists();
      auto const lamb = timed_lamb();
      pass_shapes("lamb fp32 " + w.name, lamb, lists, bytes_of(lamb, lists, memory.elements()), copy, pb);
    }
    {
      adam_memory<fo::bfloat16, float> memory(w.sizes);
      auto const lists = memory.lists();
      clipped_adamw const clip;
      auto const clipped = clip.rule();
      pass_shapes("clip + adamw bf16/fp32 " + w.name, clipped, lists, bytes_of(clipped, lists, memory.elements()),
                  copy, pb);
    }
  }
  return 0;
}

int launch_sweep(double copy, char const* only)
{
  for (auto const& w : fb::all_workloads()) {
    if (only != nullptr && w.name != only) { continue; }
    int const pb = w.name == "W4" ? 10 : 50;
    double same_size = 0;
    {
      adam_memory<float, float> memory(w.sizes);
      auto const lists = memory.lists();
      fo::rules::adam rule;
      double const bytes = bytes_of(rule, lists, memory.elements());
      launch_modes("adam fp32 " + w.name, rule, lists, bytes, copy, pb);
      auto const lamb = timed_lamb();
      launch_modes("lamb fp32 " + w.name, lamb, lists, bytes_of(lamb, lists, memory.elements()), copy, pb);
      same_size = copy_bandwidth(static_cast<std::size_t>(bytes / 2));
      std::printf("%-44s %10.1f us %8.3f TB/s %7.1f%% of copy\n", ("D2D copy of adam's bytes " + w.name).c_str(),
                  bytes / same_size * 1e6, same_size * 1e-12, 100.0 * same_size / copy);
    }
    {
      adam_memory<fo::bfloat16, float> memory(w.sizes);
      auto const lists = memory.lists();
      fo::rules::adamw rule;
      launch_modes("adamw bf16/fp32 " + w.name, rule, lists, bytes_of(rule, lists, memory.elements()), copy, pb);
      clipped_adamw const clip;
      auto const clipped = clip.rule();
      launch_modes("clip + adamw bf16/fp32 " + w.name, clipped, lists, bytes_of(clipped, lists, memory.elements()),
                   copy, pb);
    }
    {
      q8_adam_memory<float> memory(w.sizes);
      auto const lists = memory.lists();
      fo::rules::adamw rule;
      double const bytes = fo::memory_traffic<fo::rules::adamw, std::decay_t<decltype(lists)>>::exact_bytes *
                           static_cast<double>(memory.elements());
      launch_modes("adamw fp32/8-bit " + w.name, rule, lists, bytes, copy, pb);
    }
  }
  return 0;
}

/// The default policy with the 8-bit update's warps taking `Units` units of work a request
/// from the plan's work queue (0: no queue, units dealt round-robin).
template <int Units>
struct ticket_policy : fo::cuda::detail::default_policy {
  static constexpr fo::cuda::detail::quantized_shape quantized_update(std::size_t widest, bool fast)
  {
    auto shape = fo::cuda::detail::default_policy::quantized_update(widest, fast);
    shape.units_per_ticket = Units;
    return shape;
  }
};

// Whether --q8 sweeps the 8-bit update's persistent grid, and the device's SMs.
bool sweep_q8 = false;
std::int64_t sms_of_device = 0;

template <class T>
struct tag {
  using type = T;
};

/// AdamW with 8-bit states (issue 16): time per step against the copy, for the bytes
/// `memory_traffic::exact_bytes` counts (codes and scales).
template <class P>
void q8_case(std::string const& name, std::vector<std::int64_t> const& sizes, double copy, int pb)
{
  q8_adam_memory<P> memory(sizes);
  auto const lists = memory.lists();
  fo::rules::adamw const rule;
  auto const plan = fo::cuda::make_plan(lists);
  double const bytes = fo::memory_traffic<fo::rules::adamw, std::decay_t<decltype(lists)>>::exact_bytes *
                       static_cast<double>(memory.elements());
  print({name, time_gpu([&] { plan.run(rule, fo::step_info{timed_step}); }, pb), bytes, copy});
  // With --q8: the 8-bit update's shapes (blocks per SM of the persistent grid, one or two
  // blocks of lookahead or none; the library's chooses by parameter width and memory speed), a
  // grid of two waves, and longer chunks (fewer chunk changes for a warp's cursor).
  if (!sweep_q8) { return; }
  // Each variant's step from one state must give the default's bits (checked on W1 and W3:
  // 10 and 2000 tensors).
  bool const check = name.find("W1") != std::string::npos || name.find("W3") != std::string::npos;
  std::vector<unsigned char> start, expected;
  if (check) {
    start = memory.snapshot();
    plan.run(rule, fo::step_info{3});
    expected = memory.snapshot();
  }
  char const* const only_variants = std::getenv("FUSEDOPT_Q8_VARIANTS");
  auto variant = [&](std::string const& label, auto policy_tag, std::int64_t max_blocks, std::int64_t chunk = 0) {
    using variant_policy = typename decltype(policy_tag)::type;
    if (only_variants != nullptr && label.find(only_variants) == std::string::npos) { return; }
    char const* verdict = "";
    if (check) {
      memory.restore(start);
      fo::cuda::options opts;
      opts.chunk_elements = chunk;
      opts.max_blocks = max_blocks;
      fo::cuda::make_plan<variant_policy>(lists, opts).run(rule, fo::step_info{3});
      verdict = memory.snapshot() == expected ? " [bits =]" : " [BITS DIFFER]";
    }
    print({name + " " + label + verdict, time_variant<variant_policy>(rule, lists, chunk, max_blocks, pb), bytes, copy});
  };
  constexpr int pass = fo::cuda::detail::default_policy::pass_bytes_per_lane;
  variant("lookahead 4/SM, tails in lanes (fast memory)", tag<policy<128, 64, true, true, 1, 4, true, pass, 1, false, true>>{}, 0);
  variant("lookahead 4/SM", tag<policy<128, 64, true, true, 1, 4, true>>{}, 0);
  variant("lookahead 2 blocks 3/SM (slow memory)", tag<policy<128, 64, true, true, 1, 3, true, pass, 2>>{}, 0);
  variant("lookahead 2 blocks 3/SM, tails in lanes", tag<policy<128, 64, true, true, 1, 3, true, pass, 2, false, true>>{}, 0);
  variant("lookahead 2 blocks 4/SM", tag<policy<128, 64, true, true, 1, 4, true, pass, 2>>{}, 0);
  variant("lookahead 5/SM", tag<policy<128, 64, true, true, 1, 5, true>>{}, 0);
  variant("no lookahead 5/SM", tag<policy<128, 64, true, true, 1, 5, false>>{}, 0);
  variant("no lookahead 5/SM, next block staged (16-bit, slow memory)",
          tag<policy<128, 64, true, true, 1, 5, false, fo::cuda::detail::default_policy::pass_bytes_per_lane, 1, true>>{}, 0);
  variant("no lookahead 4/SM", tag<policy<128, 64, true, true, 1, 4, false>>{}, 0);
  variant("round-robin, no queue", tag<ticket_policy<0>>{}, 0);
  variant("queue, 1 unit a ticket", tag<ticket_policy<1>>{}, 0);
  variant("queue, 2 units a ticket", tag<ticket_policy<2>>{}, 0);
  variant("queue, 4 units a ticket", tag<ticket_policy<4>>{}, 0);
  variant("queue, 8 units a ticket", tag<ticket_policy<8>>{}, 0);
  variant("8/SM grid", tag<fo::cuda::detail::default_policy>{}, 8 * sms_of_device);
  variant("chunk 4096", tag<fo::cuda::detail::default_policy>{}, 0, 4096);
  variant("chunk 8192", tag<fo::cuda::detail::default_policy>{}, 0, 8192);
}

/// Every variant on one workload: block size, bytes per slot, streaming hints, chunk, cap.
template <class Rule, class Lists>
void variants(std::string const& prefix, Rule const& rule, Lists const& lists, double bytes, double copy, int pb,
              std::int64_t sms)
{
  auto run = [&](char const* label, double t) { print({prefix + " " + label, t, bytes, copy}); };
  auto const first = fo::cuda::l2_eviction::evict_first;
  auto const normal = fo::cuda::l2_eviction::evict_normal;
  run("t128 b64 c2048 evict-first", time_variant<policy<128, 64, true, true>>(rule, lists, 2048, 0, pb, first));
  run("t128 b64 c2048 evict-normal", time_variant<policy<128, 64, true, true>>(rule, lists, 2048, 0, pb, normal));
  run("t128 b64 c1024", time_variant<policy<128, 64, true, true>>(rule, lists, 1024, 0, pb));
  run("t128 b64 c4096", time_variant<policy<128, 64, true, true>>(rule, lists, 4096, 0, pb));
  run("t128 b32 c2048", time_variant<policy<128, 32, true, true>>(rule, lists, 2048, 0, pb));
  run("t128 b32 c4096", time_variant<policy<128, 32, true, true>>(rule, lists, 4096, 0, pb));
  run("t128 b16 c2048", time_variant<policy<128, 16, true, true>>(rule, lists, 2048, 0, pb));
  run("t256 b32 c2048", time_variant<policy<256, 32, true, true>>(rule, lists, 2048, 0, pb));
  run("t256 b32 c4096", time_variant<policy<256, 32, true, true>>(rule, lists, 4096, 0, pb));
  run("t256 b16 c1024", time_variant<policy<256, 16, true, true>>(rule, lists, 1024, 0, pb));
  run("t256 b16 c1024 6/SM", time_variant<policy<256, 16, true, true, 6>>(rule, lists, 1024, 0, pb));
  run("t256 b16 c1024 8/SM", time_variant<policy<256, 16, true, true, 8>>(rule, lists, 1024, 0, pb));
  // Launch bounds that fit without spills since the iteration is one function (stop 36:
  // Adam fp32 t256 b16 at 48 / 40 registers, t128 b64 at 96, none spilled).
  run("t256 b16 c1024 5/SM", time_variant<policy<256, 16, true, true, 5>>(rule, lists, 1024, 0, pb));
  run("t128 b64 c2048 5/SM", time_variant<policy<128, 64, true, true, 5>>(rule, lists, 2048, 0, pb));
  run("t128 b32 c2048 5/SM", time_variant<policy<128, 32, true, true, 5>>(rule, lists, 2048, 0, pb));
  run("t256 b16 c2048", time_variant<policy<256, 16, true, true>>(rule, lists, 2048, 0, pb));
  run("t256 b16 c2048 6/SM", time_variant<policy<256, 16, true, true, 6>>(rule, lists, 2048, 0, pb));
  run("t512 b16 c2048 3/SM", time_variant<policy<512, 16, true, true, 3>>(rule, lists, 2048, 0, pb));
  run("t512 b16 c2048", time_variant<policy<512, 16, true, true>>(rule, lists, 2048, 0, pb));
  run("t128 b16 c512", time_variant<policy<128, 16, true, true>>(rule, lists, 512, 0, pb));
  run("t512 b32 c4096", time_variant<policy<512, 32, true, true>>(rule, lists, 4096, 0, pb));
  run("t256 b16 c4096", time_variant<policy<256, 16, true, true>>(rule, lists, 4096, 0, pb));
  run("t512 b16 c4096", time_variant<policy<512, 16, true, true>>(rule, lists, 4096, 0, pb));
  run("t256 b64 c4096", time_variant<policy<256, 64, true, true>>(rule, lists, 4096, 0, pb));
}

/// --shapes: the default shape against blocks of 64 threads (the default's bytes a thread over
/// half the elements a block: finer blocks at the same fixed work a thread) on one workload,
/// each shape timed twice in turn (A B A B).
template <class Rule, class Lists>
void shapes(std::string const& prefix, Rule const& rule, Lists const& lists, double bytes, double copy, int pb)
{
  auto run = [&](char const* label, double t) { print({prefix + " " + label, t, bytes, copy}); };
  for (int round = 0; round < 2; ++round) {
    run("t128 b64 c2048", time_variant<policy<128, 64, true, true>>(rule, lists, 2048, 0, pb));
    run("t64 b64 c1024", time_variant<policy<64, 64, true, true>>(rule, lists, 1024, 0, pb));
    run("t64 b64 c2048", time_variant<policy<64, 64, true, true>>(rule, lists, 2048, 0, pb));
    run("t64 b32 c1024", time_variant<policy<64, 32, true, true>>(rule, lists, 1024, 0, pb));
    run("t128 b32 c1024", time_variant<policy<128, 32, true, true>>(rule, lists, 1024, 0, pb));
  }
}

int main(int argc, char** argv)
{
  bool const tune = argc > 1 && std::strcmp(argv[1], "--variants") == 0;
  bool const probing = argc > 1 && std::strcmp(argv[1], "--probe") == 0;
  // --plain: the headline's Adam fp32 and AdamW bf16 rows only (no 8-bit cases), for builds or
  // shapes (FUSEDOPT_GT_MEMORY) compared in turn.
  // --shapes: the headline's rows, each workload's followed by shapes().
  bool const shaping = argc > 1 && std::strcmp(argv[1], "--shapes") == 0;
  bool const plain_only = shaping || (argc > 1 && std::strcmp(argv[1], "--plain") == 0);
  cudaDeviceProp prop{};
  FUSEDOPT_CUDA_TRY(cudaGetDeviceProperties(&prop, 0));
  double const copy = copy_bandwidth();
  std::printf("device %s, %d SMs; D2D copy %.3f TB/s (read + write)\n", prop.name, prop.multiProcessorCount,
              copy * 1e-12);
  std::int64_t const sms = prop.multiProcessorCount;
  if (probing) { return probe(copy) + eviction_sweep(copy); }
  if (argc > 1 && std::strcmp(argv[1], "--w1") == 0) { return w1_ceiling(copy, prop.multiProcessorCount); }
  if (argc > 1 && std::strcmp(argv[1], "--passes") == 0) { return pass_sweep(copy); }
  // --launch W2: that workload alone.
  if (argc > 1 && std::strcmp(argv[1], "--launch") == 0) { return launch_sweep(copy, argc > 2 ? argv[2] : nullptr); }
  if (argc > 1 && std::strcmp(argv[1], "--q8") == 0) {
    sms_of_device = sms;
    double const per_sm_cycle = fo::cuda::detail::dram_bytes_per_sm_cycle(0);
    std::printf("%.1f DRAM bytes per SM cycle: the default policy's 8-bit shape for %s memory\n", per_sm_cycle,
                fo::cuda::detail::memory_is_fast<fo::cuda::detail::default_policy>(0) ? "fast" : "slow");
    // --q8 W2 [bf16]: that workload's fp32 (or bf16) case alone, without the sweep (for a
    // profiler, or builds compared in turn).
    char const* only = argc > 2 ? argv[2] : nullptr;
    bool const bf16_only = argc > 3 && std::strcmp(argv[3], "bf16") == 0;
    // FUSEDOPT_Q8_VARIANTS=text: the sweep's variants whose label holds it, on the workload given too.
    sweep_q8 = only == nullptr || std::getenv("FUSEDOPT_Q8_VARIANTS") != nullptr;
    // --q8 W3-whole: W3 with every size rounded up to whole blocks of 256 (what the tensors'
    // partial last blocks cost).
    auto workloads = fb::all_workloads();
    fb::workload whole = fb::w3();
    whole.name = "W3-whole";
    for (auto& n : whole.sizes) { n = (n + 255) / 256 * 256; }
    workloads.push_back(whole);
    for (auto const& w : workloads) {
      if (only == nullptr ? w.name == "W3-whole" : w.name != only) { continue; }
      int const pb = w.name == "W4" ? 10 : 50;
      if (!bf16_only) { q8_case<float>("adamw fp32/8-bit " + w.name, w.sizes, copy, pb); }
      if (only == nullptr || bf16_only) { q8_case<fo::bfloat16>("adamw bf16/8-bit " + w.name, w.sizes, copy, pb); }
    }
    return 0;
  }

  std::vector<result> headline;
  for (auto const& w : fb::all_workloads()) {
    int const pb = w.name == "W4" ? 10 : 50;
    {
      adam_memory<float, float> memory(w.sizes);
      auto const lists = memory.lists();
      auto const plan = fo::cuda::make_plan(lists, timed_options());
      fo::rules::adam rule;
      double const bytes = bytes_of(rule, lists, memory.elements());  // 28: 4 reads, 3 writes of 4 bytes
      double const s = time_gpu([&] { plan.run(rule, fo::step_info{timed_step}); }, pb);
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
      if (shaping) { shapes(w.name + " adam fp32", rule, lists, bytes, copy, pb); }
    }
    {
      adam_memory<fo::bfloat16, float> memory(w.sizes);
      auto const lists = memory.lists();
      auto const plan = fo::cuda::make_plan(lists, timed_options());
      fo::rules::adamw rule;
      // 22: bf16 p (read + write), g (read); fp32 m, v (read + write)
      double const bytes = bytes_of(rule, lists, memory.elements());
      double const s = time_gpu([&] { plan.run(rule, fo::step_info{timed_step}); }, pb);
      print({"adamw bf16/fp32 " + w.name, s, bytes, copy});
      if (tune) { variants(w.name + " adamw bf16", rule, lists, bytes, copy, pb, sms); }
      if (shaping) { shapes(w.name + " adamw bf16", rule, lists, bytes, copy, pb); }
    }
    if (plain_only) { continue; }
    q8_case<float>("adamw fp32/8-bit " + w.name, w.sizes, copy, pb);
    q8_case<fo::bfloat16>("adamw bf16/8-bit " + w.name, w.sizes, copy, pb);
  }
  std::printf("\nheadline (Adam fp32, fraction of D2D copy):");
  for (auto const& r : headline) { std::printf(" %s %.1f%%", r.name.substr(10, 2).c_str(), 100.0 * r.bytes / r.seconds / r.copy); }
  std::printf("\n");
  return 0;
}
