/// @file unit_harness.cc
/// @brief Steps a fusedopt_jax unit (a library csrc/unit.cc builds: one optimizer kind, form and
/// dtype combination) on the host without jax or XLA, for tests/test_units_without_jax.py.
///
///   unit_harness UNIT INPUT OUTPUT
///
/// INPUT (little-endian): int64 kind, inplace, param, state1, state2, update (runner.hpp's
/// values), leaves, steps; int64 sizes[leaves]; float32 hyper[steps][16]; each leaf's parameter;
/// each step's gradients, leaf by leaf; each leaf's first state, then each leaf's second (as many
/// states as the kind has). Elements are 4 bytes (float32) or 2 (bfloat16). OUTPUT: each leaf's
/// parameter after the steps (the fused form) or the last step's update (Optax's form), then the
/// states, in INPUT's order.
#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "runner.hpp"

namespace {

using namespace fusedopt_jax;

[[noreturn]] void die(std::string const& message)
{
  std::fprintf(stderr, "unit_harness: %s\n", message.c_str());
  std::exit(1);
}

std::size_t width(std::int64_t d) { return d == 0 ? 4 : 2; }

struct reader {
  std::FILE* f;
  template <class T>
  T one()
  {
    T value{};
    if (std::fread(&value, sizeof value, 1, f) != 1) { die("INPUT ends early"); }
    return value;
  }
  void bytes(void* data, std::size_t n)
  {
    if (n > 0 && std::fread(data, 1, n, f) != n) { die("INPUT ends early"); }
  }
};

}  // namespace

int main(int argc, char** argv)
{
  if (argc != 4) { die("usage: unit_harness UNIT INPUT OUTPUT"); }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) { die(dlerror()); }
  auto const make = reinterpret_cast<unit_maker>(dlsym(library, "FusedoptJaxUnitMakeCpu"));
  if (make == nullptr) { die(std::string(argv[1]) + " exports no FusedoptJaxUnitMakeCpu"); }

  std::FILE* in = std::fopen(argv[2], "rb");
  if (in == nullptr) { die(std::string("cannot open ") + argv[2]); }
  reader r{in};
  std::int64_t header[8];
  for (auto& h : header) { h = r.one<std::int64_t>(); }
  group_key key;
  key.kind = static_cast<int>(header[0]);
  key.inplace = header[1] != 0;
  key.param = static_cast<dtype>(header[2]);
  key.state1 = static_cast<dtype>(header[3]);
  key.state2 = static_cast<dtype>(header[4]);
  key.update = static_cast<dtype>(header[5]);
  std::int64_t const n = header[6], steps = header[7];
  int const states = states_of(static_cast<kind>(key.kind));
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(n));
  for (auto& s : sizes) { s = r.one<std::int64_t>(); }
  std::vector<float> hyper(static_cast<std::size_t>(steps * 16));
  r.bytes(hyper.data(), hyper.size() * sizeof(float));

  auto buffers = [&](std::int64_t type) {
    std::vector<std::vector<unsigned char>> b;
    for (std::int64_t s : sizes) { b.emplace_back(static_cast<std::size_t>(s) * width(type)); }
    return b;
  };
  auto params = buffers(header[2]), updates = buffers(header[5]), state1 = buffers(header[3]), state2 = buffers(header[4]);
  for (auto& p : params) { r.bytes(p.data(), p.size()); }
  std::vector<decltype(params)> grads;
  for (std::int64_t t = 0; t < steps; ++t) {
    grads.push_back(buffers(header[2]));
    for (auto& g : grads.back()) { r.bytes(g.data(), g.size()); }
  }
  if (states > 0) {
    for (auto& s : state1) { r.bytes(s.data(), s.size()); }
  }
  if (states > 1) {
    for (auto& s : state2) { r.bytes(s.data(), s.size()); }
  }
  std::fclose(in);

  std::unique_ptr<runner> run(make(&key));
  if (!run) { die("the unit makes no runner for this key"); }
  try {
    for (std::int64_t t = 0; t < steps; ++t) {
      std::vector<leaf> leaves(static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < leaves.size(); ++i) {
        leaf& l = leaves[i];
        l.size = sizes[i];
        l.grad = grads[static_cast<std::size_t>(t)][i].data();
        if (key.inplace) {
          l.param = params[i].data();
        } else {
          l.param_in = params[i].data();
          l.update = updates[i].data();
        }
        if (states > 0) { l.state1 = state1[i].data(); }
        if (states > 1) { l.state2 = state2[i].data(); }
      }
      run->run(leaves, hyper.data() + 16 * t, nullptr);
    }
  } catch (std::exception const& e) {
    die(e.what());
  }

  std::FILE* out = std::fopen(argv[3], "wb");
  if (out == nullptr) { die(std::string("cannot open ") + argv[3]); }
  auto write = [&](std::vector<std::vector<unsigned char>> const& b) {
    for (auto const& x : b) {
      if (!x.empty() && std::fwrite(x.data(), 1, x.size(), out) != x.size()) { die("cannot write OUTPUT"); }
    }
  };
  write(key.inplace ? params : updates);
  if (states > 0) { write(state1); }
  if (states > 1) { write(state2); }
  return std::fclose(out) == 0 ? 0 : 1;
}
