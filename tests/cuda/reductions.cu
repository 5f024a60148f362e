// Reduction passes on the CUDA backend: norm_of (L2 and inf, per tensor and global) and
// clip_by_global_norm against double references, determinism (two runs, every transport and
// grid size give the same bits), NaN and infinity propagation, the error_if_nonfinite flag,
// empty lists, and the workspace capacity check.
#include "support.cuh"

#include <cmath>
#include <limits>

using namespace fusedopt_test;

namespace {

using pg_problem = problem<spec<slot::param_t, float>, spec<slot::grad_t, float, fill::symmetric, true>>;

/// Per-tensor sums of squares and max-abs of the host copy of slot K, in double.
template <std::size_t K, class Problem>
void reference_norms(Problem& p, std::vector<double>& l2, std::vector<double>& inf, double& l2_total,
                     double& inf_total)
{
  auto& a = p.template slot_arena<K>();
  l2.assign(a.sizes.size(), 0.0);
  inf.assign(a.sizes.size(), 0.0);
  double sum = 0, largest = 0;
  for (std::size_t t = 0; t < a.sizes.size(); ++t) {
    double s = 0, m = 0;
    for (std::int64_t i = 0; i < a.sizes[t]; ++i) {
      double const x = as_double(a.host[static_cast<std::size_t>(a.offsets[t] + i)]);
      s += x * x;
      m = std::max(m, std::fabs(x));
    }
    l2[t] = std::sqrt(s);
    inf[t] = m;
    sum += s;
    largest = std::max(largest, m);
  }
  l2_total = std::sqrt(sum);
  inf_total = largest;
}


}  // namespace

TEST_CASE("norm_of: per-tensor and global L2 and inf norms against a double reference", "[cuda][reduce]")
{
  for (scenario const& how : plan_scenarios()) {
    if (!transport_available(how.metadata)) { continue; }
    INFO("scenario " << how.name);
    pg_problem p(edge_sizes(), how.placement, 7);
    auto const plan = fo::cuda::make_plan(p.lists(true), options_of(how));
    std::size_t const rows = edge_sizes().size();
    device_array<double> per(rows), total(1), per_inf(rows), total_inf(1);
    plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, per.get(), total.get()});
    plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::inf, per_inf.get(), total_inf.get()});
    p.require_same_bits("norm_of writes nothing");

    std::vector<double> l2, inf;
    double l2_total = 0, inf_total = 0;
    reference_norms<1>(p, l2, inf, l2_total, inf_total);
    auto const got = per.download();
    auto const got_inf = per_inf.download();
    for (std::size_t t = 0; t < rows; ++t) {
      INFO("tensor " << t << " of size " << edge_sizes()[t]);
      // Each lane sums at most 64 squares (chunk / 32) in float before the double combine.
      CHECK(got[t] == fusedopt_test::Approx(l2[t]).epsilon(2e-6).margin(1e-30));
      CHECK(got_inf[t] == inf[t]);  // max is exact
    }
    CHECK(total.value() == fusedopt_test::Approx(l2_total).epsilon(2e-6));
    CHECK(total_inf.value() == inf_total);

    // norm_of alone is its pass, finalize and hook: no update kernel (updates = false).
    fo::rules::norm_of<slot::grad_t> const measure{fo::norm_kind::l2, nullptr, total.get()};
    std::size_t const tables = plan.launches_per_run();
    CHECK(plan.launches_per_run(measure) == tables + 1 + 1);
    cudaStream_t stream = nullptr;
    FO_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaGraph_t graph = nullptr;
    FO_TEST_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    plan.run(measure, {}, stream);
    FO_TEST_CUDA(cudaStreamEndCapture(stream, &graph));
    std::size_t nodes = 0;
    FO_TEST_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
    CHECK(nodes == plan.launches_per_run(measure));
    FO_TEST_CUDA(cudaGraphDestroy(graph));
    FO_TEST_CUDA(cudaStreamDestroy(stream));
  }
}

