/// @file bench/cases.hpp
/// @brief The optimizer cases of the benchmarks (Adam fp32; AdamW with bf16 params/grads and
/// fp32 states; SGD with momentum fp32; issue 5: AdamW + global-norm clipping, LAMB, AMP
/// unscale + skip + Adam; issue 45: Optax's AdamW as fusedopt_jax runs it), the packed memory
/// layout of a slot, and the random values the slots start with. Shared by host_bench.cpp and
/// cuda_bench.cu so both backends run the same rules on the same layout and data;
/// torch_peers.py uses the same hyperparameters.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fusedopt/fusedopt.hpp>

#include "../integrations/jax/csrc/optax_rules.hpp"

namespace fusedopt_bench {

namespace fo = fusedopt;

/// Where each tensor of a slot starts, in elements from the start of the slot's one
/// allocation: every start rounded up to `alignment` bytes, as framework allocators do
/// (PyTorch's caching allocator hands out 512-byte-aligned blocks; 256 is CUDA's malloc
/// guarantee).
struct packed_layout {
  std::vector<std::int64_t> offsets;
  std::int64_t total_elements = 0;  ///< including the padding between tensors
};

/// @brief Packs `sizes` back to back for an element of `element_size` bytes.
inline packed_layout pack(std::vector<std::int64_t> const& sizes, std::size_t element_size,
                          std::size_t alignment = 256)
{
  packed_layout layout;
  auto const step = static_cast<std::int64_t>(alignment / element_size);
  std::int64_t next = 0;
  for (auto n : sizes) {
    layout.offsets.push_back(next);
    next = (next + n + step - 1) / step * step;
  }
  layout.total_elements = next;
  return layout;
}

/// The values a slot starts with: uniform magnitudes in [lo, hi), with a random sign when
/// `signed_values` (never zero, so an unwritten output or a wrong index cannot hide).
struct value_range {
  float lo, hi;
  bool signed_values;
};

inline constexpr value_range param_values{1e-2f, 1.f, true};
inline constexpr value_range grad_values{1e-4f, 1e-2f, true};
inline constexpr value_range first_moment_values{1e-5f, 1e-3f, true};
inline constexpr value_range second_moment_values{1e-9f, 1e-5f, false};

/// @brief Element `i` of a slot seeded with `seed`: a stateless hash, so host and device
/// fill the same values in any order.
FUSEDOPT_HOST_DEVICE float random_value(std::uint64_t seed, std::uint64_t i, value_range r)
{
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ULL + i + 1;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  float const u = static_cast<float>(z >> 40) * 0x1.0p-24f;
  float const v = r.lo + (r.hi - r.lo) * u;
  return (r.signed_values && (z & 1u)) ? -v : v;
}

/// @brief Adam (torch.optim.Adam defaults, lr 1e-3), every slot fp32: 28 bytes per element.
struct adam_fp32 {
  static constexpr char const* name = "adam_fp32";
  using param_type = float;
  using grad_type = float;
  using state_type = float;
  static constexpr std::size_t num_states = 2;
  static constexpr std::array<value_range, num_states> state_values{first_moment_values, second_moment_values};

  static fo::rules::adam rule()
  {
    fo::rules::adam r;
    r.lr = 1e-3;
    return r;
  }
  static auto bind(fo::tensor_list<param_type> p, fo::tensor_list<grad_type const> g,
                   std::array<fo::tensor_list<state_type>, num_states> s)
  {
    return fo::bind(fo::slot::param = std::move(p), fo::slot::grad = std::move(g),
                    fo::slot::exp_avg = std::move(s[0]), fo::slot::exp_avg_sq = std::move(s[1]));
  }
};

/// @brief AdamW (lr 1e-3, weight decay 1e-2) with bf16 params and grads and fp32 moments, the
/// usual mixed-precision layout: 22 bytes per element.
struct adamw_bf16 {
  static constexpr char const* name = "adamw_bf16";
  using param_type = fo::bfloat16;
  using grad_type = fo::bfloat16;
  using state_type = float;
  static constexpr std::size_t num_states = 2;
  static constexpr std::array<value_range, num_states> state_values{first_moment_values, second_moment_values};

