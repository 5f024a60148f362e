// Includes Catch2 v2 (Debian 12) or v3 (the GPU machine) and papers over their differences,
// so test files are written once.
#pragma once

#if defined(FUSEDOPT_CATCH2_V3)
#  include <catch2/catch_approx.hpp>
#  include <catch2/catch_session.hpp>
#  include <catch2/catch_template_test_macros.hpp>
#  include <catch2/catch_test_macros.hpp>
#  include <catch2/generators/catch_generators.hpp>
#  include <catch2/generators/catch_generators_range.hpp>
#  include <catch2/matchers/catch_matchers_string.hpp>
#else
#  include <catch2/catch.hpp>
#endif

#include <string>

namespace fusedopt_test {
#if defined(FUSEDOPT_CATCH2_V3)
using Catch::Approx;
/// A matcher of messages containing `s` (Contains in v2, ContainsSubstring in v3).
inline auto contains(std::string const& s) { return Catch::Matchers::ContainsSubstring(s); }
#else
using Catch::Detail::Approx;
inline auto contains(std::string const& s) { return Catch::Matchers::Contains(s); }
#endif
}  // namespace fusedopt_test

// Exit code CTest reads as "skipped" (SKIP_RETURN_CODE in tests/CMakeLists.txt).
#define FUSEDOPT_TEST_SKIP_CODE 77
