/// @file rules/cautious.hpp
/// @brief Cautious optimizers (Liang et al. 2024, "Cautious Optimizers: Improving Training with
/// One Line of Code"; kyleliang919/C-Optim's C-AdamW) and Cautious Weight Decay (Chen et al.
/// 2025, arXiv 2510.12402), as blocks and as modifiers of any rule whose chain has a
/// learning-rate block.
///
/// Both act on the direction a rule produces in `update` before its learning-rate block
/// scales it (update then points along the gradient: the step is -lr update):
/// - `cautious_mask` keeps update only where it agrees in sign with the gradient (update *
///   grad > 0; `basic_cautious_mask<cautious_sign_of::exp_avg>`: exp_avg * grad > 0, as
///   C-Optim's and timm's C-AdamW) and scales what it keeps by 1 / max(mean of the mask,
///   1e-3), the mean taken over each tensor: a reduction pass (per-tensor counts), as LAMB's
///   trust ratio;
/// - `cautious_decay` decays the parameter only where update and parameter agree in sign
///   (update * param >= 0): param *= 1 - lr weight_decay there. Elementwise.
/// `cautious{rule}` and `cautious_weight_decay{rule, weight_decay}` insert them into `rule`'s
/// chain in front of its first learning-rate block (scale_by_scheduled_lr, or a block for which
/// rules::is_learning_rate_block is specialised), so `cautious{adamw{...}}` is C-AdamW (up to
/// the sign of an update that rounds to zero: `cautious<adamw, cautious_sign_of::exp_avg>` is
/// C-Optim's form) and `cautious{lion{...}}` C-Lion; give the rule itself a weight_decay of 0 under
/// cautious_weight_decay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../chain.hpp"
#include "../detail/rule_traits.hpp"
#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace rules {
/// @brief Whether a chain part scales `update` into the step: the cautious modifiers go in front
/// of the first such part. Specialise it (true_type) for a learning-rate block of your own (with
/// an `lr` member for cautious_weight_decay).
template <class Part>
struct is_learning_rate_block : std::false_type {};
template <class Schedule>
struct is_learning_rate_block<scale_by_scheduled_lr<Schedule>> : std::true_type {};
}  // namespace rules

namespace detail {

/// The chain a rule is made of: a chain itself, a named optimizer's as_chain(), or a
/// one-part chain of any other rule.
template <class Rule>
FUSEDOPT_HOST_DEVICE auto chain_of(Rule const& rule)
{
  if constexpr (is_chain<Rule>::value) {
    return rule;
  } else if constexpr (is_named_v<Rule>) {
    return rule.as_chain();
  } else {
    return chain(rule);
  }
}
template <class Rule>
using chain_of_t = decltype(chain_of(std::declval<Rule const&>()));

/// `Chain` with `Block` inserted in front of its first learning-rate block.
template <class Chain, class Block>
struct insert_before_lr;
template <class... Parts, class Block>
struct insert_before_lr<chain_rule<Parts...>, Block> {
  static constexpr std::size_t position()
  {
    constexpr bool found[] = {rules::is_learning_rate_block<Parts>::value...};
    std::size_t k = 0;
    while (k != sizeof...(Parts) && !found[k]) { ++k; }
    return k;
  }
  static constexpr std::size_t at = position();
  static_assert(at != sizeof...(Parts),
                "fusedopt: a cautious modifier goes in front of the rule's learning-rate block, and this rule's "
                "chain has none (scale_by_scheduled_lr, or a block marked by rules::is_learning_rate_block); "
                "chain the block (cautious_mask, cautious_decay) after the rule's direction yourself");
  using parts = std::tuple<Parts...>;

  template <std::size_t... Before, std::size_t... After>
  static auto type_of(std::index_sequence<Before...>, std::index_sequence<After...>)
    -> chain_rule<std::tuple_element_t<Before, parts>..., Block, std::tuple_element_t<at + After, parts>...>;
  using type = decltype(type_of(std::make_index_sequence<at>{}, std::make_index_sequence<sizeof...(Parts) - at>{}));

