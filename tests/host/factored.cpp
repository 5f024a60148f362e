// Factored passes on the host backend (factored.hpp), apart from any optimizer: a test part that
// sums the gradient (signed small integers: every sum exact) per row and column and stores
// the sums as its statistics; the update reads each element's statistics back. It runs after a
// reducing part that scales the gradient by its tensor's element count, so the factored pass
// sees a reduction pass's results (chain order). Then: the same bits for any thread count and
// chunk length, and tables that do not describe their tensors rejected before anything is
// written; a factored pass that stores (stored_by_pass), after which the update resumes.
#include <fusedopt/fusedopt.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.hpp"
#include "prelude.hpp"

namespace {

/// grad *= the number of elements of its tensor (a reduction pass counting them).
struct scale_by_count {
  using reduction = fo::reduction<fo::reduce_op::sum>;
  using reads = fo::slots<>;
  using writes = fo::slots<>;
  struct count {
    template <class E, class Acc>
    void operator()(E&, Acc& acc) const
    {
      acc[0] += 1;
    }
  };
  count prepare_reduce(fo::step_info const&) const { return {}; }
  struct scale {
    fo::reduced r;
    template <class E>
    void operator()(E& e) const
    {
      e[fo::slot::grad] *= static_cast<typename E::value_type>(r.tensor(e.tensor(), 0));
    }
  };
  scale prepare(fo::step_info const&, fo::reduced const& r) const { return {r}; }
};

/// Factoring part: statistics = the sums of grad (the old values ignored); update: param =
/// row statistic + 1000 x column statistic (a vector: its row statistic) + the matrix's row
/// total / 1e6.
struct sum_gradients {
  fo::factored_table<double> table{};
  using reads = fo::slots<fo::slot::grad_t>;
  using writes = fo::slots<fo::slot::param_t>;
  fo::factored_table<double> factors() const { return table; }
  struct value {
    template <class E>
    double operator()(E& e) const
    {
      return static_cast<double>(e[fo::slot::grad]);
    }
  };
  value prepare_factor(fo::step_info const&) const { return {}; }
  struct fold {
    template <class O>
    O operator()(O, double sum, std::int64_t) const
    {
      return static_cast<O>(sum);
    }
  };
  fold prepare_fold(fo::step_info const&) const { return {}; }
  struct body {
    fo::factored_table<double> table;
    template <class E>
    void operator()(E& e) const
    {
      auto const l = fo::factored_lookup<double>::of(table, e.tensor());
      auto const at = l.locate(e.index());
      e[fo::slot::param] = l.factored() ? l.row[at.row_line] + 1000 * l.col[at.col_line] + l.row_total[at.matrix] / 1e6
                                        : l.row[e.index()];
    }
  };
  body prepare(fo::step_info const&) const { return {table}; }
};

struct problem {
  std::vector<std::vector<std::int64_t>> dims{{3, 70, 130}, {129, 1}, {5}, {1, 200}, {0}, {64, 64}, {2, 260, 70}};
  fo::factored_layout layout;
  std::vector<std::vector<double>> p, g;
  std::vector<double> rows, cols, workspace;
  std::vector<fo::factored_tensor<double>> entries;

