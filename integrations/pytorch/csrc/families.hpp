/// @file families.hpp
/// @brief Plans of every optimizer family, generic over the backend (host or CUDA).
///
/// Included by host_plans.cpp (host backend) and by one `.cu` per family (CUDA backend), so
/// the two paths bind the same slots and build the same rules from the same hyperparameters.
/// A backend is a struct with `make(bound_lists, void* stream, int reduction_capacity)`,
/// `run(plan, rule, step_info, void* stream)` and `rebind(plan, bound_lists, void* stream)`.
#pragma once

// The headers used, not the umbrella fusedopt.hpp: each .cu compiles only what it needs.
#include <fusedopt/bind.hpp>
#include <fusedopt/chain.hpp>
#include <fusedopt/rules/adadelta.hpp>
#include <fusedopt/rules/adagrad.hpp>
#include <fusedopt/rules/adam.hpp>
#include <fusedopt/rules/adamax.hpp>
#include <fusedopt/rules/amp.hpp>
#include <fusedopt/rules/lamb.hpp>
#include <fusedopt/rules/lion.hpp>
#include <fusedopt/rules/nadam.hpp>
#include <fusedopt/rules/norms.hpp>
#include <fusedopt/rules/radam.hpp>
#include <fusedopt/rules/rmsprop.hpp>
#include <fusedopt/rules/sgd.hpp>

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "plans.hpp"

namespace fusedopt_torch {
namespace detail {

namespace fo = fusedopt;
namespace slot = fusedopt::slot;
namespace rules = fusedopt::rules;

template <class T>
struct tag {
  using type = T;
};

/// Calls `f(tag<T>{})` with the fusedopt element type of `t`.
template <class F>
std::unique_ptr<plan> by_dtype(dtype t, F&& f)
{
  switch (t) {
    case dtype::f32: return f(tag<float>{});
    case dtype::f64: return f(tag<double>{});
    case dtype::f16: return f(tag<fo::half>{});
    case dtype::bf16: return f(tag<fo::bfloat16>{});
  }
  throw fo::error("fusedopt_torch: unknown dtype");
}

template <class T>
fo::tensor_list<T> writable(std::vector<void*> const& ptrs, std::vector<std::int64_t> const& sizes)
{
  fo::tensor_list<T> l;
  l.reserve(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) { l.push_back(static_cast<T*>(ptrs[i]), sizes[i]); }
  return l;
}

template <class T>
fo::tensor_list<T const> readonly(std::vector<void const*> const& ptrs, std::vector<std::int64_t> const& sizes)
{
  fo::tensor_list<T const> l;
  l.reserve(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) { l.push_back(static_cast<T const*>(ptrs[i]), sizes[i]); }
  return l;
}

/// Param, grad and the k-th state of `x` as fusedopt bindings.
template <class T>
auto param(lists const& x)
{
  return slot::param = writable<T>(x.param, x.sizes);
}
template <class T>
auto grad(lists const& x)
{
  return slot::grad = readonly<T>(x.grad, x.sizes);
}
template <class T>
fo::tensor_list<T> state(lists const& x, std::size_t k)
{
  FUSEDOPT_EXPECTS(k < x.states.size(), "fusedopt_torch: a state list is missing");
  return writable<T>(x.states[k], x.sizes);
}

/// Whether a family's builder has a variant for state kept in the plan's memory (NAdam's
/// mu_product under capturable=True): `on_device(h)` says when, `device_rule(h)` builds it.
template <class Build, class = void>
struct has_device_rule : std::false_type {};
template <class Build>
struct has_device_rule<Build, std::void_t<decltype(std::declval<Build const&>().device_rule(std::declval<hyper const&>()))>>
  : std::true_type {};

/// A plan of backend B over lists that `Bind` makes from the tensors (so that a step whose
/// tensors moved rebinds the plan to new lists of the same geometry), running the rule `Build`
/// makes from the hyperparameters.
template <class B, class Plan, class Bind, class Build>
class plan_impl final : public plan {
 public:
  plan_impl(Plan p, Bind bind, Build build) : plan_(std::move(p)), bind_(bind), build_(build) {}
  void run(hyper const& h, step_count step, amp_inputs amp, void* stream) const override
  {
    fo::step_info info;
    info.step = step.value;
    if (step.counter != nullptr) {
      info.step = fo::scalar<std::int64_t>::from_pointer(step.counter);
      info.advance = step.counter;
    }
    if constexpr (Build::amp) {
      if (amp.any()) {
        // torch's fused kernels: grad / grad_scale, and nothing written when found_inf is set.
        auto const flag = fo::flag_pointer(const_cast<float*>(amp.found_inf));  // only read
        B::run(plan_, fo::chain(rules::divide_gradients{amp.grad_scale}, rules::skip_if_set(build_(h), flag)), info,
               stream);
        return;
      }
    } else {
      FUSEDOPT_EXPECTS(!amp.any(), "fusedopt_torch: this optimizer does not take GradScaler's grad_scale and found_inf");
    }
    if constexpr (has_device_rule<Build>::value) {
      if (Build::on_device(h)) {
        B::run(plan_, build_.device_rule(h), info, stream);
        return;
      }
    }
    B::run(plan_, build_(h), info, stream);
  }
  bool rebind(lists const& tensors, void* stream) override
  {
    auto bound = bind_(tensors);
    try {
      B::rebind(plan_, bound, stream);  // checks the geometry once on the usual path
    } catch (fo::error const&) {
      if (!plan_.can_rebind(bound)) { return false; }  // another geometry: the caller re-plans
      throw;
    }
    return true;
  }
  bool rebind_gradients(lists const& tensors, void* stream) override
  {
    grads_.resize(tensors.grad.size());  // allocates at the first call only
    for (std::size_t i = 0; i < grads_.size(); ++i) { grads_[i] = static_cast<grad_pointer>(tensors.grad[i]); }
    try {
      B::rebind_slot(plan_, fo::slot::grad, grads_.data(), grads_.size(), stream);
    } catch (fo::error const&) {
      return false;
    }
    return true;
  }

