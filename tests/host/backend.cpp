// The host backend and list validation: edge sizes, many tensors, mixed sizes and element
// types, thread-count independence, and every bad input rejected before memory is touched.
#include <fusedopt/fusedopt.hpp>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "catch.hpp"
#include "prelude.hpp"
#include "edge_sizes.hpp"
#include "reference/harness.hpp"


namespace {

/// param += grad. With small integers the result is exact in every element type, so an
/// element updated twice, or not at all, shows.
struct add_grad {
  using reads = fo::slots<fo::slot::param_t, fo::slot::grad_t>;
  using writes = fo::slots<fo::slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    e[param] += e[grad];
  }
};

template <class T>
T from_int(int x)
{
  return fo::from_opmath<T>(static_cast<fo::opmath_t<T>>(x));
}
template <class T>
int to_int(T x)
{
  return static_cast<int>(fo::to_opmath<fo::opmath_t<T>>(x));
}

/// Bit pattern of a value, for bitwise comparisons of any element type.
template <class T>
std::vector<unsigned char> bytes_of(std::vector<T> const& v)
{
  std::vector<unsigned char> b(v.size() * sizeof(T));
  if (!v.empty()) { std::memcpy(b.data(), v.data(), b.size()); }
  return b;
}

constexpr int canary = 77;
constexpr std::int64_t pad = 64;

/// Tensors of the given sizes laid out one after the other in one buffer, with `pad`
/// canary elements before, between and after them: a write outside a tensor shows.
template <class T>
class padded_tensors {
 public:
  explicit padded_tensors(std::vector<std::int64_t> const& sizes)
  {
    std::int64_t offset = pad;
    for (auto n : sizes) {
      offsets_.push_back(offset);
      sizes_.push_back(n);
      offset += n + pad;
    }
    buffer_.assign(static_cast<std::size_t>(offset), from_int<T>(canary));
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      for (std::int64_t i = 0; i < sizes_[t]; ++i) { element(t, i) = from_int<T>(value(t, i)); }
    }
  }
  /// The initial value of element i of tensor t: a small integer, exact in every type.
  static int value(std::size_t t, std::int64_t i) { return static_cast<int>((i + 3 * static_cast<std::int64_t>(t)) % 64) - 32; }

  T& element(std::size_t t, std::int64_t i) { return buffer_[static_cast<std::size_t>(offsets_[t] + i)]; }
  template <class U = T>
  fo::tensor_list<U> list()
  {
    fo::tensor_list<U> l;
    l.reserve(sizes_.size());
    for (std::size_t t = 0; t < sizes_.size(); ++t) { l.push_back(buffer_.data() + offsets_[t], sizes_[t]); }
    return l;
  }
  /// Every element outside the tensors still holds the canary.
  [[nodiscard]] bool canaries_intact() const
  {
    std::size_t t = 0;
    for (std::int64_t k = 0; k < static_cast<std::int64_t>(buffer_.size()); ++k) {
      while (t < sizes_.size() && k >= offsets_[t] + sizes_[t]) { ++t; }
      bool const inside = t < sizes_.size() && k >= offsets_[t];
      if (!inside && to_int(buffer_[static_cast<std::size_t>(k)]) != canary) { return false; }
    }
    return true;
  }
  [[nodiscard]] std::size_t num_tensors() const { return sizes_.size(); }
  [[nodiscard]] std::int64_t size(std::size_t t) const { return sizes_[t]; }
  /// The whole buffer's bits, canaries included.
  [[nodiscard]] std::vector<unsigned char> bits() const { return bytes_of(buffer_); }

 private:
  std::vector<T> buffer_;
  std::vector<std::int64_t> offsets_, sizes_;
};

