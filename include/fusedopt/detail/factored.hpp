/// @file detail/factored.hpp
/// @brief Factored passes (factored.hpp) as the backends see them: which parts of a rule have
/// one, what each reads, its per-element value body, and the order of its additions, which
/// both backends follow so that the statistics have the same bits on each.
///
/// A factoring part has `factors()` (its factored_table), `prepare_factor(step)` (a body
/// `v(e) -> double`, the value summed) and `prepare_fold(step)` (`f(old, sum, count)`, the new
/// statistic). Like a reduction pass, a factored pass runs the parts before its owner first, so
/// it sees the element as the owner will: the backends run the passes in chain order, a
/// factored pass after the reduction passes of the parts before its owner (factor_before_v).
///
/// The order (factored.hpp's factored_tile_rows = 256, factored_tile_cols = 64): a matrix is cut
/// into tiles of 256 x 64 elements (the last ones smaller). In a tile of h rows and w columns,
/// the partial of column c is ((0 + v[0][c]) + v[1][c]) + ... + v[h-1][c], in double; the
/// partial of row r is the lane tree (lane_tree) of a[l] = v[r][l] + v[r][l + 32], l = 0..31,
/// a missing value (c >= w) being 0 (the CUDA backend's warp per tile, lane l holding columns l
/// and l + 32, sums a row by shuffles in this tree). A row's sum is its partials over the
/// column tiles j = 0, 1, ... added in that order to 0, a column's over the row tiles i = 0, 1,
/// .... A matrix's row total is a tree over 256 lanes: lane k adds the folded statistics of rows
/// k, k + 256, ... (as doubles) in order to 0; then lanes k and k + s are added for s = 128, 64,
/// ..., 1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../chain.hpp"
#include "../config.hpp"
#include "../factored.hpp"
#include "../meta.hpp"
#include "../numeric/dtypes.hpp"
#include "../rule.hpp"
#include "../scalar.hpp"
#include "phases.hpp"
#include "rule_traits.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

/// Lanes of a matrix's row total (the order above).
inline constexpr int factored_total_lanes = 256;
/// Lanes of a tile row's partial (a warp's).
inline constexpr int factored_row_lanes = 32;
static_assert(factored_tile_cols == 2 * factored_row_lanes, "a tile row is two columns a lane");

/// The lane tree of N values (N a power of two): lanes k and k + s added for s = N / 2, ..., 1,
/// the sum in lane 0 (`lane` is overwritten).
template <int N>
FUSEDOPT_HOST_DEVICE double lane_tree(double (&lane)[N])
{
  static_assert((N & (N - 1)) == 0, "a tree of a power of two lanes");
  for (int s = N / 2; s > 0; s /= 2) {
    for (int k = 0; k < s; ++k) { lane[k] += lane[k + s]; }
  }
  return lane[0];
}

/// A part with a factored pass: it has `factors()`.
template <class R, class = void>
struct is_factoring : std::false_type {};
template <class R>
struct is_factoring<R, std::void_t<decltype(std::declval<R const&>().factors())>> : std::true_type {};

/// Number of factored passes of a rule.
template <class R, class = void>
struct factor_count : std::integral_constant<int, is_factoring<R>::value ? 1 : 0> {};
template <class R>
inline constexpr int factor_count_v = factor_count<R>::value;
template <class R>
struct factor_count<R, std::enable_if_t<is_named_v<R> && !is_factoring<R>::value>>
  : factor_count<typename R::chain_type> {};
template <class... Parts>
struct factor_count<chain_rule<Parts...>, void>
  : std::integral_constant<int, (0 + ... + factor_count<Parts>::value)> {};

/// Factored-pass offset of part K of a chain, and the part that owns factored pass J.
template <std::size_t K, class... Parts>
FUSEDOPT_HOST_DEVICE constexpr int factor_offset()
{
  return counted_offset<factor_count, K, Parts...>();
}
template <int J, class... Parts>
FUSEDOPT_HOST_DEVICE constexpr std::size_t part_of_factor()
{
  return counted_owner<factor_count, J, Parts...>();
}

