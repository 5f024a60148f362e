/// @file version.hpp
/// @brief fusedopt's version.
///
/// Written by hand, not generated: a header-only library must compile from its source tree
/// with nothing but `-I include` (vendored without CMake, or by torch.utils.cpp_extension).
/// The top-level CMakeLists.txt refuses to configure when these numbers disagree with
/// `project(fusedopt VERSION ...)`, so a release changes both.
#pragma once

/// Major version: a change here may break code written against the previous one.
#define FUSEDOPT_VERSION_MAJOR 0
/// Minor version: new features, compatible within one major version.
#define FUSEDOPT_VERSION_MINOR 1
/// Patch version: fixes only.
#define FUSEDOPT_VERSION_PATCH 0
/// The version as one number: major * 10000 + minor * 100 + patch.
#define FUSEDOPT_VERSION (FUSEDOPT_VERSION_MAJOR * 10000 + FUSEDOPT_VERSION_MINOR * 100 + FUSEDOPT_VERSION_PATCH)
/// The version as text, "major.minor.patch".
#define FUSEDOPT_VERSION_STRING "0.1.0"
