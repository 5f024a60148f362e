// Muon on the host backend (host/muon.hpp) against a double-precision reference of
// torch.optim.Muon's algorithm (torch/optim/_muon.py, torch 2.9-2.11) written here: momentum
// EMA, Nesterov mix, Frobenius normalisation, Newton-Schulz on the transpose when rows > cols,
// decoupled weight decay with the unscaled lr, the lr scaled by the matrix's shape.
//
// Tolerances (measured with MUON_STATS=1, which prints each matrix's distances). With
// Newton-Schulz in float the plan differs from the reference by float rounding only: O within
// 3e-5 of ||O|| (Frobenius) and of max|O| (per element), measured up to 4e-6; buffers within
// 1e-5. With Newton-Schulz in bfloat16 (torch's choice: every product rounded to 8 bits of
// mantissa), O within 10% of ||O|| and 12% of max|O|, measured up to 5% and 6% (a 2 x 3
// matrix; 1.5-2% from 16 x 16 up): the distance of a bfloat16 iteration from the exact one,
// whichever implementation computes it (docs/muon.md, "Tolerances"). Parameters: the same
// plus lr * ratio * the largest difference in O, summed over the steps.
#include <fusedopt/host/muon.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "prelude.hpp"

namespace {

using fusedopt_test::Approx;
using fo::matrix_shape;
using fo::rules::muon;

// ---- the reference ----------------------------------------------------------------------

using matrix = std::vector<double>;  // row-major

// torch's _zeropower_via_newtonschulz in double: X = U (or U^T when rows > cols), normalised,
// `steps` iterations, transposed back.
matrix reference_newton_schulz(matrix const& u, matrix_shape shape, muon const& opt)
{
  bool const transposed = shape.rows > shape.cols;
  std::int64_t const s = transposed ? shape.cols : shape.rows;
  std::int64_t const l = transposed ? shape.rows : shape.cols;
  matrix x(static_cast<std::size_t>(s * l));
  for (std::int64_t i = 0; i < s; ++i) {
    for (std::int64_t k = 0; k < l; ++k) { x[i * l + k] = transposed ? u[k * s + i] : u[i * l + k]; }
  }
  double sum = 0;
  for (double v : x) { sum += v * v; }
  double const norm = std::max(std::sqrt(sum), opt.eps);
  for (double& v : x) { v /= norm; }
  matrix a(static_cast<std::size_t>(s * s)), b(a.size()), next(x.size());
  for (int it = 0; it < opt.ns_steps; ++it) {
    fo::rules::ns_coefficients const k = opt.iteration(it);
    for (std::int64_t i = 0; i < s; ++i) {
      for (std::int64_t j = 0; j < s; ++j) {
        double d = 0;
        for (std::int64_t q = 0; q < l; ++q) { d += x[i * l + q] * x[j * l + q]; }
        a[i * s + j] = d;
      }
    }
    for (std::int64_t i = 0; i < s; ++i) {
      for (std::int64_t j = 0; j < s; ++j) {
        double d = 0;
        for (std::int64_t q = 0; q < s; ++q) { d += a[i * s + q] * a[q * s + j]; }
        b[i * s + j] = k.b * a[i * s + j] + k.c * d;
      }
    }
    for (std::int64_t i = 0; i < s; ++i) {
      for (std::int64_t q = 0; q < l; ++q) {
        double d = 0;
        for (std::int64_t j = 0; j < s; ++j) { d += b[i * s + j] * x[j * l + q]; }
        next[i * l + q] = k.a * x[i * l + q] + d;
      }
    }
    x.swap(next);
  }
  matrix o(u.size());
  for (std::int64_t i = 0; i < s; ++i) {
    for (std::int64_t k = 0; k < l; ++k) { (transposed ? o[k * s + i] : o[i * l + k]) = x[i * l + k]; }
  }
  return o;
}

double ratio_of(matrix_shape shape, muon const& opt)
{
  auto const rows = static_cast<double>(shape.rows), cols = static_cast<double>(shape.cols);
  return opt.adjust_lr == fo::rules::muon_lr_adjustment::original ? std::sqrt(std::max(1.0, rows / cols))
                                                                   : 0.2 * std::sqrt(std::max(rows, cols));
}

// One of torch's steps on one matrix; returns O.
matrix reference_step(matrix& param, matrix const& grad, matrix& buf, matrix_shape shape, muon const& opt)
{
  double const mu = opt.momentum.value;
  for (std::size_t i = 0; i < buf.size(); ++i) { buf[i] += (1 - mu) * (grad[i] - buf[i]); }
  matrix u(buf.size());
  for (std::size_t i = 0; i < u.size(); ++i) { u[i] = opt.nesterov ? grad[i] + mu * (buf[i] - grad[i]) : buf[i]; }
  matrix const o = reference_newton_schulz(u, shape, opt);
  double const lr = opt.lr.value;
  double const adjusted = lr * ratio_of(shape, opt);
  for (std::size_t i = 0; i < param.size(); ++i) {
    param[i] *= 1 - lr * opt.weight_decay.value;
    param[i] -= adjusted * o[i];
  }
  return o;
}

// ---- the problem ------------------------------------------------------------------------

template <class P>
struct problem {
  std::vector<matrix_shape> shapes;
  std::vector<std::vector<P>> params, grads, bufs;
  std::vector<matrix> ref_params, ref_bufs;
  std::mt19937_64 rng;

