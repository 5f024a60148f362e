/// @file numeric/math.hpp
/// @brief Math used by rules, with the same results on host and device.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../config.hpp"

// A square root that cannot set errno, so that loops calling it vectorise with the compiler's
// default flags (docs/decisions.md, "A square root that vectorises without -fno-math-errno").
// Under -fmath-errno (GCC's and Clang's default) sqrtf may write errno: GCC keeps it behind a
// branch to the library, Clang as a library call, and neither vectorises a loop holding it.
// Declared `const`, the builtin is the instruction alone (sqrtss, vsqrtps: the same correctly
// rounded result, NaN for a NaN or negative input). No per-function setting does this: GCC
// takes a builtin's errno behaviour from the command line (a function marked
// `optimize("no-math-errno")` still branches), Clang has none. With GCC the attribute joins the
// builtin's one declaration, so in a translation unit that includes this header
// `__builtin_sqrtf` and `__builtin_sqrt` (and libstdc++'s std::sqrt(float), which calls the
// first) leave errno alone; ::sqrtf, ::sqrt and std::sqrt(double) still set it.
#if (defined(__GNUC__) || defined(__clang__)) && !FUSEDOPT_DEVICE_PASS
#  define FUSEDOPT_CONST_SQRT 1
extern "C" {
float __builtin_sqrtf(float) noexcept __attribute__((const));
double __builtin_sqrt(double) noexcept __attribute__((const));
}
#else
#  define FUSEDOPT_CONST_SQRT 0
#endif

