/// @file plans.hpp
/// @brief The small interface between the torch binding (the core) and fusedopt's kernels (units).
///
/// Nothing here knows torch or CUDA: tensors are raw pointers and sizes, the stream is a
/// `void*` (a `cudaStream_t`), hyperparameters a plain struct. The kernels live in *units*:
/// shared libraries compiled on demand (fusedopt_torch/_codegen.py generates their source) or
/// ahead of time (setup.py), each exporting `fusedopt_torch_unit()` (unit_api below). The core,
/// `binding.cpp` and `engine.cpp`, alone includes torch; it loads units with dlopen and makes
/// plans through them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fusedopt_torch {

/// @brief Element type of every list of one plan (param, grad and states share it, as in torch).
enum class dtype : int { f32 = 0, f64 = 1, f16 = 2, bf16 = 3 };

/// @brief The optimizer families, once: X(name, plans) for each, where `plans` names the plan
/// function that serves it (`<plans>_plan` in families.hpp). After them, `user`: a rule written
/// by the user (fusedopt_torch.rule), whose unit brings its own plan function (user_rule.hpp).
/// Python sees them as fusedopt_torch._C.Family.<name>.
#define FUSEDOPT_TORCH_FAMILIES(X) \
  X(sgd, sgd)                      \
  X(adam, adam)                    \
  X(adamw, adamw)                  \
  X(adagrad, adagrad)              \
  X(rmsprop, rmsprop)              \
  X(lamb, lamb)                    \
  X(lion, lion)                    \
  X(radam, radam)                  \
  X(adamax, adamax)                \
  X(adadelta, adadelta)            \
  X(nadam, nadam)

enum class family : int {
#define FUSEDOPT_TORCH_ENUM(name, plans) name,
  FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_ENUM)
#undef FUSEDOPT_TORCH_ENUM
  user,
};

/// @brief Every hyperparameter any family reads, with torch's names; a family ignores the others.
/// Read from the parameter group at every step (a scheduler may change lr every step). Python
/// builds it by field name (fusedopt_torch._C.Hyper, binding.cpp exports every field but the
/// two the engine sets).
struct hyper {
  double lr = 1e-3;
  /// When set, lr is read from here at every step instead (a tensor lr: a double in the plan's
  /// memory that the engine refreshes from the tensor in stream order, so a captured CUDA graph
  /// sees a scheduler's new lr at every replay).
  double const* lr_pointer = nullptr;
  double beta1 = 0.9;
  double beta2 = 0.999;
  /// When set, beta1 / beta2 are read from here at every step (Tensor betas of a capturable
  /// Adam/AdamW, refreshed by the engine as a tensor lr is).
  double const* beta1_pointer = nullptr;
  double const* beta2_pointer = nullptr;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;       ///< SGD, RMSprop
  double dampening = 0.0;      ///< SGD
  double alpha = 0.99;         ///< RMSprop
  double lr_decay = 0.0;       ///< Adagrad
  double rho = 0.9;            ///< Adadelta
  double max_grad_norm = 0.0;  ///< LAMB (apex): clip the gradients' global norm first when > 0
  double momentum_decay = 4e-3;  ///< NAdam
  /// NAdam: torch's state['mu_product'] before the step (mu_1 ... mu_{t-1}); the engine sets it
  /// per bucket (it is per parameter in torch), not Python.
  double mu_product = 1.0;
  /// NAdam with capturable=True: the product lives in the plan's memory instead, read there by
  /// the step and advanced there after it (rules::advance_mu_product), rounded to float when
  /// `mu_product_single` (torch's float32 state).
  double* mu_product_pointer = nullptr;
  bool mu_product_single = true;
  bool amsgrad = false;
  bool maximize = false;
  bool nesterov = false;
  bool centered = false;
  bool decoupled_weight_decay = false;  ///< RAdam, NAdam
  bool bias_correction = true;          ///< LAMB
  bool grad_averaging = true;           ///< LAMB
  bool adam_w_mode = true;              ///< LAMB
  bool use_nvlamb = false;              ///< LAMB
  /// Low-precision parameters (families with supports_low_precision): a Kahan compensation
  /// state (rules::with_kahan; a layout), or stochastic rounding of bfloat16 parameters.
  bool kahan = false;
  bool stochastic_rounding = false;
  /// Low-precision parameters with a float32 master copy (layout::master): the family's rule
  /// runs on the master, the parameter is its rounding (rules::with_master).
  bool master_weights = false;
  /// A user rule's hyperparameters, in the order its spec declares them (user_rule.hpp): a
  /// number (bools and integers as doubles), or, where `user_pointers[k]` is set, a double in
  /// the plan's memory refreshed from a Tensor every step (as lr_pointer).
  static constexpr int max_user = 32;
  double user[max_user] = {};
  double const* user_pointers[max_user] = {};
};