  problem(std::vector<matrix_shape> s, std::uint64_t seed) : shapes(std::move(s)), rng(seed)
  {
    std::normal_distribution<double> normal(0.0, 1.0);
    for (auto const& shape : shapes) {
      auto const n = static_cast<std::size_t>(shape.rows * shape.cols);
      std::vector<P> p(n);
      matrix rp(n);
      for (std::size_t i = 0; i < n; ++i) {
        p[i] = fo::from_opmath<P>(static_cast<float>(normal(rng)));
        rp[i] = static_cast<double>(fo::to_opmath<float>(p[i]));
      }
      params.push_back(p);
      ref_params.push_back(rp);
      grads.emplace_back(n);
      bufs.emplace_back(n, fo::from_opmath<P>(0.0f));
      ref_bufs.emplace_back(n, 0.0);
    }
  }

  void new_gradients()
  {
    std::normal_distribution<double> normal(0.0, 1.0);
    for (auto& g : grads) {
      for (auto& v : g) { v = fo::from_opmath<P>(static_cast<float>(normal(rng))); }
    }
  }

  auto lists()
  {
    fo::tensor_list<P> p, m;
    fo::tensor_list<P const> g;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      p.push_back(params[t].data(), static_cast<std::int64_t>(params[t].size()));
      g.push_back(grads[t].data(), static_cast<std::int64_t>(grads[t].size()));
      m.push_back(bufs[t].data(), static_cast<std::int64_t>(bufs[t].size()));
    }
    return fo::bind(param = p, grad = g, momentum_buffer = m);
  }
};

struct tolerance {
  double o_frobenius;  ///< ||O - O_ref||_F / ||O_ref||_F
  double o_element;    ///< max |O - O_ref| / max |O_ref|
  double state;        ///< absolute, params and buffers
};

