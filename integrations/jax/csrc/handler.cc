/// @file handler.cc
/// @brief The XLA FFI handler of fusedopt_jax: one call steps every leaf of a pytree.
///
/// Compiled twice by the C++ compiler (no CUDA header here): FUSEDOPT_JAX_CUDA=1 exports
/// `FusedoptJaxStepCuda` (registered for the "CUDA" platform: it takes XLA's stream),
/// FUSEDOPT_JAX_CUDA=0 exports `FusedoptJaxStepCpu` (the "cpu" platform).
///
/// Operands: hyper (float32[16], optax_rules.hpp's hyper_index), then the n parameters, the n
/// gradients and, per state the kind has (0, 1 or 2), its n tensors. Results: n parameters
/// (fused form, `inplace`) or n updates (Optax's form), then the states. XLA aliases every
/// written state (and the fused form's parameters) to its operand (input_output_aliases); where
/// it did not (a backend without aliasing), the operand is copied into the result first.
///
/// Leaves are grouped by element types, and each group runs one cached plan (runner.hpp) made
/// by the loaded unit for its combination (unit.cc: a library per optimizer kind, form and
/// dtypes, loaded by FusedoptJaxAddUnit when Python traces a step that needs it). Plans are
/// kept per device and geometry for the life of the process, each device's under a mutex of its
/// own (the library's only state, with the units' list).
///
/// Two CUDA entry points run the same handler: `FusedoptJaxStepCuda`, a plain thunk that XLA
/// runs at every execution, and `FusedoptJaxStepCudaGraph`, registered command-buffer
/// compatible: XLA may record it into a CUDA graph (calling it under stream capture, once per
/// set of buffer addresses) and replay the graph without calling it again (unit.cc,
/// `run_captured`). `FusedoptJaxHandlerCalls()` counts the handler's calls (tests use it to see
/// replays).
///
/// FUSEDOPT_JAX_PROFILE=N (diagnosis): every N calls, the handler's mean host time per call and
/// how many of those calls had to bind their leaves anew go to stderr.
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runner.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace fusedopt_jax {
namespace FUSEDOPT_JAX_BACKEND {
namespace {

constexpr std::int64_t hyper_floats = 16;

bool to_dtype(ffi::DataType t, dtype& out)
{
  if (t == ffi::DataType::F32) {
    out = dtype::f32;
    return true;
  }
  if (t == ffi::DataType::BF16) {
    out = dtype::bf16;
    return true;
  }
  return false;
}

std::size_t width(dtype d) { return d == dtype::f32 ? 4 : 2; }

/// One device's runners, under a mutex of its own: XLA runs each local device's program on a
/// thread of its own, and a plan's first build synchronises its stream; one device's calls
/// never wait for another's.
struct device_cache {
  std::mutex mutex;
  std::map<std::string, std::unique_ptr<runner>> runners;
};

/// The loaded units' factories (FusedoptJaxAddUnit: added while steps may run) and the devices'
/// runners.
struct plan_cache {
  std::mutex mutex;  ///< guards `units` and `devices` (the map, not a device's runners)
  std::vector<unit_maker> units;
  std::map<int, std::unique_ptr<device_cache>> devices;

  device_cache& on(int device)
  {
    std::lock_guard<std::mutex> lock(mutex);
    std::unique_ptr<device_cache>& d = devices[device];
    if (!d) { d = std::make_unique<device_cache>(); }
    return *d;
  }
};

plan_cache& cache()
{
  static plan_cache* c = new plan_cache;  // never destroyed: XLA may call in at exit
  return *c;
}

/// Geometry of one group on one device, and the call's place in its pytree (the `first` attribute,
/// its first leaf's index): the key of its plan. Calls of one step over equal geometry (a model's repeated blocks
/// split into calls of 256 leaves) keep a plan each instead of rebinding one in turn.
std::string cache_key(int device, std::int64_t first_leaf, group_key const& k, std::vector<leaf> const& leaves)
{
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a of the sizes
  for (leaf const& l : leaves) {
    auto s = static_cast<std::uint64_t>(l.size);
    for (int b = 0; b < 8; ++b) {
      h ^= (s >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
  return std::to_string(device) + ":" + std::to_string(first_leaf) + ":" + std::to_string(k.kind) + ":" + std::to_string(k.inplace) + ":" +
         std::to_string(static_cast<int>(k.param)) + std::to_string(static_cast<int>(k.state1)) +
         std::to_string(static_cast<int>(k.state2)) + std::to_string(static_cast<int>(k.update)) + ":" +
         std::to_string(leaves.size()) + ":" + std::to_string(h);
}

ffi::Error fail(std::string message) { return ffi::Error::InvalidArgument("fusedopt_jax: " + std::move(message)); }

char const* name_of(dtype d) { return d == dtype::f32 ? "float32" : "bfloat16"; }

/// A runner for the group from the first loaded unit that makes one.
std::unique_ptr<runner> make_runner(plan_cache& c, group_key const& key)
{
  std::vector<unit_maker> units;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    units = c.units;
  }
  for (unit_maker make : units) {
    if (runner* r = make(&key)) { return std::unique_ptr<runner>(r); }
  }
  return nullptr;
}

/// FUSEDOPT_JAX_PROFILE's counters (under a mutex of their own: devices' calls run at once).
struct profile {
  std::mutex mutex;
  long every = 0;
  long calls = 0, bound = 0;
  double seconds = 0;
};

profile& profiler()
{
  static profile* p = [] {
    auto* q = new profile;  // never destroyed, as the cache
    char const* v = std::getenv("FUSEDOPT_JAX_PROFILE");
    q->every = v != nullptr ? std::atol(v) : 0;
    return q;
  }();
  return *p;
}

void record(double seconds, bool bound)
{
  profile& p = profiler();
  std::lock_guard<std::mutex> lock(p.mutex);
  ++p.calls;
  p.bound += bound ? 1 : 0;
  p.seconds += seconds;
  if (p.calls == p.every) {
    std::fprintf(stderr, "fusedopt_jax: handler %.1f us a call over %ld calls, %ld of them bound their leaves anew\n",
                 p.seconds / static_cast<double>(p.calls) * 1e6, p.calls, p.bound);
    p.calls = p.bound = 0;
    p.seconds = 0;
  }
}

struct device_guard {
  int previous;
  explicit device_guard(int device) : previous(set_device(device)) {}
  // A destructor must not throw (std::terminate): a failed restore leaves the error to the
  // runtime's next call.
  ~device_guard()
  {
    try {
      set_device(previous);
    } catch (...) {
    }
  }
  device_guard(device_guard const&) = delete;
  device_guard& operator=(device_guard const&) = delete;
};

std::atomic<long>& handler_calls()
{
  static std::atomic<long> calls{0};
  return calls;
}

/// Calls that bound their leaves anew (a new plan or a rebind): tests see plans kept.
std::atomic<long>& handler_binds()
{
  static std::atomic<long> binds{0};
  return binds;
}

// A function-try-block: nothing thrown (a CUDA error in copy_async, an allocation) may cross
// XLA's C interface; it becomes the call's error, a Python exception.
ffi::Error step(void* stream, std::int64_t kind_value, bool inplace, std::int64_t n, std::int64_t first_leaf, ffi::RemainingArgs args,
                ffi::RemainingRets rets)
try {
  auto const started = std::chrono::steady_clock::now();
  handler_calls().fetch_add(1, std::memory_order_relaxed);
  if (kind_value < 0 || kind_value >= num_kinds) { return fail("unknown optimizer kind " + std::to_string(kind_value)); }
  auto const k = static_cast<kind>(kind_value);
  int const states = states_of(k);
  auto const expected_args = static_cast<std::size_t>(1 + n * (2 + states));
  auto const expected_rets = static_cast<std::size_t>(n * (1 + states));
  if (n < 0 || args.size() != expected_args || rets.size() != expected_rets) {
    return fail("the call has " + std::to_string(args.size()) + " operands and " + std::to_string(rets.size()) +
                " results, expected " + std::to_string(expected_args) + " and " + std::to_string(expected_rets) +
                " for " + std::to_string(n) + " leaves");
  }
  auto hyper = args.get<ffi::AnyBuffer>(0);
  if (hyper.has_error()) { return hyper.error(); }
  if (hyper->element_type() != ffi::DataType::F32 || static_cast<std::int64_t>(hyper->element_count()) < hyper_floats) {
    return fail("the hyperparameter operand must be float32[16]");
  }
  auto const* hyper_data = static_cast<float const*>(hyper->untyped_data());

  std::vector<std::pair<group_key, std::vector<leaf>>> groups;
  void const* first = nullptr;
  for (std::int64_t i = 0; i < n; ++i) {
    auto in = [&](std::int64_t block) { return args.get<ffi::AnyBuffer>(static_cast<std::size_t>(1 + block * n + i)); };
    auto out = [&](std::int64_t block) { return rets.get<ffi::AnyBuffer>(static_cast<std::size_t>(block * n + i)); };
    auto p = in(0);
    auto g = in(1);
    auto r0 = out(0);
    if (p.has_error()) { return p.error(); }
    if (g.has_error()) { return g.error(); }
    if (r0.has_error()) { return r0.error(); }
    group_key key;
    key.kind = static_cast<int>(k);
    key.inplace = inplace;
    if (!to_dtype(p->element_type(), key.param)) { return fail("leaf " + std::to_string(i) + ": unsupported parameter type"); }
    if (g->element_type() != p->element_type()) { return fail("leaf " + std::to_string(i) + ": gradient type differs from the parameter's"); }
    dtype r0_type{};
    if (!to_dtype((*r0)->element_type(), r0_type)) { return fail("leaf " + std::to_string(i) + ": unsupported result type"); }
    auto const size = static_cast<std::int64_t>(p->element_count());
    if (static_cast<std::int64_t>(g->element_count()) != size || static_cast<std::int64_t>((*r0)->element_count()) != size) {
      return fail("leaf " + std::to_string(i) + ": gradient or result size differs from the parameter's");
    }
    leaf l;
    l.size = size;
    l.grad = g->untyped_data();
    if (inplace) {
      if (r0_type != key.param) { return fail("leaf " + std::to_string(i) + ": result type differs from the parameter's"); }
      l.param = (*r0)->untyped_data();
      if (l.param != p->untyped_data() && size > 0) { copy_async(l.param, p->untyped_data(), size * width(key.param), stream); }
    } else {
      key.update = r0_type;
      l.param_in = p->untyped_data();
      l.update = (*r0)->untyped_data();
    }
    for (int s = 0; s < states; ++s) {
      auto si = in(2 + s);
      auto so = out(1 + s);
      if (si.has_error()) { return si.error(); }
      if (so.has_error()) { return so.error(); }
      dtype t{};
      if (!to_dtype(si->element_type(), t) || (*so)->element_type() != si->element_type()) {
        return fail("leaf " + std::to_string(i) + ": unsupported state type");
      }
      if (static_cast<std::int64_t>(si->element_count()) != size || static_cast<std::int64_t>((*so)->element_count()) != size) {
        return fail("leaf " + std::to_string(i) + ": state size differs from the parameter's");
      }
      void* data = (*so)->untyped_data();
      if (data != si->untyped_data() && size > 0) { copy_async(data, si->untyped_data(), size * width(t), stream); }
      (s == 0 ? key.state1 : key.state2) = t;
      (s == 0 ? l.state1 : l.state2) = data;
    }
    if (first == nullptr && size > 0) { first = l.grad; }
    auto it = groups.begin();
    while (it != groups.end() && !(it->first == key)) { ++it; }
    if (it == groups.end()) {
      groups.emplace_back(key, std::vector<leaf>{});
      it = groups.end() - 1;
    }
    it->second.push_back(l);
  }
  if (first == nullptr) { return ffi::Error::Success(); }  // nothing to update

  int const device = device_of(first);
  device_guard guard(device);
  plan_cache& c = cache();
  device_cache& d = c.on(device);
  std::lock_guard<std::mutex> lock(d.mutex);
  bool bound = false;
  for (auto& [key, leaves] : groups) {
    std::unique_ptr<runner>& r = d.runners[cache_key(device, first_leaf, key, leaves)];
    if (!r) { r = make_runner(c, key); }
    if (!r) {
      std::string states_named;  // the states the kind has, as its unit is named
      if (states > 0) { states_named += std::string(", states ") + name_of(key.state1); }
      if (states > 1) { states_named += std::string(" / ") + name_of(key.state2); }
      return fail("no unit is loaded for optimizer kind " + std::to_string(key.kind) + (key.inplace ? ", fused form" : ", Optax's form") +
                  ", parameters " + name_of(key.param) + states_named +
                  ": fusedopt_jax builds and loads the units a step needs when the step is traced; a program not traced in "
                  "this process (deserialized) needs fusedopt_jax.register(units=\"all\") first");
    }
    bound = r->run(leaves, hyper_data, stream) || bound;
  }
  if (bound) { handler_binds().fetch_add(1, std::memory_order_relaxed); }
  if (profiler().every > 0) {
    record(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), bound);
  }
  return ffi::Error::Success();
} catch (std::exception const& e) {
  return fail(e.what());
} catch (...) {
  return fail("an unknown C++ exception");
}

#if FUSEDOPT_JAX_CUDA
ffi::Error step_cuda(void* stream, std::int64_t kind_value, bool inplace, std::int64_t n, std::int64_t first_leaf, ffi::RemainingArgs args,
                     ffi::RemainingRets rets)
{
  return step(stream, kind_value, inplace, n, first_leaf, args, rets);
}
#else
ffi::Error step_cpu(std::int64_t kind_value, bool inplace, std::int64_t n, std::int64_t first_leaf, ffi::RemainingArgs args,
                    ffi::RemainingRets rets)
{
  return step(nullptr, kind_value, inplace, n, first_leaf, args, rets);
}
#endif

}  // namespace
}  // namespace FUSEDOPT_JAX_BACKEND
}  // namespace fusedopt_jax

// The entry points are the only symbols the libraries export (built with -fvisibility=hidden).
extern "C" __attribute__((visibility("default"))) long FusedoptJaxHandlerCalls()
{
  return fusedopt_jax::FUSEDOPT_JAX_BACKEND::handler_calls().load();
}

extern "C" __attribute__((visibility("default"))) long FusedoptJaxHandlerBinds()
{
  return fusedopt_jax::FUSEDOPT_JAX_BACKEND::handler_binds().load();
}

/// Loads the unit library at `path` (unit.cc, built by fusedopt_jax/_build.py for this backend)
/// and adds its factory; it stays loaded for the life of the process. Returns 0, or 1 with the
/// reason in `message` (at most `capacity` bytes, terminated).
extern "C" __attribute__((visibility("default"))) int FusedoptJaxAddUnit(char const* path, char* message, int capacity)
{
  namespace backend = fusedopt_jax::FUSEDOPT_JAX_BACKEND;
  auto const refuse = [&](char const* why, char const* more = "") {
    if (capacity > 0) { std::snprintf(message, static_cast<std::size_t>(capacity), "%s%s", why, more); }
    return 1;
  };
  try {  // nothing thrown may cross into ctypes
    void* library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      char const* why = dlerror();
      return refuse(why != nullptr ? why : "dlopen failed");
    }
    auto const make = reinterpret_cast<fusedopt_jax::unit_maker>(dlsym(library, fusedopt_jax::unit_maker_symbol));
    if (make == nullptr) { return refuse("the library exports no ", fusedopt_jax::unit_maker_symbol); }  // the other backend's unit?
    backend::plan_cache& c = backend::cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    c.units.push_back(make);  // a device's first step with this unit may be waiting for it
    return 0;
  } catch (std::exception const& e) {
    return refuse(e.what());
  } catch (...) {
    return refuse("an unknown C++ exception");
  }
}

