// What the host tests share: fusedopt and Catch2, `fo` and the names of the slots most tests
// bind, and two assertions.
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <functional>
#include <string>
#include <vector>

#include "catch.hpp"

namespace fo = fusedopt;
// fo::slot::remainder stays spelled out: `remainder` at global scope is <cmath>'s function.
using fo::slot::exp_avg;
using fo::slot::exp_avg_sq;
using fo::slot::grad;
using fo::slot::master;
using fo::slot::max_exp_avg_sq;
using fo::slot::momentum_buffer;
using fo::slot::param;

namespace fusedopt_test {

/// a == b, without Catch's decomposition: a failure would print megabytes of elements.
template <class A, class B>
bool same(A const& a, B const& b)
{
  return a == b;
}

/// Calls `f`, which must throw fusedopt::error whose message contains every one of `words`.
inline void expect_error(std::function<void()> const& f, std::vector<std::string> const& words)
{
  try {
    f();
    FAIL("no fusedopt::error thrown");
  } catch (fo::error const& e) {
    std::string const what = e.what();
    INFO("message: " << what);
    for (auto const& w : words) {
      INFO("expected in the message: " << w);
      CHECK(what.find(w) != std::string::npos);
    }
  }
}

}  // namespace fusedopt_test

using fusedopt_test::expect_error;
using fusedopt_test::same;
