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
/// the lower code (the smaller value): the number of the map's exact midpoints below q, found by
/// integer compares of q's bits with tables built from those midpoints (quantization_map), so
/// the code is the same on every IEEE machine. A block of zeros (a = 0) stores 0 and
/// the code of 0.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "../config.hpp"
#include "../error.hpp"
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

/// @brief The storage of 8-bit quantized state tensors, in units of 16 bytes. A tensor of n
/// elements is cut into blocks of `Block` elements (the last one partly used); each block
/// keeps one fp32 scale (the absolute maximum of its values when they were stored) and one
/// 8-bit code per element. A tensor takes `units_for(n)` units (`bytes_for(n)` bytes, 1 + 4 /
/// Block bytes per element and at most 252 bytes of padding), laid out as
///
///     [padding][scale of block nb-1] ... [scale of block 0][codes of block 0][codes of block 1] ...
///
/// with `scale_bytes(n)` bytes (a multiple of 256) before the codes: the codes start 256-byte
/// aligned where the storage is (a block's codes one 256-byte piece of DRAM: 1.5% faster than
/// 128-byte alignment, H100), and the scale of block b sits 4 (b + 1) bytes before them,
/// so one address (the codes') finds both. In a block of a multiple of 128 elements the codes
/// are in lane order (`code_position`): the 4 Block / 128 codes that one lane of a warp
/// updates (elements 128 g + 4 l .. + 3 for each g) lie side by side, one access each
/// (docs/decisions.md, "8-bit states: codes aligned, scales apart, a lane's codes together").
///
/// A `tensor_list<blockwise8<Map, Block>>` entry points at the storage's first unit (16-byte
/// aligned, fusedopt::bind checks it; 256-byte aligned for full speed, as cudaMalloc's and
/// torch's allocations are, and as tensors laid end to end stay: `bytes_for` is a multiple of
/// 256) and counts the tensor's n elements. All-zero storage holds zeros (a scale of 0 reads
/// every code as 0). `quantized_state` reads and writes one tensor's scales and codes on the
/// host.
template <class Map, int Block = 256>
struct alignas(16) blockwise8 {
  static_assert(std::is_same_v<Map, signed_dynamic_map> || std::is_same_v<Map, unsigned_dynamic_map>,
                "fusedopt::blockwise8: Map is signed_dynamic_map or unsigned_dynamic_map");
  // A warp owns a block on the GPU (Block / 32 elements per lane), and chunks of the CUDA
  // backend (2048 elements) hold whole blocks.
  static_assert(Block >= 32 && Block <= 2048 && (Block & (Block - 1)) == 0,
                "fusedopt::blockwise8: Block is a power of two from 32 to 2048");
  using map_type = Map;
  static constexpr int block_elements = Block;

  unsigned char bytes[16];

  /// @brief Blocks of a tensor of `elements` elements.
  static constexpr std::int64_t blocks_in(std::int64_t elements) { return (elements + Block - 1) / Block; }
  /// @brief Bytes before the codes (the scales, reversed, and padding to a multiple of 256).
  static constexpr std::int64_t scale_bytes(std::int64_t elements)
  {
    return (4 * blocks_in(elements) + 255) / 256 * 256;
  }
  /// @brief Bytes of storage a tensor of `elements` elements takes (a multiple of 16).
  static constexpr std::int64_t bytes_for(std::int64_t elements)
  {
    return scale_bytes(elements) + blocks_in(elements) * Block;
  }
  /// @brief Units (of 16 bytes) to allocate for a tensor of `elements` elements.
  static constexpr std::int64_t units_for(std::int64_t elements) { return bytes_for(elements) / 16; }

