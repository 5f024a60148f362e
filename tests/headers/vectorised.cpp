// fusedopt vendored without CMake, at -O2: the host backend's Adam loop vectorises with the
// compiler's default flags (no -fno-math-errno, no -O3, no -march; issue 47). Compiled, never
// run, by the test headers_vectorised (tests/headers/CMakeLists.txt), which disassembles the
// object: Adam's per-element square root is the only packed float square root in it, so its
// absence means the loop runs one element at a time (4-5x slower than vectorised).
#include <fusedopt/fusedopt.hpp>

#include <cstdint>

namespace fo = fusedopt;

void adam_step(fo::tensor_list<float> const& params, fo::tensor_list<float const> const& grads,
               fo::tensor_list<float> const& exp_avgs, fo::tensor_list<float> const& exp_avg_sqs, std::int64_t step)
{
  auto const lists = fo::bind(fo::slot::param = params, fo::slot::grad = grads, fo::slot::exp_avg = exp_avgs,
                              fo::slot::exp_avg_sq = exp_avg_sqs);
  fo::host::apply(fo::rules::adam{}, lists, fo::step_info{step});
}
