// A rule with a factored pass (Adafactor) under skip_if_nonfinite: a skipped step would still
// fold its factored statistics (caller memory, not slots the guard stores back), so it is
// rejected.
// expect-error: cannot wrap a rule with factored passes
#include <fusedopt/fusedopt.hpp>

namespace fo = fusedopt;

int main()
{
  float found_inf = 0;
#if defined(FUSEDOPT_COMPILE_FAIL)
  auto rule = fo::rules::skip_if_nonfinite(fo::rules::adafactor{}, &found_inf);
#else
  auto rule = fo::rules::skip_if_nonfinite(fo::rules::adamw{}, &found_inf);
#endif
  return fo::is_rule_v<decltype(rule)> ? 0 : 1;
}