  /// @brief Byte of element j's code (0 <= j < Block) among its block's codes: lane order in
  /// blocks of a multiple of 128 elements (element 128 g + 4 l + k at 4 G l + 4 g + k, G =
  /// Block / 128), element order in smaller blocks.
  FUSEDOPT_HOST_DEVICE static constexpr int code_position(int j)
  {
    if constexpr (Block % 128 == 0) {
      return (j % 128) / 4 * (Block / 32) + j / 128 * 4 + j % 4;
    } else {
      return j;
    }
  }
  /// @brief Byte of element i's code from the start of the codes.
  FUSEDOPT_HOST_DEVICE static constexpr std::int64_t code_offset(std::int64_t i)
  {
    return i / Block * Block + code_position(static_cast<int>(i % Block));
  }
};
static_assert(sizeof(blockwise8<signed_dynamic_map>) == 16, "fusedopt::blockwise8 is a 16-byte unit of storage");

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
    return std::remove_const_t<T>::units_for(elements);
  } else {
    return elements;
  }
}

/// Where the codes of a quantized tensor of `elements` elements start in its storage: the
/// address the backends bind it by (its scales lie before it, see blockwise8).
template <class T>
T* quantized_codes(T* storage, std::int64_t elements)
{
  using byte = std::conditional_t<std::is_const_v<T>, unsigned char const, unsigned char>;
  return reinterpret_cast<T*>(reinterpret_cast<byte*>(storage) + std::remove_const_t<T>::scale_bytes(elements));
}

/// Where the scale of block `block` lies in a quantized tensor whose codes start at `codes`:
/// the scales are stored reversed before the codes (blockwise8).
template <class Byte>
FUSEDOPT_HOST_DEVICE Byte* scale_address(Byte* codes, std::uint64_t block)
{
  static_assert(sizeof(Byte) == 1, "scale_address takes a byte pointer");
  return codes - 4 * (block + 1);
}

/// The scale of block `block` of the quantized tensor whose codes start at `codes`.
FUSEDOPT_HOST_DEVICE float load_scale(void const* codes, std::uint64_t block)
{
  auto const* at = scale_address(static_cast<unsigned char const*>(codes), block);
#if FUSEDOPT_DEVICE_PASS
  return *reinterpret_cast<float const*>(at);  // a device memcpy of unknown alignment is four byte loads
#else
  float scale;
  std::memcpy(&scale, at, sizeof scale);
  return scale;
#endif
}
FUSEDOPT_HOST_DEVICE void store_scale(void* codes, std::uint64_t block, float scale)
{
  auto* at = scale_address(static_cast<unsigned char*>(codes), block);
#if FUSEDOPT_DEVICE_PASS
  *reinterpret_cast<float*>(at) = scale;
#else
  std::memcpy(at, &scale, sizeof scale);
#endif
}

/// Buckets of the code search: |q| in [2^-23, 1] by its float exponent (104..127) and the top
/// 7 bits of its mantissa, 128 buckets per octave; the last one holds 1.0 alone. Smaller |q|
/// search bucket 0, which holds no midpoint (the nearest ones are 1.6e-7 and more away), so
/// they take the code of 0.
inline constexpr int quantization_buckets = 23 * 128 + 1;
inline constexpr std::uint32_t quantization_smallest_bits = 104u << 23;  // 2^-23

/// A map's 256 values, sorted, and its code search: one 32-bit entry per bucket of |q| and
/// sign of q (only q >= 0 for the unsigned map, whose every negative q takes code 0). A bucket
/// holds at most one of the 255 midpoints between neighbouring values (make_dynamic_map checks
/// it), so its entry gives the code from the low 16 bits of |q|, `low`, with one addition and
/// one shift: code = (entry + low) >> 17 for q >= 0, (entry + (low ^ 0xffff)) >> 17 for q < 0
/// (the complement is one logic instruction with the sign mask, where a negation took a compare
/// and a select). For q >= 0, entry = (code of the bucket's low end) << 17 + 2^17 - t, where
/// low >= t exactly when q is above the bucket's midpoint (t = 2^16: no midpoint); for q < 0,
/// entry = (code of the bucket's low end) << 17 + 2^17 + t - 1 - 0xffff, where low < t exactly
/// when q is above it (t = 0: none). Entries are exact: the code is the one the midpoints give
/// compared in double.
template <bool Signed>
struct quantization_map {
  static constexpr int entries = (Signed ? 2 : 1) * quantization_buckets;
  float values[256];
  /// [0, quantization_buckets): q >= 0; then (signed map) q < 0.
  std::uint32_t search[entries];
};