TEST_CASE("norm_of gives the same bits every run, with every transport and grid size", "[cuda][reduce][determinism]")
{
  // Same chunking and placement: the partials are the same whatever carries the tables,
  // however many blocks loop over the chunks, and whether the pass, finalize and hook kernels
  // are launched as programmatic dependents (each waits for the one before it) or not.
  std::vector<std::int64_t> sizes = edge_sizes();
  pg_problem p(sizes, shift::same, 9);
  std::vector<double> reference;
  double reference_total = 0;
  int runs = 0;
  for (auto t : {fo::cuda::transport::device_table, fo::cuda::transport::param_4k, fo::cuda::transport::param_32k}) {
    if (!transport_available(t)) { continue; }
    for (std::int64_t max_blocks : {std::int64_t{0}, std::int64_t{2}, std::int64_t{7}, std::int64_t{-1}}) {
      fo::cuda::options opts;
      opts.metadata = t;
      opts.chunk_elements = 40;
      opts.max_blocks = max_blocks < 0 ? 0 : max_blocks;
      opts.dependent_launch = max_blocks >= 0;
      auto const plan = fo::cuda::make_plan(p.lists(true), opts);
      device_array<double> per(sizes.size()), total(1);
      for (int twice = 0; twice < 2; ++twice) {
        plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, per.get(), total.get()});
        auto const got = per.download();
        double const got_total = total.value();
        if (runs++ == 0) {
          reference = got;
          reference_total = got_total;
          continue;
        }
        INFO("transport " << static_cast<int>(t) << " max_blocks " << max_blocks << " (-1: ordinary launches) run "
                           << twice);
        REQUIRE(std::memcmp(got.data(), reference.data(), got.size() * sizeof(double)) == 0);
        REQUIRE(same_bits(got_total, reference_total));
      }
    }
  }
  CHECK(runs >= 10);
}

TEST_CASE("norms propagate NaN and infinity; the norm of nothing is 0", "[cuda][reduce]")
{
  std::vector<std::int64_t> sizes{5000, 3, 0, 70000};
  double const inf = std::numeric_limits<double>::infinity();
  SECTION("an infinity in one tensor")
  {
    pg_problem p(sizes, shift::none, 3);
    auto& g = p.slot_arena<1>();
    g.host[static_cast<std::size_t>(g.offsets[3] + 4321)] = -std::numeric_limits<float>::infinity();
    push(p);
    auto const plan = fo::cuda::make_plan(p.lists(true));
    device_array<double> per(sizes.size()), total(1), per_inf(sizes.size()), total_inf(1);
    plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, per.get(), total.get()});
    plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::inf, per_inf.get(), total_inf.get()});
    CHECK(total.value() == inf);
    CHECK(total_inf.value() == inf);
    CHECK(per.download()[3] == inf);
    CHECK(std::isfinite(per.download()[0]));
    CHECK(per_inf.download()[2] == 0.0);  // empty tensor
  }
  SECTION("a NaN in one tensor")
  {
    pg_problem p(sizes, shift::same, 4);
    auto& g = p.slot_arena<1>();
    g.host[static_cast<std::size_t>(g.offsets[0] + 17)] = std::numeric_limits<float>::quiet_NaN();
    push(p);
    auto const plan = fo::cuda::make_plan(p.lists(true));
    device_array<double> per_inf(sizes.size()), total_inf(1), total(1);
    plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::inf, per_inf.get(), total_inf.get()});
    plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, nullptr, total.get()});
    CHECK(std::isnan(total_inf.value()));
    CHECK(std::isnan(per_inf.download()[0]));
    CHECK(!std::isnan(per_inf.download()[3]));
    CHECK(std::isnan(total.value()));
  }
  SECTION("empty lists and lists of empty tensors")
  {
    for (auto const& s : {std::vector<std::int64_t>{}, std::vector<std::int64_t>{0, 0, 0}}) {
      pg_problem p(s, shift::none, 5);
      auto const plan = fo::cuda::make_plan(p.lists(true));
      device_array<double> per(std::max<std::size_t>(s.size(), 1)), total(1);
      total.set(-1.0);
      per.set(-1.0);
      plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::inf, per.get(), total.get()});
      CHECK(total.value() == 0.0);
      for (std::size_t t = 0; t < s.size(); ++t) { CHECK(per.download()[t] == 0.0); }
      plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, per.get(), total.get()});
      CHECK(total.value() == 0.0);
    }
  }
}

