/// @file detail/muon_lists.hpp
/// @brief The lists of a muon plan and of its two passes, for host::muon_plan and
/// cuda::muon_plan alike: which bound list is which slot, the element types, and what both
/// refuse at compile time.
#pragma once

#include <cstddef>
#include <type_traits>

#include "../bind.hpp"
#include "../config.hpp"
#include "../numeric/dtypes.hpp"
#include "../rules/muon.hpp"
#include "../tensor_list.hpp"
#include "rebind.hpp"

FUSEDOPT_NAMESPACE_BEGIN
namespace detail {

/// @brief A muon plan over bindings `B...` (slot::param, slot::grad and slot::momentum_buffer,
/// in any order) with its Newton-Schulz matrices in `NS`: pass 1 reads the gradients and
/// buffers and writes the matrices; pass 2 reads the matrices into the parameters. `Plan` is
/// the backend's engine plan template (host::plan, cuda::plan).
template <class NS, class... B>
struct muon_lists {
  using lists_type = bound_lists<B...>;

 private:
  using bound = typename lists_type::memory_slots;
  static_assert(sizeof...(B) == 3 && contains_v<bound, slot::param_t> && contains_v<bound, slot::grad_t> &&
                  contains_v<bound, slot::momentum_buffer_t>,
                "a muon plan binds exactly slot::param, slot::grad and slot::momentum_buffer");

 public:
  static constexpr std::size_t param_at = bound_position_v<lists_type, slot::param_t>;
  static constexpr std::size_t grad_at = bound_position_v<lists_type, slot::grad_t>;
  static constexpr std::size_t buffer_at = bound_position_v<lists_type, slot::momentum_buffer_t>;
  using param_type = typename lists_type::template element_t<param_at>;
  using grad_type = typename lists_type::template element_t<grad_at>;
  using buffer_type = typename lists_type::template element_t<buffer_at>;
  static_assert(!std::is_const_v<param_type> && !std::is_const_v<buffer_type>,
                "a muon plan writes slot::param and slot::momentum_buffer: bind them to lists that are not const");
  static_assert(!is_blockwise_v<param_type> && !is_blockwise_v<grad_type> && !is_blockwise_v<buffer_type>,
                "a muon plan does not take 8-bit quantized lists");

  /// Pass 1's lists: gradients and buffers in, Newton-Schulz inputs out.
  using input_lists_type = bound_lists<binding<slot::grad_t, grad_type>, binding<slot::momentum_buffer_t, buffer_type>,
                                       binding<slot::ns_matrix_t, NS>>;
  template <template <class...> class Plan>
  using input_plan = Plan<binding<slot::grad_t, grad_type>, binding<slot::momentum_buffer_t, buffer_type>,
                          binding<slot::ns_matrix_t, NS>>;
  /// Pass 2's lists: the orthogonalised matrices into the parameters.
  using output_lists_type = bound_lists<binding<slot::param_t, param_type>, binding<slot::ns_matrix_t, NS const>>;
  template <template <class...> class Plan>
  using output_plan = Plan<binding<slot::param_t, param_type>, binding<slot::ns_matrix_t, NS const>>;

  /// Pass 1's lists: `lists`' gradients and buffers, and the plan's Newton-Schulz matrices.
  static input_lists_type input_lists(lists_type const& lists, tensor_list<NS> const& matrices)
  {
    return bind(slot::grad = lists.template list<grad_at>(), slot::momentum_buffer = lists.template list<buffer_at>(),
                slot::ns_matrix = matrices);
  }
  /// Pass 2's lists: `lists`' parameters and the orthogonalised matrices.
  static output_lists_type output_lists(lists_type const& lists, tensor_list<NS const> const& matrices)
  {
    return bind(slot::param = lists.template list<param_at>(), slot::ns_matrix = matrices);
  }
};

}  // namespace detail
FUSEDOPT_NAMESPACE_END
