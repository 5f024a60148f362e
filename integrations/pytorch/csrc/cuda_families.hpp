/// @file cuda_families.hpp
/// @brief One CUDA entry point per plan function of families.hpp (the 8-bit ones included), each
/// defined in its own .cu (cuda_<plans>.cu, one line: FUSEDOPT_TORCH_CUDA_PLANS(<plans>); Adam's
/// and AdamW's a dispatch to one .cu per dtype: cuda_backend.cuh) so that nvcc compiles them in
/// parallel. No CUDA or torch types.
#pragma once

#include "plans.hpp"

namespace fusedopt_torch {
namespace detail {

#define FUSEDOPT_TORCH_DECLARE(name, plans) \
  std::unique_ptr<plan> cuda_##plans(family, dtype, layout const&, lists const&, void*);
FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_DECLARE)
FUSEDOPT_TORCH_QUANTIZED_FAMILIES(FUSEDOPT_TORCH_DECLARE)
#undef FUSEDOPT_TORCH_DECLARE

}  // namespace detail
}  // namespace fusedopt_torch
