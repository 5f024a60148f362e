// An independent reference of 8-bit blockwise quantization (Dettmers et al., "8-bit Optimizers
// via Block-wise Quantization", 2022), written from the paper's definition of the dynamic map
// and of block-wise quantization, never from fusedopt's code: the maps are built the way the
// paper's implementation states them (bitsandbytes' create_dynamic_map: linspace boundaries,
// their midpoints, powers of ten from std::pow), sorted with std::sort; an element's code is
// found by a linear scan for the nearest value. Shared by tests/host/quantized_states.cpp and
// tests/cuda/quantized_states.cu, with the helpers both use to lay out quantized tensors.
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace fusedopt_test {

/// The paper's dynamic map with 8 bits and 7 exponent bits, in double, sorted ascending.
inline std::vector<double> reference_dynamic_map(bool is_signed)
{
  std::vector<double> values;
  for (int exponent = 0; exponent < 7; ++exponent) {
    int const fractions = is_signed ? (1 << exponent) : (1 << (exponent + 1));
    double const decade = std::pow(10.0, exponent - 6);
    std::vector<double> boundaries(static_cast<std::size_t>(fractions) + 1);
    for (int j = 0; j <= fractions; ++j) { boundaries[static_cast<std::size_t>(j)] = 0.1 + (1.0 - 0.1) * j / fractions; }
    for (int j = 0; j < fractions; ++j) {
      double const mean = (boundaries[static_cast<std::size_t>(j)] + boundaries[static_cast<std::size_t>(j) + 1]) / 2;
      values.push_back(decade * mean);
      if (is_signed) { values.push_back(-decade * mean); }
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::sort(values.begin(), values.end());
  return values;
}

/// The map's values as stored (rounded to float).
inline std::vector<float> reference_map_floats(bool is_signed)
{
  std::vector<float> out;
  for (double v : reference_dynamic_map(is_signed)) { out.push_back(static_cast<float>(v)); }
  return out;
}

/// The code of x in a block of absolute maximum `absmax`: q = x * (1 / absmax) in float (the
/// documented normalisation), then the nearest map value by a linear scan, the lower code on
/// an exact tie; the code of 0 for absmax 0 or subnormal.
inline int reference_code(std::vector<float> const& map, float x, float absmax)
{
  float const inverse = absmax >= std::numeric_limits<float>::min() ? 1.f / absmax : 0.f;
  float const q = x * inverse;
  int best = 0;
  for (int c = 1; c < static_cast<int>(map.size()); ++c) {
    // The distance to a neighbour of q is exact in double (both are floats of close magnitude).
    if (std::fabs(static_cast<double>(q) - map[static_cast<std::size_t>(c)]) <
        std::fabs(static_cast<double>(q) - map[static_cast<std::size_t>(best)])) {
      best = c;
    }
  }
  return best;
}

/// A quantized tensor's blocks holding `values` as the paper quantizes them: each block's
/// scale is its largest |value|, each code the nearest (reference_code).
template <class Q>
std::vector<Q> reference_quantize(std::vector<float> const& values)
{
  std::vector<float> const map = reference_map_floats(Q::map_type::is_signed);
  auto const n = static_cast<std::int64_t>(values.size());
  std::vector<Q> blocks(static_cast<std::size_t>(Q::blocks_for(n)));
  for (std::size_t b = 0; b < blocks.size(); ++b) {
    std::size_t const first = b * Q::block_elements;
    std::size_t const last = std::min(values.size(), first + Q::block_elements);
    float absmax = 0.f;
    for (std::size_t i = first; i < last; ++i) { absmax = std::max(absmax, std::fabs(values[i])); }
    blocks[b].absmax = absmax;
    std::fill(std::begin(blocks[b].codes), std::end(blocks[b].codes), std::uint8_t{0});
    for (std::size_t i = first; i < last; ++i) {
      blocks[b].codes[i - first] = static_cast<std::uint8_t>(reference_code(map, values[i], absmax));
    }
  }
  return blocks;
}

/// The values a quantized tensor of `n` elements holds: map[code] * absmax.
template <class Q>
std::vector<float> reference_dequantize(std::vector<Q> const& blocks, std::int64_t n)
{
  std::vector<float> const map = reference_map_floats(Q::map_type::is_signed);
  std::vector<float> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    Q const& b = blocks[static_cast<std::size_t>(i / Q::block_elements)];
    out[static_cast<std::size_t>(i)] = map[b.codes[i % Q::block_elements]] * b.absmax;
  }
  return out;
}

/// The tensor's blocks and codes in use equal (unused codes of a last block are not compared).
template <class Q>
bool same_blocks(std::vector<Q> const& a, std::vector<Q> const& b, std::int64_t n)
{
  if (a.size() != b.size()) { return false; }
  for (std::int64_t i = 0; i < n; ++i) {
    auto const block = static_cast<std::size_t>(i / Q::block_elements);
    if (a[block].codes[i % Q::block_elements] != b[block].codes[i % Q::block_elements]) { return false; }
  }
  for (std::size_t k = 0; k < a.size(); ++k) {
    if (std::memcmp(&a[k].absmax, &b[k].absmax, sizeof(float)) != 0) { return false; }
  }
  return true;
}

// ---- rules that exercise the storage without an optimizer's arithmetic ----------------

/// Slot = values[offsets[tensor] + index] (memory of the backend's side): what a block stores
/// when its new values are chosen, zeros, huge values and non-finite ones included. Reads
/// nothing, so every block it touches counts as changed.
template <class Slot>
struct assign_state {
  float const* values;
  std::int64_t const* offsets;
  using reads = fusedopt::slots<>;
  using writes = fusedopt::slots<Slot>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fusedopt::step_info const&) const
  {
    e[Slot{}] = values[offsets[e.tensor()] + e.index()];
  }
};

/// param = Slot: the dequantized values, readable as floats.
template <class Slot>
struct read_state {
  using reads = fusedopt::slots<Slot>;
  using writes = fusedopt::slots<fusedopt::slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fusedopt::step_info const&) const
  {
    e[fusedopt::slot::param] = e[Slot{}];
  }
};

/// Slot = Slot: reads and writes every value unchanged.
template <class Slot>
struct keep_state {
  using reads = fusedopt::slots<Slot>;
  using writes = fusedopt::slots<Slot>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fusedopt::step_info const&) const
  {
    e[Slot{}] = e[Slot{}] * 1.0f;
  }
};

/// Values of every magnitude the states meet, both signs (unsigned maps: magnitudes), and in
/// places exact ties between two codes of a block whose largest value is 1.
inline std::vector<float> mixed_values(std::int64_t n, std::uint64_t seed, bool is_signed)
{
  std::uint64_t state = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&state] {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  std::vector<float> out(static_cast<std::size_t>(n));
  for (auto& x : out) {
    double const exponent = -9.0 + 12.0 * static_cast<double>(next() % 1000000) / 1e6;
    double const magnitude = std::pow(10.0, exponent);
    x = static_cast<float>(is_signed && (next() & 1) ? -magnitude : magnitude);
  }
  return out;
}

}  // namespace fusedopt_test