 private:
  using grad_pointer = typename Plan::template slot_pointer_t<fo::slot::grad_t>;
  Plan plan_;
  Bind bind_;
  Build build_;
  std::vector<grad_pointer> grads_;  // rebind_gradients' addresses, typed
};

/// A plan of backend B over the lists `bind(x)` makes.
template <class B, class Bind, class Build>
std::unique_ptr<plan> wrap(Bind bind, lists const& x, Build build, void* stream, int reduction_capacity = 0)
{
  auto p = B::make(bind(x), stream, reduction_capacity);
  return std::make_unique<plan_impl<B, decltype(p), Bind, Build>>(std::move(p), bind, build);
}

// ---- rules from hyperparameters -----------------------------------------------------------

/// A hyperparameter the engine may hand over in memory (a tensor's value, refreshed every step).
inline fo::scalar<double> scalar_of(double value, double const* pointer)
{
  return pointer != nullptr ? fo::scalar<double>::from_pointer(pointer) : fo::scalar<double>(value);
}

inline fo::scalar<double> lr_of(hyper const& h) { return scalar_of(h.lr, h.lr_pointer); }
inline fo::scalar<double> beta1_of(hyper const& h) { return scalar_of(h.beta1, h.beta1_pointer); }
inline fo::scalar<double> beta2_of(hyper const& h) { return scalar_of(h.beta2, h.beta2_pointer); }

inline rules::sgd sgd_rule(hyper const& h)
{
  rules::sgd r;
  r.lr = lr_of(h);
  r.momentum = h.momentum;
  r.dampening = h.dampening;
  r.weight_decay = h.weight_decay;
  r.nesterov = h.nesterov;
  r.maximize = h.maximize;
  return r;
}

template <class R>
R adam_rule(hyper const& h)
{
  R r;
  r.lr = lr_of(h);
  r.beta1 = beta1_of(h);
  r.beta2 = beta2_of(h);
  r.eps = h.eps;
  r.weight_decay = h.weight_decay;
  r.amsgrad = h.amsgrad;
  r.maximize = h.maximize;
  return r;
}

inline rules::adagrad adagrad_rule(hyper const& h)
{
  rules::adagrad r;
  r.lr = lr_of(h);
  r.lr_decay = h.lr_decay;
  r.weight_decay = h.weight_decay;
  r.eps = h.eps;
  r.maximize = h.maximize;
  return r;
}

inline rules::rmsprop rmsprop_rule(hyper const& h)
{
  rules::rmsprop r;
  r.lr = lr_of(h);
  r.alpha = h.alpha;
  r.eps = h.eps;
  r.weight_decay = h.weight_decay;
  r.momentum = h.momentum;
  r.centered = h.centered;
  r.maximize = h.maximize;
  return r;
}

inline rules::lamb lamb_rule(hyper const& h)
{
  rules::lamb r;
  r.lr = lr_of(h);
  r.beta1 = beta1_of(h);
  r.beta2 = beta2_of(h);
  r.eps = h.eps;
  r.weight_decay = h.weight_decay;
  r.bias_correction = h.bias_correction;
  r.grad_averaging = h.grad_averaging;
  r.adam_w_mode = h.adam_w_mode;
  r.use_nvlamb = h.use_nvlamb;
  return r;
}

inline rules::lion lion_rule(hyper const& h)
{
  rules::lion r;
  r.lr = lr_of(h);
  r.beta1 = beta1_of(h);
  r.beta2 = beta2_of(h);
  r.weight_decay = h.weight_decay;
  r.maximize = h.maximize;
  return r;
}

inline rules::radam radam_rule(hyper const& h)
{
  rules::radam r;
  r.lr = lr_of(h);
  r.beta1 = beta1_of(h);
  r.beta2 = beta2_of(h);
  r.eps = h.eps;
  r.weight_decay = h.weight_decay;
  r.decoupled_weight_decay = h.decoupled_weight_decay;
  r.maximize = h.maximize;
  return r;
}

inline rules::adamax adamax_rule(hyper const& h)
{
  rules::adamax r;
  r.lr = lr_of(h);
  r.beta1 = beta1_of(h);
  r.beta2 = beta2_of(h);
  r.eps = h.eps;
  r.weight_decay = h.weight_decay;
  r.maximize = h.maximize;
  return r;
}

inline rules::adadelta adadelta_rule(hyper const& h)
{
  rules::adadelta r;
  r.lr = lr_of(h);
  r.rho = h.rho;
  r.eps = h.eps;
  r.weight_decay = h.weight_decay;
  r.maximize = h.maximize;
  return r;
}

inline rules::nadam nadam_rule(hyper const& h)
{
  rules::nadam r;
  r.lr = lr_of(h);
  r.beta1 = beta1_of(h);
  r.beta2 = beta2_of(h);
  r.eps = h.eps;
  r.weight_decay = h.weight_decay;
  r.momentum_decay = h.momentum_decay;
  r.decoupled_weight_decay = h.decoupled_weight_decay;
  r.maximize = h.maximize;
  r.mu_product = scalar_of(h.mu_product, h.mu_product_pointer);
  return r;
}

// Captureless lambdas: trivially copyable, stored in the plan. `amp`: the family takes
// GradScaler's fused protocol (supports_amp), so its plans also instantiate the AMP rule.
struct build_sgd {
  static constexpr bool amp = true;
  rules::sgd operator()(hyper const& h) const { return sgd_rule(h); }
};
struct build_adam {
  static constexpr bool amp = true;
  rules::adam operator()(hyper const& h) const { return adam_rule<rules::adam>(h); }
};
struct build_adamw {
  static constexpr bool amp = true;
  rules::adamw operator()(hyper const& h) const { return adam_rule<rules::adamw>(h); }
};
struct build_adagrad {
  static constexpr bool amp = true;
  rules::adagrad operator()(hyper const& h) const { return adagrad_rule(h); }
};
struct build_rmsprop {
  static constexpr bool amp = false;
  rules::rmsprop operator()(hyper const& h) const { return rmsprop_rule(h); }
};
struct build_lamb {
  static constexpr bool amp = false;
  rules::lamb operator()(hyper const& h) const { return lamb_rule(h); }
};
struct build_clipped_lamb {
  static constexpr bool amp = false;
  auto operator()(hyper const& h) const { return fo::chain(rules::clip_by_global_norm{h.max_grad_norm}, lamb_rule(h)); }
};
struct build_lion {
  static constexpr bool amp = false;
  rules::lion operator()(hyper const& h) const { return lion_rule(h); }
};
struct build_radam {
  static constexpr bool amp = false;
  rules::radam operator()(hyper const& h) const { return radam_rule(h); }
};
struct build_adamax {
  static constexpr bool amp = false;
  rules::adamax operator()(hyper const& h) const { return adamax_rule(h); }
};
struct build_adadelta {
  static constexpr bool amp = false;
  rules::adadelta operator()(hyper const& h) const { return adadelta_rule(h); }
};
struct build_nadam {
  static constexpr bool amp = false;
  rules::nadam operator()(hyper const& h) const { return nadam_rule(h); }
  /// capturable=True: the product in the plan's memory, advanced there after the step.
  [[nodiscard]] static bool on_device(hyper const& h) { return h.mu_product_pointer != nullptr; }
  auto device_rule(hyper const& h) const
  {
    rules::nadam const r = nadam_rule(h);
    return fo::chain(r, rules::advance_mu_product{h.mu_product_pointer, r.beta1, r.momentum_decay, h.mu_product_single});
  }
};

// ---- plans per family (one function per .cu) -----------------------------------------------
//
// Each binds the family's slots through a captureless lambda (`auto const& x` -> bound lists),
// kept by the plan to rebind it when the tensors move.

template <class B>
std::unique_ptr<plan> sgd_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    if (l.momentum) {
      return wrap<B>([](lists const& y) { return fo::bind(param<T>(y), grad<T>(y), slot::momentum_buffer = state<T>(y, 0)); },
                     x, build_sgd{}, s);
    }
    return wrap<B>([](lists const& y) { return fo::bind(param<T>(y), grad<T>(y)); }, x, build_sgd{}, s);
  });
}

