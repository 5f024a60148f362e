/// @file unit_harness.cpp
/// @brief Runs a plan of a fusedopt_torch unit on the host, without torch: what
/// tests/python/test_units.py uses to check generated units (built-in and user rules) against
/// each other bit for bit and against references, on any machine.
///
///   unit_harness UNIT FAMILY DTYPE LAYOUT FLOAT_STATES STATES STEPS HYPERS OUTPUT
///
/// FAMILY, DTYPE, LAYOUT: plans.hpp's values (DTYPE 0 float32 or 1 float64); FLOAT_STATES the
/// layout's float_states; STATES how many state tensors (zeros at first); HYPERS
/// "lr=1e-3,beta1=0.9,u0=0.5": hyper fields by name, uK a user rule's k-th. Tensors of the sizes
/// below get a parameter and, at every step, a gradient from a fixed pseudo-random sequence.
/// OUTPUT receives, as float64 values: the initial parameters, each step's gradients, the final
/// parameters, then each state's final values (tensor by tensor).
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "plans.hpp"

namespace {

using namespace fusedopt_torch;

std::vector<std::int64_t> const sizes = {1, 3, 16, 17, 255, 1000, 4097};

/// A value in [-1, 1) from a 64-bit linear congruential sequence.
double next_value(std::uint64_t& state)
{
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return static_cast<double>(state >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
}

[[noreturn]] void die(std::string const& message)
{
  std::fprintf(stderr, "unit_harness: %s\n", message.c_str());
  std::exit(2);
}

void set_hyper(hyper& h, std::string const& key, double value)
{
  if (key.size() > 1 && key[0] == 'u') {
    int const k = std::atoi(key.c_str() + 1);
    if (k < 0 || k >= hyper::max_user) { die("bad user hyperparameter " + key); }
    h.user[k] = value;
    return;
  }
#define FUSEDOPT_TORCH_NUMBER(field) \
  if (key == #field) {               \
    h.field = value;                 \
    return;                          \
  }
#define FUSEDOPT_TORCH_FLAG(field) \
  if (key == #field) {             \
    h.field = value != 0.0;        \
    return;                        \
  }
  FUSEDOPT_TORCH_HYPER_NUMBERS(FUSEDOPT_TORCH_NUMBER)
  FUSEDOPT_TORCH_HYPER_FLAGS(FUSEDOPT_TORCH_FLAG)
#undef FUSEDOPT_TORCH_NUMBER
#undef FUSEDOPT_TORCH_FLAG
  die("unknown hyperparameter " + key);
}

/// Tensors of one element type: float or double, held as raw bytes.
struct buffer {
  std::vector<unsigned char> bytes;
  bool is_double = false;
  void resize(std::int64_t n, bool as_double)
  {
    is_double = as_double;
    bytes.assign(static_cast<std::size_t>(n) * (as_double ? 8 : 4), 0);
  }
  double get(std::int64_t i) const
  {
    if (is_double) {
      double v;
      std::memcpy(&v, bytes.data() + 8 * i, 8);
      return v;
    }
    float v;
    std::memcpy(&v, bytes.data() + 4 * i, 4);
    return v;
  }
  void set(std::int64_t i, double v)
  {
    if (is_double) {
      std::memcpy(bytes.data() + 8 * i, &v, 8);
    } else {
      auto const f = static_cast<float>(v);
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    }
  }
  void* data() { return bytes.data(); }
};

}  // namespace

int main(int argc, char** argv)
{
  if (argc != 10) { die("usage: unit_harness UNIT FAMILY DTYPE LAYOUT FLOAT_STATES STATES STEPS HYPERS OUTPUT"); }
  void* handle = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) { die(std::string("dlopen: ") + dlerror()); }
  auto const entry = reinterpret_cast<unit_entry>(dlsym(handle, unit_entry_point));
  if (entry == nullptr) { die("no entry point"); }
  unit_api const* api = entry();
  if (api == nullptr || api->abi != unit_abi || api->make_plan == nullptr) { die("not a plan unit of this ABI"); }