FUSEDOPT_NAMESPACE_BEGIN
namespace math {

/// Correctly rounded square root (IEEE) on host and device; on the host it never sets errno.
FUSEDOPT_HOST_DEVICE float sqrt(float x)
{
#if FUSEDOPT_CONST_SQRT
  return __builtin_sqrtf(x);
#else
  return ::sqrtf(x);
#endif
}
FUSEDOPT_HOST_DEVICE double sqrt(double x)
{
#if FUSEDOPT_CONST_SQRT
  return __builtin_sqrt(x);
#else
  return ::sqrt(x);
#endif
}

FUSEDOPT_HOST_DEVICE float abs(float x) { return ::fabsf(x); }
FUSEDOPT_HOST_DEVICE double abs(double x) { return ::fabs(x); }

/// Larger of a and b; NaN if either is NaN (torch.maximum's semantics).
template <class T>
FUSEDOPT_HOST_DEVICE T maximum(T a, T b)
{
  return (a > b || a != a) ? a : b;
}

/// -x when `flip`, else x, by flipping the sign bit: exact as a negation, with neither a select
/// (which, with a few others in one chain, keeps GCC from vectorising a host loop) nor a
/// multiplication (which a compiler may fuse into an FMA with a neighbouring add, differently
/// in two kernels of one rule).
FUSEDOPT_HOST_DEVICE float negate_if(float x, bool flip)
{
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits ^= static_cast<std::uint32_t>(flip) << 31;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}
FUSEDOPT_HOST_DEVICE double negate_if(double x, bool flip)
{
  std::uint64_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits ^= static_cast<std::uint64_t>(flip) << 63;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

/// `chosen ? a : b` for a choice that is the same for every element of a step, written with
/// integer masks: GCC turns a conditional into a branch when it can sink the arithmetic of `a`
/// into it, and (floating-point traps being on by default) then cannot if-convert a branch
/// holding a float operation, so the host loop stays scalar ("control flow in loop"). Both
/// values are computed; the result has the bits of the conditional's.
template <class T>
FUSEDOPT_HOST_DEVICE T select(bool chosen, T a, T b)
{
#if FUSEDOPT_DEVICE_PASS
  return chosen ? a : b;
#else
  using bits_type = std::conditional_t<sizeof(T) == 8, std::uint64_t, std::uint32_t>;
  static_assert(sizeof(T) == sizeof(bits_type), "math::select takes float or double");
  bits_type x, y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  bits_type const mask = bits_type{0} - static_cast<bits_type>(chosen);
  bits_type const z = (x & mask) | (y & ~mask);
  T result;
  std::memcpy(&result, &z, sizeof result);
  return result;
#endif
}

/// -1, 0 or +1 (0 for NaN), as torch.sign.
template <class T>
FUSEDOPT_HOST_DEVICE T sign(T x)
{
  return static_cast<T>((x > T(0)) - (x < T(0)));
}

/// Two bases to one exponent by repeated squaring, in one loop whose two chains run side by
/// side: the same bits on host and device (std::pow may differ). Adam's bias corrections take
/// both betas to the step, once per thread in every block of the update: one loop of
/// log2(step) rounds instead of two (docs/tuning.md, "W1's ceiling, the rule's prepare, and
/// the shapes on two GPUs"). 1 for an exponent <= 0.
struct power_pair {
  double first, second;
};
FUSEDOPT_HOST_DEVICE power_pair ipow_pair(double a, double b, std::int64_t exponent)
{
  power_pair result{1.0, 1.0};
  while (exponent > 0) {
    if (exponent & 1) {
      result.first *= a;
      result.second *= b;
    }
    a *= a;
    b *= b;
    exponent >>= 1;
  }
  return result;
}

/// base^exponent: ipow_pair's first chain (the second, unused, is dropped by the compiler).
FUSEDOPT_HOST_DEVICE double ipow(double base, std::int64_t exponent) { return ipow_pair(base, base, exponent).first; }

/// @brief 0.96^x for x >= 0: NAdam's momentum cache 0.96^(t * momentum_decay); 1 for x < 0,
/// 0 for NaN.
///
/// The exponent is real, so math::ipow cannot serve and std::pow / CUDA's pow may differ
/// in the last bit. Instead x = n + f is split into its integer part, whose bits select
/// factors 0.96^(2^j), and its fraction, whose bits select factors 0.96^(2^-k); the factors
/// are constants (correctly rounded, computed offline with 400-bit arithmetic) and the
/// result is a fixed sequence of at most 64 multiplications, which IEEE rounds the same way
/// on host and device (a multiplication alone cannot be contracted into an FMA). Relative
/// error: a few ulp of double, about 1e-15. Bits of f below 2^-49 are dropped: their factor
/// rounds to 1.0 in double.
FUSEDOPT_HOST_DEVICE double momentum_cache_power(double x)
{
  // 0.96^(2^j), j = 0..14; 0.96^(2^15) underflows to 0 in double.
  constexpr double squares[15] = {
    0x1.eb851eb851eb8p-1,  0x1.d7dbf487fcb92p-1,  0x1.b2dd8d6457178p-1,  0x1.7159f992d250ep-1,
    0x1.0a72408c5ed93p-1,  0x1.1551a12142664p-2,  0x1.2c69c0b956283p-4,  0x1.608807620b0d6p-8,
    0x1.e5765c9576c70p-16, 0x1.cc4cd8c3e7a9ap-31, 0x1.9dd22108ba333p-61, 0x1.4e77d5882faefp-121,
    0x1.b4fce9479324bp-242, 0x1.74f73a3bf3590p-483, 0x1.0fafb7ffd414cp-965};
  // 0.96^(2^-k), k = 1..49; from k = 50 on the factor rounds to 1.0.
  constexpr double roots[49] = {
    0x1.f5a7cecdb684ap-1, 0x1.facd25beb92c8p-1, 0x1.fd64e03fbea51p-1, 0x1.feb20330f43f5p-1,
    0x1.ff58e653d9d47p-1, 0x1.ffac6c57a7d54p-1, 0x1.ffd634771f000p-1, 0x1.ffeb19ce5dd06p-1,
    0x1.fff58ccbe1edap-1, 0x1.fffac65f1da66p-1, 0x1.fffd632dd9fcdp-1, 0x1.fffeb1967fc89p-1,
    0x1.ffff58cb2496cp-1, 0x1.ffffac658b780p-1, 0x1.ffffd632c4073p-1, 0x1.ffffeb1961966p-1,
    0x1.fffff58cb0afep-1, 0x1.fffffac658512p-1, 0x1.fffffd632c26ep-1, 0x1.fffffeb196130p-1,
    0x1.ffffff58cb096p-1, 0x1.ffffffac6584bp-1, 0x1.ffffffd632c25p-1, 0x1.ffffffeb19613p-1,
    0x1.fffffff58cb09p-1, 0x1.fffffffac6585p-1, 0x1.fffffffd632c2p-1, 0x1.fffffffeb1961p-1,
    0x1.ffffffff58cb1p-1, 0x1.ffffffffac658p-1, 0x1.ffffffffd632cp-1, 0x1.ffffffffeb196p-1,
    0x1.fffffffff58cbp-1, 0x1.fffffffffac66p-1, 0x1.fffffffffd633p-1, 0x1.fffffffffeb19p-1,
    0x1.ffffffffff58dp-1, 0x1.ffffffffffac6p-1, 0x1.ffffffffffd63p-1, 0x1.ffffffffffeb2p-1,
    0x1.fffffffffff59p-1, 0x1.fffffffffffacp-1, 0x1.fffffffffffd6p-1, 0x1.fffffffffffebp-1,
    0x1.ffffffffffff6p-1, 0x1.ffffffffffffbp-1, 0x1.ffffffffffffdp-1, 0x1.fffffffffffffp-1,
    0x1.fffffffffffffp-1};

  if (!(x < 32768.0)) { return 0.0; }  // underflows (as pow does); also catches +inf and NaN
  // Below 0 only for a step before the first (or a negative momentum_decay read from memory):
  // outside NAdam's domain, clamped to 0.96^0 so the cast below stays defined (a double below
  // -2^63 or -inf has no int64 value).
  if (x < 0.0) { return 1.0; }
  auto const whole = static_cast<std::int64_t>(x);  // x >= 0: truncation is floor
  double fraction = x - static_cast<double>(whole);  // exact
  double result = 1.0;
  for (int j = 0; j < 15; ++j) {
    if ((whole >> j) & 1) { result *= squares[j]; }
  }
  for (int k = 0; k < 49; ++k) {
    fraction += fraction;  // exact: shifts the next bit of the fraction into the units place
    if (fraction >= 1.0) {
      result *= roots[k];
      fraction -= 1.0;
    }
  }
  return result;
}

}  // namespace math
FUSEDOPT_NAMESPACE_END