  static fo::rules::adamw rule()
  {
    fo::rules::adamw r;
    r.lr = 1e-3;
    r.weight_decay = 1e-2;
    return r;
  }
  static auto bind(fo::tensor_list<param_type> p, fo::tensor_list<grad_type const> g,
                   std::array<fo::tensor_list<state_type>, num_states> s)
  {
    return fo::bind(fo::slot::param = std::move(p), fo::slot::grad = std::move(g),
                    fo::slot::exp_avg = std::move(s[0]), fo::slot::exp_avg_sq = std::move(s[1]));
  }
};

/// @brief SGD with momentum 0.9 (lr 1e-2), every slot fp32: 20 bytes per element.
struct sgd_momentum_fp32 {
  static constexpr char const* name = "sgd_momentum_fp32";
  using param_type = float;
  using grad_type = float;
  using state_type = float;
  static constexpr std::size_t num_states = 1;
  static constexpr std::array<value_range, num_states> state_values{first_moment_values};

  static fo::rules::sgd rule()
  {
    fo::rules::sgd r;
    r.lr = 1e-2;
    r.momentum = 0.9;
    return r;
  }
  static auto bind(fo::tensor_list<param_type> p, fo::tensor_list<grad_type const> g,
                   std::array<fo::tensor_list<state_type>, num_states> s)
  {
    return fo::bind(fo::slot::param = std::move(p), fo::slot::grad = std::move(g),
                    fo::slot::momentum_buffer = std::move(s[0]));
  }
};

// ---- issue 5: cases with reduction passes ----------------------------------------------------

/// @brief What a case's rule reads or writes through pointers (device memory for the CUDA
/// benchmark): AMP's inv_scale and found_inf, the clipped norm.
struct step_scalars {
  double inv_scale = 1.0;
  float found_inf = 0.f;
  double total_norm = 0.0;
  /// fusedopt_jax's hyperparameter operand (optax_rules.hpp, hyper_index) for optax.adamw(lr
  /// 1e-3, weight decay 1e-2) at step 1, as fusedopt_jax/_core.py rounds each value.
  float optax_hyper[fusedopt_jax::hyper_size] = {-1e-3f, 0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.0f, 1e-2f, 0.1f, 0.001f};
};

/// @brief AdamW with bf16 params and grads and fp32 moments (adamw_bf16) behind
/// clip_by_global_norm(max_norm 1): one reduction pass reading the gradients (2 bytes per
/// element), then the update: 24 bytes per element, adamw_bf16's 22 plus one read of the
/// gradients.
struct adamw_clip_bf16 : adamw_bf16 {
  static constexpr char const* name = "adamw_clip_bf16";
  static auto rule(step_scalars* s)
  {
    fo::rules::clip_by_global_norm clip;
    clip.max_norm = 1.0;
    clip.total_norm = &s->total_norm;
    return fo::chain(clip, adamw_bf16::rule());
  }
};

/// @brief LAMB (NVLAMB: trust ratio always applied; lr 1e-3, weight decay 1e-2), every slot
/// fp32: a reduction pass reading param, grad and both moments (16 bytes per element) and the
/// update (28): 44 bytes per element, 1.57x adam_fp32's 28.
struct lamb_fp32 : adam_fp32 {
  static constexpr char const* name = "lamb_fp32";
  static fo::rules::lamb rule()
  {
    fo::rules::lamb r;
    r.lr = 1e-3;
    r.weight_decay = 1e-2;
    r.use_nvlamb = true;
    return r;
  }
};

/// @brief AMP: unscale the gradients by a device inv_scale, count non-finite ones (one
/// reduction pass reading the gradients, 4 bytes per element), and Adam (adam_fp32) unless the
/// count is not 0: 32 bytes per element, adam_fp32's 28 plus one read of the gradients.
struct amp_adam_fp32 : adam_fp32 {
  static constexpr char const* name = "amp_adam_fp32";
  static auto rule(step_scalars* s)
  {
    return fo::chain(fo::rules::unscale_gradients{fo::scalar<double>::from_pointer(&s->inv_scale)},
                     fo::rules::skip_if_nonfinite(adam_fp32::rule(), &s->found_inf));
  }
};

/// @brief Issue 45: optax.adamw's step as fusedopt_jax compiles it (integrations/jax: the fused
/// form, in place), every slot fp32: adam_fp32's 28 bytes per element, with Optax's order of
/// operations (three IEEE divisions an element where fusedopt's Adam has one). Beside adam_fp32
/// it shows what Optax's formula costs the kernel (docs/jax.md, "W4 and W2 at the kernel").
struct optax_adamw_fp32 : adam_fp32 {
  static constexpr char const* name = "optax_adamw_fp32";
  static auto rule(step_scalars* s) { return fusedopt_jax::make_adam<true>(s->optax_hyper); }
};

/// True when `Case::rule` takes the step's scalars.
template <class Case, class = void>
struct takes_scalars : std::false_type {};
template <class Case>
struct takes_scalars<Case, std::void_t<decltype(Case::rule(static_cast<step_scalars*>(nullptr)))>> : std::true_type {};

/// @brief The rule of `Case`, given the step's scalars (unused by cases that need none).
template <class Case>
auto rule_of([[maybe_unused]] step_scalars* scalars)
{
  if constexpr (takes_scalars<Case>::value) {
    return Case::rule(scalars);
  } else {
    return Case::rule();
  }
}

/// @brief Bytes one element moves in one step of `Rule` over `Lists`, every pass counted:
/// each reduction pass reads its slots once; the update pass loads and stores once each.
template <class Rule, class Lists>
constexpr std::size_t bytes_per_element()
{
  return fo::bytes_per_element_v<Rule, Lists>;
}

/// @brief Passes over memory in one step of `Rule`: its reduction passes and the update.
template <class Rule>
inline constexpr int passes_over_memory = fo::pass_count_v<Rule> + 1;

/// @brief One slot's tensors in one allocation made by `Memory` (host or device), laid out
/// by `pack`. `Memory<T>` provides `T* data()`, construction from an element count, and
/// `fill(seed, value_range)` over all of it.
template <template <class> class Memory, class T>
class slot_storage {
 public:
  slot_storage(std::vector<std::int64_t> const& sizes, std::uint64_t seed, value_range values)
      : sizes_(sizes), layout_(pack(sizes, sizeof(T))), memory_(layout_.total_elements)
  {
    memory_.fill(seed, values);
  }

