/// @file rules/asgd.hpp
/// @brief ASGD (torch.optim.ASGD: averaged stochastic gradient descent) and its blocks.
///
/// torch keeps two scalars per tensor, `eta` and `mu`, and sets them at the end of every step
/// from the step count: eta = lr / (1 + lambd lr t)^alpha, mu = 1 / max(1, t - t0), in Python
/// doubles, stored in float32 tensors (the default scalar dtype). Step t uses the values of
/// step t - 1 (lr and 1 at step 1). Here they are functions of the step, formed in `prepare`
/// (math::portable_pow, the same bits on host and device) and rounded to float as torch stores
/// them (`double_scalars` keeps them in double: torch under a float64 default dtype). Nothing
/// per tensor is stored and nothing is read back from the device.
#pragma once

#include <cstdint>

#include "../numeric/real_power.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace rules {

/// @brief ASGD's step size as a learning-rate schedule: eta of the steps done before this one,
/// eta(0) = lr, eta(n) = lr / (1 + lambd lr n)^alpha, rounded to float unless double_scalars.
struct asgd_eta {
  static constexpr double default_lr = 1e-2;
  scalar<double> lambd{1e-4};   ///< decay term
  scalar<double> alpha{0.75};   ///< power of the eta update
  bool double_scalars = false;  ///< keep eta in double (torch keeps it in float32)

  FUSEDOPT_HOST_DEVICE double at(scalar<double> const& lr, step_info const& s) const
  {
    double const rate = lr.get();
    double const done = static_cast<double>(s.step.get()) - 1.0;  // torch's step when eta was set
    double const eta = done < 1.0 ? rate : rate / math::portable_pow(1.0 + lambd.get() * rate * done, alpha.get());
    return double_scalars ? eta : static_cast<double>(static_cast<float>(eta));
  }
  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("asgd: lambd", lambd, detail::non_negative);
    detail::expect_range("asgd: alpha", alpha, detail::non_negative);
  }
};

/// @brief ASGD's decay term: param *= 1 - lambd * eta (eta of asgd_eta for this step).
struct asgd_decay {
  scalar<double> lr{1e-2};
  asgd_eta eta{};
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;

  FUSEDOPT_HOST_DEVICE detail::scale_slot<slot::param_t> prepare(step_info const& s) const
  {
    return detail::scale_slot<slot::param_t>{1.0 - eta.lambd.get() * eta.at(lr, s)};
  }
};

/// @brief ASGD's average: ax = param where mu is 1, else ax + (param - ax) * mu, with torch's
/// mu of the steps done before this one: 1 at step 1, then 1 / max(1, (t - 1) - t0), rounded
/// to float unless double_scalars. Put it after apply_update: it averages the new parameter.
struct asgd_average {
  scalar<double> t0{1e6};       ///< the step at which averaging starts
  bool double_scalars = false;  ///< keep mu in double (torch keeps it in float32)
  using reads = slots<slot::param_t, slot::ax_t>;
  using writes = slots<slot::ax_t>;

  struct prepared {
    double mu;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const p = e[slot::param];
      T& ax = e[slot::ax];
      // torch copies the parameter while mu is 1 (ax + (p - ax) * 1 may differ from p by a rounding).
      ax = math::select(mu == 1.0, p, ax + (p - ax) * static_cast<T>(mu));
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const
  {
    double const done = static_cast<double>(s.step.get()) - 1.0;
    double const excess = done - t0.get();
    double const mu = done < 1.0 ? 1.0 : 1.0 / (excess > 1.0 ? excess : 1.0);
    return {double_scalars ? mu : static_cast<double>(static_cast<float>(mu))};
  }
};

/// @brief torch.optim.ASGD as its `_single_tensor_asgd` computes it (torch's default on the
/// CPU; its foreach path, the default for CUDA tensors, is the same algebra rounded
/// differently). Slots: param, grad, ax. The chain: negate_gradient_if(maximize) ->
/// add_weight_decay -> asgd_decay -> momentum{} (update = grad) -> scale_by_scheduled_lr<asgd_eta>
/// -> apply_update -> asgd_average.
struct asgd : chained<asgd, chain_rule<negate_gradient_if, add_weight_decay, asgd_decay, momentum,
                                       scale_by_scheduled_lr<asgd_eta>, apply_update, asgd_average>> {
  scalar<double> lr{1e-2};           ///< learning rate
  scalar<double> lambd{1e-4};        ///< decay term
  scalar<double> alpha{0.75};        ///< power of the eta update
  scalar<double> t0{1e6};            ///< the step at which averaging starts
  scalar<double> weight_decay{0.0};  ///< L2: grad += weight_decay * param
  bool maximize = false;             ///< ascend: the gradient is negated first
  bool double_scalars = false;       ///< eta and mu in double (torch under a float64 default dtype)

  FUSEDOPT_HOST_DEVICE chain_type as_chain() const
  {
    asgd_eta const eta{lambd, alpha, double_scalars};
    return chain(negate_gradient_if{maximize}, add_weight_decay{weight_decay}, asgd_decay{lr, eta}, rules::momentum{},
                 scale_by_scheduled_lr<asgd_eta>{lr, eta}, apply_update{}, asgd_average{t0, double_scalars});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
