/// @file numeric/dtypes.hpp
/// @brief 16-bit floating-point storage types and conversions to the arithmetic type.
///
/// `fusedopt::half` and `fusedopt::bfloat16` are two-byte storage types with the layout of
/// CUDA's `__half` and `__nv_bfloat16` (so a `__half*` can be passed as a `fusedopt::half*`),
/// usable without the CUDA toolkit. Arithmetic never happens in 16 bits: values are converted
/// to their `opmath_t` (float) on load and rounded to nearest even on store.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../config.hpp"

#if FUSEDOPT_HAS_CUDA_COMPILER
#  include <cuda_fp16.h>
#endif

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {

FUSEDOPT_HOST_DEVICE std::uint32_t float_bits(float f)
{
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

FUSEDOPT_HOST_DEVICE float bits_float(std::uint32_t u)
{
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even. Done in integer arithmetic on host and device alike so that both
// give the same bits, NaN included (a quiet NaN that keeps the sign).
FUSEDOPT_HOST_DEVICE std::uint16_t float_to_bfloat16_bits(float f)
{
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) { return static_cast<std::uint16_t>((u >> 16) | 0x0040u); }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

FUSEDOPT_HOST_DEVICE float bfloat16_bits_to_float(std::uint16_t b)
{
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

FUSEDOPT_HOST_DEVICE std::uint16_t float_to_half_bits(float f)
{
#if FUSEDOPT_DEVICE_PASS
  return __half_as_ushort(__float2half_rn(f));
#else
  // Every case is computed and the result selected, without branches, so that host loops
  // over half tensors vectorise (a branch per element kept GCC from vectorising them).
  std::uint32_t x = float_bits(f);
  std::uint32_t const sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  // Normal halves: rebias the exponent by -112 and add the rounding bias (ties to even).
  std::uint32_t const normal = (x + 0xc8000fffu + ((x >> 13) & 1u)) >> 13;
  // Below the smallest normal half: adding 0.5f (whose ulp is 2^-24, the half subnormal step)
  // makes the FPU round to a multiple of 2^-24 to nearest even.
  std::uint32_t const subnormal = float_bits(bits_float(x) + 0.5f) - 0x3f000000u;
  // Integer masks rather than conditionals: GCC may sink the float addition above into the
  // branch of a conditional and then (trapping math being the default) not if-convert it.
  std::uint32_t const is_subnormal = 0u - static_cast<std::uint32_t>(x < 0x38800000u);
  std::uint32_t const is_overflow = 0u - static_cast<std::uint32_t>(x >= 0x477ff000u);  // to inf
  std::uint32_t const is_nan = 0u - static_cast<std::uint32_t>(x > 0x7f800000u);  // what cvt.rn.f16.f32 gives
  std::uint32_t magnitude = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  magnitude = (0x7c00u & is_overflow) | (magnitude & ~is_overflow);
  std::uint32_t const result = (0x7fffu & is_nan) | ((sign | magnitude) & ~is_nan);
  return static_cast<std::uint16_t>(result);
#endif
}

FUSEDOPT_HOST_DEVICE float half_bits_to_float(std::uint16_t h)
{
#if FUSEDOPT_DEVICE_PASS
  return __half2float(__ushort_as_half(h));
#else
  // Branch-free, as float_to_half_bits, and with integer masks rather than conditionals: a
  // compiler may sink the float multiplication into a branch, and (trapping math being the
  // default) then not if-convert it, leaving a branch that stops vectorisation.
  std::uint32_t const sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t const magnitude = h & 0x7fffu;
  std::uint32_t const special = 0x7f800000u | ((magnitude & 0x3ffu) << 13);  // inf and NaN
  std::uint32_t const normal = (magnitude << 13) + 0x38000000u;
  std::uint32_t const subnormal = float_bits(static_cast<float>(magnitude) * 5.9604644775390625e-8f);  // * 2^-24
  std::uint32_t const is_special = 0u - static_cast<std::uint32_t>(magnitude >= 0x7c00u);
  std::uint32_t const is_normal = ~is_special & (0u - static_cast<std::uint32_t>(magnitude >= 0x0400u));
  std::uint32_t const is_subnormal = ~(is_special | is_normal);
  return bits_float(sign | (special & is_special) | (normal & is_normal) | (subnormal & is_subnormal));
#endif
}

}  // namespace detail

/// @brief IEEE binary16 storage, layout-compatible with CUDA's `__half`.
struct half {
  std::uint16_t bits;

  half() = default;
  /// @brief Rounds `value` to the nearest half (ties to even).
  FUSEDOPT_HOST_DEVICE explicit half(float value) : bits(detail::float_to_half_bits(value)) {}
  FUSEDOPT_HOST_DEVICE explicit operator float() const { return detail::half_bits_to_float(bits); }
  /// @brief The half whose bit pattern is `b`.
  FUSEDOPT_HOST_DEVICE static half from_bits(std::uint16_t b)
  {
    half h;
    h.bits = b;
    return h;
  }
};

/// @brief bfloat16 storage (8 exponent bits, 7 mantissa bits), layout-compatible with
/// CUDA's `__nv_bfloat16`.
struct bfloat16 {
  std::uint16_t bits;

  bfloat16() = default;
  /// @brief Rounds `value` to the nearest bfloat16 (ties to even).
  FUSEDOPT_HOST_DEVICE explicit bfloat16(float value) : bits(detail::float_to_bfloat16_bits(value)) {}
  FUSEDOPT_HOST_DEVICE explicit operator float() const { return detail::bfloat16_bits_to_float(bits); }
  /// @brief The bfloat16 whose bit pattern is `b`.
  FUSEDOPT_HOST_DEVICE static bfloat16 from_bits(std::uint16_t b)
  {
    bfloat16 h;
    h.bits = b;
    return h;
  }
};

static_assert(sizeof(half) == 2 && alignof(half) == 2, "half must match __half's layout");
static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2, "bfloat16 must match __nv_bfloat16's layout");
static_assert(std::is_trivially_copyable_v<half> && std::is_trivially_copyable_v<bfloat16>);

template <class Map, int Block>
struct blockwise8;

/// @brief True for `blockwise8<Map, Block>`, the block of 8-bit codes and its scale that
/// quantized state lists hold (numeric/quantization.hpp).
template <class T>
struct is_blockwise : std::false_type {};
template <class Map, int Block>
struct is_blockwise<blockwise8<Map, Block>> : std::true_type {};
template <class T>
inline constexpr bool is_blockwise_v = is_blockwise<std::remove_const_t<T>>::value;

/// @brief True for the element types a tensor list may hold. `std::int16_t` holds integer
/// values (e.g. the `remainder` slot of split-bfloat16 parameters), handled in float;
/// `blockwise8` holds 8-bit quantized states, handled in float.
template <class T>
inline constexpr bool is_supported_element_v =
  std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, half> ||
  std::is_same_v<T, bfloat16> || std::is_same_v<T, std::int16_t> || is_blockwise_v<T>;

namespace detail {
template <class T>
struct opmath {
  static_assert(is_supported_element_v<T>,
                "fusedopt supports float, double, fusedopt::half, fusedopt::bfloat16, std::int16_t and "
                "fusedopt::blockwise8 elements");
  using type = float;
};
template <>
struct opmath<double> {
  using type = double;
};
}  // namespace detail

/// @brief The type arithmetic on a `T` is done in: float for half, bfloat16, float, int16
/// (exact: float holds every 16-bit integer) and blockwise8; double for double.
template <class T>
using opmath_t = typename detail::opmath<std::remove_const_t<T>>::type;

/// @brief Human-readable name of an element type, for error messages.
template <class T>
constexpr char const* dtype_name()
{
  using U = std::remove_const_t<T>;
  if constexpr (std::is_same_v<U, float>) { return "float"; }
  else if constexpr (std::is_same_v<U, double>) { return "double"; }
  else if constexpr (std::is_same_v<U, half>) { return "half"; }
  else if constexpr (std::is_same_v<U, std::int16_t>) { return "int16"; }
  else if constexpr (is_blockwise_v<U>) { return "blockwise8"; }
  else { return "bfloat16"; }
}

/// @brief Converts a stored value to the arithmetic type `O`.
template <class O, class T>
FUSEDOPT_HOST_DEVICE O to_opmath(T value)
{
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
    return static_cast<O>(static_cast<float>(value));
  } else {
    return static_cast<O>(value);
  }
}

/// @brief Rounds an arithmetic value to the storage type `T` (to nearest even; to int16 by
/// truncation, saturating, NaN to 0).
template <class T, class O>
FUSEDOPT_HOST_DEVICE T from_opmath(O value)
{
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
    return T(static_cast<float>(value));
  } else if constexpr (std::is_same_v<T, std::int16_t>) {
    // A bare cast is undefined out of range, and x86 and the GPU disagree there: saturate
    // explicitly so host and device store the same bits for any value.
    if (!(value == value)) { return 0; }
    if (value <= O(-32768)) { return -32768; }
    if (value >= O(32767)) { return 32767; }
    return static_cast<std::int16_t>(value);
  } else {
    return static_cast<T>(value);
  }
}

FUSEDOPT_NAMESPACE_END