#if FUSEDOPT_JAX_CUDA
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* FusedoptJaxStepCuda(XLA_FFI_CallFrame* call_frame);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* FusedoptJaxStepCudaGraph(XLA_FFI_CallFrame* call_frame);
#else
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* FusedoptJaxStepCpu(XLA_FFI_CallFrame* call_frame);
#endif

#if FUSEDOPT_JAX_CUDA
namespace {
auto cuda_binding()
{
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<void*>>()
      .Attr<std::int64_t>("kind")
      .Attr<bool>("inplace")
      .Attr<std::int64_t>("n")
      .Attr<std::int64_t>("first")
      .RemainingArgs()
      .RemainingRets();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedoptJaxStepCuda, fusedopt_jax::cuda_backend::step_cuda, cuda_binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedoptJaxStepCudaGraph, fusedopt_jax::cuda_backend::step_cuda, cuda_binding(),
                              {ffi::Traits::kCmdBufferCompatible});
#else
XLA_FFI_DEFINE_HANDLER_SYMBOL(FusedoptJaxStepCpu, fusedopt_jax::host_backend::step_cpu,
                              ffi::Ffi::Bind()
                                  .Attr<std::int64_t>("kind")
                                  .Attr<bool>("inplace")
                                  .Attr<std::int64_t>("n")
                                  .Attr<std::int64_t>("first")
                                  .RemainingArgs()
                                  .RemainingRets());
#endif
