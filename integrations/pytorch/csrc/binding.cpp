/// @file binding.cpp
/// @brief fusedopt_torch's core: the module `_C` (the engine is engine.cpp's), GradNorm, the
/// hyperparameters' record, the 8-bit states' (de)quantizers and the unit loader.
///
/// The core has no kernels: it loads *units* (shared libraries that fusedopt_torch/_build.py
/// compiles on demand, or setup.py ahead of time; plans.hpp's unit_api) and makes plans
/// through them. Each engine has a provider, a Python callable that returns the unit for a
/// (device, dtype, layout) it meets, compiling it the first time.
#include "core.hpp"

#include <fusedopt/rules/nadam.hpp>

#include <dlfcn.h>

#include <memory>
#include <string>
#include <vector>

namespace fusedopt_torch {
namespace {

/// `_C.GradNorm`: the norm of a list of gradients through one fusedopt norm plan (norm_of's
/// reduction pass and hook), kept and rebound across calls as the engine keeps its plans: the
/// host cost of a few launches where torch's get_total_norm launches per tensor and stacks
/// one view per tensor (FusedOptimizer.clip_grad_norm_).
class grad_norm {
 public:
  /// Norm plans from the units `provider(device, dtype)` returns (a unit_api address).
  explicit grad_norm(py::object provider) : provider_(std::move(provider)) {}

  /// The L2 norm (`inf`: the largest magnitude) of every element of `grads`, as a 0-d float64
  /// tensor on their device (squares computed in float, summed in double; float64, so that the
  /// norm of float16 gradients GradScaler has scaled does not overflow), enqueued on the
  /// current stream; None where the plan does not take them (several devices or dtypes,
  /// tensors neither on the CPU nor on a CUDA device, a dtype other than float32, float64,
  /// float16, bfloat16, a tensor that is not dense): then torch's function serves.
  c10::optional<at::Tensor> compute(std::vector<at::Tensor> const& grads, bool inf)
  {
    if (grads.empty()) { return c10::nullopt; }
    at::Tensor const& first = grads.front();
    auto const type = first.scalar_type();
    auto const t = plan_dtype(type);
    if (!t || (!first.is_cpu() && !first.is_cuda())) { return c10::nullopt; }
    next_pointers_.clear();
    next_sizes_.clear();
    for (auto const& g : grads) {
      if (g.device() != first.device() || g.scalar_type() != type || g.is_sparse() ||
          !g.is_non_overlapping_and_dense()) {
        return c10::nullopt;
      }
      next_pointers_.push_back(g.data_ptr());
      next_sizes_.push_back(g.numel());
    }
    int const device = first.is_cuda() ? first.get_device() : -1;
    void* stream = nullptr;
#if defined(FUSEDOPT_TORCH_WITH_CUDA)
    c10::optional<c10::cuda::CUDAGuard> guard;
    if (device >= 0) {
      guard.emplace(static_cast<c10::DeviceIndex>(device));
      if (!plan_ || device_ != device) { stream_.reset(); }  // a new plan follows no earlier run
      auto const current = at::cuda::getCurrentCUDAStream(device);
      follow_stream(stream_, current);
      stream = current.stream();
    }
#else
    if (device >= 0) { return c10::nullopt; }
#endif
    at::Tensor total = at::empty({}, first.options().dtype(at::kDouble));
    try {
      if (plan_ && (device_ != device || dtype_ != *t)) { plan_.reset(); }
      // Gradients at the addresses the plan holds (set_to_none=False) need no rebind.
      bool const moved = next_pointers_ != pointers_ || next_sizes_ != sizes_;
      if (plan_ && moved && !plan_->rebind(next_pointers_, next_sizes_, stream)) { plan_.reset(); }
      if (!plan_) {
        unit_api const& unit = unit_at(provider_(device, static_cast<int>(*t)).cast<std::uintptr_t>());
        FUSEDOPT_TORCH_CHECK(unit.make_norm_plan != nullptr, "fusedopt_torch: internal error: the unit makes no norm plans");
        std::string error;
        int threads = at::get_num_threads();
        norm_plan* made = unit.make_norm_plan(*t, next_pointers_, next_sizes_, device < 0 ? &threads : stream, &error);
        FUSEDOPT_TORCH_CHECK(made != nullptr, error);
        plan_.reset(made);
        device_ = device;
        dtype_ = *t;
      }
      pointers_.swap(next_pointers_);
      sizes_.swap(next_sizes_);
      plan_->run(inf, total.data_ptr<double>(), stream);
    } catch (py::error_already_set const&) {
      plan_.reset();
      throw;
    } catch (std::exception const& e) {
      plan_.reset();
      throw std::runtime_error(std::string("fusedopt_torch: gradient norm: ") + e.what());
    }
    return total;
  }