  auto const f = static_cast<family>(std::atoi(argv[2]));
  auto const t = static_cast<dtype>(std::atoi(argv[3]));
  if (t != dtype::f32 && t != dtype::f64) { die("dtype must be 0 (float32) or 1 (float64)"); }
  bool const as_double = t == dtype::f64;
  layout l;
  auto const bits = static_cast<std::uint32_t>(std::strtoul(argv[4], nullptr, 10));
  l.amsgrad = (bits & layout::amsgrad_bit) != 0;
  l.momentum = (bits & layout::momentum_bit) != 0;
  l.centered = (bits & layout::centered_bit) != 0;
  l.clip = (bits & layout::clip_bit) != 0;
  l.kahan = (bits & layout::kahan_bit) != 0;
  l.quantized = (bits & layout::quantized_bit) != 0;
  l.float_states = static_cast<std::uint32_t>(std::strtoul(argv[5], nullptr, 10));
  int const states = std::atoi(argv[6]);
  int const steps = std::atoi(argv[7]);
  hyper h;
  std::string spec = argv[8];
  for (std::size_t start = 0; start < spec.size();) {
    std::size_t const end = spec.find(',', start) == std::string::npos ? spec.size() : spec.find(',', start);
    std::string const item = spec.substr(start, end - start);
    std::size_t const eq = item.find('=');
    if (eq == std::string::npos) { die("bad hyperparameter " + item); }
    set_hyper(h, item.substr(0, eq), std::atof(item.c_str() + eq + 1));
    start = end + 1;
  }

  std::size_t const n = sizes.size();
  std::vector<buffer> params(n), grads(n);
  std::vector<std::vector<buffer>> state(static_cast<std::size_t>(states), std::vector<buffer>(n));
  lists x;
  x.states.resize(static_cast<std::size_t>(states));
  std::uint64_t seed = 12345;
  std::vector<double> out;
  for (std::size_t i = 0; i < n; ++i) {
    params[i].resize(sizes[i], as_double);
    grads[i].resize(sizes[i], as_double);
    for (std::int64_t j = 0; j < sizes[i]; ++j) { params[i].set(j, next_value(seed)); }
    for (std::int64_t j = 0; j < sizes[i]; ++j) { out.push_back(params[i].get(j)); }
    x.sizes.push_back(sizes[i]);
    x.param.push_back(params[i].data());
    x.grad.push_back(grads[i].data());
    for (int k = 0; k < states; ++k) {
      bool const in_float = ((l.float_states >> k) & 1u) != 0;
      state[static_cast<std::size_t>(k)][i].resize(sizes[i], as_double && !in_float);
      x.states[static_cast<std::size_t>(k)].push_back(state[static_cast<std::size_t>(k)][i].data());
    }
  }
  std::string error;
  int threads = 2;
  std::unique_ptr<plan> p(api->make_plan(f, t, l, x, &threads, &error));
  if (!p) { die("make_plan: " + error); }
  try {
    for (int s = 1; s <= steps; ++s) {
      for (std::size_t i = 0; i < n; ++i) {
        for (std::int64_t j = 0; j < sizes[i]; ++j) {
          grads[i].set(j, next_value(seed));
          out.push_back(grads[i].get(j));
        }
      }
      step_count count;
      count.value = s;
      p->run(h, count, amp_inputs{}, nullptr);
    }
  } catch (std::exception const& e) {
    die(std::string("run: ") + e.what());
  }
  for (std::size_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < sizes[i]; ++j) { out.push_back(params[i].get(j)); }
  }
  for (int k = 0; k < states; ++k) {
    for (std::size_t i = 0; i < n; ++i) {
      for (std::int64_t j = 0; j < sizes[i]; ++j) { out.push_back(state[static_cast<std::size_t>(k)][i].get(j)); }
    }
  }
  std::FILE* file = std::fopen(argv[9], "wb");
  if (file == nullptr || std::fwrite(out.data(), sizeof(double), out.size(), file) != out.size()) {
    die("cannot write the output");
  }
  std::fclose(file);
  return 0;
}
