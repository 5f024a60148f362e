// The CUDA executor of the backend-generic rule tests (executor.hpp): the test's host vectors
// mirrored in device memory, one allocation per tensor, and a fusedopt::cuda plan over the
// mirrors. A step uploads every bound slot (the test may have changed any of them: new
// gradients, a state it set), runs the plan, waits, and downloads every slot the rule may
// write; the test then checks the host vectors as it does on the host backend.
#pragma once

#include <fusedopt/fusedopt.cuh>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "catch.hpp"
#include "rules/executor.hpp"

namespace fusedopt_test {

#define FUSEDOPT_TEST_CUDA_CHECK(call)                                                                   \
  do {                                                                                                   \
    cudaError_t const fusedopt_test_status_ = (call);                                                    \
    if (fusedopt_test_status_ != cudaSuccess) { FAIL(#call << ": " << cudaGetErrorString(fusedopt_test_status_)); } \
  } while (0)

/// Device copies of one binding's tensors.
template <class Binding>
class device_mirror {
 public:
  using value_type = typename Binding::value_type;

  explicit device_mirror(Binding b) : binding_(b)
  {
    for (auto const& t : binding_.tensors()) {
      value_type* p = nullptr;
      FUSEDOPT_TEST_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(t.size(), 1) * sizeof(value_type)));
      pointers_.push_back(p);
    }
  }
  device_mirror(device_mirror const&) = delete;
  device_mirror& operator=(device_mirror const&) = delete;
  ~device_mirror()
  {
    for (auto* p : pointers_) { (void)cudaFree(p); }
  }

  [[nodiscard]] fusedopt::tensor_list<typename Binding::element_type> list() const
  {
    fusedopt::tensor_list<typename Binding::element_type> l;
    auto const& tensors = binding_.tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) { l.push_back(pointers_[t], static_cast<std::int64_t>(tensors[t].size())); }
    return l;
  }
  void upload() const
  {
    auto const& tensors = binding_.tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      FUSEDOPT_TEST_CUDA_CHECK(
        cudaMemcpy(pointers_[t], tensors[t].data(), tensors[t].size() * sizeof(value_type), cudaMemcpyHostToDevice));
    }
  }
  void download() const
  {
    if constexpr (!Binding::read_only) {
      auto& tensors = binding_.tensors();
      for (std::size_t t = 0; t < tensors.size(); ++t) {
        FUSEDOPT_TEST_CUDA_CHECK(
          cudaMemcpy(tensors[t].data(), pointers_[t], tensors[t].size() * sizeof(value_type), cudaMemcpyDeviceToHost));
      }
    }
  }

 private:
  Binding binding_;
  std::vector<value_type*> pointers_;
};

/// A fusedopt::cuda plan over device mirrors of the bindings, run as the host plan is.
template <class... Bindings>
class cuda_plan {
 public:
  explicit cuda_plan(fusedopt::cuda::options const& opts, Bindings... bindings)
    : mirrors_(bindings...), plan_(make(opts, std::index_sequence_for<Bindings...>{}))
  {
  }
  explicit cuda_plan(std::int64_t chunk_elements, Bindings... bindings)
    : cuda_plan(chunk_options(chunk_elements), bindings...)
  {
  }

  template <class Rule>
  void run(Rule const& rule, fusedopt::step_info const& step = {}) const
  {
    std::apply([](auto const&... m) { (m.upload(), ...); }, mirrors_);
    FUSEDOPT_TEST_CUDA_CHECK(cudaDeviceSynchronize());  // pageable copies may return before they land
    auto const download = [this] {
      FUSEDOPT_TEST_CUDA_CHECK(cudaDeviceSynchronize());
      std::apply([](auto const&... m) { (m.download(), ...); }, mirrors_);
    };
    try {
      plan_.run(rule, step);
    } catch (...) {
      // What the device holds after a refused run, so that a test's "nothing was written"
      // looks at the GPU's memory rather than at the host copy the run never touched.
      download();
      throw;
    }
    download();
  }

