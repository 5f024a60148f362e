/// @file detail/rule_traits.hpp
/// @brief The rule protocol in one place: every optional member a rule may have, how it is
/// detected, and what a rule without it gets.
///
/// | member                                   | detected by        | without it                           |
/// |------------------------------------------|--------------------|--------------------------------------|
/// | `reads`, `writes` (slot lists)           | rule_reads_t, ...  | every bound slot (all_bound_slots)   |
/// | `registers` (slot list)                  | rule_registers_t   | none                                 |
/// | `prepare(step)` -> per-element body      | has_prepare        | the rule called as `rule(e, step)`   |
/// | `validate(bound)`                        | has_validate       | no run-time check                    |
/// | body's `for_tensor(tensor)`              | has_tensor_hook    | the body itself on every tensor      |
/// | `reduction`, `prepare_reduce(step)`,     | is_reducing        | no reduction pass                    |
/// |   `prepare(step, reduced)`               |                    |                                      |
/// | `after_step(reduced, step)`              | has_after_step     | nothing after the update             |
/// | `finished_size`, `prepare_finish(step)`  | has_finish         | no per-tensor values after the pass  |
/// | `chain_type`, `as_chain()`               | is_named_v         | the rule is its own whole            |
/// | `stored_by_pass` (slot list, a part      | has_pass_stores    | its factored pass stores nothing     |
/// |   with a factored pass)                  |                    |                                      |
///
/// A named optimizer (rules::chained: `chain_type` and `as_chain()`, no passes of its own) is
/// treated as its chain wherever passes or hooks are derived; is_named_v is that one test.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "../meta.hpp"
#include "../reduce.hpp"
#include "../scalar.hpp"

FUSEDOPT_NAMESPACE_BEGIN

template <class... Rules>
struct chain_rule;

namespace detail {

/// Marks the default of `reads`/`writes`: every bound slot.
struct all_bound_slots {};
}  // namespace detail

/// "Every bound slot" contains every slot: keeps contains_v (and declares_v) well-formed for
/// rules that declare no reads/writes (contains has no primary definition).
template <class S>
struct contains<detail::all_bound_slots, S> : std::true_type {};
/// ... and stays every bound slot without one of them.
template <class S>
struct without<detail::all_bound_slots, S> {
  using type = detail::all_bound_slots;
};

