// A part before one whose factored pass stores (stored_by_pass) writes a slot that pass does not
// store: the update pass resumes after that pass and would never write it, so it is rejected.
// expect-error: may write only slots that pass stores
#include <fusedopt/fusedopt.hpp>

namespace fo = fusedopt;

/// Stores exp_avg in its factored pass (a sum of the gradient); the update adds it to param.
struct store_exp_avg {
  fo::factored_table<float> table{};
  using reads = fo::slots<fo::slot::exp_avg_t>;
  using writes = fo::slots<fo::slot::param_t>;
  using stored_by_pass = fo::slots<fo::slot::exp_avg_t>;
  fo::factored_table<float> factors() const { return table; }
  struct value {
    template <class E>
    double operator()(E& e) const
    {
      e[fo::slot::exp_avg] = e[fo::slot::grad];
      return e[fo::slot::grad];
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
    template <class E>
    void operator()(E& e) const
    {
      e[fo::slot::param] += e[fo::slot::exp_avg];
    }
  };
  body prepare(fo::step_info const&) const { return {}; }
};

int main()
{
#if defined(FUSEDOPT_COMPILE_FAIL)
  // weight decay writes param before the storing part: its write would be lost.
  auto rule = fo::chain(fo::rules::decoupled_weight_decay{}, store_exp_avg{});
#else
  auto rule = fo::chain(fo::rules::negate_gradient_if{}, store_exp_avg{});
#endif
  return fo::is_rule_v<decltype(rule)> ? 0 : 1;
}