  problem()
  {
    for (auto const& d : dims) { layout.add_torch_shape(d); }
    std::int64_t nr = 0, nc = 0;
    for (std::size_t t = 0; t < dims.size(); ++t) {
      nr += layout.row_elements(t);
      nc += layout.col_elements(t);
      p.emplace_back(static_cast<std::size_t>(layout.elements(t)), 0.0);
      g.emplace_back(static_cast<std::size_t>(layout.elements(t)));
      for (std::size_t i = 0; i < g.back().size(); ++i) {
        g.back()[i] = static_cast<double>(static_cast<int>((i * 31 + t * 7) % 11) - 5);
      }
    }
    rows.assign(static_cast<std::size_t>(nr), -1.0);
    cols.assign(static_cast<std::size_t>(nc), -1.0);
    workspace.assign(static_cast<std::size_t>(layout.workspace_doubles()), 0.0);
    entries = entries_of(layout);
  }
  /// The entries of `l` (this problem's shapes, factored as `l` says) over rows, cols and the
  /// workspace (l's statistics no more than layout's).
  std::vector<fo::factored_tensor<double>> entries_of(fo::factored_layout const& l)
  {
    std::vector<double*> rp, cp;
    std::int64_t r = 0, c = 0;
    for (std::size_t t = 0; t < dims.size(); ++t) {
      rp.push_back(rows.data() + r);
      cp.push_back(cols.data() + c);
      r += l.row_elements(t);
      c += l.col_elements(t);
    }
    return l.entries<double>(rp, cp, workspace.data());
  }
  auto lists()
  {
    fo::tensor_list<double> pl;
    fo::tensor_list<double const> gl;
    for (std::size_t t = 0; t < p.size(); ++t) {
      pl.push_back(p[t].data(), static_cast<std::int64_t>(p[t].size()));
      gl.push_back(g[t].data(), static_cast<std::int64_t>(g[t].size()));
    }
    return fo::bind(param = pl, grad = gl);
  }
  auto rule() { return fo::chain(scale_by_count{}, sum_gradients{layout.table<double>(entries.data())}); }
};

}  // namespace

TEST_CASE("a factored pass sums each row and column, after the reduction passes before it", "[factored]")
{
  STATIC_REQUIRE(fo::factor_count_v<decltype(problem{}.rule())> == 1);
  STATIC_REQUIRE(fo::detail::factor_before_v<decltype(problem{}.rule()), 0> == 1);
  problem pr;
  auto const plan = fo::host::make_plan(pr.lists());
  plan.run(pr.rule(), fo::step_info{1});
  std::int64_t row_offset = 0, col_offset = 0;
  for (std::size_t t = 0; t < pr.dims.size(); ++t) {
    auto const& d = pr.dims[t];
    auto const& g = pr.g[t];
    auto const n = static_cast<double>(g.size());
    if (d.size() < 2) {
      for (std::size_t i = 0; i < g.size(); ++i) {
        CHECK(pr.rows[static_cast<std::size_t>(row_offset) + i] == g[i] * n);
        CHECK(pr.p[t][i] == g[i] * n);
      }
    } else {
      std::int64_t const R = d[d.size() - 2], C = d.back(), M = static_cast<std::int64_t>(g.size()) / (R * C);
      for (std::int64_t m = 0; m < M; ++m) {
        double total = 0;
        for (std::int64_t r = 0; r < R; ++r) {
          double s = 0;
          for (std::int64_t c = 0; c < C; ++c) { s += g[static_cast<std::size_t>((m * R + r) * C + c)] * n; }
          CHECK(pr.rows[static_cast<std::size_t>(row_offset + m * R + r)] == s);
          total += s;
        }
        for (std::int64_t c = 0; c < C; ++c) {
          double s = 0;
          for (std::int64_t r = 0; r < R; ++r) { s += g[static_cast<std::size_t>((m * R + r) * C + c)] * n; }
          CHECK(pr.cols[static_cast<std::size_t>(col_offset + m * C + c)] == s);
        }
        for (std::int64_t r = 0; r < R; ++r) {
          for (std::int64_t c = 0; c < C; ++c) {
            double const want = pr.rows[static_cast<std::size_t>(row_offset + m * R + r)] +
                                1000 * pr.cols[static_cast<std::size_t>(col_offset + m * C + c)] + total / 1e6;
            CHECK(pr.p[t][static_cast<std::size_t>((m * R + r) * C + c)] == want);
          }
        }
      }
    }
    row_offset += pr.layout.row_elements(t);
    col_offset += pr.layout.col_elements(t);
  }
}

