/// @file rules/muon.hpp
/// @brief Muon (torch.optim.Muon, torch 2.9-2.11): momentum, Newton-Schulz orthogonalisation of
/// each 2-D matrix, a learning rate scaled by the matrix's shape. The first optimizer of the
/// library with a matrix stage between its elementwise passes.
///
/// A step is three stages, run by a muon plan (host/muon.hpp, cuda/muon.cuh):
/// 1. **pass 1**, one fused pass over every matrix (muon_momentum, a reducing rule):
///    buf = lerp(buf, grad, 1 - momentum); U = nesterov ? lerp(grad, buf, momentum) : buf;
///    X = NS(U) / max(NS(||NS(U)||_F), NS(eps)), stored in the plan's workspace in the
///    Newton-Schulz type NS (bfloat16 as torch, or float), the norm from a per-tensor
///    reduction pass over the same U;
/// 2. **Newton-Schulz**, batched over the matrices of one shape (transposed, as torch does, so
///    that rows <= cols): `ns_steps` times A = X X^T; B = b A + c A A; X = a X + B X;
/// 3. **pass 2**, one fused pass: param *= 1 - lr * weight_decay; param -= lr * ratio * O,
///    ratio = sqrt(max(1, rows / cols)) ("original") or 0.2 sqrt(max(rows, cols))
///    ("match_rms_adamw"), one per matrix (scale_by_matrix_lr's per-tensor body).
/// docs/muon.md has the design and what is compared with what.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../numeric/dtypes.hpp"
#include "../numeric/torch_ops.hpp"
#include "../reduce.hpp"
#include "blocks.hpp"
#include "chained.hpp"

FUSEDOPT_NAMESPACE_BEGIN

namespace slot {
/// The matrix Newton-Schulz works on, in a muon plan's workspace: its input after pass 1, its
/// output (torch's orthogonalised update O) before pass 2.
FUSEDOPT_MEMORY_SLOT(ns_matrix);
}  // namespace slot

namespace detail {
/// A value of the arithmetic type rounded to the Newton-Schulz type NS and back.
template <class NS, class T>
FUSEDOPT_HOST_DEVICE T round_to(T x)
{
  return to_opmath<T>(from_opmath<NS>(x));
}
}  // namespace detail

/// @brief The shape of a 2-D parameter, row-major as torch stores it (`rows` = `shape[0]`).
struct matrix_shape {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

namespace rules {

/// @brief One Newton-Schulz iteration's coefficients: X = a X + (b A + c A A) X, A = X X^T.
struct ns_coefficients {
  double a = 3.4445;
  double b = -4.7750;
  double c = 2.0315;
};

/// @brief torch's `adjust_lr_fn`: how the learning rate scales with a matrix's shape.
enum class muon_lr_adjustment {
  original,         ///< lr * sqrt(max(1, rows / cols)) (Keller Jordan's; torch's None and "original")
  match_rms_adamw,  ///< lr * 0.2 * sqrt(max(rows, cols)) (Moonshot's: the update's RMS near AdamW's)
};

/// @brief The ratio the learning rate is multiplied by for a matrix of `shape`, as torch's
/// `_adjust_lr` computes it (in double).
inline double muon_lr_ratio(matrix_shape shape, muon_lr_adjustment adjustment)
{
  auto const rows = static_cast<double>(shape.rows);
  auto const cols = static_cast<double>(shape.cols);
  if (adjustment == muon_lr_adjustment::match_rms_adamw) { return 0.2 * std::sqrt(rows > cols ? rows : cols); }
  double const ratio = rows / cols;
  return std::sqrt(ratio > 1.0 ? ratio : 1.0);
}

/// @brief Muon's options, torch.optim.Muon's names and defaults. Not a per-element rule: a
/// muon plan (host/muon.hpp, cuda/muon.cuh) runs it, as pass 1, Newton-Schulz and pass 2.
///
/// `lr`, `weight_decay` and `momentum` may be read through pointers (device memory for the
/// CUDA plan), so a captured step reads new values at every replay; the Newton-Schulz
/// coefficients are host values (they are the GEMMs' alpha and beta).
struct muon {
  /// Most Newton-Schulz iterations (torch: "must be less than 100").
  static constexpr int max_ns_steps = 99;

