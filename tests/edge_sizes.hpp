// Tensor sizes that hit every edge of both backends, written once for the host and CUDA tests:
// empty, one element, around the vector widths (the host's lanes, CUDA's 16-byte vectors),
// around a CUDA block's iteration and the chunk lengths (the host tests' 16 and 4096, the
// default chunks), and tensors of several default chunks.
#pragma once

#include <cstdint>
#include <vector>

namespace fusedopt_test {

inline std::vector<std::int64_t> all_edge_sizes()
{
  return {0,    1,    2,    3,    5,    7,     8,     9,     15,    16,    17,    31,     33,
          100,  127,  128,  129,  255,  1000,  2047,  2049,  4095,  4096,  4097,  16383,  16384,
          16385, 16391, 40000, 65537, 100000};
}

/// A few of them: the trajectories of tests/rules (sanitised runs too).
inline std::vector<std::int64_t> quick_edge_sizes() { return {0, 1, 7, 9, 17, 129, 4097, 16391}; }

}  // namespace fusedopt_test
