/// @file cuda_plans.cu
/// @brief make_cuda_plan: dispatch to the family's translation unit (its 8-bit one for layout::quantized).
#include <fusedopt/error.hpp>

#include "cuda_families.hpp"

namespace fusedopt_torch {

std::unique_ptr<plan> make_cuda_plan(family f, dtype t, layout const& l, lists const& x, void* stream)
{
#define FUSEDOPT_TORCH_CASE(name, plans) \
  case family::name: return detail::cuda_##plans(f, t, l, x, stream);
  if (l.quantized) {
    switch (f) {
      FUSEDOPT_TORCH_QUANTIZED_FAMILIES(FUSEDOPT_TORCH_CASE)
      default: throw fusedopt::error("fusedopt_torch: this optimizer has no 8-bit states");
    }
  }
  switch (f) {
    FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_CASE)
  }
#undef FUSEDOPT_TORCH_CASE
  throw fusedopt::error("fusedopt_torch: unknown optimizer family");
}

}  // namespace fusedopt_torch