 private:
  py::object provider_;
  std::unique_ptr<norm_plan> plan_;
  int device_ = -1;
  dtype dtype_ = dtype::f32;
  std::vector<void const*> pointers_, next_pointers_;  // the plan's gradients, this call's
  std::vector<std::int64_t> sizes_, next_sizes_;
#if defined(FUSEDOPT_TORCH_WITH_CUDA)
  c10::optional<c10::cuda::CUDAStream> stream_;
#endif
};

}  // namespace

/// `_C.load_unit(path)`: loads a unit (a shared library of kernels) and returns the address of
/// its unit_api, checked for this core's ABI. Units are never unloaded: their plans may live
/// until the process ends.
std::uintptr_t load_unit(std::string const& path)
{
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    char const* why = ::dlerror();
    fail("fusedopt_torch: cannot load the unit ", path, ": ", why != nullptr ? why : "unknown error");
  }
  auto const entry = reinterpret_cast<unit_entry>(::dlsym(handle, unit_entry_point));
  FUSEDOPT_TORCH_CHECK(entry != nullptr, "fusedopt_torch: ", path, " is not a fusedopt_torch unit (no ", unit_entry_point,
                       ")");
  unit_api const* api = entry();
  FUSEDOPT_TORCH_CHECK(api != nullptr && api->abi == unit_abi, "fusedopt_torch: the unit ", path,
                       " was built for another version of fusedopt_torch (unit ABI ", api != nullptr ? api->abi : 0u,
                       ", this core's ", unit_abi, "): delete it from the cache and run again");
  return reinterpret_cast<std::uintptr_t>(api);
}

/// `_C.Hyper.of(**fields)`: a hyper with the named fields set, in one call from Python (a
/// setattr per field through pybind11 cost 14 us per step on GPT-2 small's one group on the
/// H100 machine). Tensor values are skipped: the engine takes them apart and reads them on
/// the device. An unknown name raises AttributeError, as setting it on a Hyper does.
inline hyper hyper_of(py::kwargs const& fields)
{
  hyper h;
  for (auto const& [key, value] : fields) {
    if (THPVariable_Check(value.ptr())) { continue; }
    std::string const name = py::str(key);
    bool found = false;
    if (name == "user") {
      // A user rule's hyperparameters in its spec's order (Tensors: 0 here, read on the device).
      auto const values = value.cast<py::sequence>();
      FUSEDOPT_TORCH_CHECK(values.size() <= static_cast<std::size_t>(hyper::max_user), "fusedopt_torch: a rule takes at most ",
                           hyper::max_user, " hyperparameters, not ", values.size());
      for (std::size_t k = 0; k < values.size(); ++k) {
        py::object const v = values[k];
        h.user[k] = THPVariable_Check(v.ptr()) ? 0.0 : v.cast<double>();
      }
      continue;
    }
#define FUSEDOPT_TORCH_NUMBER(field)                  \
  if (!found && name == #field) {                     \
    h.field = value.cast<double>();                   \
    found = true;                                     \
  }
#define FUSEDOPT_TORCH_FLAG(field)                    \
  if (!found && name == #field) {                     \
    h.field = value.cast<bool>();                     \
    found = true;                                     \
  }
    FUSEDOPT_TORCH_HYPER_NUMBERS(FUSEDOPT_TORCH_NUMBER)
    FUSEDOPT_TORCH_HYPER_FLAGS(FUSEDOPT_TORCH_FLAG)
#undef FUSEDOPT_TORCH_NUMBER
#undef FUSEDOPT_TORCH_FLAG
    if (!found) { throw py::attribute_error("fusedopt_torch: Hyper has no field '" + name + "'"); }
  }
  return h;
}