// Runs `steps` steps of the plan and of the reference, checking O, params and buffers after each.
template <class NS, class P>
void check_trajectory(std::vector<matrix_shape> const& shapes, muon const& opt, int steps, tolerance tol,
                      std::uint64_t seed = 1)
{
  problem<P> pr(shapes, seed);
  fo::host::options opts;
  opts.chunk_elements = 100;  // several chunks per matrix: the reduction's partials are combined
  auto const plan = fo::host::make_muon_plan<NS>(pr.lists(), shapes, opts);
  std::vector<double> param_bound(shapes.size(), 0.0);
  for (std::int64_t t = 1; t <= steps; ++t) {
    pr.new_gradients();
    plan.run(opt, fo::step_info{t});
    for (std::size_t m = 0; m < shapes.size(); ++m) {
      matrix grad_d(pr.grads[m].size());
      for (std::size_t i = 0; i < grad_d.size(); ++i) { grad_d[i] = fo::to_opmath<double>(pr.grads[m][i]); }
      matrix const o_ref = reference_step(pr.ref_params[m], grad_d, pr.ref_bufs[m], shapes[m], opt);
      NS const* o = plan.matrix(m);
      double diff2 = 0, ref2 = 0, max_diff = 0, max_ref = 0;
      for (std::size_t i = 0; i < o_ref.size(); ++i) {
        double const d = static_cast<double>(fo::to_opmath<float>(o[i])) - o_ref[i];
        diff2 += d * d;
        ref2 += o_ref[i] * o_ref[i];
        max_diff = std::max(max_diff, std::abs(d));
        max_ref = std::max(max_ref, std::abs(o_ref[i]));
      }
      if (std::getenv("MUON_STATS") != nullptr) {
        std::printf("stats %s %lldx%lld fro %.3g elem %.3g\n", sizeof(NS) == 2 ? "bf16" : "fp32",
                    static_cast<long long>(shapes[m].rows), static_cast<long long>(shapes[m].cols),
                    std::sqrt(diff2 / ref2), max_diff / max_ref);
      }
      INFO("step " << t << ", matrix " << m << " (" << shapes[m].rows << " x " << shapes[m].cols << ")");
      CHECK(std::sqrt(diff2) <= tol.o_frobenius * std::sqrt(ref2));
      CHECK(max_diff <= tol.o_element * max_ref);
      double param_diff = 0, buf_diff = 0;
      for (std::size_t i = 0; i < o_ref.size(); ++i) {
        param_diff = std::max(param_diff, std::abs(fo::to_opmath<double>(pr.params[m][i]) - pr.ref_params[m][i]));
        buf_diff = std::max(buf_diff, std::abs(fo::to_opmath<double>(pr.bufs[m][i]) - pr.ref_bufs[m][i]));
      }
      // Each step moves the parameter by lr * ratio * O: O's differences add up in it.
      param_bound[m] += opt.lr.value * ratio_of(shapes[m], opt) * max_diff;
      CHECK(param_diff <= tol.state + param_bound[m]);
      CHECK(buf_diff <= tol.state);
    }
  }
}

constexpr tolerance float_ns{3e-5, 3e-5, 1e-5};
constexpr tolerance bfloat16_ns{0.1, 0.12, 1e-5};

std::vector<matrix_shape> mixed_shapes()
{
  // rows > cols, ==, <, tiny ones, a larger one; a group of three and groups of two and one.
  return {{24, 8}, {16, 16}, {8, 24}, {1, 1}, {2, 3}, {3, 2}, {8, 24}, {16, 16}, {64, 256}, {8, 24}, {256, 64}};
}

}  // namespace

TEST_CASE("muon plan: the layout groups matrices by shape", "[muon]")
{
  problem<float> pr(mixed_shapes(), 3);
  auto const plan = fo::host::make_muon_plan(pr.lists(), pr.shapes);
  auto const& layout = plan.layout();
  REQUIRE(layout.groups.size() == 8);
  CHECK(layout.groups[2].shape.rows == 8);
  CHECK(layout.groups[2].count == 3);
  CHECK(layout.groups[2].tensors == std::vector<std::size_t>{2, 6, 9});
  CHECK(layout.groups[1].count == 2);
  for (auto const& g : layout.groups) {
    CHECK(g.stride % 8 == 0);
    CHECK(g.small == std::min(g.shape.rows, g.shape.cols));
  }
  for (std::size_t t = 0; t + 1 < pr.shapes.size(); ++t) { CHECK(layout.offsets[t] % 8 == 0); }
}

