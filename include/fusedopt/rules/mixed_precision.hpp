/// @file rules/mixed_precision.hpp
/// @brief Low-precision parameters: fp32 master weights, split-bfloat16 parameters (bf16
/// param + 16-bit remainder) and stochastic rounding, as wrappers and blocks that any rule
/// runs under unchanged.
///
/// Every rule in rules/ reads and writes `slot::param`. The wrappers here put the
/// full-precision value in the param *register* before the rule runs and take it back out
/// afterwards, so `rules::adamw` and friends update the master without knowing about it:
/// @code
/// // bf16 param, fp32 master: adamw runs on the master; param is stored as RNE(master).
/// plan.run(fusedopt::rules::with_master{adamw});
/// // bf16 param + int16 remainder holding the exact fp32 master, no fp32 copy.
/// plan.run(fusedopt::rules::with_remainder{adamw});
/// // bf16 param only: round the new param stochastically before it is stored.
/// plan.run(fusedopt::chain(adamw, fusedopt::rules::stochastic_round_param{seed}));
/// @endcode
/// The backends convert every register to its slot's storage type with round-to-nearest-even
/// when they store it; the blocks here leave values that conversion keeps exactly where it
/// must (the stochastically rounded param, the split param and remainder).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../chain.hpp"
#include "../config.hpp"
#include "../detail/rule_traits.hpp"
#include "../meta.hpp"
#include "../numeric/dtypes.hpp"
#include "../numeric/random.hpp"
#include "../numeric/split_float.hpp"
#include "../numeric/stochastic_rounding.hpp"
#include "../rule.hpp"
#include "../scalar.hpp"
#include "../slots.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace detail {

template <class E>
inline constexpr bool float_arithmetic_v = std::is_same_v<typename E::value_type, float>;

}  // namespace detail

namespace rules {

// ---- master weights ---------------------------------------------------------------------

/// @brief Puts the master value in the param register: param = master. Run it first, so the
/// rest of the chain updates the master as if it were the parameter.
struct load_master {
  using reads = slots<slot::master_t>;
  using writes = slots<>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    e[slot::param] = e[slot::master];
  }
};

/// @brief Takes the updated value back: master = param (stored exactly), and param is stored
/// rounded to its list's type (to nearest even). Run it last.
struct store_master {
  using reads = slots<>;
  using writes = slots<slot::param_t, slot::master_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    e[slot::master] = e[slot::param];
  }
};

/// @brief Runs `Rule` on the `master` slot (fp32, or double) of a low-precision (bf16 or
/// fp16) `param`: chain(load_master, rule, store_master). The master is loaded once and
/// stored once, exactly; `param` is stored once as the master rounded to nearest even and is
/// not loaded at all (its old value is never needed). Slots: those of `Rule` plus `master`.
///
/// Wrap the whole rule, clipping and other reducing parts included
/// (`with_master{chain(clip, adamw)}`): a part outside the wrapper would see the rounded
/// param instead of the master.
/// @tparam Rule any rule (a block, a chain, a named optimizer, a reducing rule)
template <class Rule>
struct with_master : chained<with_master<Rule>, chain_rule<load_master, Rule, store_master>> {
  Rule rule{};

  with_master() = default;
  /// @brief Wraps `r` (CTAD: `rules::with_master{rules::adamw{...}}`).
  FUSEDOPT_HOST_DEVICE constexpr explicit with_master(Rule r) : rule(r) {}

  /// The chain's reads without `param`: load_master overwrites its register before any part
  /// reads it, so loading it would only cost bandwidth.
  using reads = without_t<typename chain_rule<load_master, Rule, store_master>::reads, slot::param_t>;

  FUSEDOPT_HOST_DEVICE chain_rule<load_master, Rule, store_master> as_chain() const
  {
    return chain(load_master{}, rule, store_master{});
  }
};

// ---- split-bfloat16 parameters ----------------------------------------------------------