/// What factored pass J reads, the part that owns it, and the type of its statistics.
template <class R, int J, class = void>
struct factor_traits;
template <class R>
struct factor_traits<R, 0, std::enable_if_t<is_factoring<R>::value>> {
  using owner = R;
  using reads = rule_reads_t<R>;
  using stores = pass_stored_t<R>;  ///< slots<> unless the owner declares stored_by_pass
};
template <int J, class... Parts>
struct factor_traits<chain_rule<Parts...>, J, void> {
  static constexpr std::size_t part = part_of_factor<J, Parts...>();
  using inner = factor_traits<std::tuple_element_t<part, std::tuple<Parts...>>, J - factor_offset<part, Parts...>()>;
  using owner = typename inner::owner;
  using reads = typename merge_declared<typename parts_reads<slots<Parts...>, part>::type, typename inner::reads>::type;
  using stores = typename inner::stores;
};
template <class R, int J>
struct factor_traits<R, J, std::enable_if_t<is_named_v<R> && !is_factoring<R>::value>>
  : factor_traits<typename R::chain_type, J> {};
/// Whether factored pass J stores slots (its owner's stored_by_pass).
template <class R, int J>
inline constexpr bool factor_stores_v = !std::is_same_v<typename factor_traits<R, J>::stores, slots<>>;

/// Reduction passes that come before factored pass J in chain order: the backends run it after
/// them (and before the others), so that the parts before its owner see their results.
template <class R, int J, class = void>
struct factor_before : std::integral_constant<int, 0> {};
template <int J, class... Parts>
struct factor_before<chain_rule<Parts...>, J, void>
  : std::integral_constant<int, part_offset<part_of_factor<J, Parts...>(), Parts...>() +
                                  factor_before<std::tuple_element_t<part_of_factor<J, Parts...>(), std::tuple<Parts...>>,
                                                J - factor_offset<part_of_factor<J, Parts...>(), Parts...>()>::value> {};
template <class R, int J>
struct factor_before<R, J, std::enable_if_t<is_named_v<R> && !is_factoring<R>::value>>
  : factor_before<typename R::chain_type, J> {};
template <class R, int J>
inline constexpr int factor_before_v = factor_before<R, J>::value;

/// The type of factored pass J's statistics.
template <class R, int J>
using factor_state_t = std::remove_const_t<
  std::remove_pointer_t<decltype(std::declval<typename factor_traits<R, J>::owner const&>().factors().tensors->row)>>;

/// The part that owns factored pass J (a copy: a named optimizer's chain is made on the fly).
template <int J, class R>
FUSEDOPT_HOST_DEVICE auto factor_owner(R const& rule);

template <int J, class... Parts>
FUSEDOPT_HOST_DEVICE auto factor_owner_of_chain(chain_rule<Parts...> const& c)
{
  constexpr std::size_t part = part_of_factor<J, Parts...>();
  return factor_owner<J - factor_offset<part, Parts...>()>(c.template get<part>());
}

template <int J, class R>
FUSEDOPT_HOST_DEVICE auto factor_owner(R const& rule)
{
  if constexpr (is_factoring<R>::value) {
    static_assert(J == 0, "a factoring part has one factored pass");
    return rule;
  } else if constexpr (is_chain<R>::value) {
    return factor_owner_of_chain<J>(rule);
  } else {
    return factor_owner<J>(rule.as_chain());
  }
}

/// Runs the parts before the pass's owner, then gives the owner's value of the element.
template <class Prefix, class Inner>
struct factor_after {
  Prefix prefix;
  Inner inner;
  template <class E>
  FUSEDOPT_HOST_DEVICE double operator()(E& e) const
  {
    prefix(e);
    return inner(e);
  }
  template <bool Hooked = has_tensor_hook_v<Prefix> || has_tensor_hook_v<Inner>, std::enable_if_t<Hooked, int> = 0>
  FUSEDOPT_HOST_DEVICE auto for_tensor(std::int64_t tensor) const
  {
    return factor_after<tensor_body_t<Prefix>, tensor_body_t<Inner>>{
      ::fusedopt::detail::body_for_tensor(prefix, tensor), ::fusedopt::detail::body_for_tensor(inner, tensor)};
  }
};

