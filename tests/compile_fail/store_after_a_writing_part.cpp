// A part before one whose factored pass stores (stored_by_pass) writes a slot that pass does not
// store: the update pass resumes after that pass and would never write it, so it is rejected.
// expect-error: may write only slots that pass stores
#include <fusedopt/fusedopt.hpp>

namespace fo = fusedopt;

/// What the check sees of a storing part (its factored pass's members are not needed for it).
struct stores_exp_avg {
  using reads = fo::slots<fo::slot::exp_avg_t>;
  using writes = fo::slots<fo::slot::param_t>;
  using stored_by_pass = fo::slots<fo::slot::exp_avg_t>;
  template <class E>
  void operator()(E& e, fo::step_info const&) const
  {
    e[fo::slot::param] += e[fo::slot::exp_avg];
  }
};

int main()
{
#if defined(FUSEDOPT_COMPILE_FAIL)
  // weight decay writes param before the storing part: its write would be lost.
  auto rule = fo::chain(fo::rules::decoupled_weight_decay{}, stores_exp_avg{});
#else
  auto rule = fo::chain(fo::rules::negate_gradient_if{}, stores_exp_avg{});
#endif
  return fo::is_rule_v<decltype(rule)> ? 0 : 1;
}