TEST_CASE("muon plan, float Newton-Schulz: torch's algorithm in double, every option", "[muon]")
{
  muon opt;
  opt.lr = 0.02;
  opt.nesterov = GENERATE(true, false);
  opt.adjust_lr = GENERATE(fo::rules::muon_lr_adjustment::original, fo::rules::muon_lr_adjustment::match_rms_adamw);
  opt.weight_decay = GENERATE(0.0, 0.1);
  check_trajectory<float, float>(mixed_shapes(), opt, 3, float_ns);
}

TEST_CASE("muon plan, bfloat16 Newton-Schulz (torch's): within bfloat16's distance of the exact iteration", "[muon]")
{
  muon opt;
  opt.lr = 0.02;
  opt.nesterov = GENERATE(true, false);
  opt.adjust_lr = GENERATE(fo::rules::muon_lr_adjustment::original, fo::rules::muon_lr_adjustment::match_rms_adamw);
  check_trajectory<fo::bfloat16, float>(mixed_shapes(), opt, 3, bfloat16_ns);
}

TEST_CASE("muon plan: groups of one, other momenta and Newton-Schulz lengths", "[muon]")
{
  muon opt;
  opt.lr = 0.05;
  opt.momentum = GENERATE(0.0, 0.5, 0.9);
  opt.ns_steps = GENERATE(0, 1, 7);
  check_trajectory<float, float>({{5, 7}, {7, 5}, {1, 9}, {9, 1}, {12, 12}}, opt, 2, float_ns, 5);
}

TEST_CASE("muon plan: per-iteration coefficients (Polar Express)", "[muon]")
{
  // modded-nanogpt's five Polar Express triples.
  static fo::rules::ns_coefficients const polar[] = {{8.1566, -22.4833, 15.8788},
                                                     {4.0429, -2.8089, 0.5000},
                                                     {3.8917, -2.7725, 0.5061},
                                                     {3.2858, -2.3681, 0.4645},
                                                     {2.3465, -1.7098, 0.4232}};
  muon opt;
  opt.ns_schedule = polar;
  opt.ns_steps = 5;
  check_trajectory<float, float>({{16, 48}, {48, 16}, {32, 32}}, opt, 2, float_ns, 7);
}

TEST_CASE("muon plan: bfloat16 parameters and buffers", "[muon]")
{
  muon opt;
  opt.lr = 0.02;
  // States rounded to bfloat16 at every store: 2^-8 relative of values near 1 (buffers near 1,
  // params near 3), plus the bfloat16 iteration's distance.
  check_trajectory<fo::bfloat16, fo::bfloat16>({{16, 48}, {48, 16}, {32, 32}}, opt, 2, tolerance{0.1, 0.12, 0.03}, 9);
}

TEST_CASE("muon plan: host Newton-Schulz gives the same bits for any thread count", "[muon]")
{
  // One matrix large enough for parallel products; small ones spread over the threads.
  std::vector<matrix_shape> const shapes = {{256, 192}, {4, 6}, {24, 40}, {24, 40}, {24, 40}, {24, 40}, {24, 40}};
  problem<float> one(shapes, 11), many(shapes, 11);
  fo::host::options single;
  single.threads = 1;
  fo::host::options threads;
  threads.threads = 2;
  auto const plan_one = fo::host::make_muon_plan(one.lists(), shapes, single);
  auto const plan_many = fo::host::make_muon_plan(many.lists(), shapes, threads);
  muon opt;
  for (std::int64_t t = 1; t <= 1; ++t) {
    one.new_gradients();
    many.new_gradients();
    plan_one.run(opt, fo::step_info{t});
    plan_many.run(opt, fo::step_info{t});
  }
  for (std::size_t m = 0; m < shapes.size(); ++m) {
    CHECK(same(one.params[m], many.params[m]));
    CHECK(same(one.bufs[m], many.bufs[m]));
  }
}

