// The bit pattern of a float and back, for tests that compare or build values bit by bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace fusedopt_test {

inline std::uint32_t bits_of(float f)
{
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(std::uint32_t u)
{
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace fusedopt_test
