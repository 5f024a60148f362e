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

/// One quantized tensor of `n` elements in the storage layout numeric/quantization.hpp
/// documents for blockwise8, read and written here from that description (not through the
/// library's accessors): the scale of block b 4 (b + 1) bytes before the codes, which start
/// after the scales padded to a multiple of 256 bytes; in blocks of a multiple of 128 elements
/// lane l's codes of elements 128 g + 4 l + k (g < Block / 128, k < 4) side by side at codes
/// byte 4 (Block / 128) l + 4 g + k of its block.
template <class Q>
struct q8_storage {
  static constexpr std::int64_t block = Q::block_elements;
  std::int64_t n = 0;
  std::vector<Q> units;

  /// Zeros: every scale 0, every code that of 0 (127 signed, 0 unsigned), as torch starts; or,
  /// with `codes_of_zero` false, every byte 0 (also zeros: a scale of 0 reads any code as 0).
  explicit q8_storage(std::int64_t elements, bool codes_of_zero = true)
    : n(elements), units(static_cast<std::size_t>(bytes() / 16))
  {
    if (codes_of_zero) {
      for (std::int64_t i = 0; i < n; ++i) { set_code(i, Q::map_type::is_signed ? 127 : 0); }
    }
  }
  // The layout of a tensor of `elements` elements.
  static std::int64_t blocks_of(std::int64_t elements) { return (elements + block - 1) / block; }
  static std::int64_t scale_bytes_of(std::int64_t elements) { return (4 * blocks_of(elements) + 255) / 256 * 256; }
  static std::int64_t scale_byte_of(std::int64_t elements, std::int64_t b) { return scale_bytes_of(elements) - 4 * (b + 1); }
  static std::int64_t code_byte_of(std::int64_t elements, std::int64_t i)
  {
    std::int64_t const j = i % block;
    std::int64_t const in_block = block % 128 == 0 ? (j % 128) / 4 * (4 * (block / 128)) + j / 128 * 4 + j % 4 : j;
    return scale_bytes_of(elements) + i / block * block + in_block;
  }

  [[nodiscard]] std::int64_t blocks() const { return blocks_of(n); }
  [[nodiscard]] std::int64_t scale_bytes() const { return scale_bytes_of(n); }
  [[nodiscard]] std::int64_t bytes() const { return scale_bytes() + blocks() * block; }
  [[nodiscard]] std::int64_t code_byte(std::int64_t i) const { return code_byte_of(n, i); }
  [[nodiscard]] unsigned char* raw() { return reinterpret_cast<unsigned char*>(units.data()); }
  [[nodiscard]] unsigned char const* raw() const { return reinterpret_cast<unsigned char const*>(units.data()); }
  [[nodiscard]] Q* data() { return units.data(); }

  [[nodiscard]] float scale(std::int64_t b) const
  {
    float f;
    std::memcpy(&f, raw() + scale_byte_of(n, b), sizeof f);
    return f;
  }
  void set_scale(std::int64_t b, float f) { std::memcpy(raw() + scale_byte_of(n, b), &f, sizeof f); }
  [[nodiscard]] std::uint8_t code(std::int64_t i) const { return raw()[code_byte(i)]; }
  void set_code(std::int64_t i, int c) { raw()[code_byte(i)] = static_cast<std::uint8_t>(c); }
};

/// A quantized tensor holding `values` as the paper quantizes them: each block's scale is its
/// largest |value|, each code the nearest (reference_code).
template <class Q>
q8_storage<Q> reference_quantize(std::vector<float> const& values)
{
  std::vector<float> const map = reference_map_floats(Q::map_type::is_signed);
  q8_storage<Q> q(static_cast<std::int64_t>(values.size()));
  for (std::int64_t b = 0; b < q.blocks(); ++b) {
    std::size_t const first = static_cast<std::size_t>(b * Q::block_elements);
    std::size_t const last = std::min(values.size(), first + Q::block_elements);
    float absmax = 0.f;
    for (std::size_t i = first; i < last; ++i) { absmax = std::max(absmax, std::fabs(values[i])); }
    q.set_scale(b, absmax);
    for (std::size_t i = first; i < last; ++i) {
      q.set_code(static_cast<std::int64_t>(i), reference_code(map, values[i], absmax));
    }
  }
  return q;
}

/// The values a quantized tensor holds: map[code] * scale.
template <class Q>
std::vector<float> reference_dequantize(q8_storage<Q> const& q)
{
  std::vector<float> const map = reference_map_floats(Q::map_type::is_signed);
  std::vector<float> out(static_cast<std::size_t>(q.n));
  for (std::int64_t i = 0; i < q.n; ++i) { out[static_cast<std::size_t>(i)] = map[q.code(i)] * q.scale(i / Q::block_elements); }
  return out;
}

/// Block `ba` of `a` and block `bb` of `b` hold the same scale and codes (bit for bit; the
/// codes of the elements both blocks use).
template <class Q>
bool same_block(q8_storage<Q> const& a, std::int64_t ba, q8_storage<Q> const& b, std::int64_t bb)
{
  float const x = a.scale(ba), y = b.scale(bb);
  if (std::memcmp(&x, &y, sizeof(float)) != 0) { return false; }
  std::int64_t const used = std::min(std::min(a.n - ba * Q::block_elements, b.n - bb * Q::block_elements),
                                     std::int64_t{Q::block_elements});
  for (std::int64_t j = 0; j < used; ++j) {
    if (a.code(ba * Q::block_elements + j) != b.code(bb * Q::block_elements + j)) { return false; }
  }
  return true;
}

/// The two tensors' scales and codes in use are equal (bit for bit).
template <class Q>
bool same_blocks(q8_storage<Q> const& a, q8_storage<Q> const& b)
{
  if (a.n != b.n) { return false; }
  for (std::int64_t i = 0; i < a.n; ++i) {
    if (a.code(i) != b.code(i)) { return false; }
  }
  for (std::int64_t k = 0; k < a.blocks(); ++k) {
    float const x = a.scale(k), y = b.scale(k);
    if (std::memcmp(&x, &y, sizeof(float)) != 0) { return false; }
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

/// AdEMAMix as both files step it on 8-bit states (bitsandbytes' AdEMAMix8bit's layout: exp_avg
/// and exp_avg_slow signed, exp_avg_sq unsigned), both schedulers running within the steps.
inline fusedopt::rules::ademamix scheduled_ademamix()
{
  fusedopt::rules::ademamix ademamix;
  ademamix.lr = 1e-2;
  ademamix.alpha = 5.0;
  ademamix.alpha_warmup = 4;
  ademamix.beta3_warmup = 3;
  ademamix.weight_decay = 0.01;
  return ademamix;
}

}  // namespace fusedopt_test
