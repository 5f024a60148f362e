/// @file optax_rules.hpp
/// @brief fusedopt rules that compute Optax's formulas (optax 0.2.x `scale_by_adam`, `trace`,
/// `scale_by_lion`, `scale_by_trust_ratio`, `clip_by_global_norm`, `add_decayed_weights`,
/// `scale_by_learning_rate`, `apply_updates`) operation by operation, in float, so that an
/// fp32 step can give Optax's bits where XLA rounds the same operations.
///
/// fusedopt's own rules (include/fusedopt/rules/) follow torch.optim's formulas (bias
/// corrections folded into per-step doubles, decoupled decay on the parameter first); Optax
/// rounds differently (docs/jax.md, "Parity"), hence these rules. Every per-step value is read
/// from a small float vector in device memory (host memory on the CPU backend), the `hyper`
/// operand the Python side computes with jax.numpy, so that a new learning rate, a schedule's
/// value or the step count never changes the compiled program.
///
/// Two forms of every rule (`InPlace`):
///  - false: Optax's GradientTransformation: writes the update `u` (what `optax.apply_updates`
///    adds to the parameters) into the memory slot `update_out`; the parameter is read only;
///  - true: the fused step: param = param + u, rounded once to the parameter's type (what
///    apply_updates computes from a float update).
#pragma once

#include <cstdint>
#include <type_traits>

#include <fusedopt/fusedopt.hpp>

namespace fusedopt_jax {

namespace fo = ::fusedopt;

/// The update as a memory slot of its own: Optax's form returns it instead of applying it.
FUSEDOPT_MEMORY_SLOT(update_out);

/// Positions in the `hyper` operand (float32[hyper_size]); the Python side (fusedopt_jax/_core.py,
/// `_HYPER`) writes them in this order.
enum hyper_index : int {
  h_step_size = 0,  ///< -learning_rate (Optax's scale_by_learning_rate), a schedule's value included
  h_b1,             ///< Adam/Lion beta1; SGD: the momentum (optax.trace's decay)
  h_one_minus_b1,   ///< 1 - b1 as Optax rounds it (a Python float's difference, then float32)
  h_b2,
  h_one_minus_b2,
  h_eps,
  h_eps_root,
  h_weight_decay,
  h_bc1,  ///< 1 - b1 ** count (Optax's bias correction, computed by jax.numpy)
  h_bc2,
  h_max_norm,  ///< clip_by_global_norm
  h_nesterov,  ///< SGD: 1 for Nesterov momentum
  hyper_size = 16,
};

namespace detail {

template <bool InPlace>
using output_slot_t = std::conditional_t<InPlace, fo::slot::param_t, update_out_t>;

/// Applies the update (fused form) or stores it (Optax's form).
template <bool InPlace, class E, class T>
FUSEDOPT_HOST_DEVICE void finish(E& e, T u)
{
  if constexpr (InPlace) {
    e[fo::slot::param] = e[fo::slot::param] + u;
  } else {
    e[update_out] = u;
  }
}

/// jnp.sign: -1, 1, and the argument itself for zeros and NaN.
template <class T>
FUSEDOPT_HOST_DEVICE T optax_sign(T x)
{
  return x > T(0) ? T(1) : (x < T(0) ? T(-1) : x);
}

/// optax.add_decayed_weights: u + wd * p, skipped when wd is 0 (as Optax skips a constant 0).
template <class E, class T>
FUSEDOPT_HOST_DEVICE T decayed(E& e, T u, float wd)
{
  return wd != 0.0f ? u + static_cast<T>(wd) * e[fo::slot::param] : u;
}

/// Adam's moments and direction (optax.scale_by_adam, nesterov=False), then
/// add_decayed_weights; leaves the direction in the `update` register.
struct adam_direction {
  float const* hyper = nullptr;

  using reads = fo::slots<fo::slot::grad_t, fo::slot::param_t, fo::slot::exp_avg_t, fo::slot::exp_avg_sq_t>;
  using writes = fo::slots<fo::slot::exp_avg_t, fo::slot::exp_avg_sq_t>;

