/// @file error.hpp
/// @brief The exception thrown for bad input and failed backend calls.
#pragma once

#include <stdexcept>
#include <string>

#include "config.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief Every error fusedopt reports on the host: bad input (mismatched lists, null
/// pointers, overlapping memory, missing slots) and failed CUDA calls. Thrown before any
/// memory is written. Device code never throws.
class error : public std::runtime_error {
 public:
  explicit error(std::string const& message) : std::runtime_error("fusedopt: " + message) {}
};

namespace detail {
[[noreturn]] inline void throw_error(char const* file, int line, std::string const& message)
{
  throw error(message + " (" + file + ":" + std::to_string(line) + ")");
}
}  // namespace detail

FUSEDOPT_NAMESPACE_END

/// Throws fusedopt::error with `message` (anything convertible to std::string).
#define FUSEDOPT_FAIL(message) ::fusedopt::detail::throw_error(__FILE__, __LINE__, (message))

/// Throws fusedopt::error with `message` (anything convertible to std::string) when
/// `condition` is false.
#define FUSEDOPT_EXPECTS(condition, message)                                 \
  do {                                                                       \
    if (!(condition)) {                                                      \
      ::fusedopt::detail::throw_error(__FILE__, __LINE__, (message));        \
    }                                                                        \
  } while (0)