/// `_C.quantize_state(values, state, is_signed, unit)`: stores `values` (any floating dtype,
/// shape and device) into the 8-bit `state` (of values.numel() elements, on any device) with the
/// bits a step would store, through the host unit at `unit` (its quantizer). A CUDA state makes
/// a round trip through host memory (loading a state_dict, not a step).
void quantize_state_into(at::Tensor const& values, at::Tensor state, bool is_signed, std::uintptr_t unit)
{
  auto const n = values.numel();
  check_quantized_bytes(state, n, "fusedopt_torch: quantize_state");
  auto const& api = unit_at(unit);
  FUSEDOPT_TORCH_CHECK(api.quantize_state != nullptr, "fusedopt_torch: internal error: the unit has no quantizer");
  auto const source = values.detach().to(at::kCPU, at::kFloat).contiguous();
  auto target = state.to(at::kCPU).contiguous();
  std::string error;
  FUSEDOPT_TORCH_CHECK(api.quantize_state(source.data_ptr<float>(), n, target.data_ptr(), is_signed,
                                          at::get_num_threads(), &error),
                       error);
  if (!target.is_same(state)) { state.copy_(target); }
}

/// `_C.dequantize_state(state, numel, is_signed, unit)`: the float32 values of an 8-bit state,
/// as a step reads them, on the state's device.
at::Tensor dequantize_state_of(at::Tensor const& state, std::int64_t numel, bool is_signed, std::uintptr_t unit)
{
  check_quantized_bytes(state, numel, "fusedopt_torch: dequantize_state");
  auto const& api = unit_at(unit);
  FUSEDOPT_TORCH_CHECK(api.dequantize_state != nullptr, "fusedopt_torch: internal error: the unit has no quantizer");
  auto const source = state.detach().to(at::kCPU).contiguous();
  auto values = at::empty({numel}, at::TensorOptions().dtype(at::kFloat));
  std::string error;
  FUSEDOPT_TORCH_CHECK(api.dequantize_state(source.data_ptr(), numel, values.data_ptr<float>(), is_signed,
                                            at::get_num_threads(), &error),
                       error);
  return values.to(state.device());
}

double nadam_mu(double beta1, double momentum_decay, std::int64_t t)
{
  return fusedopt::rules::scale_by_nadam::mu(beta1, momentum_decay, t);
}

double nadam_advanced(double product, double mu, bool single)
{
  return fusedopt::rules::advance_mu_product::advanced(product, mu, single);
}

}  // namespace fusedopt_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  namespace py = pybind11;
  m.doc() = "fusedopt_torch's core: fused optimizer steps on fusedopt plans from units of kernels";
  using fusedopt_torch::family;
  using fusedopt_torch::hyper;
  py::enum_<family> families(m, "Family");
#define FUSEDOPT_TORCH_VALUE(name, plans) families.value(#name, family::name);
  FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_VALUE)
#undef FUSEDOPT_TORCH_VALUE
  families.value("user", family::user);
  // The hyperparameters by name (plans.hpp's hyper); the pointers and mu_product are the engine's.
  py::class_<hyper> hypers(m, "Hyper");
  hypers.def(py::init<>());
#define FUSEDOPT_TORCH_FIELD(name) hypers.def_readwrite(#name, &hyper::name);
  FUSEDOPT_TORCH_HYPER_NUMBERS(FUSEDOPT_TORCH_FIELD)
  FUSEDOPT_TORCH_HYPER_FLAGS(FUSEDOPT_TORCH_FIELD)
#undef FUSEDOPT_TORCH_FIELD
  hypers.def_static("of", &fusedopt_torch::hyper_of,
                    "A Hyper with the given fields set (one call: what step() builds per group and step); "
                    "tensors are skipped, as the engine reads them on the device");
  fusedopt_torch::bind_engine(m);
  py::class_<fusedopt_torch::grad_norm>(m, "GradNorm")
    .def(py::init<py::object>(), py::arg("provider"))
    .def("compute", &fusedopt_torch::grad_norm::compute, py::arg("grads"), py::arg("inf") = false);
  m.def("quantize_state", &fusedopt_torch::quantize_state_into, py::arg("values"), py::arg("state"),
        py::arg("is_signed"), py::arg("unit"));
  m.def("dequantize_state", &fusedopt_torch::dequantize_state_of, py::arg("state"), py::arg("numel"),
        py::arg("is_signed"), py::arg("unit"));
  m.def("load_unit", &fusedopt_torch::load_unit, py::arg("path"),
        "Loads a unit of kernels (a shared library) and returns the address of its entry points");
  m.attr("unit_abi") = fusedopt_torch::unit_abi;
  m.attr("max_user_hyperparameters") = fusedopt_torch::hyper::max_user;
  m.def("quantized_state_bytes", &fusedopt_torch::quantized_state_bytes, py::arg("numel"));
  m.attr("quantized_block_elements") = fusedopt_torch::quantized_block_elements;
#if defined(FUSEDOPT_TORCH_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