template <int J, class R>
FUSEDOPT_HOST_DEVICE auto prepare_factor_pass(R const& rule, step_info const& step, reduced const* results);

template <int J, class... Parts, std::size_t... K>
FUSEDOPT_HOST_DEVICE auto prepare_factor_parts(chain_rule<Parts...> const& c, step_info const& step,
                                               reduced const* results, std::index_sequence<K...>)
{
  constexpr std::size_t part = part_of_factor<J, Parts...>();
  auto inner = prepare_factor_pass<J - factor_offset<part, Parts...>()>(c.template get<part>(), step,
                                                                      results + part_offset<part, Parts...>());
  using prefix_type = prepared_chain<decltype(prepare_final(c.template get<K>(), step, results))...>;
  prefix_type prefix{};
  if constexpr (sizeof...(K) > 0) {
    prefix = prefix_type{make_pack(prepare_final(c.template get<K>(), step, results + part_offset<K, Parts...>())...)};
  }
  return factor_after<prefix_type, decltype(inner)>{prefix, inner};
}

/// The value body of factored pass J: `body(e)` gives the element's value (double).
/// `results` holds the rule's reduction passes' results in pass order; the first
/// factor_before_v<R, J> of them are ready when the pass runs, and the parts before the pass's
/// owner read only those.
template <int J, class R>
FUSEDOPT_HOST_DEVICE auto prepare_factor_pass(R const& rule, step_info const& step, reduced const* results)
{
  if constexpr (is_factoring<R>::value) {
    static_assert(J == 0, "a factoring part has one factored pass");
    (void)results;
    using value_body = decltype(rule.prepare_factor(step));
    return factor_after<prepared_chain<>, value_body>{prepared_chain<>{}, rule.prepare_factor(step)};
  } else if constexpr (is_chain<R>::value) {
    return prepare_factor_parts<J>(rule, step, results, std::make_index_sequence<factor_traits<R, J>::part>{});
  } else {
    return prepare_factor_pass<J>(rule.as_chain(), step, results);
  }
}

/// Element i of `tensor` as a factored pass reads it: the pass's reads loaded (the others start
/// at 0), registers cleared.
template <class Access, class Reads>
FUSEDOPT_HOST_DEVICE void load_factor_element(typename Access::element_type& e, void* const* bases,
                                              std::int64_t tensor, std::int64_t i)
{
  e.set_position(tensor, i);
  Access::template load_reads<Reads>(e, bases, i, std::make_index_sequence<Access::num_slots>{});
  Access::clear_registers(e);
}

/// Stores what factored pass J stores of an element its body ran on (nothing for most passes).
template <class Access, class Stores>
FUSEDOPT_HOST_DEVICE void store_factor_element(typename Access::element_type const& e, void* const* bases,
                                               std::int64_t i)
{
  if constexpr (!std::is_same_v<Stores, slots<>>) {
    Access::template store_stored<Stores>(e, bases, i, std::make_index_sequence<Access::num_slots>{});
  } else {
    (void)e, (void)bases, (void)i;
  }
}

/// The value of element i of `tensor` in a factored pass: the element loaded, the body run,
/// what the pass stores stored.
template <class Access, class Reads, class Stores, class Body>
FUSEDOPT_HOST_DEVICE double factor_value(Body const& body, void* const* bases, std::int64_t tensor, std::int64_t i)
{
  typename Access::element_type e;
  load_factor_element<Access, Reads>(e, bases, tensor, i);
  double const value = body(e);
  store_factor_element<Access, Stores>(e, bases, i);
  return value;
}

/// A folded statistic, stored: `fold(old, sum, count)` in the arithmetic type of T.
template <class T, class Fold>
FUSEDOPT_HOST_DEVICE void fold_statistic(Fold const& fold, T* statistic, double sum, std::int64_t count)
{
  using O = opmath_t<T>;
  *statistic = from_opmath<T>(fold(to_opmath<O>(*statistic), sum, count));
}

