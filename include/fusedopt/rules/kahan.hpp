/// @file rules/kahan.hpp
/// @brief Kahan-compensated low-precision parameters: a bfloat16 (or fp16) parameter and a
/// compensation slot of the same width, updated in the same pass, so that pure-bf16 training
/// keeps the small updates that rounding the parameter to bfloat16 would lose.
///
/// @code
/// // bf16 param, bf16 compensation (zero at the start), bf16 or fp32 states:
/// auto lists = fusedopt::bind(slot::param = p, slot::grad = g, slot::compensation = c,
///                             slot::exp_avg = m, slot::exp_avg_sq = v);
/// plan.run(fusedopt::rules::with_kahan{fusedopt::rules::adamw{...}}, step);
/// @endcode
///
/// Per element, in float: the rule turns the parameter p into p + d; then
/// y = c + d, p' = round(p + y) (the value the store keeps), c' = y - (p' - p), stored rounded
/// to the compensation's type. What rounding p' drops is carried in c' to the next step, where
/// it is added back first (Kahan's compensated summation; optimi's `kahan_sum`). Costs two bytes
/// per parameter read and written for a bf16 compensation, against four each for an fp32 master.
#pragma once

#include <type_traits>

#include "../chain.hpp"
#include "../config.hpp"
#include "../numeric/dtypes.hpp"
#include "../rule.hpp"
#include "../scalar.hpp"
#include "../slots.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace slot {
FUSEDOPT_MEMORY_SLOT(compensation);  ///< what rounding the low-precision param dropped (rules/kahan.hpp)
FUSEDOPT_REGISTER_SLOT(param_before);  ///< the param as loaded, while a Kahan-wrapped rule runs
}  // namespace slot

namespace rules {

/// @brief Remembers the loaded parameter (with_kahan's first part).
struct kahan_begin {
  using reads = slots<slot::param_t>;
  using writes = slots<>;
  using registers = slots<slot::param_before_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    e[slot::param_before] = e[slot::param];
  }
};

/// @brief Adds the compensation to the rule's change of the parameter and leaves in the param
/// register the value its `Storage` store keeps exactly, and in the compensation register what
/// that rounding dropped (with_kahan's last part).
/// @tparam Storage the parameter's element type (bfloat16 or half)
template <class Storage>
struct kahan_end {
  using reads = slots<slot::compensation_t>;
  using writes = slots<slot::param_t, slot::compensation_t>;
  using registers = slots<slot::param_before_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    using T = typename E::value_type;
    T const before = e[slot::param_before];
    T const sum = e[slot::compensation] + (e[slot::param] - before);
    // The parameter as its store will keep it (round to nearest even), so the compensation
    // holds exactly what the stored parameter lacks.
    T const stored = to_opmath<T>(from_opmath<Storage>(before + sum));
    e[slot::param] = stored;
    e[slot::compensation] = sum - (stored - before);
  }
};

/// @brief Runs `Rule` on a low-precision `param` with Kahan compensation:
/// chain(kahan_begin, rule, kahan_end<Storage>). Bind `param` to lists of `Storage` (bfloat16 by
/// default, or half) and `compensation` to lists of the same size (bfloat16, half or float;
/// zero at the start). Wrap the whole rule, clipping and other reducing parts included.
/// @tparam Rule any rule (a block, a chain, a named optimizer, a reducing rule)
/// @tparam Storage the element type `param` is bound to
template <class Rule, class Storage = bfloat16>
struct with_kahan : chained<with_kahan<Rule, Storage>, chain_rule<kahan_begin, Rule, kahan_end<Storage>>> {
  static_assert(std::is_same_v<Storage, bfloat16> || std::is_same_v<Storage, half>,
                "fusedopt: with_kahan compensates bfloat16 or half parameters; a float parameter needs none");
  Rule rule{};

  with_kahan() = default;
  /// @brief Wraps `r` (CTAD: `rules::with_kahan{rules::adamw{...}}`).
  FUSEDOPT_HOST_DEVICE constexpr explicit with_kahan(Rule r) : rule(r) {}

  FUSEDOPT_HOST_DEVICE chain_rule<kahan_begin, Rule, kahan_end<Storage>> as_chain() const
  {
    return chain(kahan_begin{}, rule, kahan_end<Storage>{});
  }
};

template <class Rule>
with_kahan(Rule) -> with_kahan<Rule, bfloat16>;

}  // namespace rules
FUSEDOPT_NAMESPACE_END
