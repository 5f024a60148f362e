/// @file host/newton_schulz.hpp
/// @brief Muon's Newton-Schulz iteration on the CPU, for matrices stored in a bfloat16 or float
/// workspace: the host plan's matrix stage (host/muon.hpp), and the reference the CUDA plan's
/// cuBLAS stage is compared with.
///
/// Each product is formed as a GEMM with bfloat16 (or float) inputs, float accumulation and a
/// float epilogue `alpha * sum + beta * C` rounded once to the workspace type, as cuBLAS's
/// GemmEx computes it (and torch's `addmm` path): A = X X^T; B = c A A + b A; X = B X + a X.
/// Sums run in eight lanes combined in order, so the bits do not depend on the thread count.
/// Plain loops, correct first: a 768 x 768 matrix's five iterations are 13.6 GFLOP.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../config.hpp"
#include "../numeric/dtypes.hpp"
#include "../rules/muon.hpp"

#if defined(_OPENMP)
#  include <omp.h>
#endif

FUSEDOPT_NAMESPACE_BEGIN
namespace host {

/// @brief True when one matrix with sides `small` <= `large` is worth parallel products (~4M
/// multiply-adds a product or more); the smaller matrices of a group are spread over the
/// threads instead, one matrix to a thread at a time.
inline bool newton_schulz_splits_matrix(std::int64_t small, std::int64_t large)
{
  return small * small * large >= (std::int64_t{1} << 22);
}

/// @brief Floats of scratch newton_schulz needs for `count` matrices whose sides are `small` <=
/// `large`, on `threads` threads: one matrix's (2 small large + 2 small^2) for each thread that
/// takes matrices of its own.
inline std::int64_t newton_schulz_scratch(std::int64_t small, std::int64_t large, std::int64_t count = 1,
                                          int threads = 1)
{
  std::int64_t const one = 2 * small * large + 2 * small * small;
  if (threads <= 1 || count <= 1 || newton_schulz_splits_matrix(small, large)) { return one; }
  return one * std::min<std::int64_t>(count, threads);
}

}  // namespace host

// In fusedopt::detail, not host::detail: the host backend names fusedopt::detail as `detail`.
namespace detail {

template <class NS>
inline float ns_round(float x)
{
  return to_opmath<float>(from_opmath<NS>(x));
}

// x . y in eight lanes combined in order: a fixed summation order that GCC vectorises.
inline float ns_dot_lanes(float const* x, float const* y, std::int64_t n)
{
  float lanes[8] = {};
  std::int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int q = 0; q < 8; ++q) { lanes[q] += x[k + q] * y[k + q]; }
  }
  for (int q = 0; k < n; ++k, ++q) { lanes[q] += x[k] * y[k]; }
  float sum = lanes[0];
  for (int q = 1; q < 8; ++q) { sum += lanes[q]; }
  return sum;
}

// out = round(alpha * (rows of x) (rows of x)^T + beta * c), symmetric: for i <= j the dot of
// rows i and j (n long), mirrored. `c` may be null (beta unused).
template <class NS>
void ns_symmetric_product(float const* x, std::int64_t s, std::int64_t n, float alpha, float beta, float const* c,
                       float* out, int threads)
{
  bool const parallel = threads > 1 && s * s * n >= (std::int64_t{1} << 22);  // host::newton_schulz_splits_matrix
  (void)threads;
  (void)parallel;
#if defined(_OPENMP)
#  pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (parallel)
#endif
  for (std::int64_t i = 0; i < s; ++i) {
    for (std::int64_t j = i; j < s; ++j) {
      float const sum = ns_dot_lanes(x + i * n, x + j * n, n);
      float const v = ns_round<NS>(c != nullptr ? alpha * sum + beta * c[i * s + j] : alpha * sum);
      out[i * s + j] = v;
      out[j * s + i] = v;
    }
  }
}