/// @brief The fields of `hyper` Python sets, by name: X(field) for the numbers, then for the
/// flags (binding.cpp derives `_C.Hyper`'s attributes and `Hyper.of(**fields)` from them).
#define FUSEDOPT_TORCH_HYPER_NUMBERS(X) \
  X(lr) X(beta1) X(beta2) X(eps) X(weight_decay) X(momentum) X(dampening) X(alpha) X(lr_decay) X(rho) \
  X(max_grad_norm) X(momentum_decay)
#define FUSEDOPT_TORCH_HYPER_FLAGS(X) \
  X(amsgrad) X(maximize) X(nesterov) X(centered) X(decoupled_weight_decay) X(bias_correction) X(grad_averaging) \
  X(adam_w_mode) X(use_nvlamb) X(kahan) X(stochastic_rounding) X(master_weights)

/// @brief Which optional state slots a plan binds: options that change the plan's lists (the
/// other options are read at every step). A change of layout rebuilds the plan.
struct layout {
  bool amsgrad = false;   ///< Adam/AdamW: max_exp_avg_sq
  bool momentum = false;  ///< SGD, RMSprop: momentum_buffer
  bool centered = false;  ///< RMSprop: grad_avg
  bool clip = false;      ///< LAMB: a clip_by_global_norm pass in front
  bool kahan = false;     ///< a compensation state last (supports_low_precision families)
  /// The moments (exp_avg, exp_avg_sq, momentum_buffer) as 8-bit blockwise states
  /// (FUSEDOPT_TORCH_QUANTIZED_FAMILIES): set per bucket, from its parameters' state tensors.
  bool quantized = false;
  /// A float32 master copy of each 16-bit parameter as the last state, and every state in
  /// float32 (supports_low_precision families; rules::with_master).
  bool master = false;
  /// A user rule's states kept in float32 whatever the parameter's dtype: bit k for state k
  /// (the rule's dtype policy, fusedopt_torch.State(dtype="float32")).
  std::uint32_t float_states = 0;

  /// The options above as bits (amsgrad 1, momentum 2, centered 4, clip 8, kahan 16,
  /// quantized 32, master 64): what a unit compiled for one layout is keyed by (float_states apart).
  [[nodiscard]] constexpr std::uint32_t bits() const
  {
    return (amsgrad ? 1u : 0u) | (momentum ? 2u : 0u) | (centered ? 4u : 0u) | (clip ? 8u : 0u) |
           (kahan ? 16u : 0u) | (quantized ? 32u : 0u) | (master ? 64u : 0u);
  }
  static constexpr std::uint32_t amsgrad_bit = 1, momentum_bit = 2, centered_bit = 4, clip_bit = 8, kahan_bit = 16,
                                 quantized_bit = 32, master_bit = 64;

  friend bool operator==(layout const& a, layout const& b)
  {
    return a.bits() == b.bits() && a.float_states == b.float_states;
  }
  friend bool operator!=(layout const& a, layout const& b) { return !(a == b); }
};

