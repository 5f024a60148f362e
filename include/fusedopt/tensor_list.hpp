/// @file tensor_list.hpp
/// @brief Non-owning lists of tensors: one list per slot, one entry per tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "numeric/dtypes.hpp"

FUSEDOPT_NAMESPACE_BEGIN

/// @brief One tensor seen as a flat array: where it starts and how many elements it holds.
/// fusedopt never owns or frees the memory.
template <class T>
struct tensor_ref {
  T* data = nullptr;
  std::int64_t size = 0;
};

/// @brief A non-owning list of tensors of one element type (float, double, half, bfloat16,
/// std::int16_t, any of them const-qualified for slots a rule only reads), or of 8-bit
/// quantized states (`blockwise8`: `data` points to the tensor's first block, `size` counts
/// its elements, numeric/quantization.hpp).
///
/// Building a list allocates (host memory for the pointers and sizes); the lists are meant to
/// be built once and reused by plans, not rebuilt every step.
template <class T>
class tensor_list {
  static_assert(is_supported_element_v<std::remove_const_t<T>>,
                "tensor_list<T>: T must be float, double, fusedopt::half, fusedopt::bfloat16, "
                "std::int16_t or fusedopt::blockwise8 (optionally const)");

 public:
  using element_type = T;

  tensor_list() = default;
  /// @brief A list of the given tensors, in order.
  tensor_list(std::initializer_list<tensor_ref<T>> tensors) : tensors_(tensors) {}

  /// @brief Appends a tensor of `size` elements starting at `data`.
  /// @throws fusedopt::error if `size` is negative.
  void push_back(T* data, std::int64_t size)
  {
    FUSEDOPT_EXPECTS(size >= 0, "tensor_list::push_back: tensor " + std::to_string(tensors_.size()) +
                                  " has a negative size " + std::to_string(size));
    tensors_.push_back(tensor_ref<T>{data, size});
  }

  void reserve(std::size_t n) { tensors_.reserve(n); }
  /// @brief Points tensor `i` at `data`; its size stays.
  void set_data(std::size_t i, T* data) noexcept { tensors_[i].data = data; }
  [[nodiscard]] std::size_t size() const noexcept { return tensors_.size(); }
  [[nodiscard]] bool empty() const noexcept { return tensors_.empty(); }
  tensor_ref<T> const& operator[](std::size_t i) const noexcept { return tensors_[i]; }
  auto begin() const noexcept { return tensors_.begin(); }
  auto end() const noexcept { return tensors_.end(); }

 private:
  std::vector<tensor_ref<T>> tensors_;
};

/// @brief A slot bound to a tensor list: made by `slot::param = list`.
template <class Slot, class T>
struct binding {
  using slot_type = Slot;
  using element_type = T;
  tensor_list<T> list;
};

FUSEDOPT_NAMESPACE_END