 private:
  static fusedopt::cuda::options chunk_options(std::int64_t chunk_elements)
  {
    fusedopt::cuda::options opts;
    opts.chunk_elements = chunk_elements;
    return opts;
  }
  template <std::size_t... K>
  auto make(fusedopt::cuda::options const& opts, std::index_sequence<K...>)
  {
    return fusedopt::cuda::make_plan(fusedopt::bind((typename Bindings::slot_type{} = std::get<K>(mirrors_).list())...), opts);
  }

  std::tuple<device_mirror<Bindings>...> mirrors_;
  fusedopt::cuda::plan<fusedopt::binding<typename Bindings::slot_type, typename Bindings::element_type>...> plan_;
};

/// One value of type T in device memory that a rule keeps between steps (host_memory's
/// counterpart, executor.hpp): the test reads and writes it with get() and set().
template <class T>
class device_memory {
 public:
  explicit device_memory(T initial = T{})
  {
    FUSEDOPT_TEST_CUDA_CHECK(cudaMalloc(&value_, sizeof(T)));
    set(initial);
  }
  device_memory(device_memory const&) = delete;
  device_memory& operator=(device_memory const&) = delete;
  ~device_memory() { (void)cudaFree(value_); }

  [[nodiscard]] T* data() const { return value_; }
  [[nodiscard]] T get() const
  {
    T value{};
    FUSEDOPT_TEST_CUDA_CHECK(cudaMemcpy(&value, value_, sizeof(T), cudaMemcpyDeviceToHost));
    return value;
  }
  void set(T value) { FUSEDOPT_TEST_CUDA_CHECK(cudaMemcpy(value_, &value, sizeof(T), cudaMemcpyHostToDevice)); }

 private:
  T* value_ = nullptr;
};

/// Values of type T in device memory that a rule reads and writes through pointers
/// (host_array's counterpart, executor.hpp).
template <class T>
class device_array {
 public:
  explicit device_array(std::size_t n, T fill = T{}) : size_(n)
  {
    FUSEDOPT_TEST_CUDA_CHECK(cudaMalloc(&values_, std::max<std::size_t>(n, 1) * sizeof(T)));
    set(std::vector<T>(n, fill));
  }
  device_array(device_array const&) = delete;
  device_array& operator=(device_array const&) = delete;
  ~device_array() { (void)cudaFree(values_); }

  [[nodiscard]] T* data() { return values_; }
  [[nodiscard]] std::size_t size() const { return size_; }
  [[nodiscard]] std::vector<T> get() const
  {
    std::vector<T> values(size_);
    if (size_ > 0) {
      FUSEDOPT_TEST_CUDA_CHECK(cudaMemcpy(values.data(), values_, size_ * sizeof(T), cudaMemcpyDeviceToHost));
    }
    return values;
  }
  void set(std::vector<T> const& values)
  {
    std::size_t const n = std::min(values.size(), size_);
    if (n > 0) { FUSEDOPT_TEST_CUDA_CHECK(cudaMemcpy(values_, values.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  }

 private:
  T* values_ = nullptr;
  std::size_t size_;
};

/// The CUDA backend over device mirrors of the vectors.
struct cuda_executor {
  static constexpr char const* name = "cuda";
  template <class T>
  using memory = device_memory<T>;
  template <class T>
  using array = device_array<T>;

  /// A plan over the bindings; `chunk_elements` 0 takes the backend's default.
  template <class... Bindings>
  static cuda_plan<Bindings...> make_plan(std::int64_t chunk_elements, Bindings... bindings)
  {
    return cuda_plan<Bindings...>(chunk_elements, bindings...);
  }
  /// A plan over the bindings under `opts` (a test of one update shape: options::memory).
  template <class... Bindings>
  static cuda_plan<Bindings...> make_plan_with(fusedopt::cuda::options const& opts, Bindings... bindings)
  {
    return cuda_plan<Bindings...>(opts, bindings...);
  }
};

}  // namespace fusedopt_test