TEST_CASE("a global norm of float gradients whose squares overflow float is finite (issue 15)", "[cuda][reduce][clip]")
{
  // Squares above float's largest value (1e20, -3e19) and a float sum above it of squares
  // below it (1e19 in every element of a 70000-element tensor), among ordinary values: a
  // thread whose float sum overflows accumulates again in double.
  std::vector<std::int64_t> sizes{5000, 3, 0, 70000};
  for (scenario const& how : plan_scenarios()) {
    if (!transport_available(how.metadata)) { continue; }
    INFO("scenario " << how.name);
    pg_problem p(sizes, how.placement, 9);
    auto& g = p.slot_arena<1>();
    g.host[static_cast<std::size_t>(g.offsets[0] + 17)] = 1e20f;
    g.host[static_cast<std::size_t>(g.offsets[1] + 2)] = -3e19f;
    for (std::int64_t i = 0; i < sizes[3]; i += 3) { g.host[static_cast<std::size_t>(g.offsets[3] + i)] = 1e19f; }
    push(p);
    std::vector<double> l2, inf;
    double l2_total = 0, inf_total = 0;
    reference_norms<1>(p, l2, inf, l2_total, inf_total);
    REQUIRE(std::isfinite(l2_total));

    device_array<double> per(sizes.size()), total_norm(1);
    device_array<int> nonfinite(1);
    nonfinite.set(7);
    fo::rules::clip_by_global_norm clip{1.0, fo::norm_kind::l2, false, nonfinite.get(), total_norm.get()};
    fo::rules::sgd sgd;
    sgd.lr = 0.1;
    auto const plan = fo::cuda::make_plan(p.lists(true), options_of(how));
    plan.run(fo::chain(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, per.get(), nullptr}, clip, sgd));
    CHECK(total_norm.value() == fusedopt_test::Approx(l2_total).epsilon(2e-6));
    CHECK(nonfinite.value() == 0);
    auto const got = per.download();
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      INFO("tensor " << t);
      CHECK(got[t] == fusedopt_test::Approx(l2[t]).epsilon(2e-6).margin(1e-30));
    }
    // The host backend re-accumulates the same way: the same parameters within the norms'
    // rounding (not bits: the two backends sum in different orders, see above).
    pg_problem q(sizes, how.placement, 9);
    auto& qg = q.slot_arena<1>();
    qg.host = g.host;
    auto host_plan = fo::host::make_plan(q.lists(false));
    double host_total = 0;
    fo::rules::clip_by_global_norm host_clip{1.0};
    host_clip.total_norm = &host_total;
    host_plan.run(fo::chain(host_clip, sgd));
    CHECK(host_total == fusedopt_test::Approx(l2_total).epsilon(2e-6));
    pull(p);
    auto const& pa = p.slot_arena<0>();
    for (std::size_t i = 0; i < pa.host.size(); ++i) {
      REQUIRE(pa.host[i] == fusedopt_test::Approx(q.slot_arena<0>().host[i]).epsilon(1e-6).margin(3e-7));
    }
  }
}

TEST_CASE("clip_by_global_norm + SGD against a double reference and the host backend", "[cuda][reduce][clip]")
{
  auto const kind = GENERATE(fo::norm_kind::l2, fo::norm_kind::inf);
  double const max_norm = GENERATE(0.5, 1e9);  // clipping, and a bound never reached
  for (scenario const& how : plan_scenarios()) {
    if (!transport_available(how.metadata)) { continue; }
    INFO("scenario " << how.name << " kind " << static_cast<int>(kind) << " max_norm " << max_norm);
    pg_problem p(edge_sizes(), how.placement, 21);
    std::vector<double> l2, inf;
    double l2_total = 0, inf_total = 0;
    reference_norms<1>(p, l2, inf, l2_total, inf_total);
    double const norm = kind == fo::norm_kind::l2 ? l2_total : inf_total;
    double const coefficient = std::min(1.0, max_norm / (norm + 1e-6));
    auto const before = p.slot_arena<0>().host;

    device_array<double> total_norm(1);
    device_array<int> nonfinite(1);
    nonfinite.set(7);
    fo::rules::clip_by_global_norm clip{max_norm, kind, false, nonfinite.get(), total_norm.get()};
    fo::rules::sgd sgd;
    sgd.lr = 0.1;
    auto const plan = fo::cuda::make_plan(p.lists(true), options_of(how));
    plan.run(fo::chain(clip, sgd));

    CHECK(total_norm.value() == fusedopt_test::Approx(norm).epsilon(2e-6));
    CHECK(nonfinite.value() == 0);
    // Against the double reference: p - lr * coefficient * g, with float rounding.
    pull(p);
    auto const& pa = p.slot_arena<0>();
    auto const& ga = p.slot_arena<1>();
    for (std::size_t t = 0; t < pa.sizes.size(); ++t) {
      for (std::int64_t i = 0; i < pa.sizes[t]; ++i) {
        auto const at = static_cast<std::size_t>(pa.offsets[t] + i);  // slots may sit at different offsets
        double const g = ga.host[static_cast<std::size_t>(ga.offsets[t] + i)];
        double const expected = before[at] - 0.1 * (coefficient * g);
        REQUIRE(pa.host[at] == fusedopt_test::Approx(expected).epsilon(1e-6).margin(3e-7));
      }
    }
    // Against the host backend: its norm is summed in float lanes of 4096 terms (relative
    // error up to about 1e-6), so the coefficients differ slightly.
    pg_problem q(edge_sizes(), how.placement, 21);
    auto host_plan = fo::host::make_plan(q.lists(false));
    host_plan.run(fo::chain(fo::rules::clip_by_global_norm{max_norm, kind}, sgd));
    for (std::size_t i = 0; i < pa.host.size(); ++i) {
      REQUIRE(pa.host[i] == fusedopt_test::Approx(q.slot_arena<0>().host[i]).epsilon(1e-6).margin(3e-7));
    }
  }
}