  scalar<double> lr{1e-3};
  scalar<double> weight_decay{0.1};
  scalar<double> momentum{0.95};
  bool nesterov = true;
  /// The coefficients of every iteration (torch's `ns_coefficients`), unless `ns_schedule`.
  ns_coefficients coefficients{};
  /// Newton-Schulz iterations (torch's `ns_steps`), 0 to `max_ns_steps`.
  int ns_steps = 5;
  /// Per-iteration coefficients (Polar Express, Dion): when not null, iteration i uses
  /// `ns_schedule[i]`, i < ns_steps (host memory the caller keeps alive while it runs steps).
  ns_coefficients const* ns_schedule = nullptr;
  /// The Frobenius norm's lower clamp before the division (torch's `eps`).
  double eps = 1e-7;
  muon_lr_adjustment adjust_lr = muon_lr_adjustment::original;

  /// @brief The coefficients of iteration `i`.
  [[nodiscard]] ns_coefficients iteration(int i) const
  {
    return ns_schedule != nullptr ? ns_schedule[i] : coefficients;
  }

  /// @brief Checks the options as torch's constructor does (lr, weight_decay, momentum not
  /// negative; ns_steps below 100), and eps not negative.
  /// @throws fusedopt::error naming the option.
  void validate() const
  {
    detail::expect_range("muon: lr", lr, detail::non_negative);
    detail::expect_range("muon: weight_decay", weight_decay, detail::non_negative);
    detail::expect_range("muon: momentum", momentum, detail::non_negative);
    FUSEDOPT_EXPECTS(ns_steps >= 0 && ns_steps <= max_ns_steps,
                     "muon: ns_steps must be between 0 and " + std::to_string(max_ns_steps) + ", not " +
                       std::to_string(ns_steps));
    FUSEDOPT_EXPECTS(eps >= 0, "muon: eps must not be negative");
    FUSEDOPT_EXPECTS(adjust_lr == muon_lr_adjustment::original || adjust_lr == muon_lr_adjustment::match_rms_adamw,
                     "muon: adjust_lr must be muon_lr_adjustment::original or match_rms_adamw");
    for (int i = 0; i < ns_steps; ++i) {
      ns_coefficients const k = iteration(i);
      FUSEDOPT_EXPECTS(std::isfinite(k.a) && std::isfinite(k.b) && std::isfinite(k.c),
                       "muon: the coefficients of Newton-Schulz iteration " + std::to_string(i) + " must be finite");
    }
  }
};

/// @brief Muon's pass 1 (a reducing rule, one accumulator per tensor): the momentum, the
/// Nesterov mix and the normalised Newton-Schulz input, torch's steps and roundings:
/// buf = lerp(buf, grad, 1 - momentum); U = nesterov ? lerp(grad, buf, momentum) : buf;
/// ns_matrix = NS(U) / max(NS(||NS(U)||), NS(eps)), the division in the arithmetic type and
/// rounded to NS when stored (torch divides the bfloat16 tensor by its bfloat16 norm).
/// The reduction pass sums NS(U)^2 per tensor (nothing is stored); the update pass recomputes
/// U and stores the buffer and the scaled matrix. Slots: grad, momentum_buffer, ns_matrix
/// (bound to NS).
template <class NS>
struct muon_momentum {
  static_assert(std::is_same_v<NS, bfloat16> || std::is_same_v<NS, float>,
                "muon_momentum<NS>: Newton-Schulz runs in fusedopt::bfloat16 or float");
  scalar<double> momentum{0.95};
  bool nesterov = true;
  double eps = 1e-7;

  using reduction = fusedopt::reduction<reduce_op::sum>;
  using reads = slots<slot::grad_t, slot::momentum_buffer_t>;
  using writes = slots<slot::momentum_buffer_t, slot::ns_matrix_t>;

  /// The new buffer (stored) and U rounded to NS (returned).
  struct direction {
    double momentum;
    bool nesterov;
    template <class E>
    FUSEDOPT_HOST_DEVICE detail::value_t<E> operator()(E& e) const
    {
      using T = detail::value_t<E>;
      T const g = e[slot::grad];
      T& buf = e[slot::momentum_buffer];
      buf = math::lerp(buf, g, static_cast<T>(1.0 - momentum));
      T const u = math::select(nesterov, math::lerp(g, buf, static_cast<T>(momentum)), buf);
      return detail::round_to<NS>(u);
    }
  };