/// @brief The tensors of one plan, one entry per parameter. `states[k]` is the k-th state slot
/// of the family, in the order the Python class's `_state_keys` lists them for the layout.
struct lists {
  std::vector<std::int64_t> sizes;
  std::vector<void*> param;
  std::vector<void const*> grad;
  std::vector<std::vector<void*>> states;
};

/// @brief The step count of a plan's run: a value the host keeps (torch's 1-based
/// state['step'] after its increment), or, when `counter` is set, a counter in the plan's
/// memory (device memory for CUDA plans) holding the count before the step, which the run
/// advances itself and a skipped step takes back, with no host synchronisation.
struct step_count {
  std::int64_t value = 1;
  std::int64_t* counter = nullptr;
};

/// @brief GradScaler's fused protocol (torch's `optimizer.grad_scale` and `optimizer.found_inf`):
/// float scalars in the plan's memory, or null. The gradients are divided by `*grad_scale`, and
/// a step that starts with `*found_inf` set changes nothing. Only families with
/// `supports_amp(family)` take them.
struct amp_inputs {
  float const* grad_scale = nullptr;
  float const* found_inf = nullptr;
  [[nodiscard]] bool any() const { return grad_scale != nullptr || found_inf != nullptr; }
};

/// @brief Whether family `f` has plans with 8-bit moments (layout::quantized). A user rule's
/// has them where it declares eight_bit (its unit of that layout refuses them otherwise).
constexpr bool supports_quantized_states(family f)
{
  return f == family::sgd || f == family::adam || f == family::adamw || f == family::lion || f == family::user;
}

/// @brief Elements per block of an 8-bit state, and the bytes of a state of n elements:
/// fusedopt's `signed_q8` / `unsigned_q8` storage (the blocks' float scales, reversed and
/// padded to a multiple of 256 bytes, then 256 codes a block: numeric/quantization.hpp), a 1-D
/// uint8 tensor.
constexpr std::int64_t quantized_block_elements = 256;
constexpr std::int64_t quantized_blocks(std::int64_t elements)
{
  return (elements + quantized_block_elements - 1) / quantized_block_elements;
}
constexpr std::int64_t quantized_state_bytes(std::int64_t elements)
{
  return (4 * quantized_blocks(elements) + 255) / 256 * 256 + quantized_blocks(elements) * quantized_block_elements;
}

/// @brief The families that take `kahan`, `stochastic_rounding` and `master_weights` for
/// low-precision parameters.
constexpr bool supports_low_precision(family f) { return f == family::adam || f == family::adamw; }

/// @brief The families torch gives `_step_supports_amp_scaling` (its fused optimizers), and
/// user rules (their spec says whether; the engine is told so by Python).
constexpr bool supports_amp(family f)
{
  return f == family::sgd || f == family::adam || f == family::adamw || f == family::adagrad || f == family::user;
}

/// @brief A plan over lists of fixed geometry (sizes, dtype, alignment): run it once per step,
/// rebind it when the tensors move.
class plan {
 public:
  virtual ~plan() = default;
  /// @brief One step; `stream` a cudaStream_t (ignored by host plans).
  /// @throws fusedopt::error for amp inputs given to a family without supports_amp.
  virtual void run(hyper const& h, step_count step, amp_inputs amp, void* stream) const = 0;
  /// @brief Points the plan at `tensors`, the lists it was made from at new addresses (new
  /// gradients every step under `zero_grad(set_to_none=True)`): no allocation on the device,
  /// no synchronisation, at most one asynchronous upload on `stream`. Returns false, changing
  /// nothing, when the geometry differs (then make a new plan).
  /// @throws fusedopt::error on invalid lists (overlapping outputs, pageable memory for CUDA).
  virtual bool rebind(lists const& tensors, void* stream) = 0;
  /// @brief Points the plan at `tensors.grad`, its other slots where they were (the usual step
  /// under `zero_grad(set_to_none=True)`): no lists bound, each moved address checked against
  /// the memory the plan writes. Returns false, changing nothing, when the plan does not take
  /// them: then `rebind(tensors)` (which tells a new geometry from invalid lists).
  virtual bool rebind_gradients(lists const& tensors, void* stream) = 0;
  /// @brief Uploads of the plan's address table so far (CUDA; a rebind to a recently bound
  /// address set costs none: fusedopt::cuda::options::address_tables).
  [[nodiscard]] virtual std::uint64_t table_uploads() const = 0;
  /// @brief Whether run() takes amp_inputs: the unit compiled the rule's GradScaler kernel too
  /// (a plan without it is made again from a unit with it at the first scaled step).
  [[nodiscard]] virtual bool takes_amp() const = 0;
};

