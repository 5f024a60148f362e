/// @file runner.hpp
/// @brief The interface between the XLA FFI handler (handler.cc, which alone includes XLA's
/// headers) and the fused steps (unit.cc, a shared library per optimizer kind, form and element
/// types, by nvcc for the CUDA backend and by the C++ compiler for the CPU one). Nothing here includes CUDA or XLA:
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

/// The state tensors a kind binds per leaf: momentum_buffer / exp_avg, then exp_avg_sq
/// (fusedopt_jax/_build.py's KIND_STATES).
constexpr int states_of(kind k)
{
  switch (k) {
    case kind::sgd: return 0;
    case kind::sgd_momentum:
    case kind::lion: return 1;
    default: return 2;
  }
}

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

/// A unit's export (unit.cc): a new runner for the group, or null where the group is another
/// unit's. The symbol's name differs per backend, so that a unit of the other backend is refused.
using unit_maker = runner* (*)(group_key const* key);
#if FUSEDOPT_JAX_CUDA
#define FUSEDOPT_JAX_UNIT_MAKER FusedoptJaxUnitMakeCuda
#else
#define FUSEDOPT_JAX_UNIT_MAKER FusedoptJaxUnitMakeCpu
#endif
#define FUSEDOPT_JAX_STRINGIFY2(x) #x
#define FUSEDOPT_JAX_STRINGIFY(x) FUSEDOPT_JAX_STRINGIFY2(x)
inline constexpr char const* unit_maker_symbol = FUSEDOPT_JAX_STRINGIFY(FUSEDOPT_JAX_UNIT_MAKER);

namespace FUSEDOPT_JAX_BACKEND {
/// CUDA only (device.cu): the device of a device pointer, make it current (returns the previous),
/// and an asynchronous device-to-device copy on `stream`. The CPU library has no-op versions.
int device_of(void const* pointer);
int set_device(int device);
void copy_async(void* destination, void const* source, std::size_t bytes, void* stream);
}  // namespace FUSEDOPT_JAX_BACKEND

}  // namespace fusedopt_jax
