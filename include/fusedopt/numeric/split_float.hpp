/// @file numeric/split_float.hpp
/// @brief An fp32 value as a bfloat16 and a 16-bit remainder, exactly: the number format of
/// split-bfloat16 parameters (rules::with_remainder).
#pragma once

#include <cstdint>

#include "../config.hpp"
#include "dtypes.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief An fp32 value split into the bfloat16 nearest to it and the signed difference of
/// their bit patterns (see split_float).
struct split_float_bits {
  std::uint16_t param;     ///< bits of the bfloat16 nearest to the value
  std::int16_t remainder;  ///< value's bits minus (param's bits << 16), in [-32768, 32767]
};

/// @brief Splits `value` into a bfloat16 `param` and a remainder such that
/// join_float(param, remainder) gives `value`'s bits back exactly (NaN excepted: see below).
///
/// `param` is the bfloat16 nearest to `value`, ties rounded away from zero: the bit pattern
/// (value's bits + 0x8000) >> 16. It equals round-to-nearest-even everywhere except at exact
/// ties (the 16 dropped bits are 0x8000) with an even kept half, where it is the other,
/// equally near, neighbour. Round-to-nearest-even cannot be kept there: the 65537 fp32 values
/// from (2p - 1) / 2 to (2p + 1) / 2 ulp around an even bfloat16 p all round to p, but a 16-bit
/// remainder tells only 65536 of them apart. Rounding ties away from zero gives every
/// bfloat16 exactly 65536 fp32 values, at signed distances -32768 ... 32767 (in fp32 ulps of
/// the bit pattern), which is what `remainder` holds. (Intel's split SGD keeps the top 16
/// bits instead: exact too, but its bfloat16 is the truncated value, up to one bf16 ulp
/// below the master's magnitude.)
///
/// Infinities split exactly (remainder 0); a finite value rounding past the largest bfloat16
/// gives param = infinity and a negative remainder that joins back to the finite value. A
/// NaN becomes the quiet NaN 0x7fc0 (with its sign) and remainder 0: a NaN master shows as
/// a NaN parameter, whatever its payload (the payload is not kept).
FUSEDOPT_HOST_DEVICE split_float_bits split_float(float value)
{
  std::uint32_t m = detail::float_bits(value);
  if ((m & 0x7fffffffu) > 0x7f800000u) { m = (m & 0x80000000u) | 0x7fc00000u; }
  // m <= 0xffc00000 here: adding 0x8000 cannot wrap or reach the sign bit.
  auto const param = static_cast<std::uint16_t>((m + 0x8000u) >> 16);
  // value - (param << 16) is the low 16 bits of m read as a signed number.
  auto const low = static_cast<std::int32_t>(m & 0xffffu);
  auto const remainder = static_cast<std::int16_t>(low >= 0x8000 ? low - 0x10000 : low);
  return {param, remainder};
}

/// @brief The fp32 value whose split is (`param`, `remainder`): the bits
/// (param << 16) + remainder, modulo 2^32.
FUSEDOPT_HOST_DEVICE float join_float(std::uint16_t param, std::int16_t remainder)
{
  return detail::bits_float((static_cast<std::uint32_t>(param) << 16) +
                            static_cast<std::uint32_t>(static_cast<std::int32_t>(remainder)));
}

FUSEDOPT_NAMESPACE_END