TEST_CASE("a factored pass gives the same bits for any thread count and chunk length", "[factored]")
{
  problem reference;
  // Values whose sums round: the order of the additions shows in the bits.
  for (auto& t : reference.g) {
    for (std::size_t i = 0; i < t.size(); ++i) { t[i] = 1.0 / static_cast<double>(3 + i % 17) + 1e-3 * static_cast<double>(i); }
  }
  fo::host::options one;
  one.threads = 1;
  fo::host::make_plan(reference.lists(), one).run(reference.rule(), fo::step_info{1});
  for (std::int64_t chunk : {std::int64_t{7}, std::int64_t{4096}}) {
    problem other;
    other.g = reference.g;
    fo::host::options opts;
    opts.threads = 2;
    opts.chunk_elements = chunk;
    fo::host::make_plan(other.lists(), opts).run(other.rule(), fo::step_info{1});
    CHECK(std::memcmp(other.rows.data(), reference.rows.data(), reference.rows.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(other.cols.data(), reference.cols.data(), reference.cols.size() * sizeof(double)) == 0);
    CHECK(other.p == reference.p);
  }
}

TEST_CASE("a factored table that does not describe its tensors is rejected before anything is written", "[factored]")
{
  problem pr;
  auto const plan = fo::host::make_plan(pr.lists());
  auto const before = pr.p;
  SECTION("an entry of another size")
  {
    pr.entries[0].cols = 129;
  }
  SECTION("an entry without row statistics")
  {
    pr.entries[2].row = nullptr;
  }
  SECTION("a table of fewer entries than tensors")
  {
    auto rule = pr.rule();
    rule.get<1>().table.num_tensors = 2;
    REQUIRE_THROWS_AS(plan.run(rule, fo::step_info{1}), fo::error);
    CHECK(pr.p == before);
    return;
  }
  REQUIRE_THROWS_AS(plan.run(pr.rule(), fo::step_info{1}), fo::error);
  CHECK(pr.p == before);
  CHECK(pr.rows == std::vector<double>(pr.rows.size(), -1.0));
}

TEST_CASE("the 32-bit dividers of element positions are exact", "[factored]")
{
  // Divisors from 2^31 on (a dimension of a tensor that large) give 0 for every n below 2^31:
  // an element below 2^31 of any tensor is located with these dividers (element::narrow_index).
  std::vector<std::int64_t> const divisors{1, 2, 3, 5, 7, 63, 64, 65, 768, 2304, 3072, 50257, (1 << 20) + 1,
                                           1 << 30, (std::int64_t{1} << 31) - 1, std::int64_t{1} << 31,
                                           (std::int64_t{1} << 31) + 1, std::int64_t{1} << 40, std::int64_t{1} << 48};
  std::uint64_t state = 12345;
  for (auto d : divisors) {
    auto const divider = fo::detail::small_divider::of(d);
    std::vector<std::int64_t> ns{0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, (std::int64_t{1} << 31) - 1,
                                 (std::int64_t{1} << 31) - d, ((std::int64_t{1} << 31) - 1) / d * d - 1};
    for (int k = 0; k < 2000; ++k) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      ns.push_back(static_cast<std::int64_t>(state >> 33));  // below 2^31
    }
    for (auto n : ns) {
      if (n < 0 || n >= (std::int64_t{1} << 31)) { continue; }
      INFO("n " << n << " d " << d);
      REQUIRE(divider.quotient(static_cast<std::uint32_t>(n)) == static_cast<std::uint32_t>(n / d));
    }
  }
}