TEST_CASE("muon plan: a step counted by step_info::advance, hyperparameters through pointers", "[muon]")
{
  std::vector<matrix_shape> const shapes = {{8, 12}, {12, 8}};
  problem<float> by_value(shapes, 13), by_pointer(shapes, 13);
  auto const plan_value = fo::host::make_muon_plan(by_value.lists(), shapes);
  auto const plan_pointer = fo::host::make_muon_plan(by_pointer.lists(), shapes);
  double lr = 0.0, wd = 0.0, mu = 0.0;
  std::int64_t counter = 0;
  muon from_memory;
  from_memory.lr = fo::scalar<double>::from_pointer(&lr);
  from_memory.weight_decay = fo::scalar<double>::from_pointer(&wd);
  from_memory.momentum = fo::scalar<double>::from_pointer(&mu);
  fo::step_info counted{fo::scalar<std::int64_t>::from_pointer(&counter)};
  counted.advance = &counter;
  for (std::int64_t t = 1; t <= 3; ++t) {
    by_value.new_gradients();
    by_pointer.grads = by_value.grads;
    muon opt;
    opt.lr = lr = 0.01 * static_cast<double>(t);
    opt.weight_decay = wd = 0.05 * static_cast<double>(t);
    opt.momentum = mu = 0.9 - 0.1 * static_cast<double>(t);
    plan_value.run(opt, fo::step_info{t});
    plan_pointer.run(from_memory, counted);
  }
  CHECK(counter == 3);
  for (std::size_t m = 0; m < shapes.size(); ++m) {
    CHECK(same(by_value.params[m], by_pointer.params[m]));
    CHECK(same(by_value.bufs[m], by_pointer.bufs[m]));
  }
}

TEST_CASE("muon plan: rebind follows moved tensors", "[muon]")
{
  std::vector<matrix_shape> const shapes = {{8, 12}, {12, 8}, {8, 12}};
  problem<float> a(shapes, 17), b(shapes, 17);
  auto plan = fo::host::make_muon_plan(a.lists(), shapes);
  auto const reference = fo::host::make_muon_plan(b.lists(), shapes);
  muon opt;
  a.new_gradients();
  b.grads = a.grads;
  plan.run(opt, fo::step_info{1});
  reference.run(opt, fo::step_info{1});
  // The same state at new addresses.
  problem<float> moved(shapes, 99);
  moved.params = a.params;
  moved.bufs = a.bufs;
  plan.rebind(moved.lists());
  moved.new_gradients();
  b.grads = moved.grads;
  plan.run(opt, fo::step_info{2});
  reference.run(opt, fo::step_info{2});
  for (std::size_t m = 0; m < shapes.size(); ++m) {
    CHECK(same(moved.params[m], b.params[m]));
    CHECK(same(moved.bufs[m], b.bufs[m]));
  }
  // Only the gradients move.
  problem<float> grads_only(shapes, 23);
  std::vector<float const*> addresses;
  for (auto const& g : grads_only.grads) { addresses.push_back(g.data()); }
  grads_only.new_gradients();
  b.grads = grads_only.grads;
  plan.rebind(fo::slot::grad, addresses.data(), addresses.size());
  plan.run(opt, fo::step_info{3});
  reference.run(opt, fo::step_info{3});
  for (std::size_t m = 0; m < shapes.size(); ++m) { CHECK(same(moved.params[m], b.params[m])); }
}

namespace {
using fo::detail::gemm_op;
using fo::detail::gemm_shape;
using fo::detail::ns_gemm;

// Whether [a, a + n) and [b, b + m) share an element.
template <class T>
bool overlap(T const* a, std::int64_t n, T const* b, std::int64_t m)
{
  return a < b + m && b < a + n;
}

// Elements a batched column-major operand spans: the last matrix's last column ends there.
std::int64_t extent(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t stride, std::int64_t batch)
{
  return (batch - 1) * stride + (cols - 1) * ld + rows;
}

// One call of the sequence, as recorded: which GEMM (or a copy, kind -1) on which buffers.
template <class T>
struct call {
  int kind;  // ns_gemm, or -1 for a copy
  T const* a;
  T const* b;
  T const* c;
  T const* d;  // a copy's destination
  float alpha;
  float beta;
};

// A column-major batched GEMM as cublasLtMatmul computes it, D = alpha op(A) op(B) + beta C:
// float sums, the epilogue in float, rounded once to T. It checks what cuBLASLt needs of the
// operands (lds at least the stored rows, batches that do not overlap, D aliasing neither A nor
// B nor, unless it is C exactly, C) and that the shape is the one the CUDA plan prepared for
// the kind (newton_schulz_gemm_shape); and it records the call.
template <class T>
struct emulated_gemm {
  fo::detail::muon_layout::group const* g;
  std::vector<call<T>>* calls;