/// Runs add_grad once over tensors of `sizes` and checks every element was updated exactly
/// once and nothing around them was written.
template <class T>
void check_add_grad(std::vector<std::int64_t> const& sizes, fo::host::options opts)
{
  padded_tensors<T> p(sizes), g(sizes);
  auto const plan = fo::host::make_plan(fo::bind(param = p.template list<T>(), grad = g.template list<T const>()), opts);
  plan.run(add_grad{});
  std::size_t wrong = 0;
  for (std::size_t t = 0; t < p.num_tensors(); ++t) {
    for (std::int64_t i = 0; i < p.size(t); ++i) {
      wrong += to_int(p.element(t, i)) != 2 * padded_tensors<T>::value(t, i) ? 1 : 0;
    }
  }
  CHECK(wrong == 0);
  CHECK(p.canaries_intact());
  CHECK(g.canaries_intact());
}

}  // namespace

// ---- sizes -----------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("every element of tensors of edge sizes is updated exactly once", "[backend][sizes]", float, double,
                   fo::half, fo::bfloat16)
{
  std::int64_t const chunk = GENERATE(std::int64_t{16}, std::int64_t{4096}, fo::host::options{}.chunk_elements);
  fo::host::options opts;
  opts.chunk_elements = chunk;
  for (std::int64_t const n : fusedopt_test::all_edge_sizes()) {
    INFO("size " << n << ", chunk_elements " << chunk);
    check_add_grad<TestType>({n}, opts);
  }
}

TEST_CASE("lists of many tensors", "[backend][sizes]")
{
  int const count = GENERATE(0, 1, 423, 424, 5000);
  std::vector<std::int64_t> sizes;
  for (int k = 0; k < count; ++k) { sizes.push_back((k * 37) % 53); }  // includes empty tensors
  INFO(count << " tensors");
  fo::host::options opts;
  opts.chunk_elements = 16;
  check_add_grad<float>(sizes, opts);
  check_add_grad<fo::bfloat16>(sizes, {});
}

TEST_CASE("tensors of very different sizes in one list", "[backend][sizes]")
{
  std::vector<std::int64_t> const sizes{0, 1, 100000, 17, 0, 4097, 15, 4096, 1};
  fo::host::options opts;
  opts.chunk_elements = 4096;
  check_add_grad<float>(sizes, opts);
  check_add_grad<fo::half>(sizes, opts);
  check_add_grad<double>(sizes, {});
}

// ---- element types ---------------------------------------------------------------------------

namespace {

/// Runs AdamW over lists of element types P (param), G (grad), M (exp_avg), V (exp_avg_sq)
/// and, on copies, over lists of their common arithmetic type O alone. Before each step the
/// copies are set from the mixed lists; after it the mixed results must be exactly the
/// copies' results rounded to each list's type: mixing types changes only the stores.
template <class P, class G, class M, class V>
void check_mixed_types()
{
  using O = fo::common_opmath_t<P, G, M, V>;
  auto const sizes = fusedopt_test::mixed_sizes();
  fusedopt_test::random r(5);
  fusedopt_test::slot_data<P> p(sizes, 0);
  fusedopt_test::slot_data<G> g(sizes, 0);
  fusedopt_test::slot_data<M> m(sizes, 0);
  fusedopt_test::slot_data<V> v(sizes, 0);
  fusedopt_test::slot_data<O> po(sizes, 0), go(sizes, 0), mo(sizes, 0), vo(sizes, 0);
  p.randomize(r, -1, 1);
  auto const mixed = fo::host::make_plan(fo::bind(param = p.list(), grad = g.const_list(), exp_avg = m.list(),
                                                  exp_avg_sq = v.list()));
  auto const plain = fo::host::make_plan(fo::bind(param = po.list(), grad = go.const_list(), exp_avg = mo.list(),
                                                  exp_avg_sq = vo.list()));
  fo::rules::adamw opt;
  opt.lr = 0.05;
  opt.weight_decay = 0.1;
  auto copy = [](auto const& from, auto& to) {
    auto const s = from.snapshot();
    auto l = to.list();
    for (std::size_t t = 0; t < s.size(); ++t) {
      for (std::size_t i = 0; i < s[t].size(); ++i) { l[t].data[i] = static_cast<O>(s[t][i]); }
    }
  };
  auto same = [](auto const& mixed_data, auto const& plain_data) {
    using T = std::remove_const_t<std::remove_reference_t<decltype(mixed_data.raw(0, 0))>>;
    std::size_t differ = 0;
    for (std::size_t t = 0; t < mixed_data.num_tensors(); ++t) {
      for (std::size_t i = 0; i < mixed_data.size(t); ++i) {
        T const want = fo::from_opmath<T>(plain_data.raw(t, i));
        T const got = mixed_data.raw(t, i);
        differ += std::memcmp(&want, &got, sizeof(T)) != 0 ? 1 : 0;
      }
    }
    return differ;
  };
  for (std::int64_t t = 1; t <= 3; ++t) {
    g.randomize(r, -1, 1);
    copy(p, po);
    copy(g, go);
    copy(m, mo);
    copy(v, vo);
    mixed.run(opt, fo::step_info{t});
    plain.run(opt, fo::step_info{t});
    INFO("step " << t);
    CHECK(same(p, po) == 0);
    CHECK(same(m, mo) == 0);
    CHECK(same(v, vo) == 0);
  }
}

}  // namespace