  template <std::size_t... Before, std::size_t... After>
  FUSEDOPT_HOST_DEVICE static type insert(chain_rule<Parts...> const& c, Block const& block,
                                          std::index_sequence<Before...>, std::index_sequence<After...>)
  {
    return chain(c.template get<Before>()..., block, c.template get<at + After>()...);
  }
  FUSEDOPT_HOST_DEVICE static type insert(chain_rule<Parts...> const& c, Block const& block)
  {
    return insert(c, block, std::make_index_sequence<at>{}, std::make_index_sequence<sizeof...(Parts) - at>{});
  }
};
template <class Rule, class Block>
using with_block_before_lr_t = typename insert_before_lr<chain_of_t<Rule>, Block>::type;

}  // namespace detail

namespace rules {

/// @brief What cautious_mask compares in sign with the gradient: the rule's `update`
/// (C-Lion's form, and any rule's), or the new first moment `exp_avg` (C-Optim's and timm's
/// C-AdamW: `exp_avg * grad > 0`). For Adam-like rules the two differ only where the update
/// rounds to zero or is not finite (its denominator is positive), and `exp_avg` lets the
/// reduction pass skip the second moment: its load, square root and division (C-AdamW's pass
/// reads grad and exp_avg, 8 bytes an element where `update` needs 12).
enum class cautious_sign_of { update, exp_avg };

/// @brief C-AdamW's mask on any direction: update *= (x * grad > 0) / max(mean, min_mean), x
/// the `SignOf` value, mean being the fraction of the tensor's elements kept (1e-3 is C-Optim's
/// and timm's clamp; the paper's first form divided by (kept + 1) / numel). The counts come
/// from a reduction pass that runs the chain up to this block on registers (it reads what the
/// parts before it read, less what the count does not need).
template <cautious_sign_of SignOf = cautious_sign_of::update>
struct basic_cautious_mask {
  scalar<double> min_mean{1e-3};

  /// Accumulator 0: elements kept; accumulator 1: elements (per tensor).
  using reduction = fusedopt::reduction<reduce_op::sum, reduce_op::sum>;
  using reads = std::conditional_t<SignOf == cautious_sign_of::exp_avg, slots<slot::grad_t, slot::exp_avg_t>,
                                   slots<slot::grad_t>>;
  using writes = slots<>;

  /// Whether the element's sign agrees with its gradient's (x * grad > 0).
  template <class E>
  FUSEDOPT_HOST_DEVICE static bool agrees(E& e)
  {
    using T = typename E::value_type;
    if constexpr (SignOf == cautious_sign_of::exp_avg) {
      return static_cast<T>(e[slot::exp_avg]) * e[slot::grad] > T(0);
    } else {
      return e[slot::update] * e[slot::grad] > T(0);
    }
  }

  struct count {
    template <class E, class Acc>
    FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
    {
      using A = std::remove_reference_t<decltype(acc[0])>;
      acc[0] += agrees(e) ? A(1) : A(0);
      acc[1] += A(1);
    }
  };

  /// Keeps the agreeing part of update, scaled by the tensor's factor.
  struct masked {
    double scale;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const u = e[slot::update];
      e[slot::update] = agrees(e) ? u * static_cast<T>(scale) : T(0);
    }
  };

  struct prepared {
    reduced counts;
    double min_mean;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
    FUSEDOPT_HOST_DEVICE masked for_tensor(std::int64_t tensor) const
    {
      double const elements = counts.tensor(tensor, 1);
      double const mean = elements > 0 ? counts.tensor(tensor, 0) / elements : 0.0;
      return {1.0 / (mean > min_mean ? mean : min_mean)};
    }
  };