  void operator()(ns_gemm kind, gemm_shape const& s, float alpha, T const* a, T const* b, float beta, T const* c,
                  T* d) const
  {
    REQUIRE(s == fo::detail::newton_schulz_gemm_shape(*g, kind));
    REQUIRE(s.batch >= 1);
    REQUIRE(s.lda >= std::max<std::int64_t>(1, s.a_rows()));
    REQUIRE(s.ldb >= std::max<std::int64_t>(1, s.b_rows()));
    REQUIRE(s.ldc >= std::max<std::int64_t>(1, s.m));
    // Batches of D apart (each write lands in one matrix); A's, B's and C's may only be read.
    REQUIRE((s.batch == 1 || s.stride_c >= s.ldc * s.n));
    std::int64_t const a_span = extent(s.a_rows(), s.a_cols(), s.lda, s.stride_a, s.batch);
    std::int64_t const b_span = extent(s.b_rows(), s.b_cols(), s.ldb, s.stride_b, s.batch);
    std::int64_t const c_span = extent(s.m, s.n, s.ldc, s.stride_c, s.batch);
    REQUIRE_FALSE(overlap<T>(d, c_span, a, a_span));
    REQUIRE_FALSE(overlap<T>(d, c_span, b, b_span));
    REQUIRE((c == d || !overlap<T>(d, c_span, c, c_span)));
    REQUIRE((c != d || beta == 0.0f));  // in place only where C is not read (A = X X^T)
    calls->push_back({static_cast<int>(kind), a, b, c, d, alpha, beta});
    for (std::int64_t z = 0; z < s.batch; ++z) {
      T const* az = a + z * s.stride_a;
      T const* bz = b + z * s.stride_b;
      T const* cz = c + z * s.stride_c;
      T* dz = d + z * s.stride_c;
      for (std::int64_t i = 0; i < s.m; ++i) {
        for (std::int64_t j = 0; j < s.n; ++j) {
          float sum = 0.0f;
          for (std::int64_t q = 0; q < s.k; ++q) {
            float const x = fo::to_opmath<float>(s.op_a == gemm_op::n ? az[i + q * s.lda] : az[q + i * s.lda]);
            float const y = fo::to_opmath<float>(s.op_b == gemm_op::n ? bz[q + j * s.ldb] : bz[j + q * s.ldb]);
            sum += x * y;
          }
          float const old = beta != 0.0f ? fo::to_opmath<float>(cz[i + j * s.ldc]) : 0.0f;
          dz[i + j * s.ldc] = fo::from_opmath<T>(alpha * sum + beta * old);
        }
      }
    }
  }
};

// The CUDA plan's sequence of GEMMs and copies (detail::newton_schulz_gemms), run through the
// emulated GEMM, against host::newton_schulz on the same group; and the buffers of every call:
// X ping-pongs between the workspace and the scratch, C and D apart, and one copy back after an
// odd number of iterations only.
template <class T>
void check_gemm_sequence(matrix_shape shape, int ns_steps, double bound)
{
  std::int64_t const count = 3;
  std::vector<matrix_shape> const shapes(count, shape);
  fo::detail::muon_layout const layout(shapes, shapes.size(), [&](std::size_t) { return shape.rows * shape.cols; });
  auto const& g = layout.groups.at(0);
  std::vector<T> x(static_cast<std::size_t>(layout.matrix_elements));
  std::mt19937_64 rng(static_cast<std::uint64_t>(shape.rows * 1000 + shape.cols));
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::int64_t z = 0; z < count; ++z) {
    std::vector<double> v(static_cast<std::size_t>(shape.rows * shape.cols));
    double sum = 0;
    for (double& e : v) { e = normal(rng); sum += e * e; }
    for (std::size_t i = 0; i < v.size(); ++i) {
      x[static_cast<std::size_t>(z * g.stride) + i] = fo::from_opmath<T>(static_cast<float>(v[i] / std::sqrt(sum)));
    }
  }
  std::vector<T> host = x;
  muon opt;
  opt.ns_steps = ns_steps;
  std::vector<float> scratch_host(static_cast<std::size_t>(fo::host::newton_schulz_scratch(g.small, g.large)));
  fo::host::newton_schulz<T>(host.data(), count, g.stride, shape, opt, scratch_host.data(), 1);
  // The scratch starts as garbage that is not a number: nothing may read it before writing it.
  T const garbage = fo::from_opmath<T>(std::nanf(""));
  std::vector<T> scratch(static_cast<std::size_t>(count * g.stride), garbage);
  std::vector<T> gram(static_cast<std::size_t>(count * g.square_stride), garbage), poly(gram.size(), garbage);
  std::vector<call<T>> calls;
  auto const copy = [&](T* destination, T const* source, std::int64_t elements, std::int64_t stride, std::int64_t n) {
    calls.push_back({-1, source, nullptr, nullptr, destination, 0.0f, 0.0f});
    for (std::int64_t z = 0; z < n; ++z) { std::copy(source + z * stride, source + z * stride + elements, destination + z * stride); }
  };
  fo::detail::newton_schulz_gemms(g, x.data(), scratch.data(), gram.data(), poly.data(), opt, copy,
                                  emulated_gemm<T>{&g, &calls});
  INFO(shape.rows << " x " << shape.cols << ", " << ns_steps << " iterations");
  // The sequence, buffer by buffer.
  bool const transposed = shape.rows > shape.cols;
  T const* const workspace = x.data();
  T const* const other = scratch.data();
  REQUIRE(calls.size() == static_cast<std::size_t>(3 * ns_steps + (ns_steps % 2)));
  for (int it = 0; it < ns_steps; ++it) {
    T const* const current = it % 2 == 0 ? workspace : other;
    T const* const next = it % 2 == 0 ? other : workspace;
    auto const k = opt.iteration(it);
    call<T> const& a = calls[static_cast<std::size_t>(3 * it)];
    call<T> const& b = calls[static_cast<std::size_t>(3 * it + 1)];
    call<T> const& u = calls[static_cast<std::size_t>(3 * it + 2)];
    CHECK(a.kind == static_cast<int>(ns_gemm::gram));
    CHECK((a.a == current && a.b == current && a.d == gram.data() && a.alpha == 1.0f && a.beta == 0.0f));
    CHECK(b.kind == static_cast<int>(ns_gemm::poly));
    CHECK((b.a == gram.data() && b.b == gram.data() && b.c == gram.data() && b.d == poly.data()));
    CHECK((b.alpha == static_cast<float>(k.c) && b.beta == static_cast<float>(k.b)));
    CHECK(u.kind == static_cast<int>(ns_gemm::update));
    CHECK((transposed ? (u.a == poly.data() && u.b == current) : (u.a == current && u.b == poly.data())));
    CHECK((u.c == current && u.d == next && u.alpha == 1.0f && u.beta == static_cast<float>(k.a)));
  }
  if (ns_steps % 2 == 1) {
    CHECK((calls.back().kind == -1 && calls.back().a == other && calls.back().d == workspace));
  }
  // The result, in the workspace, against the host's iteration; the padding untouched.
  double diff2 = 0, ref2 = 0;
  for (std::int64_t z = 0; z < count; ++z) {
    for (std::int64_t i = 0; i < shape.rows * shape.cols; ++i) {
      auto const at = static_cast<std::size_t>(z * g.stride + i);
      double const d = fo::to_opmath<double>(x[at]) - fo::to_opmath<double>(host[at]);
      diff2 += d * d;
      ref2 += fo::to_opmath<double>(host[at]) * fo::to_opmath<double>(host[at]);
    }
    for (std::int64_t i = shape.rows * shape.cols; i < g.stride; ++i) {
      CHECK(fo::to_opmath<double>(x[static_cast<std::size_t>(z * g.stride + i)]) == 0.0);
    }
  }
  CHECK(std::sqrt(diff2) <= bound * std::sqrt(ref2));
}
}  // namespace