TEST_CASE("mixed element types across slots", "[backend][types]")
{
  SECTION("bfloat16 param and grad, float states") { check_mixed_types<fo::bfloat16, fo::bfloat16, float, float>(); }
  SECTION("half param and grad, float states") { check_mixed_types<fo::half, fo::half, float, float>(); }
  SECTION("float param, half grad, bfloat16 exp_avg, double exp_avg_sq (arithmetic in double)")
  {
    check_mixed_types<float, fo::half, fo::bfloat16, double>();
  }
  STATIC_REQUIRE(std::is_same_v<fo::common_opmath_t<fo::bfloat16, fo::half, float>, float>);
  STATIC_REQUIRE(std::is_same_v<fo::common_opmath_t<fo::bfloat16, double>, double>);
}

// ---- determinism -----------------------------------------------------------------------------

TEST_CASE("results do not depend on the number of threads or the chunk size", "[backend][threads]")
{
  std::vector<std::int64_t> sizes;
  fusedopt_test::random r(8);
  for (int k = 0; k < 120; ++k) { sizes.push_back(static_cast<std::int64_t>(r.uniform(0, 1500))); }

  auto run = [&](int threads, std::int64_t chunk) {
    fusedopt_test::random data(9);
    fusedopt_test::slot_data<float> p(sizes, 0), g(sizes, 0), m(sizes, 0), v(sizes, 0), w(sizes, 0);
    p.randomize(data, -1, 1);
    fo::host::options opts;
    opts.threads = threads;
    opts.chunk_elements = chunk;
    auto const plan = fo::host::make_plan(fo::bind(param = p.list(), grad = g.const_list(), exp_avg = m.list(),
                                                   exp_avg_sq = v.list(), fo::slot::max_exp_avg_sq = w.list()),
                                          opts);
    if (chunk == 7) { CHECK(plan.num_chunks() > 10000); }
    fo::rules::adamw opt;
    opt.amsgrad = true;
    for (std::int64_t t = 1; t <= 3; ++t) {
      g.randomize(data, -1, 1);
      plan.run(opt, fo::step_info{t});
    }
    std::vector<std::vector<std::vector<double>>> out{p.snapshot(), m.snapshot(), v.snapshot(), w.snapshot()};
    return out;
  };
  auto const one = run(1, 7);
  CHECK(run(2, 7) == one);
  CHECK(run(0, 7) == one);
  CHECK(run(3, 100) == one);
  CHECK(run(0, fo::host::options{}.chunk_elements) == one);
}

// ---- bad input ---------------------------------------------------------------------------------

namespace {

/// Memory of four slots, poisoned with a pattern that any write would change.
struct poisoned {
  std::vector<float> p, g, m, v, w, b;
  poisoned() : p(64), g(64), m(64), v(64), w(64), b(64)
  {
    float x = 0.5f;
    for (auto* s : {&p, &g, &m, &v, &w, &b}) {
      for (auto& e : *s) { e = (x += 1.25f); }
    }
  }
  [[nodiscard]] std::vector<std::vector<float>> all() const { return {p, g, m, v, w, b}; }
};

}  // namespace