template <class B, class Build>
std::unique_ptr<plan> adam_plan_of(dtype t, layout const& l, lists const& x, void* s)
{
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    if (l.amsgrad) {
      return wrap<B>(
        [](lists const& y) {
          return fo::bind(param<T>(y), grad<T>(y), slot::exp_avg = state<T>(y, 0), slot::exp_avg_sq = state<T>(y, 1),
                          slot::max_exp_avg_sq = state<T>(y, 2));
        },
        x, Build{}, s);
    }
    return wrap<B>(
      [](lists const& y) {
        return fo::bind(param<T>(y), grad<T>(y), slot::exp_avg = state<T>(y, 0), slot::exp_avg_sq = state<T>(y, 1));
      },
      x, Build{}, s);
  });
}

template <class B>
std::unique_ptr<plan> adam_plan(family f, dtype t, layout const& l, lists const& x, void* s)
{
  return f == family::adamw ? adam_plan_of<B, build_adamw>(t, l, x, s) : adam_plan_of<B, build_adam>(t, l, x, s);
}

template <class B>
std::unique_ptr<plan> adagrad_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    return wrap<B>([](lists const& y) { return fo::bind(param<T>(y), grad<T>(y), slot::sum_sq = state<T>(y, 0)); }, x,
                   build_adagrad{}, s);
  });
}

