// What the backend-generic rule tests (tests/rules/<rule>.hpp) run their steps with. A test
// keeps its tensors in host memory, one std::vector per tensor, names them per slot with
// writes(slot, data) or reads(slot, data), and asks its executor for a plan:
// - host_executor binds the vectors themselves (fusedopt::host);
// - cuda_executor (cuda_executor.cuh) mirrors them in device memory, uploads every slot
//   before a step and downloads the written ones after it (fusedopt::cuda).
// Either way a test reads its results where it wrote its inputs, so one test body serves both
// backends. This header also brings the step-by-step harness of the torch references
// (reference/harness.hpp); reference/trajectory.hpp, the whole-trajectory one, includes it. CMake compiles each tests/rules/<rule>.hpp twice, from tests/rules/rule_test.in:
// host_<rule> with host_executor, cuda_<rule> with cuda_executor (Kokkos' IncrementalTest
// pattern); the test cases name the backend in their tags.
#pragma once

#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "reference/harness.hpp"

/// A rule test: a Catch2 test case over the four element types (TestType), tagged with the
/// backend it runs on (FUSEDOPT_TEST_BACKEND_TAG, from the generated translation unit). Where
/// the CUDA rule tests are compiled and never run (CI: FUSEDOPT_CUDA_COMPILE_ONLY defines
/// FUSEDOPT_TEST_FLOAT_ONLY for them), over float alone: nvcc's time goes to the instantiations,
/// the host tests compile and run all four types of the same cases, and the GPU machine's
/// build all four on the device (docs/decisions.md, "CI: the CUDA units in float32"). There
/// too, five rules' tests make one translation unit (tests/CMakeLists.txt): what a rule header
/// declares at namespace scope is named after its rule, or in a namespace of its own.
/// Under AddressSanitizer (the `asan` preset, with UBSan), which looks for memory errors and
/// undefined behaviour rather than wrong bits, over float and bfloat16: every rule's slots at
/// four bytes and at two (with the float statistics some rules keep for 16-bit parameters);
/// double and half change the rules' arithmetic (checked bit for bit by the Release run) and
/// the engine's loads, stores and conversions, which host_backend (every element type, edge
/// sizes), mixed_precision, stochastic_rounding and kahan run under the sanitizers
/// (docs/decisions.md, "CI: nvcc's fast compile, CUDA tests several to a translation unit,
/// OpenMP threads that sleep").
#if defined(FUSEDOPT_TEST_FLOAT_ONLY)
#  define FUSEDOPT_RULE_TEST(name, tags) TEMPLATE_TEST_CASE(name, tags FUSEDOPT_TEST_BACKEND_TAG, float)
#elif defined(__SANITIZE_ADDRESS__)
#  define FUSEDOPT_RULE_TEST(name, tags) \
    TEMPLATE_TEST_CASE(name, tags FUSEDOPT_TEST_BACKEND_TAG, float, fusedopt::bfloat16)
#else
#  define FUSEDOPT_RULE_TEST(name, tags) \
    TEMPLATE_TEST_CASE(name, tags FUSEDOPT_TEST_BACKEND_TAG, float, double, fusedopt::half, fusedopt::bfloat16)
#endif

namespace fusedopt_test {

namespace fo = fusedopt;

/// A slot bound to the tensors of `Data` (anything whose `tensors()` gives a
/// std::vector<std::vector<T>>&), read-only (bound as `T const`) when `ReadOnly`.
template <class Slot, class Data, bool ReadOnly>
struct data_binding {
  Data* data;
  using slot_type = Slot;
  using value_type = typename std::decay_t<decltype(std::declval<Data&>().tensors())>::value_type::value_type;
  using element_type = std::conditional_t<ReadOnly, value_type const, value_type>;
  static constexpr bool read_only = ReadOnly;

  [[nodiscard]] std::vector<std::vector<value_type>>& tensors() const { return data->tensors(); }
  /// The list over the host vectors.
  [[nodiscard]] fusedopt::tensor_list<element_type> host_list() const
  {
    fusedopt::tensor_list<element_type> list;
    for (auto& t : tensors()) { list.push_back(t.data(), static_cast<std::int64_t>(t.size())); }
    return list;
  }
};

/// A slot the rule updates: `writes(fusedopt::slot::param, param)`.
template <class Slot, class Data>
data_binding<Slot, Data, false> writes(Slot, Data& data)
{
  return {&data};
}
/// A slot the rule only reads, bound const: `reads(fusedopt::slot::grad, grad)`.
template <class Slot, class Data>
data_binding<Slot, Data, true> reads(Slot, Data& data)
{
  return {&data};
}

/// One value of type T that a rule keeps between steps and reads through a pointer
/// (Schedule-Free's sums, Prodigy's d): host memory for the host backend. The CUDA executor's
/// `memory` is device memory with the same interface; a test reads and writes it between steps.
template <class T>
class host_memory {
 public:
  explicit host_memory(T initial = T{}) : value_(std::make_unique<T>(initial)) {}
  /// What the rule points to.
  [[nodiscard]] T* data() const { return value_.get(); }
  [[nodiscard]] T get() const { return *value_; }
  void set(T value) { *value_ = value; }

 private:
  std::unique_ptr<T> value_;
};

/// Values of type T that a rule reads and writes through pointers (Adafactor's factored
/// statistics and their table): host memory for the host backend. The CUDA executor's `array`
/// is device memory with the same interface.
template <class T>
class host_array {
 public:
  explicit host_array(std::size_t n, T fill = T{}) : values_(std::max<std::size_t>(n, 1), fill), size_(n) {}
  [[nodiscard]] T* data() { return values_.data(); }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] std::vector<T> get() const { return std::vector<T>(values_.begin(), values_.begin() + static_cast<std::ptrdiff_t>(size_)); }
  void set(std::vector<T> const& values) { std::copy(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(std::min(values.size(), size_)), values_.begin()); }

 private:
  std::vector<T> values_;
  std::size_t size_;
};

/// The host backend over the vectors themselves.
struct host_executor {
  static constexpr char const* name = "host";
  template <class T>
  using memory = host_memory<T>;
  template <class T>
  using array = host_array<T>;

  /// A plan over the bindings; `chunk_elements` 0 takes the backend's default.
  template <class... Bindings>
  static auto make_plan(std::int64_t chunk_elements, Bindings... bindings)
  {
    fusedopt::host::options opts;
    if (chunk_elements > 0) { opts.chunk_elements = chunk_elements; }
    return fusedopt::host::make_plan(fusedopt::bind((typename Bindings::slot_type{} = bindings.host_list())...), opts);
  }
};

}  // namespace fusedopt_test
