// rules::advance_mu_product on the host backend: NAdam whose running product lives in memory
// the step advances (fusedopt_torch's NAdam under capturable=True, CPU tensors) gives the bits of
// NAdam stepped with the product the caller keeps (rules::nadam_mu_product), and the product in
// memory is the helper's; rounded to float it is torch's float32 state['mu_product'].
#include <fusedopt/fusedopt.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.hpp"
#include "reference/nadam_product.hpp"

namespace fo = fusedopt;

namespace {

struct tensors {
  std::vector<float> param, grad, exp_avg, exp_avg_sq;
  explicit tensors(std::size_t n) : param(n), grad(n), exp_avg(n, 0.f), exp_avg_sq(n, 0.f)
  {
    for (std::size_t i = 0; i < n; ++i) { param[i] = 0.5f - 0.01f * static_cast<float>(i % 97); }
  }
  auto lists()
  {
    fo::tensor_list<float> p, m, v;
    fo::tensor_list<float const> g;
    p.push_back(param.data(), static_cast<std::int64_t>(param.size()));
    g.push_back(grad.data(), static_cast<std::int64_t>(grad.size()));
    m.push_back(exp_avg.data(), static_cast<std::int64_t>(exp_avg.size()));
    v.push_back(exp_avg_sq.data(), static_cast<std::int64_t>(exp_avg_sq.size()));
    return fo::bind(fo::slot::param = p, fo::slot::grad = g, fo::slot::exp_avg = m, fo::slot::exp_avg_sq = v);
  }
};

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST_CASE("advance_mu_product keeps nadam's product in memory with the bits of the host helper", "[nadam]")
{
  bool const single = GENERATE(false, true);
  std::size_t const n = 1000;
  tensors in_memory(n), kept(n);
  auto plan_in_memory = fo::host::make_plan(in_memory.lists());
  auto plan_kept = fo::host::make_plan(kept.lists());

  double product = 1.0;  // advanced by the step itself
  fo::rules::nadam stepped = fusedopt_test::nadam_with_moving_mu();
  stepped.mu_product = fo::scalar<double>::from_pointer(&product);
  auto const rule = fo::chain(stepped, fo::rules::advance_mu_product{&product, stepped.beta1, stepped.momentum_decay, single});

  double caller = 1.0;  // kept by the caller between steps
  fo::rules::nadam plain = fusedopt_test::nadam_with_moving_mu();
  for (std::int64_t t = 1; t <= 12; ++t) {
    for (std::size_t i = 0; i < n; ++i) {
      float const g = 0.01f * static_cast<float>((static_cast<std::int64_t>(i) * 37 + t * 11) % 41 - 20);
      in_memory.grad[i] = kept.grad[i] = g;
    }
    plan_in_memory.run(rule, fo::step_info{t});
    plain.mu_product = caller;
    plan_kept.run(plain, fo::step_info{t});
    caller = fo::rules::advance_mu_product::advanced(caller, fo::rules::scale_by_nadam::mu(plain.beta1.value, plain.momentum_decay.value, t), single);
    REQUIRE(same_bits(product, caller));
    REQUIRE(std::memcmp(in_memory.param.data(), kept.param.data(), n * sizeof(float)) == 0);
    REQUIRE(std::memcmp(in_memory.exp_avg.data(), kept.exp_avg.data(), n * sizeof(float)) == 0);
  }
  if (single) {
    CHECK(static_cast<double>(static_cast<float>(product)) == product);
  } else {
    fo::rules::nadam_mu_product helper;
    for (int t = 0; t < 12; ++t) { helper.advance(plain); }
    CHECK(same_bits(helper.value(), product));
  }
}

TEST_CASE("advance_mu_product rejects a null product before anything is written", "[nadam]")
{
  tensors x(10);
  auto plan = fo::host::make_plan(x.lists());
  auto const before = x.param;
  fo::rules::advance_mu_product none;  // product null
  CHECK_THROWS_AS(plan.run(fo::chain(fusedopt_test::nadam_with_moving_mu(), none), fo::step_info{1}), fo::error);
  CHECK(x.param == before);
}