template <class B>
std::unique_ptr<plan> rmsprop_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  // State order: square_avg, then momentum_buffer (with momentum), then grad_avg (centered).
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    if (l.momentum && l.centered) {
      return wrap<B>(
        [](lists const& y) {
          return fo::bind(param<T>(y), grad<T>(y), slot::square_avg = state<T>(y, 0),
                          slot::momentum_buffer = state<T>(y, 1), slot::grad_avg = state<T>(y, 2));
        },
        x, build_rmsprop{}, s);
    }
    if (l.momentum) {
      return wrap<B>(
        [](lists const& y) {
          return fo::bind(param<T>(y), grad<T>(y), slot::square_avg = state<T>(y, 0),
                          slot::momentum_buffer = state<T>(y, 1));
        },
        x, build_rmsprop{}, s);
    }
    if (l.centered) {
      return wrap<B>(
        [](lists const& y) {
          return fo::bind(param<T>(y), grad<T>(y), slot::square_avg = state<T>(y, 0), slot::grad_avg = state<T>(y, 1));
        },
        x, build_rmsprop{}, s);
    }
    return wrap<B>([](lists const& y) { return fo::bind(param<T>(y), grad<T>(y), slot::square_avg = state<T>(y, 0)); },
                   x, build_rmsprop{}, s);
  });
}

