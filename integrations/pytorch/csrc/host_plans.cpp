/// @file host_plans.cpp
/// @brief Plans of the host backend (CPU tensors): every family, every dtype; 8-bit states in
/// host_8bit_plans.cpp.
#include "host_backend.hpp"

namespace fusedopt_torch {

std::unique_ptr<plan> make_host_plan(family f, dtype t, layout const& l, lists const& x, int threads)
{
  if (l.quantized) { return detail::host_quantized_plan(f, t, l, x, threads); }
  using B = detail::host_backend;
  // The backends' `make` take a `void*` context: the stream on CUDA, the thread count here.
  void* const s = &threads;
  switch (f) {
#define FUSEDOPT_TORCH_CASE(name, plans) \
  case family::name: return detail::plans##_plan<B>(f, t, l, x, s);
    FUSEDOPT_TORCH_FAMILIES(FUSEDOPT_TORCH_CASE)
#undef FUSEDOPT_TORCH_CASE
  }
  throw fusedopt::error("fusedopt_torch: unknown optimizer family");
}

std::unique_ptr<norm_plan> make_host_norm_plan(dtype t, std::vector<void const*> const& grads,
                                               std::vector<std::int64_t> const& sizes, int threads)
{
  return detail::norm_plan_of<detail::host_backend>(t, grads, sizes, &threads);
}

double nadam_mu(double beta1, double momentum_decay, std::int64_t t)
{
  return fusedopt::rules::scale_by_nadam::mu(beta1, momentum_decay, t);
}

double nadam_advanced(double product, double mu, bool single)
{
  return fusedopt::rules::advance_mu_product::advanced(product, mu, single);
}

}  // namespace fusedopt_torch