TEST_CASE("bad lists are rejected with the slot and tensor named, before any memory is written", "[backend][errors]")
{
  poisoned mem;
  auto const before = mem.all();
  fo::rules::adam const opt;
  fo::tensor_list<float> pl{{mem.p.data(), 10}, {mem.p.data() + 10, 10}, {mem.p.data() + 20, 10}};
  fo::tensor_list<float const> gl{{mem.g.data(), 10}, {mem.g.data() + 10, 10}, {mem.g.data() + 20, 10}};
  fo::tensor_list<float> ml{{mem.m.data(), 10}, {mem.m.data() + 10, 10}, {mem.m.data() + 20, 10}};
  fo::tensor_list<float> vl{{mem.v.data(), 10}, {mem.v.data() + 10, 10}, {mem.v.data() + 20, 10}};
  auto run = [&](auto p, auto g, auto m, auto v) {
    return [=] { fo::host::apply(opt, fo::bind(param = p, grad = g, exp_avg = m, exp_avg_sq = v)); };
  };

  SECTION("the lists are valid as given") { REQUIRE_NOTHROW(run(pl, gl, ml, vl)()); }
  SECTION("lists of different lengths")
  {
    fo::tensor_list<float const> g2{{mem.g.data(), 10}, {mem.g.data() + 10, 10}};
    expect_error(run(pl, g2, ml, vl), {"slot 'grad' has 2 tensors", "slot 'param' has 3"});
    CHECK(mem.all() == before);
  }
  SECTION("a tensor with different sizes in two slots")
  {
    fo::tensor_list<float> m2{{mem.m.data(), 10}, {mem.m.data() + 10, 9}, {mem.m.data() + 20, 10}};
    expect_error(run(pl, gl, m2, vl), {"tensor 1 has 9 elements in slot 'exp_avg'", "10 in slot 'param'"});
    CHECK(mem.all() == before);
  }
  SECTION("a null tensor with a size")
  {
    fo::tensor_list<float> v2{{mem.v.data(), 10}, {mem.v.data() + 10, 10}, {nullptr, 10}};
    expect_error(run(pl, gl, ml, v2), {"tensor 2 of slot 'exp_avg_sq' is null"});
    CHECK(mem.all() == before);
  }
  SECTION("a null tensor of size 0 is fine")
  {
    fo::tensor_list<float> p0{{mem.p.data(), 10}, {nullptr, 0}, {mem.p.data() + 20, 10}};
    fo::tensor_list<float const> g0{{mem.g.data(), 10}, {nullptr, 0}, {mem.g.data() + 20, 10}};
    fo::tensor_list<float> m0{{mem.m.data(), 10}, {nullptr, 0}, {mem.m.data() + 20, 10}};
    fo::tensor_list<float> v0{{mem.v.data(), 10}, {nullptr, 0}, {mem.v.data() + 20, 10}};
    REQUIRE_NOTHROW(run(p0, g0, m0, v0)());
  }
  SECTION("a negative size")
  {
    fo::tensor_list<float const> g2{{mem.g.data(), 10}, {mem.g.data() + 10, -3}, {mem.g.data() + 20, 10}};
    expect_error(run(pl, g2, ml, vl), {"tensor 1 of slot 'grad' has a negative size -3"});
    CHECK(mem.all() == before);
    fo::tensor_list<float> l;
    l.push_back(mem.p.data(), 1);
    expect_error([&] { l.push_back(mem.p.data(), -1); }, {"tensor 1 has a negative size -1"});
    CHECK(l.size() == 1);
  }
  SECTION("an output overlapping another slot's output")
  {
    fo::tensor_list<float> m2{{mem.m.data(), 10}, {mem.p.data() + 15, 10}, {mem.m.data() + 20, 10}};
    expect_error(run(pl, gl, m2, vl), {"tensor 1 of slot 'exp_avg'", "tensor 1 of slot 'param'", "overlaps"});
    CHECK(mem.all() == before);
  }
  SECTION("an output overlapping a read-only slot")
  {
    fo::tensor_list<float const> g2{{mem.g.data(), 10}, {mem.g.data() + 10, 10}, {mem.v.data() + 5, 10}};
    expect_error(run(pl, g2, ml, vl), {"tensor 2 of slot 'grad'", "tensor 0 of slot 'exp_avg_sq'", "overlaps"});
    CHECK(mem.all() == before);
  }
  SECTION("two tensors of one output slot overlapping")
  {
    fo::tensor_list<float> p2{{mem.p.data(), 10}, {mem.p.data() + 9, 10}, {mem.p.data() + 20, 10}};
    expect_error(run(p2, gl, ml, vl), {"tensor 1 of slot 'param'", "tensor 0 of slot 'param'", "overlaps"});
    CHECK(mem.all() == before);
  }
  SECTION("adjacent tensors do not overlap")
  {
    fo::tensor_list<float> m2{{mem.p.data() + 30, 10}, {mem.p.data() + 40, 10}, {mem.p.data() + 50, 10}};
    REQUIRE_NOTHROW(run(pl, gl, m2, vl)());
  }
  SECTION("read-only lists may share memory")
  {
    fo::tensor_list<float const> g2{{mem.g.data(), 10}, {mem.g.data(), 10}, {mem.g.data(), 10}};
    REQUIRE_NOTHROW(run(pl, g2, ml, vl)());
  }
}