  struct accumulate {
    direction d;
    template <class E, class Acc>
    FUSEDOPT_HOST_DEVICE void operator()(E& e, Acc& acc) const
    {
      using A = typename Acc::value_type;
      A const x = static_cast<A>(d(e));
      acc[0] += x * x;
    }
  };

  /// One tensor's body: its divisor formed once.
  struct scaled {
    direction d;
    double divisor;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      using T = detail::value_t<E>;
      e[slot::ns_matrix] = d(e) / static_cast<T>(divisor);
    }
  };

  struct prepared {
    direction d;
    reduced norms;
    double eps;  ///< NS(eps)

    FUSEDOPT_HOST_DEVICE scaled for_tensor(std::int64_t tensor) const
    {
      // torch: the norm of the NS tensor is an NS value, clamped below by eps.
      double const norm = to_opmath<double>(from_opmath<NS>(static_cast<float>(math::sqrt(norms.tensor(tensor, 0)))));
      return scaled{d, norm > eps ? norm : eps};
    }
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
  };

  FUSEDOPT_HOST_DEVICE accumulate prepare_reduce(step_info const&) const
  {
    return {direction{momentum.get(), nesterov}};
  }
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&, reduced const& r) const
  {
    return prepared{direction{momentum.get(), nesterov}, r,
                    to_opmath<double>(from_opmath<NS>(static_cast<float>(eps)))};
  }

  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("muon: momentum", momentum, detail::non_negative);
    FUSEDOPT_EXPECTS(has_slot(bound, slot::momentum_buffer), "muon needs slot 'momentum_buffer' bound");
    FUSEDOPT_EXPECTS(has_slot(bound, slot::ns_matrix), "muon_momentum needs slot 'ns_matrix' bound");
  }
};

/// @brief update = -lr * ratio[tensor] * ns_matrix: Muon's step along the orthogonalised
/// matrix, its learning rate scaled per matrix (muon_lr_ratio, tabled by the plan in the
/// backend's memory: device memory for the CUDA plan). The product is formed once per tensor.
struct scale_by_matrix_lr {
  scalar<double> lr{1e-3};
  double const* ratios = nullptr;  ///< one per tensor

  using reads = slots<slot::ns_matrix_t>;
  using writes = slots<>;

  struct scaled {
    double factor;
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      e[slot::update] = static_cast<detail::value_t<E>>(factor) * e[slot::ns_matrix];
    }
  };
  struct prepared {
    double lr;
    double const* ratios;
    // torch: param.add_(O, alpha=-adjusted_lr), adjusted_lr = lr * ratio in double.
    FUSEDOPT_HOST_DEVICE scaled for_tensor(std::int64_t tensor) const { return scaled{-(lr * ratios[tensor])}; }
    template <class E>
    FUSEDOPT_HOST_DEVICE void operator()(E& e) const
    {
      for_tensor(e.tensor())(e);
    }
  };
  FUSEDOPT_HOST_DEVICE prepared prepare(step_info const&) const { return prepared{lr.get(), ratios}; }

  template <class Bound>
  void validate(Bound bound) const
  {
    detail::expect_range("muon: lr", lr, detail::non_negative);
    FUSEDOPT_EXPECTS(ratios != nullptr, "scale_by_matrix_lr needs its table of ratios");
    FUSEDOPT_EXPECTS(has_slot(bound, slot::ns_matrix), "scale_by_matrix_lr needs slot 'ns_matrix' bound");
  }
};

/// @brief Muon's pass 2: param *= 1 - lr * weight_decay (torch decays with the unscaled lr);
/// param += -lr * ratio * O.
using muon_apply = chain_rule<decoupled_weight_decay, scale_by_matrix_lr, apply_update>;

/// @brief Muon's pass 2 for options `opt`, with the plan's table of ratios.
inline muon_apply make_muon_apply(muon const& opt, double const* ratios)
{
  return chain(decoupled_weight_decay{opt.lr, opt.weight_decay}, scale_by_matrix_lr{opt.lr, ratios}, apply_update{});
}

/// @brief Muon's pass 1 for options `opt`.
template <class NS>
muon_momentum<NS> make_muon_momentum(muon const& opt)
{
  return muon_momentum<NS>{opt.momentum, opt.nesterov, opt.eps};
}

}  // namespace rules

