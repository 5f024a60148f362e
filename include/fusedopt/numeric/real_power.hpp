/// @file numeric/real_power.hpp
/// @brief Natural logarithm, exponential and real powers in double with the same bits on host
/// and device, for per-step values of rules (ASGD's eta, Schedule-Free's weights, AdEMAMix's
/// beta3 schedule, ADOPT's clipping bound).
///
/// std::pow, std::exp and std::log (glibc) and CUDA's pow, exp and log are each accurate to an
/// ulp or so, but not to the same bits, and a rule's `prepare` must give the same bits on both
/// backends (docs/rules.md). These functions use only IEEE operations that round the same way
/// everywhere: additions, multiplications, one division, and explicit `fma` for every
/// multiply-add (so neither -ffp-contract on the host nor -fmad on the device can fuse them
/// differently), with fixed constants (hexadecimal literals, correctly rounded). Accuracy,
/// measured against glibc over random inputs (tests/host/real_power.cpp): portable_log and
/// portable_exp within 2 ulp, portable_pow within about |y ln x| * 2^-52 relative (the error of
/// the logarithm, scaled by the exponent) plus 2 ulp; integral exponents are exact repeated
/// squaring (math::ipow), so x^2 is x * x correctly rounded, as Python's and C's pow give it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../config.hpp"
#include "math.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace math {

namespace detail_power {
/// ln 2 = ln2_hi + ln2_lo, ln2_hi with 32 trailing zero bits (so k * ln2_hi is exact for |k| < 2^20).
inline constexpr double ln2_hi = 0x1.62e42fee00000p-1;
inline constexpr double ln2_lo = 0x1.a39ef35793c76p-33;
inline constexpr double inv_ln2 = 0x1.71547652b82fep+0;

/// 2^k for a k in the normal range [-1022, 1023], from its bits.
FUSEDOPT_HOST_DEVICE double two_to(std::int64_t k)
{
  std::uint64_t const bits = static_cast<std::uint64_t>(k + 1023) << 52;
  double result;
  std::memcpy(&result, &bits, sizeof result);
  return result;
}
}  // namespace detail_power