  FUSEDOPT_HOST_DEVICE count prepare_reduce(step_info const&) const { return {}; }
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const { return {r, min_mean.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("cautious: min_mean", min_mean, detail::positive);
  }
};

/// @brief C-AdamW's mask comparing the update (cautious_sign_of::update).
using cautious_mask = basic_cautious_mask<>;

/// @brief Cautious Weight Decay: param *= 1 - lr * weight_decay where update * param >= 0 (the
/// paper's mask 1[u x >= 0]), param unchanged elsewhere. Placed before the learning-rate block,
/// where update is the direction u of the step x -= lr (u + weight_decay mask x).
struct cautious_decay {
  scalar<double> lr{1e-3};
  scalar<double> weight_decay{1e-2};
  using reads = slots<slot::param_t>;
  using writes = slots<slot::param_t>;

  struct prepared {
    double factor;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = typename E::value_type;
      T const p = e[slot::param];
      e[slot::param] = e[slot::update] * p >= T(0) ? p * static_cast<T>(factor) : p;
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return {1.0 - lr.get() * weight_decay.get()}; }

  template <class Bound>
  void validate(Bound) const
  {
    detail::expect_range("cautious weight decay: weight_decay", weight_decay, detail::non_negative);
  }
};

/// @brief `rule` with basic_cautious_mask<SignOf> in front of its learning-rate block
/// (`cautious{adamw{...}}`; C-Optim's C-AdamW exactly: `cautious<adamw,
/// cautious_sign_of::exp_avg>`). One reduction pass more than `rule`, which runs the rule's
/// parts before the mask on registers and stores nothing: it loads what the mask's value needs
/// (C-AdamW comparing the update: grad, exp_avg, exp_avg_sq; comparing exp_avg: grad and
/// exp_avg).
template <class Rule, cautious_sign_of SignOf = cautious_sign_of::update>
struct cautious : chained<cautious<Rule, SignOf>, detail::with_block_before_lr_t<Rule, basic_cautious_mask<SignOf>>> {
  using mask = basic_cautious_mask<SignOf>;
  Rule rule{};
  scalar<double> min_mean{1e-3};  ///< lower clamp of the mask's mean

  cautious() = default;
  /// @brief Wraps `r` (CTAD: `rules::cautious{rules::adamw{...}}`).
  FUSEDOPT_HOST_DEVICE constexpr explicit cautious(Rule r, scalar<double> clamp = 1e-3) : rule(r), min_mean(clamp) {}

  FUSEDOPT_HOST_DEVICE detail::with_block_before_lr_t<Rule, mask> as_chain() const
  {
    return detail::insert_before_lr<detail::chain_of_t<Rule>, mask>::insert(detail::chain_of(rule), mask{min_mean});
  }
};

/// @brief `rule` with cautious_decay in front of its learning-rate block, whose `lr` it uses.
/// Elementwise: no pass and no memory traffic beyond `rule`'s (param is read and written by
/// every rule). Set `rule`'s own weight decay to 0.
template <class Rule>
struct cautious_weight_decay : chained<cautious_weight_decay<Rule>, detail::with_block_before_lr_t<Rule, cautious_decay>> {
  Rule rule{};
  scalar<double> weight_decay{1e-2};

  cautious_weight_decay() = default;
  /// @brief Wraps `r` (CTAD: `rules::cautious_weight_decay{rules::adamw{...}, 0.1}`).
  FUSEDOPT_HOST_DEVICE constexpr cautious_weight_decay(Rule r, scalar<double> wd) : rule(r), weight_decay(wd) {}

  FUSEDOPT_HOST_DEVICE detail::with_block_before_lr_t<Rule, cautious_decay> as_chain() const
  {
    using insertion = detail::insert_before_lr<detail::chain_of_t<Rule>, cautious_decay>;
    auto const c = detail::chain_of(rule);
    return insertion::insert(c, cautious_decay{c.template get<insertion::at>().lr, weight_decay});
  }
};

}  // namespace rules
FUSEDOPT_NAMESPACE_END
