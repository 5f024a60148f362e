// NAdam's options for the tests of rules::advance_mu_product (tests/host/nadam_product.cpp and
// tests/cuda/nadam_product.cu): a momentum_decay large enough that mu moves within a few steps.
#pragma once

#include <fusedopt/rules/nadam.hpp>

namespace fusedopt_test {

inline fusedopt::rules::nadam nadam_with_moving_mu()
{
  fusedopt::rules::nadam opt;
  opt.lr = 0.05;
  opt.beta1 = 0.85;
  opt.beta2 = 0.99;
  opt.eps = 1e-3;
  opt.weight_decay = 0.05;
  opt.momentum_decay = 0.05;
  opt.decoupled_weight_decay = true;
  return opt;
}

}  // namespace fusedopt_test
