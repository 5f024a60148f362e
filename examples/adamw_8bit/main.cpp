// AdamW with 8-bit moments (docs/quantized_states.md): the same rule as full-precision AdamW,
// the moments bound as blockwise-quantized storage instead of float arrays. The storage of a
// tensor of n elements is `units_for(n)` 16-byte units (1.016 bytes per element); the backends
// dequantize on load and requantize on store in the same pass. The example steps a model with
// fp32 moments and one with 8-bit moments side by side, prints how far the parameters drift
// apart and what the states weigh, and reads one block's scale and codes back.
// With fo::cuda::make_plan and device memory the same lists run on a GPU.
#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace fo = fusedopt;

int main()
{
  std::vector<std::int64_t> const sizes{70000, 1000};
  std::int64_t total = 0;
  for (auto n : sizes) { total += n; }

  std::vector<float> param_q(static_cast<std::size_t>(total)), grad(param_q.size());
  for (std::size_t i = 0; i < param_q.size(); ++i) { param_q[i] = std::sin(0.37f * static_cast<float>(i)); }
  std::vector<float> param_f = param_q, m_f(param_q.size()), v_f(param_q.size());

  // One storage per tensor and moment; all-zero storage is a state of zeros.
  std::vector<std::vector<fo::signed_q8>> m_q;
  std::vector<std::vector<fo::unsigned_q8>> v_q;
  fo::tensor_list<float> p_q, p_f, m_full, v_full;
  fo::tensor_list<float const> g;
  fo::tensor_list<fo::signed_q8> exp_avgs;
  fo::tensor_list<fo::unsigned_q8> exp_avg_sqs;
  std::int64_t offset = 0;
  for (auto n : sizes) {
    m_q.emplace_back(static_cast<std::size_t>(fo::signed_q8::units_for(n)));
    v_q.emplace_back(static_cast<std::size_t>(fo::unsigned_q8::units_for(n)));
    exp_avgs.push_back(m_q.back().data(), n);
    exp_avg_sqs.push_back(v_q.back().data(), n);
    auto const at = static_cast<std::size_t>(offset);
    p_q.push_back(param_q.data() + at, n);
    p_f.push_back(param_f.data() + at, n);
    m_full.push_back(m_f.data() + at, n);
    v_full.push_back(v_f.data() + at, n);
    g.push_back(grad.data() + at, n);
    offset += n;
  }
  auto eight_bit = fo::host::make_plan(fo::bind(fo::slot::param = p_q, fo::slot::grad = g,
                                                fo::slot::exp_avg = exp_avgs, fo::slot::exp_avg_sq = exp_avg_sqs));
  auto full = fo::host::make_plan(
    fo::bind(fo::slot::param = p_f, fo::slot::grad = g, fo::slot::exp_avg = m_full, fo::slot::exp_avg_sq = v_full));

  fo::rules::adamw adamw;
  adamw.lr = 1e-3;
  adamw.weight_decay = 0.01;
  std::uint32_t seed = 12345;
  for (std::int64_t step = 1; step <= 20; ++step) {
    for (auto& x : grad) {  // a small linear congruential generator: the same run everywhere
      seed = seed * 1664525u + 1013904223u;
      x = static_cast<float>(seed >> 8) / 16777216.f - 0.5f;
    }
    eight_bit.run(adamw, fo::step_info{step});
    full.run(adamw, fo::step_info{step});
  }

  float drift = 0.f;
  for (std::size_t i = 0; i < param_q.size(); ++i) { drift = std::max(drift, std::fabs(param_q[i] - param_f[i])); }
  std::int64_t bytes_8bit = 0;
  for (auto n : sizes) { bytes_8bit += fo::signed_q8::bytes_for(n) + fo::unsigned_q8::bytes_for(n); }
  std::printf("20 AdamW steps, lr 1e-3: largest parameter difference, 8-bit against fp32 moments: %.2e\n",
              static_cast<double>(drift));
  std::printf("moments: %lld bytes in 8 bits, %lld in fp32\n", static_cast<long long>(bytes_8bit),
              static_cast<long long>(2 * total * 4));

  // One block read back on the host: its scale and the first element's code and value.
  fo::quantized_state<fo::signed_q8 const> first_m(m_q.front().data(), sizes.front());
  std::printf("exp_avg of tensor 0, block 0: scale %.4g, element 0 code %d = %.4g (fp32: %.4g)\n",
              static_cast<double>(first_m.scale(0)), first_m.code(0), static_cast<double>(first_m.value(0)),
              static_cast<double>(m_f[0]));
  // 20 steps of lr 1e-3 move a parameter by at most about 2e-2; 8-bit moments change the
  // update's direction only within the quantization's error.
  return drift < 1e-3f ? 0 : 1;
}