namespace detail {

/// Where a muon plan keeps each matrix: the 2-D tensors grouped by shape (in order of first
/// appearance), each group's matrices one after the other in the workspace, `stride` elements
/// apart (rounded up to 8 elements: 16-byte steps for bfloat16, as GEMMs and vector loads like),
/// and the scratch the batched Newton-Schulz of the largest group needs. Host logic shared by
/// the host and CUDA plans.
struct muon_layout {
  struct group {
    matrix_shape shape;
    std::int64_t count = 0;     ///< matrices
    std::int64_t offset = 0;    ///< of the first, in elements from the start of the matrices
    std::int64_t stride = 0;    ///< elements from one matrix to the next
    std::int64_t small = 0;     ///< min(rows, cols): Newton-Schulz's X is small x large
    std::int64_t large = 0;     ///< max(rows, cols)
    std::int64_t square_stride = 0;  ///< elements from one small x small Gram matrix to the next
    std::vector<std::size_t> tensors;  ///< the tensors of the group, in order
  };

  std::vector<group> groups;
  std::vector<std::int64_t> offsets;  ///< per tensor: its matrix, in elements from the start
  std::vector<matrix_shape> shapes;   ///< per tensor
  std::int64_t matrix_elements = 0;   ///< every group's matrices
  std::int64_t largest_group_elements = 0;  ///< count * stride of the largest group
  std::int64_t largest_group_squares = 0;   ///< count * square_stride of the largest group
  std::int64_t largest_matrix_small = 0;    ///< over all matrices: scratch of the host's NS
  std::int64_t largest_matrix_large = 0;
  std::int64_t largest_matrix_elements = 0;

  static constexpr std::int64_t align_elements = 8;
  static std::int64_t round_up(std::int64_t n) { return (n + align_elements - 1) / align_elements * align_elements; }

  /// @throws fusedopt::error when `shapes` is not one shape per tensor, a shape is negative,
  /// or rows x cols is not the tensor's size.
  template <class SizeOf>
  muon_layout(std::vector<matrix_shape> const& tensor_shapes, std::size_t tensors, SizeOf size_of)
      : shapes(tensor_shapes)
  {
    FUSEDOPT_EXPECTS(shapes.size() == tensors, "muon plan: " + std::to_string(shapes.size()) + " shapes for " +
                                                 std::to_string(tensors) + " tensors (one shape per tensor)");
    offsets.resize(tensors);
    std::vector<std::size_t> group_of(tensors);
    for (std::size_t t = 0; t < tensors; ++t) {
      matrix_shape const s = shapes[t];
      FUSEDOPT_EXPECTS(s.rows >= 0 && s.cols >= 0, "muon plan: tensor " + std::to_string(t) + " has a negative shape");
      FUSEDOPT_EXPECTS((s.rows == 0 || s.cols <= INT64_MAX / s.rows) && s.rows * s.cols == size_of(t),
                       "muon plan: tensor " + std::to_string(t) + " has " + std::to_string(size_of(t)) +
                         " elements, not " + std::to_string(s.rows) + " x " + std::to_string(s.cols));
      std::size_t g = 0;
      while (g < groups.size() && (groups[g].shape.rows != s.rows || groups[g].shape.cols != s.cols)) { ++g; }
      if (g == groups.size()) {
        group fresh;
        fresh.shape = s;
        fresh.stride = round_up(s.rows * s.cols);
        fresh.small = s.rows < s.cols ? s.rows : s.cols;
        fresh.large = s.rows < s.cols ? s.cols : s.rows;
        fresh.square_stride = round_up(fresh.small * fresh.small);
        groups.push_back(fresh);
      }
      groups[g].tensors.push_back(t);
      ++groups[g].count;
      group_of[t] = g;
    }
    for (auto& g : groups) {
      g.offset = matrix_elements;
      for (std::size_t j = 0; j < g.tensors.size(); ++j) {
        offsets[g.tensors[j]] = g.offset + static_cast<std::int64_t>(j) * g.stride;
      }
      matrix_elements += g.count * g.stride;
      largest_group_elements = std::max(largest_group_elements, g.count * g.stride);
      largest_group_squares = std::max(largest_group_squares, g.count * g.square_stride);
      largest_matrix_small = std::max(largest_matrix_small, g.small);
      largest_matrix_large = std::max(largest_matrix_large, g.large);
      largest_matrix_elements = std::max(largest_matrix_elements, g.small * g.large);
    }
  }

