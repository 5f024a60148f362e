/// @file numeric/quantization.hpp
/// @brief 8-bit blockwise-quantized storage for optimizer states (Dettmers et al., "8-bit
/// Optimizers via Block-wise Quantization", 2022): a state tensor is cut into blocks of
/// `Block` elements; each block keeps one fp32 scale (the absolute maximum of its values) and
/// one 8-bit code per element, an index into a fixed map of 256 values in [-1, 1]. An element
/// is map[code] * absmax.
///
/// The maps are the paper's dynamic ones (bitsandbytes' `create_dynamic_map`): after the sign
/// (signed map only), the number of leading zero bits gives a decimal exponent, and the
/// remaining bits a linear fraction, so small values keep their relative precision.
///   - signed (first moments, momentum): for i = 0..6, the 2^i midpoints of
///     linspace(0.1, 1, 2^i + 1) times 10^(i - 6), and their negatives; 0 and 1.
///   - unsigned (second moments): for i = 0..6, the 2^(i+1) midpoints of
///     linspace(0.1, 1, 2^(i+1) + 1) times 10^(i - 6); 0 and 1.
/// Each value is computed in double from that definition and rounded to float; codes are the
/// sorted order (signed: 0 is code 127, 1 is code 255, and -1 is not a value: the most
/// negative is -0.99297; unsigned: 0 is code 0, 1 is code 255).
///
/// Quantizing x in a block of absolute maximum a > 0: q = x / a (correctly rounded, |q| <= 1),
/// then the code of the map value nearest to q; a q exactly halfway between two values takes
/// the lower code (the smaller value). Compared in double against the exact midpoints of the
/// map, so the code is the same on every IEEE machine. A block of zeros (a = 0) stores 0 and
/// the code of 0.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../config.hpp"
#include "dtypes.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief The paper's signed dynamic map: for states of either sign (exp_avg, momentum).
struct signed_dynamic_map {
  static constexpr bool is_signed = true;
};
/// @brief The paper's unsigned dynamic map: for non-negative states (exp_avg_sq), twice the
/// fraction resolution of the signed map.
struct unsigned_dynamic_map {
  static constexpr bool is_signed = false;
};

/// @brief One block of an 8-bit quantized state: the scale (the absolute maximum of the
/// block's values when they were stored) and one code per element. A quantized state tensor
/// of n elements is an array of ceil(n / Block) blocks (the last one partly used), bound as a
/// `tensor_list<blockwise8<Map, Block>>` whose entries point at the first block and count the
/// n elements: 1 + 4 / Block bytes per element (1.016 for 256).
///
/// The scale sits next to its codes (one array per tensor, 260-byte records for Block 256)
/// rather than in an array of its own, so a bound state is one pointer per tensor like every
/// other slot (docs/decisions.md, "8-bit states: one record per block").
template <class Map, int Block = 256>
struct blockwise8 {
  static_assert(std::is_same_v<Map, signed_dynamic_map> || std::is_same_v<Map, unsigned_dynamic_map>,
                "fusedopt::blockwise8: Map is signed_dynamic_map or unsigned_dynamic_map");
  // A warp owns a block on the GPU (Block / 32 elements per lane), and chunks of the CUDA
  // backend (2048 elements) hold whole blocks.
  static_assert(Block >= 32 && Block <= 2048 && (Block & (Block - 1)) == 0,
                "fusedopt::blockwise8: Block is a power of two from 32 to 2048");
  using map_type = Map;
  static constexpr int block_elements = Block;

  float absmax;
  std::uint8_t codes[Block];

  /// @brief Blocks a tensor of `elements` elements takes.
  static constexpr std::int64_t blocks_for(std::int64_t elements) { return (elements + Block - 1) / Block; }
};

/// @brief Quantized first moments / momentum, blocks of 256 (the paper's and bitsandbytes').
using signed_q8 = blockwise8<signed_dynamic_map>;
/// @brief Quantized second moments, blocks of 256.
using unsigned_q8 = blockwise8<unsigned_dynamic_map>;