TEST_CASE("rules that need an unbound slot are rejected before any memory is written", "[backend][errors]")
{
  poisoned mem;
  auto const before = mem.all();
  fo::tensor_list<float> pl{{mem.p.data(), 64}}, ml{{mem.m.data(), 64}}, vl{{mem.v.data(), 64}};
  fo::tensor_list<float const> gl{{mem.g.data(), 64}};

  SECTION("sgd with momentum and no momentum_buffer")
  {
    fo::rules::sgd opt;
    opt.momentum = 0.9;
    expect_error([&] { fo::host::apply(opt, fo::bind(param = pl, grad = gl)); }, {"momentum_buffer"});
    // a momentum read from memory could become non-zero at any step
    double momentum = 0;
    opt.momentum = fo::scalar<double>::from_pointer(&momentum);
    expect_error([&] { fo::host::apply(opt, fo::bind(param = pl, grad = gl)); }, {"momentum_buffer"});
  }
  SECTION("adam with amsgrad and no max_exp_avg_sq")
  {
    fo::rules::adam opt;
    opt.amsgrad = true;
    expect_error([&] { fo::host::apply(opt, fo::bind(param = pl, grad = gl, exp_avg = ml, exp_avg_sq = vl)); },
                 {"max_exp_avg_sq"});
  }
  SECTION("adamw with amsgrad and no max_exp_avg_sq, through a plan")
  {
    fo::rules::adamw opt;
    opt.amsgrad = true;
    auto const plan = fo::host::make_plan(fo::bind(param = pl, grad = gl, exp_avg = ml, exp_avg_sq = vl));
    expect_error([&] { plan.run(opt, fo::step_info{3}); }, {"max_exp_avg_sq"});
  }
  CHECK(mem.all() == before);
}

TEST_CASE("bad host options are rejected", "[backend][errors]")
{
  std::vector<float> p(4), g(4);
  fo::tensor_list<float> pl{{p.data(), 4}};
  fo::tensor_list<float const> gl{{g.data(), 4}};
  auto const lists = fo::bind(param = pl, grad = gl);
  fo::host::options opts;
  opts.chunk_elements = 0;
  expect_error([&] { (void)fo::host::make_plan(lists, opts); }, {"chunk_elements"});
  opts = {};
  opts.threads = -1;
  expect_error([&] { (void)fo::host::make_plan(lists, opts); }, {"threads"});
}