  /// @brief The list of the slot's tensors, element type `U` (T or T const).
  template <class U = T>
  [[nodiscard]] fo::tensor_list<U> list() const
  {
    fo::tensor_list<U> l;
    l.reserve(sizes_.size());
    for (std::size_t i = 0; i < sizes_.size(); ++i) { l.push_back(memory_.data() + layout_.offsets[i], sizes_[i]); }
    return l;
  }
  [[nodiscard]] std::int64_t allocated_elements() const { return layout_.total_elements; }

 private:
  std::vector<std::int64_t> sizes_;
  packed_layout layout_;
  Memory<T> memory_;
};

/// @brief Every slot of `Case` over the tensor sizes of a workload, filled with random values.
template <class Case, template <class> class Memory>
class case_state {
 public:
  explicit case_state(std::vector<std::int64_t> const& sizes)
      : param_(sizes, 1, param_values), grad_(sizes, 2, grad_values), states_(make_states(sizes, std::make_index_sequence<Case::num_states>{}))
  {
  }

  /// @brief The bound lists of the case (validated by fusedopt::bind).
  [[nodiscard]] auto lists() const { return lists_impl(std::make_index_sequence<Case::num_states>{}); }

  /// @brief lists() with the gradients of `other` (a case over the same sizes): what a plan
  /// sees when only the gradients moved, as under zero_grad(set_to_none=True).
  [[nodiscard]] auto lists_with_gradients_of(case_state const& other) const
  {
    return lists_impl(other.grad_, std::make_index_sequence<Case::num_states>{});
  }

  /// @brief Bytes the slots occupy (with padding), to check memory before allocating.
  static std::size_t bytes_needed(std::vector<std::int64_t> const& sizes)
  {
    return static_cast<std::size_t>(pack(sizes, sizeof(typename Case::param_type)).total_elements) *
             sizeof(typename Case::param_type) +
           static_cast<std::size_t>(pack(sizes, sizeof(typename Case::grad_type)).total_elements) *
             sizeof(typename Case::grad_type) +
           Case::num_states * static_cast<std::size_t>(pack(sizes, sizeof(typename Case::state_type)).total_elements) *
             sizeof(typename Case::state_type);
  }

 private:
  using param_storage = slot_storage<Memory, typename Case::param_type>;
  using grad_storage = slot_storage<Memory, typename Case::grad_type>;
  using state_storage = slot_storage<Memory, typename Case::state_type>;

  template <std::size_t... K>
  static std::array<state_storage, Case::num_states> make_states(std::vector<std::int64_t> const& sizes,
                                                                 std::index_sequence<K...>)
  {
    return {state_storage(sizes, 3 + K, Case::state_values[K])...};
  }
  template <std::size_t... K>
  auto lists_impl(std::index_sequence<K...> k) const
  {
    return lists_impl(grad_, k);
  }
  template <std::size_t... K>
  auto lists_impl(grad_storage const& grad, std::index_sequence<K...>) const
  {
    return Case::bind(param_.list(), grad.template list<typename Case::grad_type const>(), {states_[K].list()...});
  }

  param_storage param_;
  grad_storage grad_;
  std::array<state_storage, Case::num_states> states_;
};

}  // namespace fusedopt_bench
