/// @file rules/lars.hpp
/// @brief LARS (You, Gitman, Ginsburg, "Large Batch Training of Convolutional Networks") as
/// NVIDIA apex's LARC computes it in front of torch.optim.SGD, with per-tensor exclusion; and
/// its block scale_by_lars (a per-tensor reduction).
///
/// One step is two passes: a reduction pass reading param and grad (each tensor's ||param||^2
/// and ||grad||^2), then the update pass (param, grad, momentum_buffer read; param and
/// momentum_buffer written).
#pragma once

#include <cstdint>

#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"
#include "norms.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief LARC's gradient scaling, per tensor t (apex.parallel.LARC):
/// when ||param_t|| != 0 and ||grad_t|| != 0,
///   local = trust_coefficient * ||param_t|| / (||grad_t|| + weight_decay * ||param_t|| + eps),
///   (with `clip`: local = min(local / lr, 1), so that lr * local = min(lr_local, lr)),
///   grad = (grad + weight_decay * param) * local;
/// otherwise, and for every tensor t with `exclude[t] != 0`, the gradient is left as it is
/// (no trust ratio and no weight decay: the usual treatment of biases and norm weights).
///
/// `exclude` points to one flag per tensor of the bound lists (host memory for the host
/// backend, device memory for the CUDA backend), or is null to exclude none. The norms are
/// those of the element as the chain holds it at this point (after unscaling or clipping
/// chained in front).
struct scale_by_lars {
  scalar<double> lr{1e-3};  ///< read only with `clip`
  scalar<double> weight_decay{0.0};
  scalar<double> trust_coefficient{1e-3};
  scalar<double> eps{1e-8};
  bool clip = false;
  std::uint8_t const* exclude = nullptr;

  /// Accumulator 0: sum of param^2; accumulator 1: sum of grad^2 (per tensor).
  using reduction = fusedopt::reduction<reduce_op::sum, reduce_op::sum>;
  using reads = slots<slot::param_t, slot::grad_t>;
  using writes = slots<>;

  /// One tensor's gradient scaling: (grad + weight_decay * param) * local, or none.
  struct scaled {
    bool scale;
    double weight_decay, local;

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      if (scale) { e[slot::grad] = (e[slot::grad] + static_cast<T>(weight_decay) * e[slot::param]) * static_cast<T>(local); }
    }
  };

  struct prepared {
    reduced norms;
    double lr, weight_decay, trust_coefficient, eps;
    bool clip;
    std::uint8_t const* exclude;

    FUSEDOPT_HOST_DEVICE scaled for_tensor(std::int64_t tensor) const
    {
      scaled const none{false, 0.0, 1.0};
      if (exclude != nullptr && exclude[tensor] != 0) { return none; }
      double const param_norm = math::sqrt(norms.tensor(tensor, 0));
      double const grad_norm = math::sqrt(norms.tensor(tensor, 1));
      if (param_norm == 0.0 || grad_norm == 0.0) { return none; }
      double local = trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + eps);
      if (clip) {
        local /= lr;
        local = local < 1.0 ? local : 1.0;
      }
      return scaled{true, weight_decay, local};
    }

    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
  };

  FUSEDOPT_HOST_DEVICE detail::accumulate_squares<slot::param_t, slot::grad_t> prepare_reduce(step_info const&) const
  {
    return {};
  }
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const
  {
    return prepared{r, lr.get(), weight_decay.get(), trust_coefficient.get(), eps.get(), clip, exclude};
  }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("lars: weight_decay", weight_decay, detail::non_negative);
    detail::expect_range("lars: trust_coefficient", trust_coefficient, detail::positive);
    detail::expect_range("lars: eps", eps, detail::non_negative);
    FUSEDOPT_EXPECTS(!clip || lr.is_pointer() || lr.value > 0, "lars: clip needs a positive learning rate");
  }
};

/// @brief LARS: apex's LARC wrapped around torch.optim.SGD (momentum, dampening, nesterov),
/// with per-tensor exclusion. Slots: param, grad, and momentum_buffer when momentum != 0.
///
/// The chain: scale_by_lars -> momentum -> scale_by_lr -> apply_update, i.e. for each tensor
/// g' = (g + wd * p) * trust_coefficient * ||p|| / (||g|| + wd * ||p|| + eps) (g' = g for
/// excluded tensors and where a norm is 0), buf = momentum * buf + (1 - dampening) * g' (g' at
/// step 1), p -= lr * buf (or lr * (g' + momentum * buf) with nesterov). As in LARC + SGD the
/// learning rate multiplies the momentum buffer, not the gradient that enters it (the paper's
/// Algorithm 1 puts lr inside the momentum; the two agree while lr is constant).
///
/// Defaults: trust_coefficient 0.001 and momentum 0.9 (the paper's), eps 1e-8 (LARC's).
struct lars : chained<lars, chain_rule<scale_by_lars, momentum, scale_by_lr, apply_update>> {
  scalar<double> lr{1e-3};
  scalar<double> momentum{0.9};
  scalar<double> dampening{0.0};
  scalar<double> weight_decay{0.0};
  /// eta: the trust coefficient.
  scalar<double> trust_coefficient{1e-3};
  scalar<double> eps{1e-8};
  bool nesterov = false;
  /// LARC's clipping mode: the effective rate is min(lr * local, lr) instead of lr * local.
  bool clip = false;
  /// One flag per tensor (non-zero: excluded from the trust ratio and weight decay), or null.
  std::uint8_t const* exclude = nullptr;

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    return chain(scale_by_lars{lr, weight_decay, trust_coefficient, eps, clip, exclude},
                 rules::momentum{momentum, dampening, nesterov}, scale_by_lr{lr}, apply_update{});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
