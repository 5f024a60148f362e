/// @file core.hpp
/// @brief What fusedopt_torch's core's two translation units share (engine.cpp: the engine;
/// binding.cpp: the module and the rest): the headers of torch it uses, error messages, and
/// what both call (plan_dtype, follow_stream, the 8-bit state's bytes, unit_at). The engine's own
/// checks of parameters and states are engine.cpp's.
///
/// Two translation units because the core is the critical path of a first step from an empty
/// cache (docs/decisions.md, "The core in two translation units"): torch's cpp_extension builds
/// them in parallel.
#pragma once

#if defined(FUSEDOPT_TORCH_FULL_HEADERS)
#  include <torch/extension.h>
#else
// What the core uses of torch: ATen's Tensor and the two factory functions it calls, the
// autograd variable and torch's pybind11 casters; not ATen/ATen.h (every operator's header) nor
// torch/extension.h's C++ frontend (nn, optim, data, serialize), whose parsing took most of the
// core's compile time (docs/decisions.md, "fusedopt_torch compiles on demand"). _ext.py falls
// back to torch/extension.h where a torch lacks one of these.
#  include <ATen/core/Tensor.h>
#  include <ATen/ops/empty.h>
#  include <ATen/ops/full.h>
#  include <torch/csrc/autograd/python_variable.h>
#  include <torch/csrc/utils/pybind.h>
#endif

#include <ATen/Parallel.h>

#if defined(FUSEDOPT_TORCH_WITH_CUDA)
#  include <ATen/cuda/CUDAContext.h>
#  include <ATen/cuda/CUDAEvent.h>
#  include <c10/cuda/CUDAGuard.h>
#endif

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "plans.hpp"

namespace fusedopt_torch {

namespace py = pybind11;

// Error messages are built as std::string and thrown as std::runtime_error (pybind11 makes it a
// RuntimeError), never through TORCH_CHECK: TORCH_CHECK streams its message parts through an
// std::ostringstream (c10::str), and streaming an integer there from this extension crashed the
// process on the GPU machine's torch 2.11 (SIGSEGV in std::ostream::_M_insert<unsigned long>,
// the segmentation fault of issue 15 row 11).
inline std::string text(char const* s) { return s; }
inline std::string text(std::string const& s) { return s; }
template <class I, std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int> = 0>
std::string text(I value)
{
  return std::to_string(value);
}
inline std::string text(at::IntArrayRef values)
{
  std::string out = "[";
  for (std::size_t k = 0; k < values.size(); ++k) { out += (k ? ", " : "") + std::to_string(values[k]); }
  return out + "]";
}
inline std::string text(at::ScalarType t) { return c10::toString(t); }
inline std::string text(c10::Device const& d) { return d.str(); }

template <class... Parts>
[[noreturn]] void fail(Parts const&... parts)
{
  throw std::runtime_error((std::string() + ... + text(parts)));
}

#define FUSEDOPT_TORCH_CHECK(condition, ...)               \
  do {                                                     \
    if (!(condition)) { ::fusedopt_torch::fail(__VA_ARGS__); } \
  } while (0)

/// The plans' element type of `type`; none for a type fusedopt has no plans for.
inline c10::optional<dtype> plan_dtype(at::ScalarType type)
{
  switch (type) {
    case at::kFloat: return dtype::f32;
    case at::kDouble: return dtype::f64;
    case at::kHalf: return dtype::f16;
    case at::kBFloat16: return dtype::bf16;
    default: return c10::nullopt;
  }
}

#if defined(FUSEDOPT_TORCH_WITH_CUDA)
/// Orders work on `stream` after a plan's last run (`last`) on another stream (a plan's device
/// tables and workspace are rewritten in stream order), and makes `stream` the last one.
inline void follow_stream(c10::optional<c10::cuda::CUDAStream>& last, c10::cuda::CUDAStream const& stream)
{
  if (last && *last != stream) {
    // A capture (torch.cuda.graph synchronises the device before it begins) must not wait on
    // an event recorded outside it. Asked only on a change of stream: not every step.
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream.stream(), &capturing));
    if (capturing == cudaStreamCaptureStatusNone) {
      at::cuda::CUDAEvent done;
      done.record(*last);
      done.block(stream);
    }
  }
  last = stream;
}
#endif

/// Checks the 8-bit state `s` of a tensor of `numel` elements: a contiguous 1-D uint8 tensor of
/// quantized_state_bytes(numel), 16-byte aligned (fusedopt's blockwise8 storage). `who...`
/// prefix the message.
template <class... Who>
void check_quantized_bytes(at::Tensor const& s, std::int64_t numel, Who const&... who)
{
  std::int64_t const bytes = quantized_state_bytes(numel);
  FUSEDOPT_TORCH_CHECK(s.scalar_type() == at::kByte && s.dim() == 1 && s.is_contiguous() && s.numel() == bytes, who...,
                       ": the 8-bit state of ", numel, " elements must be a contiguous 1-D uint8 tensor of ", bytes,
                       " bytes, not a ", s.scalar_type(), " tensor of shape ", s.sizes(),
                       " (a [blocks, 260] state was saved before 2026-11-26: the 8-bit optimizers' load_state_dict converts it)");
  FUSEDOPT_TORCH_CHECK(reinterpret_cast<std::uintptr_t>(s.data_ptr()) % 16 == 0, who...,
                       ": the 8-bit state must be 16-byte aligned (a fresh tensor is; a slice at an odd offset is not)");
}

/// The unit_api of a unit's address (as `load_unit` returns it).
inline unit_api const& unit_at(std::uintptr_t address)
{
  FUSEDOPT_TORCH_CHECK(address != 0, "fusedopt_torch: internal error: no unit");
  return *reinterpret_cast<unit_api const*>(address);
}

/// Adds `_C.Engine` to the module (engine.cpp).
void bind_engine(py::module_& m);

}  // namespace fusedopt_torch