TEST_CASE("host options out of range are rejected with the option named", "[backend][errors]")
{
  std::vector<float> p(4), g(4);
  fo::tensor_list<float> pl{{p.data(), 4}};
  fo::tensor_list<float const> gl{{g.data(), 4}};
  auto const lists = fo::bind(param = pl, grad = gl);
  fo::host::options opts;
  for (int threads : {fo::host::options::max_threads + 1, 60000, 100000}) {
    opts.threads = threads;
    expect_error([&] { (void)fo::host::make_plan(lists, opts); }, {"threads", std::to_string(threads)});
  }
  opts = {};
  opts.threads = fo::host::options::max_threads;  // the bound itself is accepted
  REQUIRE_NOTHROW(fo::host::make_plan(lists, opts));
  opts = {};
  for (int capacity : {-1, fo::host::options::max_reduction_capacity + 1, 2147483647}) {
    opts.reduction_capacity = capacity;
    expect_error([&] { (void)fo::host::make_plan(lists, opts); }, {"reduction_capacity"});
  }
  opts = {};
  opts.chunk_elements = std::numeric_limits<std::int64_t>::max();  // one chunk per tensor, no overflow
  auto const plan = fo::host::make_plan(lists, opts);
  CHECK(plan.num_chunks() == 1);
}

TEST_CASE("host pointers not aligned to their element size are rejected", "[backend][errors]")
{
  alignas(16) unsigned char memory[256] = {};
  auto* aligned = reinterpret_cast<float*>(memory);
  SECTION("float at +1 and +2 bytes")
  {
    for (int offset : {1, 2}) {
      auto* odd = reinterpret_cast<float*>(memory + 128 + offset);
      fo::tensor_list<float> pl{{aligned, 8}};
      fo::tensor_list<float const> gl{{odd, 8}};
      expect_error([&] { (void)fo::host::make_plan(fo::bind(param = pl, grad = gl)); }, {"tensor 0 of slot 'grad'", "aligned"});
    }
  }
  SECTION("double at +4 bytes")
  {
    auto* odd = reinterpret_cast<double*>(memory + 4);
    fo::tensor_list<double> pl{{odd, 4}};
    fo::tensor_list<double const> gl{{reinterpret_cast<double*>(memory + 128), 4}};
    expect_error([&] { (void)fo::host::make_plan(fo::bind(param = pl, grad = gl)); }, {"slot 'param'", "aligned"});
  }
  SECTION("bfloat16 at +1 byte")
  {
    auto* odd = reinterpret_cast<fo::bfloat16*>(memory + 1);
    fo::tensor_list<fo::bfloat16> pl{{odd, 4}};
    fo::tensor_list<fo::bfloat16 const> gl{{reinterpret_cast<fo::bfloat16*>(memory + 128), 4}};
    expect_error([&] { fo::host::apply(add_grad{}, fo::bind(param = pl, grad = gl)); }, {"slot 'param'", "aligned"});
  }
  SECTION("an empty tensor may have any address")
  {
    fo::tensor_list<float> pl{{reinterpret_cast<float*>(memory + 1), 0}};
    fo::tensor_list<float const> gl{{reinterpret_cast<float*>(memory + 3), 0}};
    REQUIRE_NOTHROW(fo::host::make_plan(fo::bind(param = pl, grad = gl)));
  }
}

TEST_CASE("a rejected run leaves the step counter unchanged", "[backend][errors]")
{
  std::vector<float> p(64, 1.f), g(64, 0.5f);
  fo::tensor_list<float> pl{{p.data(), 64}};
  fo::tensor_list<float const> gl{{g.data(), 64}};
  fo::host::options opts;
  opts.reduction_capacity = 0;  // too small for the clip pass
  auto const plan = fo::host::make_plan(fo::bind(param = pl, grad = gl), opts);
  std::int64_t counter = 4;
  fo::step_info step{fo::scalar<std::int64_t>::from_pointer(&counter)};
  step.advance = &counter;
  auto const rule = fo::chain(fo::rules::clip_by_global_norm{1.0}, fo::rules::sgd{});
  expect_error([&] { plan.run(rule, step); }, {"reduction_capacity"});
  CHECK(counter == 4);
  CHECK(p == std::vector<float>(64, 1.f));
}

