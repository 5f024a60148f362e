/// @file groups.hpp
/// @brief Parameter groups in one launch: one rule type, G sets of hyperparameters, and a
/// per-tensor group index.
///
/// @code
/// fusedopt::rules::adamw decay, no_decay;
/// decay.lr = 1e-3;    decay.weight_decay = 0.1;
/// no_decay.lr = 2e-3; no_decay.weight_decay = 0.0;     // biases and norm weights
/// std::vector<std::int32_t> group_of = ...;             // one entry per tensor: 0 or 1
/// auto rule = fusedopt::groups{{decay, no_decay}, group_of.data()};  // groups<adamw, 2>
/// plan.run(rule, step);
/// @endcode
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "chain.hpp"
#include "config.hpp"
#include "detail/factored.hpp"
#include "detail/pack.hpp"
#include "detail/phases.hpp"
#include "detail/rule_traits.hpp"
#include "error.hpp"
#include "reduce.hpp"
#include "rule.hpp"
#include "scalar.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

/// Runs the body of group `g` through a chain of compile-time comparisons (no run-time indexed
/// array of bodies, which the GPU would keep in local memory); a group outside [0, G) falls
/// through: the element is left as loaded.
template <class Q, class... Rest, class E, class... Args>
FUSEDOPT_HOST_DEVICE void call_group(pack<Q, Rest...> const& bodies, std::int32_t g, E& e, Args&... args)
{
  if (g == 0) {
    bodies.head(e, args...);
  } else if constexpr (sizeof...(Rest) > 0) {
    call_group(bodies.tail, g - 1, e, args...);
  }
}

/// The groups' bodies over one tensor, its group looked up once (group_dispatch::for_tensor).
template <class... Bodies>
struct group_of_tensor {
  pack<Bodies...> bodies;
  std::int32_t group;

  template <class E, class... Args>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, Args&... args) const
  {
    call_group(bodies, group, e, args...);
  }
};

/// The prepared bodies of every group, and where to find each tensor's group.
template <class... Bodies>
struct group_dispatch {
  pack<Bodies...> bodies;
  std::int32_t const* group_of;

  /// Update body `(e)` and reduction body `(e, acc)` alike.
  template <class E, class... Args>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, Args&... args) const
  {
    call_group(bodies, group_of[e.tensor()], e, args...);
  }

  /// The tensor's group, looked up once per chunk rather than per element, with every group's
  /// per-tensor body.
  FUSEDOPT_HOST_DEVICE group_of_tensor<tensor_body_t<Bodies>...> for_tensor(std::int64_t tensor) const
  {
    return {::fusedopt::detail::bodies_for_tensor(bodies, tensor), group_of[tensor]};
  }
};

/// `reduction` of groups<Rule, G>: that of the rule's single pass, if it has one.
template <class Rule, bool Reducing = (pass_count_v<Rule> > 0)>
struct groups_reduction {};
template <class Rule>
struct groups_reduction<Rule, true> {
  using reduction = typename pass_traits<Rule, 0>::reduction;
  static_assert(pass_traits<Rule, 0>::finished_size == 0,
                "fusedopt::groups: the rule finishes its reduction's results per tensor (prepare_finish, "
                "Adafactor's step size), which groups do not forward; chain it outside the groups");
};

/// Drops the "fusedopt: " prefix of an error's message, to wrap it in another.
inline std::string error_text(error const& e)
{
  std::string text = e.what();
  std::string const prefix = "fusedopt: ";
  if (text.compare(0, prefix.size(), prefix) == 0) { text.erase(0, prefix.size()); }
  return text;
}

}  // namespace detail