/// Line factors (factored.hpp's factored_tensor::row_factor, col_factor): a factoring part may
/// declare `prepare_line_factors(step)`, a body with `row(stat, mean) -> O` and `col(stat) ->
/// O` (O: T's arithmetic type, mean: the matrix's row total / R in double), which the backends
/// run on each folded statistic of a matrix after its row total, so that the passes after it
/// read a factor per row and one per column instead of computing them per element (Adafactor's
/// and CAME's rsqrt of the normalised row and of the column). Where the body also has
/// `vector(stat) -> O`, a vector's row factors are vector(stat) of its statistics and its
/// column factors 1: the passes then read a vector's factor as a matrix's, through the same code
/// (factored_lookup::factor_of), and run no per-element branch on the tensor's kind (Adafactor's
/// and CAME's rsqrt of the element's own second moment; the product with 1 is exact). Parts
/// without them get no_line_factors, which writes nothing.
template <class R, class = void>
struct has_line_factors : std::false_type {};
template <class R>
struct has_line_factors<R, std::void_t<decltype(std::declval<R const&>().prepare_line_factors(
                             std::declval<step_info const&>()))>> : std::true_type {};

struct no_line_factors {};

/// True where a line factors body also gives vectors' factors (`vector(stat)`).
template <class Factors, class O, class = void>
struct has_vector_factors : std::false_type {};
template <class Factors, class O>
struct has_vector_factors<Factors, O, std::void_t<decltype(std::declval<Factors const&>().vector(std::declval<O>()))>>
  : std::true_type {};

/// The line factors of factored pass J's owner, or no_line_factors.
template <int J, class R>
FUSEDOPT_HOST_DEVICE auto prepare_line_factors(R const& rule, step_info const& step)
{
  auto const owner = factor_owner<J>(rule);
  if constexpr (has_line_factors<decltype(owner)>::value) {
    return owner.prepare_line_factors(step);
  } else {
    (void)owner, (void)step;
    return no_line_factors{};
  }
}

/// A matrix's mean row statistic from its row total (the normaliser the rules and the line
/// factors divide by).
FUSEDOPT_HOST_DEVICE double row_mean(double total, std::int64_t rows)
{
  return total * (1.0 / static_cast<double>(rows));
}

/// Row r (of matrix m) or column l (of all the matrices' columns) factor, stored.
template <class T, class Factors>
FUSEDOPT_HOST_DEVICE void write_row_factor(Factors const& factors, factored_tensor<T> const& e, std::int64_t line,
                                           double mean)
{
  if constexpr (!std::is_same_v<Factors, no_line_factors>) {
    e.row_factor[line] = factors.row(to_opmath<opmath_t<T>>(e.row[line]), mean);
  }
}
template <class T, class Factors>
FUSEDOPT_HOST_DEVICE void write_col_factor(Factors const& factors, factored_tensor<T> const& e, std::int64_t line)
{
  if constexpr (!std::is_same_v<Factors, no_line_factors>) {
    e.col_factor[line] = factors.col(to_opmath<opmath_t<T>>(e.col[line]));
  }
}
/// Row `line` of a vector (a tensor of row statistics only): its factor, and the column
/// factors of 1 at lines line, line + its rows, ... (all of them once its rows are taken).
template <class T, class Factors>
FUSEDOPT_HOST_DEVICE void write_vector_factor(Factors const& factors, factored_tensor<T> const& e, std::int64_t line)
{
  using O = opmath_t<T>;
  if constexpr (has_vector_factors<Factors, O>::value) {
    e.row_factor[line] = factors.vector(to_opmath<O>(e.row[line]));
    std::int64_t const row_lines = e.matrices * e.rows;
    for (std::int64_t c = line; c < e.matrices * e.cols; c += row_lines) { e.col_factor[c] = O(1); }
  }
}

}  // namespace detail
FUSEDOPT_NAMESPACE_END