TEST_CASE("a host plan rebound to moved tensors gives the bits of a fresh plan", "[backend][rebind]")
{
  std::vector<std::int64_t> const sizes = {0, 1, 7, 33, 40000, 100000, 5};
  fo::host::options opts;
  opts.chunk_elements = 4096;
  // Fresh: one plan per step over the lists where the tensors are at that step.
  padded_tensors<float> fresh_p(sizes), fresh_m(sizes), fresh_v(sizes);
  // Moved: one plan for all steps; its state moves between two buffers and its gradients
  // between three, as a caching allocator's buffers would.
  padded_tensors<float> moved_p[2] = {padded_tensors<float>(sizes), padded_tensors<float>(sizes)};
  padded_tensors<float> moved_m[2] = {padded_tensors<float>(sizes), padded_tensors<float>(sizes)};
  padded_tensors<float> moved_v[2] = {padded_tensors<float>(sizes), padded_tensors<float>(sizes)};
  padded_tensors<float> grads[3] = {padded_tensors<float>(sizes), padded_tensors<float>(sizes),
                                    padded_tensors<float>(sizes)};
  auto lists_of = [](padded_tensors<float>& p, padded_tensors<float>& g, padded_tensors<float>& m,
                     padded_tensors<float>& v) {
    return fo::bind(param = p.list<float>(), grad = g.list<float const>(), exp_avg = m.list<float>(),
                    exp_avg_sq = v.list<float>());
  };
  auto plan = fo::host::make_plan(lists_of(moved_p[0], grads[0], moved_m[0], moved_v[0]), opts);
  fo::rules::adamw rule;
  rule.lr = 0.01;
  for (std::int64_t t = 1; t <= 6; ++t) {
    auto& g = grads[t % 3];
    int const here = static_cast<int>(t % 2);
    auto const lists = lists_of(moved_p[here], g, moved_m[here], moved_v[here]);
    REQUIRE(plan.can_rebind(lists));
    plan.rebind(lists);
    plan.run(rule, fo::step_info{t});
    fo::host::make_plan(lists_of(fresh_p, g, fresh_m, fresh_v), opts).run(rule, fo::step_info{t});
    REQUIRE(moved_p[here].bits() == fresh_p.bits());
    REQUIRE(moved_m[here].bits() == fresh_m.bits());
    REQUIRE(moved_v[here].bits() == fresh_v.bits());
    // The state moves to the other buffer for the next step.
    moved_p[1 - here] = moved_p[here];
    moved_m[1 - here] = moved_m[here];
    moved_v[1 - here] = moved_v[here];
  }
  for (auto& p : moved_p) { CHECK(p.canaries_intact()); }
  for (auto& g : grads) { CHECK(g.canaries_intact()); }
}

TEST_CASE("rebind(slot, addresses): new gradients without binding the lists again", "[backend][rebind]")
{
  std::vector<std::int64_t> const sizes = {0, 1, 7, 33, 40000, 5};
  padded_tensors<float> p(sizes), m(sizes), v(sizes), fresh_p(sizes), fresh_m(sizes), fresh_v(sizes);
  padded_tensors<float> grads[3] = {padded_tensors<float>(sizes), padded_tensors<float>(sizes),
                                    padded_tensors<float>(sizes)};
  auto lists_of = [](padded_tensors<float>& pp, padded_tensors<float>& g, padded_tensors<float>& mm,
                     padded_tensors<float>& vv) {
    return fo::bind(param = pp.list<float>(), grad = g.list<float const>(), exp_avg = mm.list<float>(),
                    exp_avg_sq = vv.list<float>());
  };
  auto plan = fo::host::make_plan(lists_of(p, grads[0], m, v));
  fo::rules::adamw rule;
  rule.lr = 0.01;
  for (std::int64_t t = 1; t <= 6; ++t) {
    auto& g = grads[t % 3];
    std::vector<float const*> addresses;
    for (auto const& tensor : g.list<float const>()) { addresses.push_back(tensor.data); }
    plan.rebind(grad, addresses.data(), addresses.size());
    plan.run(rule, fo::step_info{t});
    fo::host::make_plan(lists_of(fresh_p, g, fresh_m, fresh_v)).run(rule, fo::step_info{t});
    REQUIRE(p.bits() == fresh_p.bits());
    REQUIRE(m.bits() == fresh_m.bits());
    REQUIRE(v.bits() == fresh_v.bits());
  }
  CHECK(plan.lists().list<1>()[3].data == grads[0].list<float const>()[3].data);  // step 6 used grads[0]
}