/// @brief The norm of every element of one list of gradients of one dtype
/// (FusedOptimizer.clip_grad_norm_): fusedopt's norm_of rule over a plan of the gradients,
/// which is its reduction pass and after-step hook, with no update pass.
class norm_plan {
 public:
  virtual ~norm_plan() = default;
  /// @brief Writes the L2 norm (`inf`: the largest magnitude) of every element to `*total`
  /// (for a CUDA plan device memory of its device, in stream order, no synchronisation).
  virtual void run(bool inf, double* total, void* stream) const = 0;
  /// @brief Points the plan at `grads` of the sizes it was made with; false, changing
  /// nothing, for another geometry (then make a new plan).
  virtual bool rebind(std::vector<void const*> const& grads, std::vector<std::int64_t> const& sizes, void* stream) = 0;
};

/// @brief NAdam's momentum coefficient of step `t`, mu_t = beta1 (1 - 0.5 * 0.96^(t momentum_decay)),
/// with the bits the NAdam rule uses (rules::scale_by_nadam::mu). Defined in binding.cpp.
double nadam_mu(double beta1, double momentum_decay, std::int64_t t);

/// @brief torch's `mu_product *= mu` (rules::advance_mu_product::advanced): `product * mu`,
/// rounded to float when `single`. Defined in binding.cpp.
double nadam_advanced(double product, double mu, bool single);

// ---- units ------------------------------------------------------------------------------------

/// @brief The version of unit_api: a unit of another version is refused when loaded.
constexpr std::uint32_t unit_abi = 1;

/// @brief What a unit exports (`extern "C" unit_api const* fusedopt_torch_unit()`): the
/// entry points it compiled, null for the others. Errors come back as text in `*error` (a null
/// result), never as exceptions across the library boundary; a plan's own methods throw
/// fusedopt::error, which the core catches (units and core share the C++ runtime).
/// `context` is the `cudaStream_t` for CUDA units, a pointer to the thread count for host units.
struct unit_api {
  std::uint32_t abi = unit_abi;
  /// A plan over `tensors` (a host plan: CPU memory, on `*static_cast<int*>(context)` threads;
  /// a CUDA plan: the current device's memory, built on the stream).
  plan* (*make_plan)(family f, dtype t, layout const& l, lists const& tensors, void* context,
                     std::string* error) = nullptr;
  /// The norm plan of clip_grad_norm_ over `grads`.
  norm_plan* (*make_norm_plan)(dtype t, std::vector<void const*> const& grads, std::vector<std::int64_t> const& sizes,
                               void* context, std::string* error) = nullptr;
  /// Stores `n` floats as an 8-bit state (`is_signed`: the signed map of first moments, else the
  /// unsigned map of second moments) with the bits a step would store: the library's quantizer,
  /// run by the host backend. False, with `*error` set, on failure.
  bool (*quantize_state)(float const* values, std::int64_t n, void* state, bool is_signed, int threads,
                         std::string* error) = nullptr;
  /// The `n` values of an 8-bit state, as a step reads them.
  bool (*dequantize_state)(void const* state, std::int64_t n, float* values, bool is_signed, int threads,
                           std::string* error) = nullptr;
};

/// @brief The name of the function every unit exports.
constexpr char const* unit_entry_point = "fusedopt_torch_unit";
using unit_entry = unit_api const* (*)();

}  // namespace fusedopt_torch