namespace detail {

/// Union of two reads/writes declarations; "every bound slot" absorbs everything.
template <class A, class B>
struct merge_declared {
  using type = set_union_t<A, B>;
};
template <class B>
struct merge_declared<all_bound_slots, B> {
  using type = all_bound_slots;
};
template <class A>
struct merge_declared<A, all_bound_slots> {
  using type = all_bound_slots;
};
template <>
struct merge_declared<all_bound_slots, all_bound_slots> {
  using type = all_bound_slots;
};

/// The union of any number of declarations (slots<> for none).
template <class... Declared>
struct merge_all {
  using type = slots<>;
};
template <class First, class... Rest>
struct merge_all<First, Rest...> {
  using type = typename merge_declared<First, typename merge_all<Rest...>::type>::type;
};

template <class R, class = void>
struct rule_reads {
  using type = all_bound_slots;
};
template <class R>
struct rule_reads<R, std::void_t<typename R::reads>> {
  using type = typename R::reads;
};
template <class R, class = void>
struct rule_writes {
  using type = all_bound_slots;
};
template <class R>
struct rule_writes<R, std::void_t<typename R::writes>> {
  using type = typename R::writes;
};
template <class R, class = void>
struct rule_registers {
  using type = slots<>;
};
template <class R>
struct rule_registers<R, std::void_t<typename R::registers>> {
  using type = typename R::registers;
};

template <class R>
using rule_reads_t = typename rule_reads<R>::type;
template <class R>
using rule_writes_t = typename rule_writes<R>::type;
template <class R>
using rule_registers_t = typename rule_registers<R>::type;

template <class Declared, class S>
inline constexpr bool declares_v = std::is_same_v<Declared, all_bound_slots> || contains_v<Declared, S>;

template <class R, class = void>
struct has_prepare : std::false_type {};
template <class R>
struct has_prepare<R, std::void_t<decltype(std::declval<R const&>().prepare(std::declval<step_info const&>()))>>
  : std::true_type {};

template <class R, class Bound, class = void>
struct has_validate : std::false_type {};
template <class R, class Bound>
struct has_validate<R, Bound, std::void_t<decltype(std::declval<R const&>().validate(Bound{}))>>
  : std::true_type {};

/// A prepared body may offer `for_tensor(std::int64_t tensor) const`: a body giving the same
/// bits on every element of that tensor, with the work that depends only on the tensor (a
/// trust ratio's square roots and division) done once. Backends call it once per chunk, so a
/// chunk's elements run the per-tensor body; a body called directly must stay correct too.
template <class B, class = void>
struct has_tensor_hook : std::false_type {};
template <class B>
struct has_tensor_hook<B, std::void_t<decltype(std::declval<B const&>().for_tensor(std::int64_t{}))>>
  : std::true_type {};
template <class B>
inline constexpr bool has_tensor_hook_v = has_tensor_hook<B>::value;

template <class R, class = void>
struct is_reducing : std::false_type {};
template <class R>
struct is_reducing<R, std::void_t<typename R::reduction>> : std::true_type {};

/// A reducing rule that finishes each tensor's results once per step (reduce.hpp): its pass's
/// `finished_size` doubles per tensor, computed by `prepare_finish(step)`'s body.
template <class R, class = void>
struct has_finish : std::false_type {};
template <class R>
struct has_finish<R, std::void_t<decltype(R::finished_size),
                                 decltype(std::declval<R const&>().prepare_finish(std::declval<step_info const&>()))>>
  : std::true_type {};

template <class R, class = void>
struct has_after_step : std::false_type {};
template <class R>
struct has_after_step<R, std::void_t<decltype(std::declval<R const&>().after_step(std::declval<reduced const&>(),
                                                                                   std::declval<step_info const&>()))>>
  : std::true_type {};

/// True for a rule that declares `static constexpr bool updates = false` (norm_of): a rule
/// that only measures, whose update writes no slot and computes nothing. Host and CUDA plans
/// run its reduction passes and after-step hooks and skip its update pass, which would read
/// every element once more for nothing.
template <class R, class = void>
struct skips_update : std::false_type {};
template <class R>
struct skips_update<R, std::enable_if_t<!R::updates>> : std::true_type {
  static_assert(std::is_same_v<typename rule_writes<R>::type, slots<>>,
                "fusedopt: a rule that declares updates = false must write no slot");
};
template <class R>
inline constexpr bool skips_update_v = skips_update<R>::value;

template <class R>
struct is_chain : std::false_type {};
template <class... Parts>
struct is_chain<chain_rule<Parts...>> : std::true_type {};

template <class R, class = void>
struct has_chain_type : std::false_type {};
template <class R>
struct has_chain_type<R, std::void_t<typename R::chain_type, decltype(std::declval<R const&>().as_chain())>>
  : std::true_type {};

/// A named optimizer: exposes its chain and has no passes of its own, so passes and hooks are
/// its chain's.
template <class R>
inline constexpr bool is_named_v = !is_reducing<R>::value && has_chain_type<R>::value;

/// A part whose factored pass (factored.hpp) stores the slots `stored_by_pass` lists: the
/// values its pass body leaves in the element. The update pass then resumes at that part (see
/// stores_in_pass): its `prepare(step)` body is what is left of it after the pass, and its
/// `reads` and `writes` are that body's.
template <class R, class = void>
struct has_pass_stores : std::false_type {};
template <class R>
struct has_pass_stores<R, std::void_t<typename R::stored_by_pass>> : std::true_type {};

/// True when a rule's update pass resumes after a storing pass: it or one of its parts (at any
/// depth) has one. The parts of a chain before the last such part are left out of its update
/// pass, reads and writes (chain_rule::resume).
template <class R, class = void>
struct stores_in_pass : has_pass_stores<R> {};
template <class... Parts>
struct stores_in_pass<chain_rule<Parts...>, void> : std::bool_constant<(stores_in_pass<Parts>::value || ...)> {};
template <class R>
struct stores_in_pass<R, std::enable_if_t<!has_pass_stores<R>::value && is_named_v<R>>>
  : stores_in_pass<typename R::chain_type> {};

/// The part of a chain where its update pass starts: the last part that stores in its pass
/// (0 when none does).
template <class... Parts>
constexpr std::size_t resume_part()
{
  constexpr bool stores[] = {stores_in_pass<Parts>::value...};
  std::size_t resume = 0;
  for (std::size_t k = 0; k < sizeof...(Parts); ++k) {
    if (stores[k]) { resume = k; }
  }
  return resume;
}

/// What a storing pass stores: the part's `stored_by_pass`, found through chains (slots<> for
/// rules without such a pass).
template <class R, class = void>
struct pass_stored {
  using type = slots<>;
};
template <class R>
struct pass_stored<R, std::enable_if_t<has_pass_stores<R>::value>> {
  using type = typename R::stored_by_pass;
};
template <class... Parts>
struct pass_stored<chain_rule<Parts...>, void>
  : pass_stored<std::tuple_element_t<resume_part<Parts...>(), std::tuple<Parts...>>> {};
template <class R>
struct pass_stored<R, std::enable_if_t<!has_pass_stores<R>::value && is_named_v<R>>>
  : pass_stored<typename R::chain_type> {};
template <class R>
using pass_stored_t = typename pass_stored<R>::type;

}  // namespace detail
FUSEDOPT_NAMESPACE_END