  /// Both ratio tables, [original..., match_rms_adamw...], one per tensor each.
  [[nodiscard]] std::vector<double> ratio_tables() const
  {
    std::vector<double> ratios(2 * shapes.size());
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      ratios[t] = rules::muon_lr_ratio(shapes[t], rules::muon_lr_adjustment::original);
      ratios[shapes.size() + t] = rules::muon_lr_ratio(shapes[t], rules::muon_lr_adjustment::match_rms_adamw);
    }
    return ratios;
  }
};

/// A GEMM operand as cuBLAS takes it: as stored (column-major) or transposed.
enum class gemm_op { n, t };

/// The three GEMMs of a Newton-Schulz iteration: A = X X^T, B = c A A + b A, X' = B X + a X.
enum class ns_gemm { gram, poly, update };
inline constexpr std::size_t ns_gemm_kinds = 3;

/// One strided-batched column-major GEMM as cuBLASLt takes it: D = alpha op(A) op(B) + beta C
/// over `batch` matrices, op(A) m x k, op(B) k x n, C and D m x n. C and D have one layout
/// (`ldc`, `stride_c`) and, in Newton-Schulz, always different addresses. The CUDA plan makes
/// its cuBLASLt layouts and picks its algorithms from these when it is built.
struct gemm_shape {
  gemm_op op_a = gemm_op::n;
  gemm_op op_b = gemm_op::n;
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
  std::int64_t lda = 0;
  std::int64_t stride_a = 0;
  std::int64_t ldb = 0;
  std::int64_t stride_b = 0;
  std::int64_t ldc = 0;  ///< C's and D's
  std::int64_t stride_c = 0;
  std::int64_t batch = 0;

  /// Rows and columns of A as stored (column-major): op(A) is m x k.
  [[nodiscard]] std::int64_t a_rows() const { return op_a == gemm_op::n ? m : k; }
  [[nodiscard]] std::int64_t a_cols() const { return op_a == gemm_op::n ? k : m; }
  /// Rows and columns of B as stored: op(B) is k x n.
  [[nodiscard]] std::int64_t b_rows() const { return op_b == gemm_op::n ? k : n; }
  [[nodiscard]] std::int64_t b_cols() const { return op_b == gemm_op::n ? n : k; }

  friend bool operator==(gemm_shape const& x, gemm_shape const& y)
  {
    return x.op_a == y.op_a && x.op_b == y.op_b && x.m == y.m && x.n == y.n && x.k == y.k && x.lda == y.lda &&
           x.stride_a == y.stride_a && x.ldb == y.ldb && x.stride_b == y.stride_b && x.ldc == y.ldc &&
           x.stride_c == y.stride_c && x.batch == y.batch;
  }
  friend bool operator!=(gemm_shape const& x, gemm_shape const& y) { return !(x == y); }
};

/// The shape of GEMM `kind` of group `g`'s Newton-Schulz (the same at every iteration).
///
/// The workspace holds each matrix as the parameter, row-major rows x cols: to a column-major
/// GEMM that is the cols x rows matrix X^T, so no transposition is ever copied.
/// rows <= cols: torch's X is the matrix itself; W = X^T (large x small, ld large):
///   A = W^T W (T, N); B = c A A + b A (N, N); W' = W B^T + a W (N, T) (= (B X + a X)^T).
/// rows > cols: torch orthogonalises X^T, which is what the GEMM sees, M (small x large, ld small):
///   A = M M^T (N, T); B = c A A + b A (N, N); M' = B M + a M (N, N).
inline gemm_shape newton_schulz_gemm_shape(muon_layout::group const& g, ns_gemm kind)
{
  bool const transposed = g.shape.rows > g.shape.cols;
  std::int64_t const s = g.small;
  std::int64_t const l = g.large;
  std::int64_t const sq = g.square_stride;
  gemm_shape r;
  r.batch = g.count;
  switch (kind) {
    case ns_gemm::gram:  // A = X X^T, s x s, both operands the matrices
      r.m = s;
      r.n = s;
      r.k = l;
      r.op_a = transposed ? gemm_op::n : gemm_op::t;
      r.op_b = transposed ? gemm_op::t : gemm_op::n;
      r.lda = r.ldb = transposed ? s : l;
      r.stride_a = r.stride_b = g.stride;
      r.ldc = s;
      r.stride_c = sq;
      break;
    case ns_gemm::poly:  // B = c A A + b A, s x s
      r.m = r.n = r.k = s;
      r.lda = r.ldb = r.ldc = s;
      r.stride_a = r.stride_b = r.stride_c = sq;
      break;
    case ns_gemm::update:
      if (transposed) {  // M' = B M + a M: A = B (s x s), B = M (s x l)
        r.m = s;
        r.n = l;
        r.k = s;
        r.lda = s;
        r.stride_a = sq;
        r.ldb = s;
        r.stride_b = g.stride;
        r.ldc = s;
      } else {  // W' = W B^T + a W: A = W (l x s), B = B (s x s), transposed
        r.m = l;
        r.n = s;
        r.k = s;
        r.op_b = gemm_op::t;
        r.lda = l;
        r.stride_a = g.stride;
        r.ldb = s;
        r.stride_b = sq;
        r.ldc = l;
      }
      r.stride_c = g.stride;
      break;
  }
  return r;
}

