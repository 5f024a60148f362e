/// @file runner.hpp
/// @brief The interface between the XLA FFI handler (handler.cc, which alone includes XLA's
/// headers) and the fused steps (unit.cc, compiled once per optimizer kind, by nvcc for the
/// CUDA library and by the C++ compiler for the CPU one). Nothing here includes CUDA or XLA:
/// buffers are raw pointers, the stream a `void*` (a cudaStream_t on CUDA, unused on the CPU).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#ifndef FUSEDOPT_JAX_CUDA
#define FUSEDOPT_JAX_CUDA 0
#endif

// Each library's symbols in a namespace of their own (the CPU and the CUDA library can both be
// loaded in one process; their symbols are hidden too).
#if FUSEDOPT_JAX_CUDA
#define FUSEDOPT_JAX_BACKEND cuda_backend
#else
#define FUSEDOPT_JAX_BACKEND host_backend
#endif

namespace fusedopt_jax {

/// The optimizer of a call (the `kind` attribute; fusedopt_jax/_core.py `_KIND`).
enum class kind : int { sgd = 0, sgd_momentum = 1, adam = 2, lion = 3, lamb = 4, clip_adam = 5 };
inline constexpr int num_kinds = 6;

/// Element types a list may hold. Others are refused in Python before the call.
enum class dtype : int { f32 = 0, bf16 = 1 };

/// The element types of one group of leaves: param (and grad: the same), the two states (exp_avg
/// or momentum_buffer, exp_avg_sq; `f32` where the kind has no such state) and the update of
/// Optax's form (`f32` in the fused form, unused).
struct group_key {
  int kind = 0;
  bool inplace = false;
  dtype param = dtype::f32, state1 = dtype::f32, state2 = dtype::f32, update = dtype::f32;

  friend bool operator==(group_key const& a, group_key const& b)
  {
    return a.kind == b.kind && a.inplace == b.inplace && a.param == b.param && a.state1 == b.state1 &&
           a.state2 == b.state2 && a.update == b.update;
  }
};

/// One pytree leaf: its buffers (null for a slot the kind does not bind) and element count.
struct leaf {
  void const* param_in = nullptr;  ///< Optax's form: the parameter, read only
  void* param = nullptr;           ///< the fused form: the parameter's output (aliased to its input)
  void const* grad = nullptr;
  void* state1 = nullptr;  ///< exp_avg or momentum_buffer (output, aliased to its input)
  void* state2 = nullptr;  ///< exp_avg_sq
  void* update = nullptr;  ///< Optax's form: the update's output
  std::int64_t size = 0;
};

/// A cached plan of one group: `run` binds the leaves (a new plan where their geometry changed,
/// else a rebind) and enqueues the step. Throws fusedopt::error on bad input.
class runner {
 public:
  virtual ~runner() = default;
  /// Returns whether the leaves had to be bound (a new plan or a rebind: their addresses or
  /// geometry differ from the last call's), for FUSEDOPT_JAX_PROFILE.
  virtual bool run(std::vector<leaf> const& leaves, float const* hyper, void* stream) = 0;
};

namespace FUSEDOPT_JAX_BACKEND {
/// A runner for the group, or null where the combination of types is not compiled.
std::unique_ptr<runner> make_runner(group_key const& key);
// One per kind (unit.cc compiled with FUSEDOPT_JAX_KIND = the kind).
std::unique_ptr<runner> make_runner_sgd(group_key const& key);
std::unique_ptr<runner> make_runner_sgd_momentum(group_key const& key);
std::unique_ptr<runner> make_runner_adam(group_key const& key);
std::unique_ptr<runner> make_runner_lion(group_key const& key);
std::unique_ptr<runner> make_runner_lamb(group_key const& key);
std::unique_ptr<runner> make_runner_clip_adam(group_key const& key);

/// CUDA only (device.cu): the device of a device pointer, make it current (returns the previous),
/// and an asynchronous device-to-device copy on `stream`. The CPU library has no-op versions.
int device_of(void const* pointer);
int set_device(int device);
void copy_async(void* destination, void const* source, std::size_t bytes, void* stream);
}  // namespace FUSEDOPT_JAX_BACKEND

}  // namespace fusedopt_jax