// next = round(p m + a m): p is s x s, m and next s x l, row-major.
template <class NS>
void ns_polynomial_step(float const* p, float const* m, std::int64_t s, std::int64_t l, float a, float* next,
                        int threads)
{
  bool const parallel = threads > 1 && s * s * l >= (std::int64_t{1} << 22);  // as above
  (void)threads;
  (void)parallel;
#if defined(_OPENMP)
#  pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
#endif
  for (std::int64_t i = 0; i < s; ++i) {
    float* row = next + i * l;
    for (std::int64_t k = 0; k < l; ++k) { row[k] = 0.0f; }
    for (std::int64_t j = 0; j < s; ++j) {
      float const pij = p[i * s + j];
      float const* mj = m + j * l;
      for (std::int64_t k = 0; k < l; ++k) { row[k] += pij * mj[k]; }
    }
    float const* mi = m + i * l;
    for (std::int64_t k = 0; k < l; ++k) { row[k] = ns_round<NS>(row[k] + a * mi[k]); }
  }
}

}  // namespace detail

namespace host {

/// @brief Newton-Schulz in place on `count` matrices of `shape` (row-major), `stride` elements
/// apart from `matrices`, with `opt`'s iterations and coefficients. A matrix with more rows
/// than columns is orthogonalised as its transpose (torch's `X.T`), and stored back in its
/// own layout. `threads` (at least 1): OpenMP threads, over the rows of each product for large
/// matrices, over the matrices for small ones (newton_schulz_splits_matrix); `scratch` holds
/// newton_schulz_scratch(min, max, count, threads) floats. The bits do not depend on `threads`.
template <class NS>
void newton_schulz(NS* matrices, std::int64_t count, std::int64_t stride, matrix_shape shape, rules::muon const& opt,
                   float* scratch, int threads = 1)
{
  static_assert(std::is_same_v<NS, bfloat16> || std::is_same_v<NS, float>,
                "newton_schulz<NS>: the workspace holds fusedopt::bfloat16 or float");
  bool const transposed = shape.rows > shape.cols;
  std::int64_t const s = transposed ? shape.cols : shape.rows;
  std::int64_t const l = transposed ? shape.rows : shape.cols;
  if (s == 0 || l == 0 || count == 0) { return; }
  threads = threads < 1 ? 1 : threads;
  auto const one = [&](std::int64_t matrix, float* slot, int product_threads) {
    NS* x = matrices + matrix * stride;
    float* m = slot;
    float* next = m + s * l;
    float* gram = next + s * l;
    float* poly = gram + s * s;
    for (std::int64_t i = 0; i < s; ++i) {
      for (std::int64_t k = 0; k < l; ++k) {
        m[i * l + k] = to_opmath<float>(transposed ? x[k * s + i] : x[i * l + k]);
      }
    }
    for (int it = 0; it < opt.ns_steps; ++it) {
      rules::ns_coefficients const k = opt.iteration(it);
      detail::ns_symmetric_product<NS>(m, s, l, 1.0f, 0.0f, nullptr, gram, product_threads);
      detail::ns_symmetric_product<NS>(gram, s, s, static_cast<float>(k.c), static_cast<float>(k.b), gram, poly,
                                       product_threads);
      detail::ns_polynomial_step<NS>(poly, m, s, l, static_cast<float>(k.a), next, product_threads);
      std::swap(m, next);
    }
    for (std::int64_t i = 0; i < s; ++i) {
      for (std::int64_t k = 0; k < l; ++k) {
        (transposed ? x[k * s + i] : x[i * l + k]) = from_opmath<NS>(m[i * l + k]);
      }
    }
  };
  if (threads == 1 || count == 1 || newton_schulz_splits_matrix(s, l)) {
    for (std::int64_t matrix = 0; matrix < count; ++matrix) { one(matrix, scratch, threads); }
    return;
  }
  std::int64_t const per_thread = newton_schulz_scratch(s, l);
  int const workers = static_cast<int>(std::min<std::int64_t>(count, threads));
  (void)workers;
  (void)per_thread;
#if defined(_OPENMP)
#  pragma omp parallel for schedule(dynamic, 1) num_threads(workers)
#endif
  for (std::int64_t matrix = 0; matrix < count; ++matrix) {
#if defined(_OPENMP)
    float* const slot = scratch + per_thread * omp_get_thread_num();
#else
    float* const slot = scratch;
#endif
    one(matrix, slot, 1);
  }
}

}  // namespace host
FUSEDOPT_NAMESPACE_END
