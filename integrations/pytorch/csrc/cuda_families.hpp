/// @file cuda_families.hpp
/// @brief One CUDA entry point per family, each defined in its own .cu (cuda_<family>.cu) so
/// that nvcc compiles them in parallel. No CUDA or torch types.
#pragma once

#include "plans.hpp"

namespace fusedopt_torch {
namespace detail {

using cuda_entry = std::unique_ptr<plan> (*)(family, dtype, layout const&, lists const&, void*);

std::unique_ptr<plan> cuda_sgd(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_adam(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_adagrad(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_rmsprop(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_lamb(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_lion(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_radam(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_adamax(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_adadelta(family, dtype, layout const&, lists const&, void*);
std::unique_ptr<plan> cuda_nadam(family, dtype, layout const&, lists const&, void*);

}  // namespace detail
}  // namespace fusedopt_torch
