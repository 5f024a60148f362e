/// @file cuda_plans.cu
/// @brief make_cuda_plan: dispatch to the family's translation unit.
#include <fusedopt/error.hpp>

#include "cuda_families.hpp"

namespace fusedopt_torch {

std::unique_ptr<plan> make_cuda_plan(family f, dtype t, layout const& l, lists const& x, void* stream)
{
  using namespace detail;
  switch (f) {
    case family::sgd: return cuda_sgd(f, t, l, x, stream);
    case family::adam:
    case family::adamw: return cuda_adam(f, t, l, x, stream);
    case family::adagrad: return cuda_adagrad(f, t, l, x, stream);
    case family::rmsprop: return cuda_rmsprop(f, t, l, x, stream);
    case family::lamb: return cuda_lamb(f, t, l, x, stream);
    case family::lion: return cuda_lion(f, t, l, x, stream);
    case family::radam: return cuda_radam(f, t, l, x, stream);
    case family::adamax: return cuda_adamax(f, t, l, x, stream);
    case family::adadelta: return cuda_adadelta(f, t, l, x, stream);
    case family::nadam: return cuda_nadam(f, t, l, x, stream);
  }
  throw fusedopt::error("fusedopt_torch: unknown optimizer family");
}

}  // namespace fusedopt_torch