TEST_CASE("an element's line factor found once per run of elements is the one found alone", "[factored]")
{
  // factored_lookup::factor_of: lane 0 of a run locates its row; the other lanes reuse it while
  // the run stays in that row. Runs of 1 to 8 elements from every offset, over shapes whose
  // rows end inside runs (columns not a multiple of the width, one-column and one-row
  // matrices, batches), the lookup reused from run to run as a backend's tensor body is.
  struct shape {
    std::int64_t matrices, rows, cols;
  };
  std::vector<shape> const shapes{{1, 3, 5}, {2, 4, 8}, {3, 5, 3}, {1, 1, 7}, {2, 3, 1}, {1, 6, 4}};
  fo::factored_layout layout;
  for (auto const& s : shapes) { layout.add(s.matrices, s.rows, s.cols, true); }
  std::vector<std::vector<double>> stats(2 * shapes.size());
  std::vector<double*> rows, cols;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    stats[2 * t].resize(static_cast<std::size_t>(layout.row_elements(t)));
    stats[2 * t + 1].resize(static_cast<std::size_t>(layout.col_elements(t)));
    rows.push_back(stats[2 * t].data());
    cols.push_back(stats[2 * t + 1].data());
  }
  std::vector<double> workspace(static_cast<std::size_t>(layout.workspace_doubles()));
  auto entries = layout.entries<double>(rows, cols, workspace.data());
  bool const large = GENERATE(false, true);
  // Tensors of 2^31 elements or more are located by index_divider: the same runs through it;
  // and so with elements that say their index is below 2^31 (element::narrow_index: the 32-bit
  // dividers, which every entry has, whatever its size).
  bool const narrow = GENERATE(false, true);
  if (large) {
    for (auto& entry : entries) { entry.small = false; }
  }
  auto const table = layout.table<double>(entries.data());
  using element_type = fo::element<double, fo::slots<fo::slot::grad_t>, fo::slots<>>;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    shape const s = shapes[t];
    auto const& entry = entries[t];
    for (std::int64_t k = 0; k < s.matrices * s.rows; ++k) { entry.row_factor[k] = static_cast<double>(k + 1); }
    for (std::int64_t k = 0; k < s.matrices * s.cols; ++k) { entry.col_factor[k] = 1000.0 * static_cast<double>(k + 1); }
    std::int64_t const elements = s.matrices * s.rows * s.cols;
    for (int width : {1, 2, 4, 8}) {
      for (int head = 0; head < width; ++head) {
        auto const lookup = fo::factored_lookup<double>::of(table, static_cast<std::int64_t>(t));
        for (std::int64_t first = head; first + width <= elements; first += width) {
          for (int lane = 0; lane < width; ++lane) {
            std::int64_t const i = first + lane;
            element_type e;
            e.set_position(static_cast<std::int64_t>(t), i);
            e.set_vector_lane(lane, width);
            e.set_narrow_index(narrow);
            std::int64_t const row_line = i / s.cols;
            std::int64_t const col_line = row_line / s.rows * s.cols + i % s.cols;
            INFO("tensor " << t << " width " << width << " head " << head << " element " << i << " large " << large
                           << " narrow " << narrow);
            REQUIRE(lookup.factor_of(e) == entry.row_factor[row_line] * entry.col_factor[col_line]);
            // A lookup made for the element alone (a body formed per element) agrees too.
            REQUIRE(fo::factored_lookup<double>::of(table, static_cast<std::int64_t>(t)).factor_of(e) ==
                    entry.row_factor[row_line] * entry.col_factor[col_line]);
          }
        }
      }
    }
  }
}