TEST_CASE("rebind(slot, addresses) checks what bind checks and stays as it was", "[backend][rebind][errors]")
{
  std::vector<float> p(100, 1.f), g(100, 1.f), q(100, 1.f);
  fo::tensor_list<float> pl{{p.data(), 10}, {p.data() + 10, 20}};
  fo::tensor_list<float const> gl{{g.data(), 10}, {g.data() + 10, 20}};
  auto plan = fo::host::make_plan(fo::bind(param = pl, grad = gl));
  std::vector<float const*> moved = {q.data(), q.data() + 10};
  SECTION("a count that is not the tensors'")
  {
    expect_error([&] { plan.rebind(grad, moved.data(), 1); }, {"1 addresses for a plan of 2 tensors"});
  }
  SECTION("a gradient over a parameter")
  {
    moved[1] = p.data() + 25;  // [25, 45) overlaps parameter 1 at [10, 30)
    expect_error([&] { plan.rebind(grad, moved.data(), moved.size()); },
                 {"tensor 1 of slot 'grad' overlaps a tensor the rule writes"});
  }
  SECTION("a null gradient with elements")
  {
    moved[0] = nullptr;
    expect_error([&] { plan.rebind(grad, moved.data(), moved.size()); }, {"tensor 0 of slot 'grad' is null"});
  }
  SECTION("a misaligned gradient")
  {
    moved[1] = reinterpret_cast<float const*>(reinterpret_cast<char const*>(q.data() + 10) + 2);
    expect_error([&] { plan.rebind(grad, moved.data(), moved.size()); }, {"tensor 1 of slot 'grad'", "aligned"});
  }
  SECTION("gradients over each other: allowed, both only read")
  {
    moved[1] = q.data() + 5;
    REQUIRE_NOTHROW(plan.rebind(grad, moved.data(), moved.size()));
    plan.run(add_grad{});
    CHECK(p[0] == 2.f);
    return;
  }
  plan.run(add_grad{});  // still the original gradients
  CHECK(p[0] == 2.f);
  CHECK(p[29] == 2.f);
}

TEST_CASE("a host plan refuses lists of another geometry and stays as it was", "[backend][rebind][errors]")
{
  std::vector<float> p(100, 1.f), g(100, 1.f), q(100, 1.f);
  fo::tensor_list<float> pl{{p.data(), 10}, {p.data() + 10, 20}};
  fo::tensor_list<float const> gl{{g.data(), 10}, {g.data() + 10, 20}};
  auto plan = fo::host::make_plan(fo::bind(param = pl, grad = gl));
  SECTION("another size")
  {
    fo::tensor_list<float> p2{{q.data(), 10}, {q.data() + 10, 21}};
    fo::tensor_list<float const> g2{{g.data(), 10}, {g.data() + 10, 21}};
    auto const lists = fo::bind(param = p2, grad = g2);
    CHECK_FALSE(plan.can_rebind(lists));
    expect_error([&] { plan.rebind(lists); }, {"tensor 1 has 21 elements but the plan was made for 20"});
  }
  SECTION("another tensor count")
  {
    fo::tensor_list<float> p2{{q.data(), 10}};
    fo::tensor_list<float const> g2{{g.data(), 10}};
    auto const lists = fo::bind(param = p2, grad = g2);
    CHECK_FALSE(plan.can_rebind(lists));
    expect_error([&] { plan.rebind(lists); }, {"1 tensors but the plan was made for 2"});
  }
  SECTION("a misaligned pointer")
  {
    fo::tensor_list<float> p2{{q.data(), 10}, {reinterpret_cast<float*>(reinterpret_cast<char*>(q.data() + 10) + 2), 20}};
    expect_error([&] { plan.rebind(fo::bind(param = p2, grad = gl)); }, {"tensor 1 of slot 'param'", "aligned"});
  }
  plan.run(add_grad{});
  CHECK(p[0] == 2.f);
  CHECK(p[29] == 2.f);
  CHECK(q == std::vector<float>(100, 1.f));
}