TEST_CASE("muon: the CUDA plan's GEMM sequence, emulated, is the host's Newton-Schulz", "[muon]")
{
  // The operands, leading dimensions, strides and buffers handed to cuBLASLt, checked without
  // a GPU: float to 1e-5 (two orders of summation), bfloat16 within its tolerance; an odd and
  // an even number of iterations (the copy back, none), one, and none.
  for (matrix_shape const shape : {matrix_shape{24, 8}, matrix_shape{8, 24}, matrix_shape{16, 16}, matrix_shape{1, 1},
                                   matrix_shape{2, 3}, matrix_shape{3, 2}, matrix_shape{64, 96}, matrix_shape{96, 64}}) {
    for (int const steps : {5, 4}) {
      check_gemm_sequence<float>(shape, steps, 1e-5);
      check_gemm_sequence<fo::bfloat16>(shape, steps, 0.1);
    }
  }
  for (int const steps : {0, 1}) {
    check_gemm_sequence<float>(matrix_shape{8, 24}, steps, 1e-5);
    check_gemm_sequence<float>(matrix_shape{24, 8}, steps, 1e-5);
  }
}

TEST_CASE("muon plan: errors before anything is written", "[muon]")
{
  std::vector<matrix_shape> const shapes = {{8, 12}, {12, 8}};
  problem<float> pr(shapes, 29);
  expect_error([&] { (void)fo::host::make_muon_plan(pr.lists(), {{8, 12}}); }, {"2 tensors", "one shape per tensor"});
  expect_error([&] { (void)fo::host::make_muon_plan(pr.lists(), {{8, 12}, {12, 9}}); },
               {"tensor 1", "96 elements", "12 x 9"});
  expect_error([&] { (void)fo::host::make_muon_plan(pr.lists(), {{8, 12}, {-12, -8}}); }, {"negative shape"});
  auto const plan = fo::host::make_muon_plan(pr.lists(), shapes);
  auto const before = pr.params;
  auto const bufs_before = pr.bufs;
  muon opt;
  opt.ns_steps = 100;
  expect_error([&] { plan.run(opt); }, {"ns_steps", "99"});
  opt = muon{};
  opt.lr = -1.0;
  expect_error([&] { plan.run(opt); }, {"lr", "must not be negative"});
  opt = muon{};
  opt.momentum = -0.5;
  expect_error([&] { plan.run(opt); }, {"momentum"});
  opt = muon{};
  opt.weight_decay = -0.5;
  expect_error([&] { plan.run(opt); }, {"weight_decay"});
  opt = muon{};
  opt.eps = -1.0;
  expect_error([&] { plan.run(opt); }, {"eps"});
  opt = muon{};
  expect_error([&] { plan.run(opt, fo::step_info{0}); }, {"step"});
  CHECK(same(pr.params, before));
  CHECK(same(pr.bufs, bufs_before));
}

TEST_CASE("muon plan: a zero gradient leaves the parameters to the weight decay", "[muon]")
{
  std::vector<matrix_shape> const shapes = {{4, 6}};
  problem<float> pr(shapes, 31);
  auto const plan = fo::host::make_muon_plan(pr.lists(), shapes);
  auto const before = pr.params;
  muon opt;
  opt.lr = 0.1;
  opt.weight_decay = 0.5;
  plan.run(opt, fo::step_info{1});  // gradients are zero: norm 0, clamped to eps, O = 0
  for (std::size_t i = 0; i < before[0].size(); ++i) {
    CHECK(pr.params[0][i] == before[0][i] * static_cast<float>(1 - 0.1 * 0.5));
  }
}
