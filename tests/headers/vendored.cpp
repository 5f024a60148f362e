// fusedopt vendored without CMake: the umbrella header compiles from the source tree with
// nothing but `-I include` (no generated header, no definitions from the CMake target), and
// states the version. Compiled by the test headers_vendored (tests/headers/CMakeLists.txt).
#include <fusedopt/fusedopt.hpp>

#include <cstring>

static_assert(FUSEDOPT_VERSION == FUSEDOPT_VERSION_MAJOR * 10000 + FUSEDOPT_VERSION_MINOR * 100 + FUSEDOPT_VERSION_PATCH,
              "FUSEDOPT_VERSION must be the three numbers combined");

int main()
{
  // The test passes the version CMake's project() declares; the header must agree.
  return std::strcmp(FUSEDOPT_VERSION_STRING, FUSEDOPT_EXPECTED_VERSION) == 0 ? 0 : 1;
}