namespace detail {

/// Units of storage (elements, or blocks of a blockwise8 list) a tensor of `elements`
/// elements of list type T takes; each unit is sizeof(T) bytes.
template <class T>
constexpr std::int64_t storage_units(std::int64_t elements)
{
  if constexpr (is_blockwise_v<T>) {
    return std::remove_const_t<T>::blocks_for(elements);
  } else {
    return elements;
  }
}

/// Buckets of the code search: |q| in [2^-23, 1] by its float exponent (104..127) and the top
/// 7 bits of its mantissa, 128 buckets per octave; the last one holds 1.0 alone. Smaller |q|
/// round to the code of 0 (the nearest nonzero values are 5.5e-7 and more away).
inline constexpr int quantization_buckets = 23 * 128 + 1;
inline constexpr std::uint32_t quantization_smallest_bits = 104u << 23;  // 2^-23

/// A map's 256 values, sorted; the 255 midpoints between neighbours (exact in double), then two
/// entries above every q (so that the search may look two past its guess); and the guesses of
/// the search: for each bucket of |q| (quantization_buckets), the number of midpoints below
/// every q >= 0 of the bucket (`below_positive`) and below every q < 0 of it (`below_negative`).
/// A bucket holds at most two midpoints (make_dynamic_map checks it), so a code is its guess
/// plus two comparisons.
struct quantization_map {
  float values[256];
  double midpoints[257];
  std::uint8_t below_positive[quantization_buckets];
  std::uint8_t below_negative[quantization_buckets];
  std::uint8_t zero_code;
};

/// Midpoints of `map` below `q` (strictly, or at most `q` when `inclusive`).
constexpr int midpoints_below(quantization_map const& map, double q, bool inclusive)
{
  int n = 0;
  while (n < 255 && (map.midpoints[n] < q || (inclusive && map.midpoints[n] == q))) { ++n; }
  return n;
}

constexpr quantization_map make_dynamic_map(bool is_signed)
{
  constexpr double decades[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  double all[256] = {};
  int n = 0;
  for (int i = 0; i < 7; ++i) {
    int const means = is_signed ? (1 << i) : (2 << i);
    for (int j = 0; j < means; ++j) {
      double const mean = 0.1 + 0.9 * (j + 0.5) / means;  // midpoint of linspace(0.1, 1, means + 1)
      all[n++] = decades[i] * mean;
      if (is_signed) { all[n++] = -(decades[i] * mean); }
    }
  }
  all[n++] = 0.0;
  all[n++] = 1.0;
  for (int i = 1; i < n; ++i) {  // insertion sort: constexpr, 256 values
    double const x = all[i];
    int j = i;
    for (; j > 0 && all[j - 1] > x; --j) { all[j] = all[j - 1]; }
    all[j] = x;
  }
  quantization_map map{};
  for (int c = 0; c < 256; ++c) { map.values[c] = static_cast<float>(all[c]); }
  for (int c = 0; c < 255; ++c) {
    map.midpoints[c] = (static_cast<double>(map.values[c]) + static_cast<double>(map.values[c + 1])) * 0.5;
  }
  map.midpoints[255] = map.midpoints[256] = 2.0;
  map.zero_code = static_cast<std::uint8_t>(midpoints_below(map, 0.0, false));
  // The guesses, walking the buckets in order (the counts move monotonically, so the whole table
  // takes a few thousand steps: nvcc's constant evaluation has a budget). Bucket b is
  // [low(b), low(b + 1)), low(b) = 2^(e - 127) (1 + m / 128) for e = 104 + b / 128, m = b % 128:
  // the float whose bits are quantization_smallest_bits + (b << 16).
  double lows[quantization_buckets + 1] = {};  // lows[b + 1] is bucket b's high end
  double octave = 1.0 / 8388608.0;               // 2^-23
  for (int b = 0; b < quantization_buckets; ++b) {
    if (b > 0 && b % 128 == 0) { octave *= 2.0; }
    lows[b] = octave * (1.0 + (b % 128) / 128.0);
  }
  lows[quantization_buckets] = 2.0;
  int below = 0;  // midpoints below the bucket's low end
  for (int b = 0; b < quantization_buckets; ++b) {
    while (below < 255 && map.midpoints[below] < lows[b]) { ++below; }
    map.below_positive[b] = static_cast<std::uint8_t>(below);
  }
  int at_or_below = 0;  // midpoints at or below minus the bucket's high end
  for (int b = quantization_buckets - 1; b >= 0; --b) {
    while (at_or_below < 255 && map.midpoints[at_or_below] <= -lows[b + 1]) { ++at_or_below; }
    map.below_negative[b] = static_cast<std::uint8_t>(at_or_below);
  }
  // The search looks two midpoints past its guess: no bucket may hold three. Of q >= 0 in bucket
  // b, the midpoints below the next bucket; of q < 0, at most those at or below -low (the guess
  // of bucket b - 1, or of 0 for the first bucket).
  for (int b = 0; b < quantization_buckets; ++b) {
    int const positive_end = b + 1 < quantization_buckets ? map.below_positive[b + 1] : 255;
    int const negative_end = b > 0 ? map.below_negative[b - 1] : map.zero_code;
    if (positive_end - map.below_positive[b] > 2 || negative_end - map.below_negative[b] > 2) {
      throw "fusedopt: a quantization bucket holds more than two midpoints";  // not a constant expression
    }
  }
  return map;
}

template <class Map>
inline constexpr quantization_map host_map = make_dynamic_map(Map::is_signed);
#if FUSEDOPT_HAS_CUDA_COMPILER
// The device's copy, from the same constant evaluation: kernels cannot read host variables.
template <class Map>
__device__ constexpr quantization_map device_map = make_dynamic_map(Map::is_signed);
#endif

/// The map of `Map` in the memory of the side that runs the caller.
template <class Map>
FUSEDOPT_HOST_DEVICE quantization_map const& map_of()
{
#if FUSEDOPT_DEVICE_PASS
  return device_map<Map>;
#else
  return host_map<Map>;
#endif
}

/// The value of `code` in a block of scale `absmax`: one multiplication, the same bits everywhere.
FUSEDOPT_HOST_DEVICE float dequantize(quantization_map const& map, std::uint8_t code, float absmax)
{
  return map.values[code] * absmax;
}

/// The factor that normalises a block of absolute maximum `absmax`: 1 / absmax (correctly
/// rounded, once per block); 0 for a block of zeros, and for a block whose absmax is subnormal
/// (under 2^-126, where 1 / absmax could overflow): its values are stored as zeros.
FUSEDOPT_HOST_DEVICE float inverse_scale(float absmax)
{
  constexpr float smallest_normal = 1.17549435e-38f;  // 2^-126
  return absmax >= smallest_normal ? 1.f / absmax : 0.f;
}

/// The code of `x` in a block whose inverse_scale is `inverse` (|x| at most the block's absolute
/// maximum, finite): the nearest map value to q = x * inverse (in float; |q| <= 1), the lower
/// one at an exact tie; the code of 0 for a block of zeros. That is the number of midpoints
/// below q, compared in double: the bucket of |q| gives how many lie below the whole bucket,
/// and two comparisons the ones inside it (three dependent loads where a bisection takes
/// eight). A multiplication, not a division per element, as bitsandbytes normalises.
FUSEDOPT_HOST_DEVICE std::uint8_t quantize(quantization_map const& map, float x, float inverse)
{
  float const q = x * inverse;
  std::uint32_t const bits = float_bits(q);
  std::uint32_t const magnitude = bits & 0x7fffffffu;
  if (magnitude < quantization_smallest_bits) { return map.zero_code; }
  auto const bucket = static_cast<int>((magnitude - quantization_smallest_bits) >> 16);
  int const guess = (bits >> 31) != 0 ? map.below_negative[bucket] : map.below_positive[bucket];
  double const wide = q;
  return static_cast<std::uint8_t>(guess + (map.midpoints[guess] < wide ? 1 : 0) + (map.midpoints[guess + 1] < wide ? 1 : 0));
}

}  // namespace detail
FUSEDOPT_NAMESPACE_END
