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

/// A map's 256 values, sorted, and the 255 midpoints between neighbours (exact in double).
struct quantization_map {
  float values[256];
  double midpoints[255];
};

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

/// The code of `x` in a block of absolute maximum `absmax` (>= |x|, finite): the nearest map
/// value to x / absmax, the lower one at an exact tie; the code of 0 when absmax is 0. A
/// branch-free bisection over the 255 midpoints (8 comparisons).
FUSEDOPT_HOST_DEVICE std::uint8_t quantize(quantization_map const& map, float x, float absmax)
{
  double const q = absmax > 0.f ? static_cast<double>(x / absmax) : 0.0;
  int code = 0;
  for (int step = 128; step > 0; step >>= 1) { code += q > map.midpoints[code + step - 1] ? step : 0; }
  return static_cast<std::uint8_t>(code);
}

}  // namespace detail
FUSEDOPT_NAMESPACE_END