TEST_CASE("clip_by_global_norm: error_if_nonfinite sets a device flag and leaves the gradient unscaled",
          "[cuda][reduce][clip]")
{
  std::vector<std::int64_t> sizes{1000, 4097, 1};
  pg_problem p(sizes, shift::none, 31);
  auto const plan = fo::cuda::make_plan(p.lists(true));
  device_array<int> nonfinite(1);
  device_array<double> total_norm(1);
  fo::rules::clip_by_global_norm clip{0.5, fo::norm_kind::l2, true, nonfinite.get(), total_norm.get()};
  fo::rules::sgd sgd;
  sgd.lr = 1.0;

  // Finite: flag 0 and clipping applied.
  plan.run(fo::chain(clip, sgd));
  CHECK(nonfinite.value() == 0);
  CHECK(std::isfinite(total_norm.value()));

  // One infinite gradient: flag 1, norm infinite, every other gradient applied unscaled.
  pull(p);
  auto& g = p.slot_arena<1>();
  auto const at = static_cast<std::size_t>(g.offsets[1] + 2049);
  g.host[at] = std::numeric_limits<float>::infinity();
  push(p);
  auto const before = p.slot_arena<0>().host;
  plan.run(fo::chain(clip, sgd));
  CHECK(nonfinite.value() == 1);
  CHECK(total_norm.value() == std::numeric_limits<double>::infinity());
  pull(p);
  auto const& pa = p.slot_arena<0>();
  std::size_t const probe = static_cast<std::size_t>(pa.offsets[0] + 5);
  CHECK(pa.host[probe] == before[probe] - g.host[probe]);  // coefficient 1
  CHECK(pa.host[at] == -std::numeric_limits<float>::infinity());
}

TEST_CASE("the reduction workspace: capacity checked before anything runs", "[cuda][reduce][errors]")
{
  std::vector<std::int64_t> sizes{100, 200};
  pg_problem p(sizes, shift::none, 41);
  device_array<double> total(1);
  fo::cuda::options small;
  small.reduction_capacity = 1;  // norm_of needs 2
  auto const plan = fo::cuda::make_plan(p.lists(true), small);
  REQUIRE_THROWS_AS(plan.run(fo::rules::norm_of<slot::grad_t>{fo::norm_kind::l2, nullptr, total.get()}), fo::error);
  fo::cuda::options none;
  none.reduction_capacity = 0;
  auto const elementwise_only = fo::cuda::make_plan(p.lists(true), none);
  REQUIRE_THROWS_AS(elementwise_only.run(fo::rules::norm_of<slot::grad_t>{}), fo::error);
  fo::rules::sgd sgd;
  elementwise_only.run(sgd);  // rules without passes need no workspace
  FO_TEST_CUDA(cudaDeviceSynchronize());
  fo::cuda::options negative;
  negative.reduction_capacity = -1;
  REQUIRE_THROWS_AS(fo::cuda::make_plan(p.lists(true), negative), fo::error);
  // Launch counts: pass + finalize per pass, the update, the hook; norm_of alone has no
  // update (updates = false), chained in front of a rule it has.
  auto const plan8 = fo::cuda::make_plan(p.lists(true));
  CHECK(plan8.launches_per_run(fo::rules::norm_of<slot::grad_t>{}) == 3);
  CHECK(plan8.launches_per_run(fo::chain(fo::rules::norm_of<slot::grad_t>{}, sgd)) == 4);
  CHECK(plan8.launches_per_run(sgd) == 1);
}
