// Shared harness of the CUDA tests: tensor lists laid out in one arena per slot (on the host
// and on the device, with poisoned gaps and chosen misalignments), trajectories run on the
// host backend (the reference) and the CUDA backend side by side, and a bit-for-bit
// comparison of every arena, gaps included, after every step.
#pragma once

#include <fusedopt/fusedopt.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "edge_sizes.hpp"

namespace fusedopt_test {
namespace fo = ::fusedopt;
namespace slot = ::fusedopt::slot;

#define FO_TEST_CUDA(call)                                                                            \
  do {                                                                                                \
    cudaError_t const fo_test_status_ = (call);                                                       \
    if (fo_test_status_ != cudaSuccess) { FAIL(#call << " failed: " << cudaGetErrorString(fo_test_status_)); } \
  } while (0)

/// Host-to-device copy that has landed when it returns. A plain cudaMemcpy from pageable host
/// memory may return once the bytes are staged, before the DMA (on the legacy stream) reaches
/// the device; the tests' kernels run on non-blocking streams, which do not wait for it.
inline void upload_bytes(void* device, void const* host, std::size_t bytes)
{
  FO_TEST_CUDA(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
  FO_TEST_CUDA(cudaDeviceSynchronize());
}

/// FUSEDOPT_TEST_QUICK=1 (set by scripts/gpu-check under the sanitizers) trims trajectories
/// and scenarios so that instrumented runs stay within minutes.
inline bool quick()
{
  char const* q = std::getenv("FUSEDOPT_TEST_QUICK");
  return q != nullptr && *q != '\0' && *q != '0';
}

inline int trajectory_steps() { return quick() ? 3 : 10; }

/// How an arena is filled: inputs and signed states, non-negative states (second moments),
/// small signed states (centred averages kept below the square average).
enum class fill { symmetric, positive, small };

template <class T>
T draw(std::mt19937_64& rng, fill kind)
{
  double lo = -1.0, hi = 1.0;
  if (kind == fill::positive) { lo = 0.01, hi = 1.0; }
  if (kind == fill::small) { lo = -0.05, hi = 0.05; }
  double const x = std::uniform_real_distribution<double>(lo, hi)(rng);
  if constexpr (std::is_same_v<T, double>) {
    return x;
  } else {
    return fo::from_opmath<T>(static_cast<float>(x));
  }
}

/// One bound slot of a test: its tag, element type, fill, and whether the list is const
/// (read-only, refreshed with new values before every step, as gradients are).
template <class Slot, class T, fill Kind = fill::symmetric, bool Const = false>
struct spec {
  using slot = Slot;
  using type = T;
  static constexpr fill kind = Kind;
  static constexpr bool is_const = Const;
};

/// How tensors sit in their arenas: aligned to 64 bytes, shifted by the same number of
/// elements in every slot (vector head path), or shifted differently per slot (scalar path).
enum class shift { none, same, mixed };

/// Scalar elements between tensors, poisoned: a stray write there changes the bits compared.
inline constexpr std::int64_t gap = 3;

template <class Spec>
struct arena {
  using T = typename Spec::type;
  using element = std::conditional_t<Spec::is_const, T const, T>;
  using element_type_unqualified = T;

  std::vector<T> host;
  T* device = nullptr;
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> sizes;

  arena() = default;
  arena(arena const&) = delete;
  arena& operator=(arena const&) = delete;
  ~arena() { (void)cudaFree(device); }

  void layout(std::vector<std::int64_t> const& tensor_sizes, shift how, std::size_t slot_index)
  {
    constexpr std::int64_t align = 64 / static_cast<std::int64_t>(sizeof(T));
    std::int64_t cursor = 0;
    sizes = tensor_sizes;
    offsets.clear();
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      cursor = (cursor + align - 1) / align * align;
      std::int64_t s = 0;
      if (how == shift::same) { s = static_cast<std::int64_t>((i * 3 + 1) % 8); }
      if (how == shift::mixed) { s = static_cast<std::int64_t>((i + slot_index) % 3); }
      offsets.push_back(cursor + s);
      cursor += s + sizes[i] + gap;
    }
    host.assign(static_cast<std::size_t>(cursor + align), T{});
    FO_TEST_CUDA(cudaMalloc(&device, host.size() * sizeof(T)));
  }

  void randomize(std::mt19937_64& rng)
  {
    for (auto& x : host) { x = draw<T>(rng, Spec::kind); }
    upload_bytes(device, host.data(), host.size() * sizeof(T));
  }

  [[nodiscard]] fo::tensor_list<element> list(bool on_device) const
  {
    fo::tensor_list<element> l;
    l.reserve(sizes.size());
    T* base = on_device ? device : const_cast<T*>(host.data());
    for (std::size_t i = 0; i < sizes.size(); ++i) { l.push_back(base + offsets[i], sizes[i]); }
    return l;
  }

  /// The first element whose bits differ between the device and the host, or -1.
  [[nodiscard]] std::int64_t first_difference(std::vector<T>& scratch) const
  {
    scratch.resize(host.size());
    FO_TEST_CUDA(cudaMemcpy(scratch.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
    if (std::memcmp(scratch.data(), host.data(), host.size() * sizeof(T)) == 0) { return -1; }
    for (std::size_t i = 0; i < host.size(); ++i) {
      if (std::memcmp(&scratch[i], &host[i], sizeof(T)) != 0) { return static_cast<std::int64_t>(i); }
    }
    return -1;
  }

  /// Where element `i` of the arena is: "tensor t element e" or "gap after tensor t".
  [[nodiscard]] std::string locate(std::int64_t i) const
  {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      if (i >= offsets[t] && i < offsets[t] + sizes[t]) {
        return "tensor " + std::to_string(t) + " (size " + std::to_string(sizes[t]) + ") element " +
               std::to_string(i - offsets[t]);
      }
    }
    return "padding (outside every tensor)";
  }
};

template <class T>
double as_double(T x)
{
  return static_cast<double>(fo::to_opmath<fo::opmath_t<T>>(x));
}

/// Tensors of `sizes` in every slot of `Specs...`, on the host and the device alike.
template <class... Specs>
class problem {
 public:
  problem(std::vector<std::int64_t> const& sizes, shift how, std::uint64_t seed) : rng_(seed)
  {
    init(sizes, how, std::index_sequence_for<Specs...>{});
  }

  /// The lists bound over the host arenas (reference) or the device arenas.
  [[nodiscard]] auto lists(bool on_device) const { return bind(on_device, std::index_sequence_for<Specs...>{}); }

  /// New values in every const slot (gradients), the same on host and device.
  void refresh_inputs() { refresh(std::index_sequence_for<Specs...>{}); }

  /// Device arenas must equal host arenas bit for bit, gaps included.
  void require_same_bits(std::string const& context) { compare(context, std::index_sequence_for<Specs...>{}); }

  template <std::size_t K>
  auto& slot_arena()
  {
    return std::get<K>(arenas_);
  }

 private:
  template <std::size_t... K>
  void init(std::vector<std::int64_t> const& sizes, shift how, std::index_sequence<K...>)
  {
    (std::get<K>(arenas_).layout(sizes, how, K), ...);
    (std::get<K>(arenas_).randomize(rng_), ...);
  }

  template <std::size_t... K>
  auto bind(bool on_device, std::index_sequence<K...>) const
  {
    return fo::bind((typename Specs::slot{} = std::get<K>(arenas_).list(on_device))...);
  }

  template <std::size_t... K>
  void refresh(std::index_sequence<K...>)
  {
    ((Specs::is_const ? std::get<K>(arenas_).randomize(rng_) : void()), ...);
  }

  template <std::size_t... K>
  void compare(std::string const& context, std::index_sequence<K...>)
  {
    (compare_one<K>(context), ...);
  }

  template <std::size_t K>
  void compare_one(std::string const& context)
  {
    using S = std::tuple_element_t<K, std::tuple<Specs...>>;
    using T = typename S::type;
    auto& a = std::get<K>(arenas_);
    std::vector<T> device_values;
    std::int64_t const i = a.first_difference(device_values);
    if (i >= 0) {
      auto const d = device_values[static_cast<std::size_t>(i)];
      auto const h = a.host[static_cast<std::size_t>(i)];
      FAIL(context << ": slot '" << S::slot::name << "' (" << fo::dtype_name<T>() << ") differs at "
                   << a.locate(i) << ": device " << as_double(d) << " host " << as_double(h));
    }
  }

  std::mt19937_64 rng_;
  std::tuple<arena<Specs>...> arenas_;
};

/// How the CUDA side runs a trajectory.
struct scenario {
  char const* name;
  bool one_shot;  // cuda::apply instead of a plan
  fo::cuda::transport metadata;
  std::int64_t chunk_elements;
  std::int64_t max_blocks;
  shift placement;
  fo::cuda::l2_eviction eviction = fo::cuda::l2_eviction::automatic;
  fo::cuda::memory_speed memory = fo::cuda::memory_speed::automatic;
};

inline std::ostream& operator<<(std::ostream& os, scenario const& s) { return os << s.name; }

/// The CUDA options a scenario asks for.
inline fo::cuda::options options_of(scenario const& how)
{
  fo::cuda::options opts;
  opts.metadata = how.metadata;
  opts.chunk_elements = how.chunk_elements;
  opts.max_blocks = how.max_blocks;
  opts.eviction = how.eviction;
  opts.memory = how.memory;
  return opts;
}

/// Each transport, chunk boundaries (small chunks), the block loop, the three placements,
/// both L2 eviction priorities (the test sizes fit in L2, so `automatic` takes evict-normal),
/// and the update's shapes for fast memory (forced; under `automatic` the test sizes take the
/// shapes for slow memory on any GPU).
inline std::vector<scenario> scenarios()
{
  using fo::cuda::transport;
  auto const evict_first = fo::cuda::l2_eviction::evict_first;
  auto const fast = fo::cuda::memory_speed::fast;
  std::vector<scenario> all = {
    {"plan/device_table/aligned", false, transport::automatic, 0, 0, shift::none},
    {"plan/device_table/chunk40/same-shift/evict-first", false, transport::device_table, 40, 0, shift::same, evict_first},
    {"plan/device_table/max_blocks3/mixed-shift", false, transport::device_table, 0, 3, shift::mixed},
    {"plan/param_4k/chunk40/same-shift", false, transport::param_4k, 40, 0, shift::same},
    {"plan/param_32k/mixed-shift", false, transport::param_32k, 0, 0, shift::mixed},
    {"apply/automatic/same-shift", true, transport::automatic, 0, 0, shift::same},
    {"apply/param_4k/chunk40/aligned/evict-first", true, transport::param_4k, 40, 0, shift::none, evict_first},
    {"plan/device_table/chunk40/max_blocks2/same-shift", false, transport::device_table, 40, 2, shift::same},
    {"plan/device_table/max_blocks3/fast-memory-shape/same-shift", false, transport::device_table, 0, 3, shift::same,
     fo::cuda::l2_eviction::automatic, fast},
    {"apply/param_4k/chunk40/fast-memory-shape/aligned", true, transport::param_4k, 40, 0, shift::none, evict_first,
     fast},
  };
  if (quick()) { all = {all[1], all[3], all[5], all[8]}; }
  return all;
}

/// Tensor sizes that hit every edge (tests/edge_sizes.hpp, shared with the host tests), all in
/// one list: a few under a sanitizer.
inline std::vector<std::int64_t> edge_sizes() { return quick() ? quick_edge_sizes() : all_edge_sizes(); }

inline bool transport_available(fo::cuda::transport t)
{
  if (t != fo::cuda::transport::param_32k) { return true; }
  int device = 0;
  FO_TEST_CUDA(cudaGetDevice(&device));
  return fo::cuda::param_32k_available(device);
}

/// Runs `steps` steps of `make_rule(t)` on the host backend and on the CUDA backend as
/// `how` says, and requires the same bits in every arena after every step.
template <class Problem, class MakeRule>
void check_trajectory(Problem& p, MakeRule&& make_rule, scenario const& how, int steps, std::string const& label)
{
  if (!transport_available(how.metadata)) {
    WARN("transport::param_32k is not available here; scenario " << how.name << " not run");
    return;
  }
  auto const host_lists = p.lists(false);
  auto const device_lists = p.lists(true);
  auto host_plan = fo::host::make_plan(host_lists);
  fo::cuda::options const opts = options_of(how);
  std::optional<decltype(fo::cuda::make_plan(device_lists))> device_plan;
  if (!how.one_shot) { device_plan.emplace(fo::cuda::make_plan(device_lists, opts)); }
  for (std::int64_t t = 1; t <= steps; ++t) {
    p.refresh_inputs();
    auto const rule = make_rule(t);
    fo::step_info const step{t};
    host_plan.run(rule, step);
    if (device_plan) {
      device_plan->run(rule, step);
    } else {
      fo::cuda::apply(rule, device_lists, step, opts);
    }
    FO_TEST_CUDA(cudaDeviceSynchronize());
    p.require_same_bits(label + " [" + how.name + "] step " + std::to_string(t));
  }
}

/// Element types of a test: the parameter and its gradient, and the optimizer states.
template <class Param, class State>
struct dtypes {
  using param = Param;
  using state = State;
};

using f32 = dtypes<float, float>;
using f64 = dtypes<double, double>;
using f16 = dtypes<fo::half, fo::half>;
using bf16 = dtypes<fo::bfloat16, fo::bfloat16>;
using bf16_f32 = dtypes<fo::bfloat16, float>;  // bf16 param/grad, fp32 states: the usual mixed case

/// The specs every optimizer binds: the parameter (of type P) and its read-only gradient.
template <class P>
using param_spec = spec<slot::param_t, P>;
template <class P>
using grad_spec = spec<slot::grad_t, P, fill::symmetric, true>;

/// Adam's four slots: param and grad of type P, exp_avg and exp_avg_sq of type S.
template <class P, class S>
using adam_problem_of =
  problem<param_spec<P>, grad_spec<P>, spec<slot::exp_avg_t, S>, spec<slot::exp_avg_sq_t, S, fill::positive>>;

/// The message of the fusedopt::error `f()` throws, or "" when it throws none.
template <class F>
std::string message_of(F&& f)
{
  try {
    f();
  } catch (fo::error const& e) {
    return e.what();
  }
  return "";
}

/// The whole sweep for one optimizer configuration: every scenario over edge_sizes().
template <class... Specs, class MakeRule>
void sweep(MakeRule&& make_rule, std::string const& label, std::uint64_t seed = 1234)
{
  for (scenario const& how : scenarios()) {
    problem<Specs...> p(edge_sizes(), how.placement, seed++);
    check_trajectory(p, make_rule, how, trajectory_steps(), label);
  }
}

/// The make_rule of a sweep whose rule is the same at every step: a Rule with its defaults
/// changed by `change`.
template <class Rule, class Change>
auto every_step(Change change)
{
  Rule rule;
  change(rule);
  return [rule](std::int64_t) { return rule; };
}

/// sweep() of an optimizer over param and grad of `D::param` and the state specs `States...`.
template <class D, class... States, class MakeRule>
void sweep_optimizer(MakeRule&& make_rule, std::string const& label)
{
  sweep<param_spec<typename D::param>, grad_spec<typename D::param>, States...>(make_rule, label);
}

// ---- helpers of the issue-5 tests (reductions, AMP, mixed precision) -------------------------

/// The graph of what `enqueue()` puts on `stream` (captured in thread-local mode),
/// instantiated; both destroyed with it.
class captured_graph {
 public:
  template <class Enqueue>
  captured_graph(cudaStream_t stream, Enqueue&& enqueue)
  {
    FO_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue();
    FO_TEST_CUDA(cudaStreamEndCapture(stream, &graph_));
    FO_TEST_CUDA(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  captured_graph(captured_graph const&) = delete;
  captured_graph& operator=(captured_graph const&) = delete;
  ~captured_graph()
  {
    (void)cudaGraphExecDestroy(exec_);
    (void)cudaGraphDestroy(graph_);
  }
  void launch(cudaStream_t stream) const { FO_TEST_CUDA(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

/// A device array of `n` T, freed on destruction.
template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n = 1) : size_(n)
  {
    FO_TEST_CUDA(cudaMalloc(&data_, std::max<std::size_t>(n, 1) * sizeof(T)));
    FO_TEST_CUDA(cudaMemset(data_, 0, std::max<std::size_t>(n, 1) * sizeof(T)));
    FO_TEST_CUDA(cudaDeviceSynchronize());  // the memset runs on the legacy stream (see upload_bytes)
  }
  device_array(device_array const&) = delete;
  device_array& operator=(device_array const&) = delete;
  ~device_array() { (void)cudaFree(data_); }

  [[nodiscard]] T* get() const { return data_; }
  [[nodiscard]] std::size_t size() const { return size_; }
  void upload(std::vector<T> const& values)
  {
    REQUIRE(values.size() <= std::max<std::size_t>(size_, 1));
    upload_bytes(data_, values.data(), values.size() * sizeof(T));
  }
  void set(T const& value) { upload(std::vector<T>(std::max<std::size_t>(size_, 1), value)); }
  [[nodiscard]] std::vector<T> download() const
  {
    std::vector<T> out(std::max<std::size_t>(size_, 1));
    FO_TEST_CUDA(cudaDeviceSynchronize());
    FO_TEST_CUDA(cudaMemcpy(out.data(), data_, out.size() * sizeof(T), cudaMemcpyDeviceToHost));
    out.resize(size_);
    return out;
  }
  [[nodiscard]] T value() const { return download().at(0); }

 private:
  T* data_ = nullptr;
  std::size_t size_;
};

/// Same bits (NaN payloads included) for two values of a trivially copyable type.
template <class T>
bool same_bits(T const& a, T const& b)
{
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// |device - host| <= rtol * |host| + atol for every element of every arena of a problem (gaps
/// included, where both must hold the same poison); NaN only where the host has NaN.
struct tolerance {
  double rtol = 0, atol = 0;
};

template <class T>
bool close_enough(T d, T h, tolerance tol)
{
  double const x = as_double(d), y = as_double(h);
  if (y != y) { return x != x; }
  if (x == y) { return true; }
  return std::fabs(x - y) <= tol.rtol * std::fabs(y) + tol.atol;
}

/// Requires every arena of `p` (device) to be within `tol` of its host copy.
template <class Problem, std::size_t... K>
void require_close(Problem& p, tolerance tol, std::string const& context, std::index_sequence<K...>)
{
  (
    [&] {
      auto& a = p.template slot_arena<K>();
      using T = typename std::decay_t<decltype(a)>::element_type_unqualified;
      std::vector<T> device_values;
      (void)a.first_difference(device_values);
      for (std::size_t i = 0; i < a.host.size(); ++i) {
        if (!close_enough(device_values[i], a.host[i], tol)) {
          FAIL(context << ": slot " << K << " differs at " << a.locate(static_cast<std::int64_t>(i)) << ": device "
                       << as_double(device_values[i]) << " host " << as_double(a.host[i]) << " (rtol " << tol.rtol
                       << ", atol " << tol.atol << ")");
        }
      }
    }(),
    ...);
}

template <class... Specs>
void require_close(problem<Specs...>& p, tolerance tol, std::string const& context)
{
  require_close(p, tol, context, std::index_sequence_for<Specs...>{});
}

/// Copies every arena's device values into its host copy (to start the host from the
/// device's state, or to compare two device problems through their host copies).
template <class Problem, std::size_t... K>
void pull(Problem& p, std::index_sequence<K...>)
{
  (
    [&] {
      auto& a = p.template slot_arena<K>();
      FO_TEST_CUDA(cudaMemcpy(a.host.data(), a.device, a.host.size() * sizeof(a.host[0]), cudaMemcpyDeviceToHost));
    }(),
    ...);
}
template <class... Specs>
void pull(problem<Specs...>& p)
{
  pull(p, std::index_sequence_for<Specs...>{});
}

/// Copies every arena's host values to the device.
template <class Problem, std::size_t... K>
void push(Problem& p, std::index_sequence<K...>)
{
  (
    [&] {
      auto& a = p.template slot_arena<K>();
      upload_bytes(a.device, a.host.data(), a.host.size() * sizeof(a.host[0]));
    }(),
    ...);
}
template <class... Specs>
void push(problem<Specs...>& p)
{
  push(p, std::index_sequence_for<Specs...>{});
}

/// The plan scenarios (reducing rules need a plan): every transport, small chunks, a capped grid,
/// the three placements.
inline std::vector<scenario> plan_scenarios()
{
  std::vector<scenario> out;
  for (scenario const& s : scenarios()) {
    if (!s.one_shot) { out.push_back(s); }
  }
  return out;
}

/// Runs `steps` steps of `make_rule(t, on_device)` on the host backend (on_device false: host
/// pointers in the rule) and on a CUDA plan as `how` says, each on its own trajectory, and
/// requires the device within `tol` of the host after every step: for rules whose results
/// depend on a reduction's combine order, which differs between the backends. A zero
/// tolerance requires the same bits (rules whose pointers differ between the backends).
template <class Problem, class MakeRule>
void check_close_trajectory(Problem& p, MakeRule&& make_rule, scenario const& how, int steps, tolerance tol,
                            std::string const& label)
{
  if (!transport_available(how.metadata)) { return; }
  auto host_plan = fo::host::make_plan(p.lists(false));
  fo::cuda::options const opts = options_of(how);
  auto const device_plan = fo::cuda::make_plan(p.lists(true), opts);
  for (std::int64_t t = 1; t <= steps; ++t) {
    p.refresh_inputs();
    fo::step_info const step{t};
    host_plan.run(make_rule(t, false), step);
    device_plan.run(make_rule(t, true), step);
    FO_TEST_CUDA(cudaDeviceSynchronize());
    std::string const context = label + " [" + how.name + "] step " + std::to_string(t);
    if (tol.rtol == 0 && tol.atol == 0) {
      p.require_same_bits(context);  // a zero tolerance means the same bits
    } else {
      require_close(p, tol, context);
    }
  }
}

}  // namespace fusedopt_test