/// For 2^-126 <= m < 2: the bits of the smallest float at or above m, and whether m is a float
/// (constant evaluation cannot look at a double's bits in C++17).
struct float_ceiling {
  std::uint32_t bits;
  bool exact;
};
constexpr float_ceiling float_ceiling_of(double m)
{
  int exponent = 0;
  double scale = 1.0;  // m in [scale, 2 scale)
  while (m >= 2.0 * scale) { scale *= 2.0; ++exponent; }
  while (m < scale) { scale *= 0.5; --exponent; }
  double const fraction = (m / scale - 1.0) * 8388608.0;  // exact: a power-of-two division, m < 2^54 ulps
  auto const whole = static_cast<std::uint32_t>(fraction);
  bool const exact = fraction == static_cast<double>(whole);
  std::uint32_t const floor_bits = (static_cast<std::uint32_t>(exponent + 127) << 23) | whole;
  return {exact ? floor_bits : floor_bits + 1, exact};
}

template <bool Signed>
constexpr quantization_map<Signed> make_dynamic_map()
{
  constexpr double decades[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  double all[256] = {};
  int n = 0;
  for (int i = 0; i < 7; ++i) {
    int const means = Signed ? (1 << i) : (2 << i);
    for (int j = 0; j < means; ++j) {
      double const mean = 0.1 + 0.9 * (j + 0.5) / means;  // midpoint of linspace(0.1, 1, means + 1)
      all[n++] = decades[i] * mean;
      if (Signed) { all[n++] = -(decades[i] * mean); }
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
  quantization_map<Signed> map{};
  for (int c = 0; c < 256; ++c) { map.values[c] = static_cast<float>(all[c]); }
  double midpoints[255] = {};  // exact in double: half the sum of two floats of one sign
  for (int c = 0; c < 255; ++c) {
    midpoints[c] = (static_cast<double>(map.values[c]) + static_cast<double>(map.values[c + 1])) * 0.5;
  }
  // The codes of the buckets' ends, walking the buckets in order (the counts move monotonically,
  // so the whole table takes a few thousand steps: nvcc's constant evaluation has a budget).
  // Bucket b is [low(b), low(b + 1)), low(b) = 2^(e - 127) (1 + m / 128) for e = 104 + b / 128,
  // m = b % 128: the float whose bits are quantization_smallest_bits + (b << 16).
  double lows[quantization_buckets + 1] = {};  // lows[b + 1] is bucket b's high end
  double octave = 1.0 / 8388608.0;               // 2^-23
  for (int b = 0; b < quantization_buckets; ++b) {
    if (b > 0 && b % 128 == 0) { octave *= 2.0; }
    lows[b] = octave * (1.0 + (b % 128) / 128.0);
  }
  lows[quantization_buckets] = 2.0;
  // Thresholds t in the low 16 bits of |q|: for q >= 0, the bucket's midpoint is below q when
  // low >= t (t = 2^16: no midpoint); for q < 0, when low < t (t = 0: none).
  constexpr std::uint32_t code_shift = 17;
  constexpr std::uint32_t no_midpoint = 0x10000;
  constexpr int negative = quantization_buckets;
  std::uint32_t base[(Signed ? 2 : 1) * quantization_buckets] = {};  // code of each bucket's low end
  std::uint32_t threshold[(Signed ? 2 : 1) * quantization_buckets] = {};
  int below = 0;  // q >= 0: midpoints below the bucket's low end, all below q
  for (int b = 0; b < quantization_buckets; ++b) {
    while (below < 255 && midpoints[below] < lows[b]) { ++below; }
    base[b] = static_cast<std::uint32_t>(below);
    threshold[b] = no_midpoint;
  }
  if constexpr (Signed) {
    int at_or_below = 0;  // q < 0: midpoints at or below minus the bucket's high end, all below q
    for (int b = quantization_buckets - 1; b >= 0; --b) {
      while (at_or_below < 255 && midpoints[at_or_below] <= -lows[b + 1]) { ++at_or_below; }
      base[negative + b] = static_cast<std::uint32_t>(at_or_below);
    }
  }
  // Each midpoint m in its bucket, by the bits of |m| (the float at or below it). For q >= 0,
  // m < q exactly when q's bits reach those of the smallest float above m; for q < 0, m < q when
  // |q|'s bits stay below those of the smallest float at or above |m|.
  for (double const m : midpoints) {
    double const magnitude = m < 0 ? -m : m;
    if (magnitude < lows[1]) {
      throw "fusedopt: a midpoint lies in the lowest quantization bucket";  // not a constant expression
    }
    float_ceiling const ceiling = float_ceiling_of(magnitude);
    std::uint32_t const floor_bits = ceiling.exact ? ceiling.bits : ceiling.bits - 1;
    std::uint32_t const bucket = (floor_bits - quantization_smallest_bits) >> 16;
    std::uint32_t const low_bits = quantization_smallest_bits + (bucket << 16);
    int const at = (m < 0 ? negative : 0) + static_cast<int>(bucket);
    if (threshold[at] != (m < 0 ? 0 : no_midpoint)) {
      throw "fusedopt: a quantization bucket holds two midpoints";  // not a constant expression
    }
    threshold[at] = m < 0 ? ceiling.bits - low_bits : ceiling.bits + (ceiling.exact ? 1 : 0) - low_bits;
  }
  for (int at = 0; at < map.entries; ++at) {
    std::uint32_t const carry = std::uint32_t{1} << code_shift;
    map.search[at] =
      (base[at] << code_shift) + (at < negative ? carry - threshold[at] : carry + threshold[at] - 1 - 0xffffu);
  }
  return map;
}

template <class Map>
using map_t = quantization_map<Map::is_signed>;

template <class Map>
inline constexpr map_t<Map> host_map = make_dynamic_map<Map::is_signed>();
#if FUSEDOPT_HAS_CUDA_COMPILER
// The device's copy, from the same constant evaluation: kernels cannot read host variables.
template <class Map>
__device__ constexpr map_t<Map> device_map = make_dynamic_map<Map::is_signed>();
#endif

/// The map of `Map` in the memory of the side that runs the caller.
template <class Map>
FUSEDOPT_HOST_DEVICE map_t<Map> const& map_of()
{
#if FUSEDOPT_DEVICE_PASS
  return device_map<Map>;
#else
  return host_map<Map>;
#endif
}
/// The maps where map_of finds them (global memory on the device), for code that takes a
/// source of maps: the CUDA backend passes its block's copy in shared memory instead.
struct global_maps {
  template <class Map>
  FUSEDOPT_HOST_DEVICE map_t<Map> const& get() const
  {
    return map_of<Map>();
  }
};

/// The value of `code` in a block of scale `absmax`: one multiplication, the same bits everywhere.
template <bool Signed>
FUSEDOPT_HOST_DEVICE float dequantize(quantization_map<Signed> const& map, std::uint8_t code, float absmax)
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
/// below q: one load of the entry of q's bucket, one addition and one shift. A multiplication, not a division per element, as bitsandbytes normalises.
template <bool Signed>
FUSEDOPT_HOST_DEVICE std::uint8_t quantize(quantization_map<Signed> const& map, float x, float inverse)
{
  std::uint32_t bits = float_bits(x * inverse);
  // All ones for q < 0 (the sign bit, negated), else zero.
  std::uint32_t const sign_mask = 0u - (bits >> 31);
  if constexpr (!Signed) {
    bits &= ~sign_mask;  // below every value of the unsigned map: the code of 0
  }
  std::uint32_t magnitude = bits & 0x7fffffffu;
  magnitude = magnitude > quantization_smallest_bits ? magnitude : quantization_smallest_bits;
  // |q| <= fl(absmax * fl(1 / absmax)) < 1 + 2^-22 (|x| <= absmax), so q's bucket is at most the
  // last one, which starts at 1: the callers pass x of the block whose maximum gave `inverse`.
  // The bucket is (magnitude - smallest) >> 16; written as a difference of shifts (smallest's
  // low 16 bits are 0) the constant joins the table's address.
  std::uint32_t const bucket = (magnitude >> 16) - (quantization_smallest_bits >> 16);
  std::uint32_t const negative = Signed ? sign_mask & std::uint32_t{quantization_buckets} : 0u;
  std::uint32_t const entry = map.search[bucket + negative];
  std::uint32_t const low = Signed ? (magnitude ^ sign_mask) & 0xffffu : magnitude & 0xffffu;
  return static_cast<std::uint8_t>((entry + low) >> 17);
}

}  // namespace detail

/// @brief One 8-bit quantized tensor's scales and codes, read and written on the host: a view
/// of the `Q::units_for(size)` units at `storage` (Q a blockwise8, const for a read-only view),
/// for tests, checkpoint converters and tools that inspect states. Owns nothing. A block or
/// element out of range throws fusedopt::error.
template <class Q>
class quantized_state {
  static_assert(is_blockwise_v<Q>, "fusedopt::quantized_state: Q is a blockwise8 type");
  using unit = std::remove_const_t<Q>;
  using byte = std::conditional_t<std::is_const_v<Q>, unsigned char const, unsigned char>;

 public:
  quantized_state(Q* storage, std::int64_t size)
    : codes_(reinterpret_cast<byte*>(detail::quantized_codes(storage, size))), size_(size)
  {
  }

  [[nodiscard]] std::int64_t size() const noexcept { return size_; }
  [[nodiscard]] std::int64_t blocks() const noexcept { return unit::blocks_in(size_); }

  /// @brief The scale (absolute maximum when stored) of block b.
  [[nodiscard]] float scale(std::int64_t b) const
  {
    return detail::load_scale(codes_, static_cast<std::uint64_t>(checked_block(b)));
  }
  void set_scale(std::int64_t b, float scale) const
  {
    static_assert(!std::is_const_v<Q>, "fusedopt::quantized_state: a view of const storage is read-only");
    detail::store_scale(codes_, static_cast<std::uint64_t>(checked_block(b)), scale);
  }
  /// @brief The code of element i (0 <= i < size()).
  [[nodiscard]] std::uint8_t code(std::int64_t i) const { return codes_[unit::code_offset(checked_element(i))]; }
  void set_code(std::int64_t i, std::uint8_t code) const
  {
    static_assert(!std::is_const_v<Q>, "fusedopt::quantized_state: a view of const storage is read-only");
    codes_[unit::code_offset(checked_element(i))] = code;
  }
  /// @brief Element i as a step reads it: map[code] * scale.
  [[nodiscard]] float value(std::int64_t i) const
  {
    return detail::dequantize(detail::map_of<typename unit::map_type>(), code(i), scale(i / unit::block_elements));
  }

 private:
  std::int64_t checked_block(std::int64_t b) const
  {
    FUSEDOPT_EXPECTS(b >= 0 && b < blocks(), "fusedopt::quantized_state: block " + std::to_string(b) + " of a tensor of " +
                                               std::to_string(blocks()) + " blocks");
    return b;
  }
  std::int64_t checked_element(std::int64_t i) const
  {
    FUSEDOPT_EXPECTS(i >= 0 && i < size_, "fusedopt::quantized_state: element " + std::to_string(i) + " of a tensor of " +
                                            std::to_string(size_) + " elements");
    return i;
  }

  byte* codes_;
  std::int64_t size_;
};

FUSEDOPT_NAMESPACE_END
