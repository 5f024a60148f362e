/// @file c_unit.hpp
/// @brief What the units loaded with ctypes share (muon_unit.hpp, adafactor_unit.hpp,
/// prodigy_unit.hpp, came_unit.hpp): tensor lists from arrays of addresses and sizes, errors as a
/// return code and a message (never an exception across the C boundary), and the calls that take
/// the stream only on CUDA.
#pragma once

#include <fusedopt/error.hpp>
#include <fusedopt/factored.hpp>
#include <fusedopt/tensor_list.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <type_traits>
#include <vector>

/// An entry point of a ctypes unit: C linkage, visible (units are built with hidden symbols).
#define FUSEDOPT_TORCH_C_EXPORT extern "C" __attribute__((visibility("default")))

namespace fusedopt_torch {
namespace c_unit {

/// n tensors of T at `pointers` (void* or void const*), sizes[t] elements each.
template <class T, class P>
::fusedopt::tensor_list<T> list_of(P const* pointers, std::int64_t const* sizes, std::int64_t n)
{
  ::fusedopt::tensor_list<T> list;
  for (std::int64_t t = 0; t < n; ++t) { list.push_back(static_cast<T*>(pointers[t]), sizes[t]); }
  return list;
}

/// Writes `message` into `error` (size bytes, always terminated) and returns 1.
inline int failed(char* error, std::size_t size, char const* message)
{
  if (error != nullptr && size > 0) { std::snprintf(error, size, "%s", message); }
  return 1;
}

/// Runs f(): 0, or 1 with the exception's message in `error`.
template <class F>
int guarded(char* error, std::size_t size, F&& f)
{
  try {
    f();
    return 0;
  } catch (std::exception const& e) {
    return failed(error, size, e.what());
  } catch (...) {
    return failed(error, size, "fusedopt_torch: unknown error in a unit");
  }
}

#ifdef CUDART_VERSION  // a CUDA unit (it includes fusedopt.cuh, and so the CUDA runtime, first)
/// Frees device memory held by a unit's unique_ptr.
struct device_free {
  void operator()(void* p) const { (void)cudaFree(p); }
};

/// A CUDA plan's options for a rule with factored passes (Adafactor's, CAME's): longer chunks
/// (fusedopt::factored_chunk_elements).
inline ::fusedopt::cuda::options factored_rule_options()
{
  ::fusedopt::cuda::options o;
  o.chunk_elements = ::fusedopt::factored_chunk_elements;
  return o;
}

/// n values of T in device memory (at least one, so that an empty layout still has an address).
template <class T>
std::unique_ptr<T, device_free> device_array(std::size_t n)
{
  void* p = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&p, (n > 0 ? n : 1) * sizeof(T)));
  return std::unique_ptr<T, device_free>(static_cast<T*>(p));
}
#endif

/// f(stream as S) for a CUDA unit (S: cudaStream_t), f() for a host unit (S: void): one call
/// site for a plan call that takes the stream only on CUDA.
template <class S, class F>
void on_stream(void* stream, F&& f)
{
  if constexpr (std::is_void_v<S>) {
    (void)stream;
    f();
  } else {
    f(static_cast<S>(stream));
  }
}

/// A unit's rebind_grads: `held` (the plan's gradient addresses) takes the n addresses `given`
/// (as many as the plan has tensors, else `count_error`), then the plan is rebound to them on
/// `stream` (S as on_stream's).
template <class S, class Plan, class Pointer>
void rebind_grads(Plan& plan, std::vector<Pointer>& held, void const* const* given, std::int64_t n, void* stream,
                  char const* count_error)
{
  FUSEDOPT_EXPECTS(static_cast<std::size_t>(n) == held.size(), count_error);
  for (std::int64_t t = 0; t < n; ++t) { held[static_cast<std::size_t>(t)] = static_cast<Pointer>(given[t]); }
  on_stream<S>(stream, [&](auto... on) { plan.rebind(::fusedopt::slot::grad, held.data(), held.size(), on...); });
}

}  // namespace c_unit
}  // namespace fusedopt_torch