template <class B>
std::unique_ptr<plan> lamb_plan(family, dtype t, layout const& l, lists const& x, void* s)
{
  // The trust ratio needs two accumulators, the clip one more in its own pass.
  constexpr int capacity = 4;
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    auto bind = [](lists const& y) {
      return fo::bind(param<T>(y), grad<T>(y), slot::exp_avg = state<T>(y, 0), slot::exp_avg_sq = state<T>(y, 1));
    };
    if (l.clip) { return wrap<B>(bind, x, build_clipped_lamb{}, s, capacity); }
    return wrap<B>(bind, x, build_lamb{}, s, capacity);
  });
}

template <class B>
std::unique_ptr<plan> lion_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    return wrap<B>([](lists const& y) { return fo::bind(param<T>(y), grad<T>(y), slot::exp_avg = state<T>(y, 0)); }, x,
                   build_lion{}, s);
  });
}

template <class B>
std::unique_ptr<plan> radam_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    return wrap<B>(
      [](lists const& y) {
        return fo::bind(param<T>(y), grad<T>(y), slot::exp_avg = state<T>(y, 0), slot::exp_avg_sq = state<T>(y, 1));
      },
      x, build_radam{}, s);
  });
}

template <class B>
std::unique_ptr<plan> adamax_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    return wrap<B>(
      [](lists const& y) {
        return fo::bind(param<T>(y), grad<T>(y), slot::exp_avg = state<T>(y, 0), slot::exp_inf = state<T>(y, 1));
      },
      x, build_adamax{}, s);
  });
}

template <class B>
std::unique_ptr<plan> adadelta_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    return wrap<B>(
      [](lists const& y) {
        return fo::bind(param<T>(y), grad<T>(y), slot::square_avg = state<T>(y, 0), slot::acc_delta = state<T>(y, 1));
      },
      x, build_adadelta{}, s);
  });
}

template <class B>
std::unique_ptr<plan> nadam_plan(family, dtype t, layout const&, lists const& x, void* s)
{
  // State order: exp_avg, exp_avg_sq (torch's mu_product is a scalar per bucket: hyper::mu_product).
  return by_dtype(t, [&](auto tg) -> std::unique_ptr<plan> {
    using T = typename decltype(tg)::type;
    return wrap<B>(
      [](lists const& y) {
        return fo::bind(param<T>(y), grad<T>(y), slot::exp_avg = state<T>(y, 0), slot::exp_avg_sq = state<T>(y, 1));
      },
      x, build_nadam{}, s);
  });
}

}  // namespace detail
}  // namespace fusedopt_torch