/// @brief ln(x) for x > 0: +inf for +inf, -inf for 0, NaN for x < 0 and NaN.
///
/// x = m 2^e with m in [sqrt(1/2), sqrt(2)); with f = m - 1 (exact) and s = f / (2 + f),
/// ln(m) = 2 atanh(s) = f - s (f - P(s^2)), P(z) = sum_{k>=1} 2 z^k / (2k + 1) to ten terms
/// (|s| < 0.172: the next term is below 2^-54 of the result); then e ln 2 is added in two parts.
FUSEDOPT_HOST_DEVICE double portable_log(double x)
{
  if (!(x > 0.0)) { return x == 0.0 ? -HUGE_VAL : (x - x) / (x - x); }  // 0 -> -inf; < 0, NaN -> NaN
  if (x > 1.7976931348623157e308) { return x; }                       // +inf
  std::int64_t e = 0;
  if (x < 0x1p-1022) {  // subnormal: scale into the normal range first (exact)
    x *= 0x1p54;
    e = -54;
  }
  std::uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  e += static_cast<std::int64_t>((bits >> 52) & 0x7ff) - 1023;
  bits = (bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull;  // m in [1, 2)
  double m;
  std::memcpy(&m, &bits, sizeof m);
  if (m > 0x1.6a09e667f3bcdp+0) {  // above sqrt(2): halve, so that m is in [sqrt(1/2), sqrt(2))
    m *= 0.5;
    e += 1;
  }
  double const f = m - 1.0;  // exact (Sterbenz)
  double const s = f / (2.0 + f);
  double const z = s * s;
  double p = 0x1.8618618618618p-4;  // 2/21
  p = ::fma(p, z, 0x1.af286bca1af28p-4);  // 2/19
  p = ::fma(p, z, 0x1.e1e1e1e1e1e1ep-4);  // 2/17
  p = ::fma(p, z, 0x1.1111111111111p-3);  // 2/15
  p = ::fma(p, z, 0x1.3b13b13b13b14p-3);  // 2/13
  p = ::fma(p, z, 0x1.745d1745d1746p-3);  // 2/11
  p = ::fma(p, z, 0x1.c71c71c71c71cp-3);  // 2/9
  p = ::fma(p, z, 0x1.2492492492492p-2);  // 2/7
  p = ::fma(p, z, 0x1.999999999999ap-2);  // 2/5
  p = ::fma(p, z, 0x1.5555555555555p-1);  // 2/3
  p = p * z;
  double const log_m = ::fma(-s, f - p, f);
  auto const k = static_cast<double>(e);
  return ::fma(k, detail_power::ln2_hi, ::fma(k, detail_power::ln2_lo, log_m));
}

/// @brief e^x: +inf above ln(DBL_MAX), 0 below ln of the smallest subnormal, NaN for NaN.
///
/// x = k ln 2 + r with |r| <= ln(2)/2 (Cody and Waite's two-part reduction), e^r by its
/// Taylor polynomial to r^13/13! (the next term is below 2^-57), then scaled by 2^k in at most
/// two exact multiplications (one rounding where the result is subnormal).
FUSEDOPT_HOST_DEVICE double portable_exp(double x)
{
  if (x != x) { return x; }
  if (x > 709.782712893384) { return HUGE_VAL; }
  if (x < -745.1332191019412) { return 0.0; }
  double const kd = ::floor(::fma(x, detail_power::inv_ln2, 0.5));
  double r = ::fma(-kd, detail_power::ln2_hi, x);
  r = ::fma(-kd, detail_power::ln2_lo, r);
  double p = 0x1.6124613a86d09p-33;  // 1/13!
  p = ::fma(p, r, 0x1.1eed8eff8d898p-29);  // 1/12!
  p = ::fma(p, r, 0x1.ae64567f544e4p-26);  // 1/11!
  p = ::fma(p, r, 0x1.27e4fb7789f5cp-22);  // 1/10!
  p = ::fma(p, r, 0x1.71de3a556c734p-19);  // 1/9!
  p = ::fma(p, r, 0x1.a01a01a01a01ap-16);  // 1/8!
  p = ::fma(p, r, 0x1.a01a01a01a01ap-13);  // 1/7!
  p = ::fma(p, r, 0x1.6c16c16c16c17p-10);  // 1/6!
  p = ::fma(p, r, 0x1.1111111111111p-7);   // 1/5!
  p = ::fma(p, r, 0x1.5555555555555p-5);   // 1/4!
  p = ::fma(p, r, 0x1.5555555555555p-3);   // 1/3!
  p = ::fma(p, r, 0.5);
  p = ::fma(p, r, 1.0);
  p = ::fma(p, r, 1.0);
  auto k = static_cast<std::int64_t>(kd);
  if (k > 1023) {  // e^x just below the overflow threshold: 2^k does not exist, 2^(k-1) * 2 does
    p *= 2.0;
    k -= 1;
  }
  if (k < -1022) {  // subnormal result: two factors, the last multiplication rounds once
    return p * detail_power::two_to(k + 600) * 0x1p-600;
  }
  return p * detail_power::two_to(k);
}

/// @brief x^y for x >= 0: exp(y ln x), with the cases of C's pow that rules meet: x^0 = 1
/// (also for x = 0), 0^y = 0 for y > 0 and +inf for y < 0, 1^y = 1, and an integral y
/// (|y| < 2^31) by repeated squaring (math::ipow), exact to one rounding per multiplication.
/// NaN for x < 0 with a non-integral y, and for NaN arguments.
FUSEDOPT_HOST_DEVICE double portable_pow(double x, double y)
{
  if (y == 0.0 || x == 1.0) { return 1.0; }
  if (x != x || y != y) { return x + y; }
  if (y == ::floor(y) && ::fabs(y) < 0x1p31) {
    auto const n = static_cast<std::int64_t>(y);
    double const magnitude = ipow(x, n < 0 ? -n : n);
    return n < 0 ? 1.0 / magnitude : magnitude;
  }
  if (x == 0.0) { return y > 0.0 ? 0.0 : HUGE_VAL; }
  if (x < 0.0) { return (x - x) / (x - x); }
  return portable_exp(y * portable_log(x));
}

}  // namespace math
FUSEDOPT_NAMESPACE_END
