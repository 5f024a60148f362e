/// @file cuda_plans.cu
/// @brief make_cuda_plan: dispatch to the family's translation unit.
#include <fusedopt/error.hpp>

#include "cuda_families.hpp"

namespace fusedopt_torch {

std::unique_ptr<plan> make_cuda_plan(family f, dtype t, layout const& l, lists const& x, void* stream)
{
  switch (f) {
#define FUSEDOPT_TORCH_CASE(name, plans) \
  case family::name: return detail::cuda_##plans(f, t, l, x, stream);
    FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_CASE)
#undef FUSEDOPT_TORCH_CASE
  }
  throw fusedopt::error("fusedopt_torch: unknown optimizer family");
}

}  // namespace fusedopt_torch
