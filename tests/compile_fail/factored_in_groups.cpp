// A rule with a factored pass (Adafactor) inside parameter groups: its statistics would be
// folded by no pass (groups hide the factoring part), so it is rejected.
// expect-error: which a group cannot hold
#include <fusedopt/fusedopt.hpp>

namespace fo = fusedopt;

int main()
{
#if defined(FUSEDOPT_COMPILE_FAIL)
  fo::groups<fo::rules::adafactor, 2> rule{};
#else
  fo::groups<fo::rules::adamw, 2> rule{};
#endif
  return fo::is_rule_v<decltype(rule)> ? 0 : 1;
}