  struct prepared {
    float b1, c1, b2, c2, eps, eps_root, wd, bc1, bc2;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[fo::slot::grad];
      // (1 - decay) * g**order + decay * t, as optax.tree.update_moment(_per_elem_norm).
      T const m = static_cast<T>(c1) * g + static_cast<T>(b1) * e[fo::slot::exp_avg];
      T const v = static_cast<T>(c2) * (g * g) + static_cast<T>(b2) * e[fo::slot::exp_avg_sq];
      e[fo::slot::exp_avg] = m;
      e[fo::slot::exp_avg_sq] = v;
      T const m_hat = m / static_cast<T>(bc1);
      T const v_hat = v / static_cast<T>(bc2);
      T const u = m_hat / (fo::math::sqrt(v_hat + static_cast<T>(eps_root)) + static_cast<T>(eps));
      e[fo::slot::update] = decayed(e, u, wd);
    }
  };

  FUSEDOPT_HOST_DEVICE prepared prepare(fo::step_info const&) const
  {
    float const* h = hyper;
    return prepared{h[h_b1], h[h_one_minus_b1], h[h_b2], h[h_one_minus_b2], h[h_eps],
                    h[h_eps_root], h[h_weight_decay], h[h_bc1], h[h_bc2]};
  }
};

/// scale_by_learning_rate then apply_updates (fused form) or the update stored.
template <bool InPlace>
struct scale_and_finish {
  float const* hyper = nullptr;

  using reads = std::conditional_t<InPlace, fo::slots<fo::slot::param_t>, fo::slots<>>;
  using writes = fo::slots<output_slot_t<InPlace>>;

  struct prepared {
    float step_size;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      finish<InPlace>(e, static_cast<T>(step_size) * e[fo::slot::update]);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(fo::step_info const&) const { return prepared{hyper[h_step_size]}; }
};

/// The sum of the gradients' squares over every element (clip_by_global_norm's reduction).
struct accumulate_grad_squares {
  template <class E, class Acc>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
  {
    using A = std::remove_reference_t<decltype(acc[0])>;
    auto const x = static_cast<A>(e[fo::slot::grad]);
    acc[0] += x * x;
  }
};

}  // namespace detail

/// optax.clip_by_global_norm(max_norm): g unchanged while the global norm is below max_norm,
/// else (g / norm) * max_norm. The norm is summed in a reduction pass (float partial sums
/// combined in double, deterministic), where XLA sums in float in its own order.
struct optax_clip_by_global_norm {
  float const* hyper = nullptr;

  using reduction = fo::reduction<fo::reduce_op::sum>;
  using reads = fo::slots<fo::slot::grad_t>;
  using writes = fo::slots<>;

  struct prepared {
    bool keep;
    float norm, max_norm;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[fo::slot::grad];
      e[fo::slot::grad] = keep ? g : (g / static_cast<T>(norm)) * static_cast<T>(max_norm);
    }
  };

  FUSEDOPT_HOST_DEVICE detail::accumulate_grad_squares prepare_reduce(fo::step_info const&) const { return {}; }
  FUSEDOPT_HOST_DEVICE prepared prepare(fo::step_info const&, fo::reduced const& r) const
  {
    float const norm = static_cast<float>(fo::math::sqrt(r.total(0)));
    float const max_norm = hyper[h_max_norm];
    return prepared{norm < max_norm, norm, max_norm};
  }
};

/// optax.sgd: trace (momentum, Nesterov) when `Momentum`, then the learning rate.
template <bool InPlace, bool Momentum>
struct optax_sgd {
  float const* hyper = nullptr;

  using reads = std::conditional_t<Momentum, fo::slots<fo::slot::grad_t, fo::slot::param_t, fo::slot::momentum_buffer_t>,
                                   fo::slots<fo::slot::grad_t, fo::slot::param_t>>;
  using writes = std::conditional_t<Momentum, fo::slots<fo::slot::momentum_buffer_t, detail::output_slot_t<InPlace>>,
                                    fo::slots<detail::output_slot_t<InPlace>>>;