/// @brief Joins the bfloat16 param and its int16 remainder into the exact fp32 master, in the
/// param register (see join_float). Run it first. Needs float arithmetic (no double list
/// bound).
struct join_remainder {
  using reads = slots<slot::param_t, slot::remainder_t>;
  using writes = slots<>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    static_assert(detail::float_arithmetic_v<E>,
                  "fusedopt: join_remainder/with_remainder need float arithmetic; bind no double list with them");
    // The register holds the loaded bfloat16 exactly: its bits are the bfloat16's, shifted.
    auto const param = static_cast<std::uint16_t>(detail::float_bits(e[slot::param]) >> 16);
    auto const remainder = static_cast<std::int16_t>(e[slot::remainder]);
    e[slot::param] = join_float(param, remainder);
  }
};

/// @brief Splits the updated fp32 value in the param register into the bfloat16 param and
/// the int16 remainder (see split_float); both registers then hold values their stores keep
/// exactly. Run it last.
struct split_remainder {
  using reads = slots<>;
  using writes = slots<slot::param_t, slot::remainder_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, step_info const&) const
  {
    static_assert(detail::float_arithmetic_v<E>,
                  "fusedopt: split_remainder/with_remainder need float arithmetic; bind no double list with them");
    split_float_bits const s = split_float(e[slot::param]);
    e[slot::param] = detail::bfloat16_bits_to_float(s.param);
    e[slot::remainder] = static_cast<float>(s.remainder);
  }
};

/// @brief Runs `Rule` on the exact fp32 master held by a bfloat16 `param` and an
/// `std::int16_t` `remainder` (no fp32 copy: 4 bytes per parameter instead of 6):
/// chain(join_remainder, rule, split_remainder). Afterwards param is the bfloat16 nearest to
/// the new master (ties away from zero, see split_float) and param + remainder hold the master
/// exactly, so the trajectory of the master is bit for bit that of the rule run on fp32
/// parameters. Bind `param` to bfloat16 lists and `remainder` to std::int16_t lists (both
/// zero-initialised remainders and split_float of an fp32 model are valid starting points).
/// @tparam Rule any rule (a block, a chain, a named optimizer, a reducing rule)
template <class Rule>
struct with_remainder : chained<with_remainder<Rule>, chain_rule<join_remainder, Rule, split_remainder>> {
  Rule rule{};

  with_remainder() = default;
  /// @brief Wraps `r` (CTAD: `rules::with_remainder{rules::adamw{...}}`).
  FUSEDOPT_HOST_DEVICE constexpr explicit with_remainder(Rule r) : rule(r) {}

  FUSEDOPT_HOST_DEVICE chain_rule<join_remainder, Rule, split_remainder> as_chain() const
  {
    return chain(join_remainder{}, rule, split_remainder{});
  }
};

// ---- stochastic rounding ----------------------------------------------------------------

/// @brief Rounds the register of `Slot` to bfloat16 stochastically (see
/// stochastic_round_to_bfloat16), so that the backend's round-to-nearest store of it is
/// exact: put it last in a chain whose `Slot` is bound to bfloat16 lists.
///
/// The random bits of an element come from random_for(seed ^ salt, step, e.tensor(),
/// e.index()), where `salt` is a hash of the slot's name: rounding two slots with one seed
/// uses independent streams. The same (seed, step, tensor, element) always gives the same
/// bits, on the host and on the device; each step draws new ones. Needs float arithmetic
/// (no double list bound).
/// @tparam Slot the slot to round (param, or a bfloat16 state)
template <class Slot>
struct stochastic_round {
  /// The user's seed; changing it changes every rounding.
  std::uint64_t seed = 0;

  /// Mixed into the seed so that each slot has its own stream.
  static constexpr std::uint64_t salt = detail::name_hash(Slot::name);

  using reads = slots<Slot>;
  using writes = slots<Slot>;

  struct prepared {
    std::uint64_t key;
    std::int64_t step;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      static_assert(detail::float_arithmetic_v<E>,
                    "fusedopt: stochastic rounding to bfloat16 needs float arithmetic; bind no double list with it");
      random_bits const r = random_for(key, step, e.tensor(), e.index());
      e[Slot{}] = stochastic_round_to_bfloat16(e[Slot{}], r.word[0]);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const& s) const { return {seed ^ salt, s.step.get()}; }
};

/// @brief Stochastic rounding of the parameter: `chain(rule, stochastic_round_param{seed})`.
using stochastic_round_param = stochastic_round<slot::param_t>;

}  // namespace rules
FUSEDOPT_NAMESPACE_END