/// @brief Runs a rule with different hyperparameters per group of tensors, in one pass over
/// memory: `rules[k]` updates every tensor t with `group_of[t] == k`.
///
/// Each group's rule is prepared once per thread (per-step values such as bias corrections
/// are computed G times, not once per element); each element runs the body of its tensor's
/// group. `group_of` holds one int32 per tensor of the bound lists, in host memory for the
/// host backend and device memory for the CUDA backend; it is read at every step, so
/// regrouping needs no new rule. A tensor whose group is outside [0, G) is left as loaded
/// (its slots are stored back unchanged; a slot the rule writes without reading it would be
/// stored as 0, so keep the indices in range).
///
/// Works for any rule with at most one reduction pass (LAMB, LARS, norm-based blocks): the
/// pass's per-tensor results are then each tensor's own, computed by its group's body;
/// results over all tensors (`reduced::total`) mix the groups. Rules with several passes
/// (`chain(clip_by_global_norm{...}, lamb{...})`) and rules with after-step hooks are
/// rejected at compile time: chain them outside, as in
/// `chain(clip_by_global_norm{...}, groups<lamb, 2>{...})`.
///
/// @tparam Rule the rule type every group runs (each group holds its own copy).
/// @tparam G the number of groups (at least 1).
template <class Rule, std::size_t G>
struct groups : detail::groups_reduction<Rule> {
  static_assert(G >= 1, "fusedopt::groups needs at least one group");
  static_assert(is_rule_v<Rule>, "fusedopt::groups: the rule must be trivially copyable");
  static_assert(detail::pass_count_v<Rule> <= 1,
                "fusedopt::groups supports rules with at most one reduction pass; chain the others "
                "outside the groups, e.g. chain(clip_by_global_norm{...}, groups<lamb, 2>{...})");
  static_assert(!detail::needs_after_step<Rule>::value,
                "fusedopt::groups: the rule has an after-step hook (flags, norms, loss scale), which "
                "each group would run; chain such rules outside the groups");
  static_assert(detail::factor_count_v<Rule> == 0,
                "fusedopt::groups: the rule has a factored pass (Adafactor, CAME: factored.hpp), which a "
                "group cannot hold; run one plan per group");

  using reads = detail::rule_reads_t<Rule>;
  using writes = detail::rule_writes_t<Rule>;
  using registers = detail::rule_registers_t<Rule>;

  /// The rule of each group.
  Rule rules[G];
  /// One group index per tensor of the bound lists.
  std::int32_t const* group_of = nullptr;

  groups() = default;
  /// @brief `groups<R, 2>{{rule_for_group_0, rule_for_group_1}, group_of}`.
  FUSEDOPT_HOST_DEVICE groups(Rule const (&per_group)[G], std::int32_t const* group_index) : group_of(group_index)
  {
    for (std::size_t k = 0; k < G; ++k) { rules[k] = per_group[k]; }
  }

  /// @brief Update body of a rule without reduction passes.
  template <class R = Rule, std::enable_if_t<detail::pass_count_v<R> == 0, int> = 0>
  FUSEDOPT_HOST_DEVICE auto prepare(step_info const& step) const
  {
    return prepare_each(step, std::make_index_sequence<G>{});
  }

  /// @brief Accumulating body of the rule's reduction pass.
  template <class R = Rule, std::enable_if_t<detail::pass_count_v<R> == 1, int> = 0>
  FUSEDOPT_HOST_DEVICE auto prepare_reduce(step_info const& step) const
  {
    return prepare_reduce_each(step, std::make_index_sequence<G>{});
  }

  /// @brief Update body of a rule with a reduction pass, given its results.
  template <class R = Rule, std::enable_if_t<detail::pass_count_v<R> == 1, int> = 0>
  FUSEDOPT_HOST_DEVICE auto prepare(step_info const& step, reduced const& results) const
  {
    return prepare_final_each(step, &results, std::make_index_sequence<G>{});
  }

  /// @brief Checks every group's rule against the bound slots.
  /// @throws fusedopt::error naming the group whose options are rejected, or if `group_of` is null.
  template <class Bound>
  void validate(Bound bound) const
  {
    FUSEDOPT_EXPECTS(group_of != nullptr, "groups: group_of must point to one group index per tensor");
    for (std::size_t k = 0; k < G; ++k) {
      try {
        detail::validate_rule(rules[k], bound);
      } catch (error const& e) {
        throw error("groups: group " + std::to_string(k) + ": " + detail::error_text(e));
      }
    }
  }

 private:
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE auto prepare_each(step_info const& step, std::index_sequence<K...>) const
  {
    using bodies = detail::group_dispatch<decltype(detail::prepare_rule(rules[K], step))...>;
    return bodies{detail::make_pack(detail::prepare_rule(rules[K], step)...), group_of};
  }
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE auto prepare_reduce_each(step_info const& step, std::index_sequence<K...>) const
  {
    // Pass 0 needs no earlier results.
    using bodies = detail::group_dispatch<decltype(detail::prepare_pass<0>(rules[K], step, nullptr))...>;
    return bodies{detail::make_pack(detail::prepare_pass<0>(rules[K], step, nullptr)...), group_of};
  }
  template <std::size_t... K>
  FUSEDOPT_HOST_DEVICE auto prepare_final_each(step_info const& step, reduced const* results,
                                               std::index_sequence<K...>) const
  {
    using bodies = detail::group_dispatch<decltype(detail::prepare_final(rules[K], step, results))...>;
    return bodies{detail::make_pack(detail::prepare_final(rules[K], step, results)...), group_of};
  }
};

FUSEDOPT_NAMESPACE_END
