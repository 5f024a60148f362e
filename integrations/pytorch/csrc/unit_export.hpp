/// @file unit_export.hpp
/// @brief What every unit (a shared library of kernels, plans.hpp's unit_api) is made of: the
/// backend filter (which dtypes, layouts and GradScaler kernels it compiles), error capture at
/// the library boundary, and the exported entry point. A unit's source (_codegen.py generates
/// it) includes unit_host.hpp or unit_cuda.cuh, then families.hpp or user_rule.hpp, defines its
/// entry points and ends with FUSEDOPT_TORCH_EXPORT_UNIT.
#pragma once

#include <fusedopt/error.hpp>

#include <cstdint>
#include <exception>
#include <string>

#include "plans.hpp"

namespace fusedopt_torch {
namespace detail {

/// Backend `Base` compiling what `Filter` says: `Filter::dtype(t)`, `Filter::layout(bits)`
/// (constexpr) and `Filter::amp` (unit_plans.hpp's filter_of and compiles_amp read them).
template <class Base, class Filter>
struct filtered : Base {
  static constexpr bool compiles_dtype(dtype t) { return Filter::dtype(t); }
  static constexpr bool compiles_layout(std::uint32_t bits) { return Filter::layout(bits); }
  static constexpr bool amp = Filter::amp;
};

/// A filter that compiles everything (ahead-of-time units).
struct compile_all {
  static constexpr bool dtype(dtype) { return true; }
  static constexpr bool layout(std::uint32_t) { return true; }
  static constexpr bool amp = true;
};

/// `make()` (a unique_ptr) released, or null with the exception's text in `*error`: nothing
/// is thrown across the library boundary when a unit makes something.
template <class Make>
auto made(std::string* error, Make&& make) -> decltype(make().release())
{
  try {
    return make().release();
  } catch (std::exception const& e) {
    *error = e.what();
  } catch (...) {
    *error = "fusedopt_torch: unknown error in a unit";
  }
  return nullptr;
}

/// `run()` (returning nothing): true, or false with the exception's text in `*error`.
template <class Run>
bool ran(std::string* error, Run&& run)
{
  try {
    run();
    return true;
  } catch (std::exception const& e) {
    *error = e.what();
  } catch (...) {
    *error = "fusedopt_torch: unknown error in a unit";
  }
  return false;
}

}  // namespace detail
}  // namespace fusedopt_torch

#if defined(_WIN32)
#  define FUSEDOPT_TORCH_UNIT_EXPORT extern "C" __declspec(dllexport)
#else
#  define FUSEDOPT_TORCH_UNIT_EXPORT extern "C" __attribute__((visibility("default")))
#endif

/// Defines the unit's entry point (plans.hpp's unit_entry_point) with these functions (each
/// the name of a function of unit_api's type, or nullptr where the unit has none).
#define FUSEDOPT_TORCH_EXPORT_UNIT(make_plan, make_norm_plan, quantize_state, dequantize_state)         \
  FUSEDOPT_TORCH_UNIT_EXPORT ::fusedopt_torch::unit_api const* fusedopt_torch_unit()                 \
  {                                                                                                  \
    static ::fusedopt_torch::unit_api const api{::fusedopt_torch::unit_abi, make_plan, make_norm_plan, \
                                                quantize_state, dequantize_state};                   \
    return &api;                                                                                     \
  }