namespace {

/// update = grad (what the storing part's pass sums and stores).
struct take_gradient {
  using reads = fo::slots<fo::slot::grad_t>;
  using writes = fo::slots<>;
  template <class E>
  void operator()(E& e, fo::step_info const&) const
  {
    e[fo::slot::update] = e[fo::slot::grad];
  }
};

/// A factoring part whose pass stores (stored_by_pass): its pass sums the update per row and
/// column and stores it as exp_avg; the update pass resumes here: param = exp_avg + the row
/// statistic, from the stored exp_avg (the gradient is not loaded again).
struct store_sums {
  fo::factored_table<double> table{};
  using reads = fo::slots<fo::slot::exp_avg_t>;
  using writes = fo::slots<fo::slot::param_t>;
  using stored_by_pass = fo::slots<fo::slot::exp_avg_t>;
  fo::factored_table<double> factors() const { return table; }
  struct value {
    template <class E>
    double operator()(E& e) const
    {
      e[fo::slot::exp_avg] = e[fo::slot::update];
      return static_cast<double>(e[fo::slot::update]);
    }
  };
  value prepare_factor(fo::step_info const&) const { return {}; }
  sum_gradients::fold prepare_fold(fo::step_info const&) const { return {}; }
  struct body {
    fo::factored_table<double> table;
    template <class E>
    void operator()(E& e) const
    {
      auto const l = fo::factored_lookup<double>::of(table, e.tensor());
      e[fo::slot::param] = e[fo::slot::exp_avg] + l.row[l.locate(e.index()).row_line];
    }
  };
  body prepare(fo::step_info const&) const { return {table}; }
};

/// problem's tensors with an exp_avg slot (starting at -7) and the storing rule.
struct storing_problem : problem {
  std::vector<std::vector<double>> m;
  storing_problem()
  {
    for (auto const& t : p) { m.emplace_back(t.size(), -7.0); }
  }
  auto lists()
  {
    fo::tensor_list<double> pl, ml;
    fo::tensor_list<double const> gl;
    for (std::size_t t = 0; t < p.size(); ++t) {
      pl.push_back(p[t].data(), static_cast<std::int64_t>(p[t].size()));
      gl.push_back(g[t].data(), static_cast<std::int64_t>(g[t].size()));
      ml.push_back(m[t].data(), static_cast<std::int64_t>(m[t].size()));
    }
    return fo::bind(param = pl, grad = gl, exp_avg = ml);
  }
  auto rule() { return fo::chain(scale_by_count{}, take_gradient{}, store_sums{layout.table<double>(entries.data())}); }
};

}  // namespace

TEST_CASE("a factored pass that stores: the update resumes after it and loads only what it reads", "[factored]")
{
  using rule_type = decltype(storing_problem{}.rule());
  using lists_type = decltype(storing_problem{}.lists());
  using traffic = fo::memory_traffic<rule_type, lists_type>;
  STATIC_REQUIRE(rule_type::resume == 2);
  // The update: exp_avg loaded, param stored; the gradient neither loaded nor exp_avg stored.
  STATIC_REQUIRE(!traffic::loads<1>);
  STATIC_REQUIRE(traffic::loads<2>);
  STATIC_REQUIRE(!traffic::stores<2>);
  STATIC_REQUIRE(traffic::stores<0>);
  // Update 16, the reduction pass reads nothing, the factored pass reads grad and exp_avg (16)
  // and stores exp_avg (8).
  STATIC_REQUIRE(fo::bytes_per_element_v<rule_type, lists_type> == 16 + 0 + 24);
  storing_problem pr;
  auto const plan = fo::host::make_plan(pr.lists());
  plan.run(pr.rule(), fo::step_info{1});
  std::int64_t row_offset = 0;
  for (std::size_t t = 0; t < pr.dims.size(); ++t) {
    auto const n = static_cast<double>(pr.g[t].size());
    std::int64_t const C = pr.dims[t].size() >= 2 ? pr.dims[t].back() : 1;
    for (std::size_t i = 0; i < pr.g[t].size(); ++i) {
      CHECK(pr.m[t][i] == pr.g[t][i] * n);  // every element stored by the pass, vectors too
      double const row = pr.rows[static_cast<std::size_t>(row_offset) + i / static_cast<std::size_t>(C)];
      CHECK(pr.p[t][i] == pr.m[t][i] + row);
    }
    row_offset += pr.layout.row_elements(t);
  }
}

TEST_CASE("a storing pass's table must cover every tensor with elements", "[factored]")
{
  storing_problem pr;
  // The vectors without statistics, as add_torch_shape(dims, false) gives them.
  fo::factored_layout without;
  for (auto const& d : pr.dims) { without.add_torch_shape(d, false); }
  auto const entries = pr.entries_of(without);
  auto rule = pr.rule();
  rule.get<2>().table = without.table<double>(entries.data());
  CHECK(without.table<double>(entries.data()).elements < pr.layout.table<double>(pr.entries.data()).elements);
  auto const plan = fo::host::make_plan(pr.lists());
  auto const p0 = pr.p;
  auto const m0 = pr.m;
  REQUIRE_THROWS_WITH(plan.run(rule, fo::step_info{1}), fusedopt_test::contains("the pass stores every element"));
  CHECK(pr.p == p0);
  CHECK(pr.m == m0);
}
