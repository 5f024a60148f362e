/// @file libtorch/cuda_steps.cuh
/// @brief The CUDA plans of fusedopt::libtorch's optimizers: defines `make_cuda_steps()`
/// (declared in plans.hpp). Include it in exactly one `.cu` file of the program, compiled by
/// nvcc without torch's headers (torch/torch.h does not compile under nvcc), and hand the
/// result to the optimizers:
///
/// @code
/// // cuda_steps.cu (nvcc)
/// #include <fusedopt/libtorch/cuda_steps.cuh>
///
/// // train.cpp (the C++ compiler, with torch)
/// fusedopt::libtorch::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3),
///                               {fusedopt::libtorch::make_cuda_steps()});
/// @endcode
///
/// That file compiles every dtype and layout of every family (minutes of nvcc). To spread them
/// over several `.cu` files compiled in parallel, define FUSEDOPT_LIBTORCH_CUDA_PLANS_EXTERN
/// before including this header, and instantiate each rule in a file of its own:
/// `#include <fusedopt/libtorch/cuda_plans.cuh>` then
/// `FUSEDOPT_LIBTORCH_CUDA_PLANS(fusedopt::rules::adamw);` (likewise adam, sgd, adagrad, rmsprop,
/// lion and lamb: every rule of cuda_steps' interface, each in exactly one file).
#pragma once

#include "cuda_plans.cuh"

namespace fusedopt {
namespace libtorch {
namespace detail {

#if defined(FUSEDOPT_LIBTORCH_CUDA_PLANS_EXTERN)
// Instantiated in other .cu files of the program (FUSEDOPT_LIBTORCH_CUDA_PLANS).
extern template std::unique_ptr<plan<rules::adamw>> make_cuda_plan<rules::adamw>(plan_request const&);
extern template std::unique_ptr<plan<rules::adam>> make_cuda_plan<rules::adam>(plan_request const&);
extern template std::unique_ptr<plan<rules::sgd>> make_cuda_plan<rules::sgd>(plan_request const&);
extern template std::unique_ptr<plan<rules::adagrad>> make_cuda_plan<rules::adagrad>(plan_request const&);
extern template std::unique_ptr<plan<rules::rmsprop>> make_cuda_plan<rules::rmsprop>(plan_request const&);
extern template std::unique_ptr<plan<rules::lion>> make_cuda_plan<rules::lion>(plan_request const&);
extern template std::unique_ptr<plan<rules::lamb>> make_cuda_plan<rules::lamb>(plan_request const&);
#endif

class cuda_steps_impl final : public cuda_steps {
 public:
  std::unique_ptr<plan<rules::adamw>> make_plan(rules::adamw const&, plan_request const& r) const override
  {
    return make_cuda_plan<rules::adamw>(r);
  }
  std::unique_ptr<plan<rules::adam>> make_plan(rules::adam const&, plan_request const& r) const override
  {
    return make_cuda_plan<rules::adam>(r);
  }
  std::unique_ptr<plan<rules::sgd>> make_plan(rules::sgd const&, plan_request const& r) const override
  {
    return make_cuda_plan<rules::sgd>(r);
  }
  std::unique_ptr<plan<rules::adagrad>> make_plan(rules::adagrad const&, plan_request const& r) const override
  {
    return make_cuda_plan<rules::adagrad>(r);
  }
  std::unique_ptr<plan<rules::rmsprop>> make_plan(rules::rmsprop const&, plan_request const& r) const override
  {
    return make_cuda_plan<rules::rmsprop>(r);
  }
  std::unique_ptr<plan<rules::lion>> make_plan(rules::lion const&, plan_request const& r) const override
  {
    return make_cuda_plan<rules::lion>(r);
  }
  std::unique_ptr<plan<rules::lamb>> make_plan(rules::lamb const&, plan_request const& r) const override
  {
    return make_cuda_plan<rules::lamb>(r);
  }
  [[nodiscard]] bool capturing(int device, void* stream) const override
  {
    device_scope const scope(device);
    return stream_capturing(stream);
  }
};

}  // namespace detail

// Not inline: defined once, by the one .cu file that includes this header (plans.hpp says so).
std::shared_ptr<cuda_steps const> make_cuda_steps() { return std::make_shared<detail::cuda_steps_impl const>(); }

}  // namespace libtorch
}  // namespace fusedopt