/// One group's Newton-Schulz as a sequence of batched column-major GEMMs D = alpha op(A) op(B)
/// + beta C (cuBLASLt's form: C and D apart) and at most one copy: what the CUDA plan hands
/// cuBLASLt, kept here, free of CUDA, so that host tests run the same sequence through an
/// emulated GEMM. `gemm(kind, shape, alpha, a, b, beta, c, d)` with `shape` =
/// newton_schulz_gemm_shape(g, kind); `copy(destination, source, elements, stride, count)`:
/// `count` runs of `elements` elements, `stride` apart in both (the matrices, not their padding).
///
/// `x` is the group's matrices in the workspace, `scratch` room for as many (ping-pong),
/// `gram` and `poly` room for the group's A and B. Per iteration, X the current buffer (`x` at
/// the first) and X' the other:
///   gram:   A = 1 X X^T + 0 A       (C = D = gram; beta 0: C is not read)
///   poly:   B = c A A + b A         (C = gram, D = poly)
///   update: X' = B X + a X          (C = X, D = X': the output aliases no input)
/// then X' becomes X. After an odd number of iterations the result is in `scratch`: one copy
/// puts it back into `x` (none after an even number, none for ns_steps = 0).
template <class T, class Copy, class Gemm>
void newton_schulz_gemms(muon_layout::group const& g, T* x, T* scratch, T* gram, T* poly, rules::muon const& opt,
                         Copy&& copy, Gemm&& gemm)
{
  if (g.small == 0 || g.large == 0) { return; }
  bool const transposed = g.shape.rows > g.shape.cols;
  gemm_shape const gram_shape = newton_schulz_gemm_shape(g, ns_gemm::gram);
  gemm_shape const poly_shape = newton_schulz_gemm_shape(g, ns_gemm::poly);
  gemm_shape const update_shape = newton_schulz_gemm_shape(g, ns_gemm::update);
  T* current = x;
  T* next = scratch;
  for (int it = 0; it < opt.ns_steps; ++it) {
    rules::ns_coefficients const k = opt.iteration(it);
    gemm(ns_gemm::gram, gram_shape, 1.0f, static_cast<T const*>(current), static_cast<T const*>(current), 0.0f,
         static_cast<T const*>(gram), gram);
    gemm(ns_gemm::poly, poly_shape, static_cast<float>(k.c), static_cast<T const*>(gram),
         static_cast<T const*>(gram), static_cast<float>(k.b), static_cast<T const*>(gram), poly);
    if (transposed) {
      gemm(ns_gemm::update, update_shape, 1.0f, static_cast<T const*>(poly), static_cast<T const*>(current),
           static_cast<float>(k.a), static_cast<T const*>(current), next);
    } else {
      gemm(ns_gemm::update, update_shape, 1.0f, static_cast<T const*>(current), static_cast<T const*>(poly),
           static_cast<float>(k.a), static_cast<T const*>(current), next);
    }
    std::swap(current, next);
  }
  if (current != x) { copy(x, static_cast<T const*>(current), g.shape.rows * g.shape.cols, g.stride, g.count); }
}

}  // namespace detail
FUSEDOPT_NAMESPACE_END