  struct prepared {
    float step_size, decay;
    bool nesterov;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[fo::slot::grad];
      T u = g;
      if constexpr (Momentum) {
        // f = g + decay * t; new_trace = f(g, trace); update = f(g, new_trace) or new_trace.
        T const t = g + static_cast<T>(decay) * e[fo::slot::momentum_buffer];
        e[fo::slot::momentum_buffer] = t;
        u = nesterov ? g + static_cast<T>(decay) * t : t;
      }
      detail::finish<InPlace>(e, static_cast<T>(step_size) * u);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(fo::step_info const&) const
  {
    return prepared{hyper[h_step_size], hyper[h_b1], hyper[h_nesterov] != 0.0f};
  }
};

/// optax.adam / optax.adamw (weight decay 0 for adam): scale_by_adam, add_decayed_weights,
/// scale_by_learning_rate.
template <bool InPlace>
using optax_adam = fo::chain_rule<detail::adam_direction, detail::scale_and_finish<InPlace>>;

/// optax.lion: scale_by_lion (hard sign), add_decayed_weights, scale_by_learning_rate.
template <bool InPlace>
struct optax_lion {
  float const* hyper = nullptr;

  using reads = fo::slots<fo::slot::grad_t, fo::slot::param_t, fo::slot::exp_avg_t>;
  using writes = fo::slots<fo::slot::exp_avg_t, detail::output_slot_t<InPlace>>;

  struct prepared {
    float step_size, b1, c1, b2, c2, wd;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const g = e[fo::slot::grad];
      T const m = e[fo::slot::exp_avg];
      T const u = detail::optax_sign(static_cast<T>(c1) * g + static_cast<T>(b1) * m);
      e[fo::slot::exp_avg] = static_cast<T>(c2) * g + static_cast<T>(b2) * m;
      detail::finish<InPlace>(e, static_cast<T>(step_size) * detail::decayed(e, u, wd));
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(fo::step_info const&) const
  {
    float const* h = hyper;
    return prepared{h[h_step_size], h[h_b1], h[h_one_minus_b1], h[h_b2], h[h_one_minus_b2], h[h_weight_decay]};
  }
};

/// optax.lamb: scale_by_adam, add_decayed_weights, scale_by_trust_ratio (fusedopt's block:
/// ||p|| / ||u|| per tensor from a reduction pass, 1 where either norm is 0; Optax's with its
/// defaults min_norm 0, trust_coefficient 1, eps 0), scale_by_learning_rate.
template <bool InPlace>
using optax_lamb =
    fo::chain_rule<detail::adam_direction, fo::rules::scale_by_trust_ratio, detail::scale_and_finish<InPlace>>;

/// optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(...)).
template <bool InPlace>
using optax_clip_adam =
    fo::chain_rule<optax_clip_by_global_norm, detail::adam_direction, detail::scale_and_finish<InPlace>>;

/// The rules as the handler makes them from the hyper pointer.
template <bool InPlace>
FUSEDOPT_HOST_DEVICE optax_adam<InPlace> make_adam(float const* h)
{
  return fo::chain(detail::adam_direction{h}, detail::scale_and_finish<InPlace>{h});
}
template <bool InPlace>
FUSEDOPT_HOST_DEVICE optax_lamb<InPlace> make_lamb(float const* h)
{
  fo::rules::scale_by_trust_ratio ratio;
  ratio.always_adapt = true;
  return fo::chain(detail::adam_direction{h}, ratio, detail::scale_and_finish<InPlace>{h});
}
template <bool InPlace>
FUSEDOPT_HOST_DEVICE optax_clip_adam<InPlace> make_clip_adam(float const* h)
{
  return fo::chain(optax_clip_by_global_norm{h}, detail::adam_direction{h}, detail::scale_and_finish<InPlace>{h});
}

}  // namespace fusedopt_jax
