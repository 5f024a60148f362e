// Only slot::remainder holds integers: a state (here exp_avg) bound to an int16 list would be
// truncated to integers at every step, so bind rejects it at compile time. The control binds
// the same memory as a remainder, which is legitimate.
// expect-error: a std::int16_t list can only be bound to slot::remainder
#include <fusedopt/fusedopt.hpp>

#include <cstdint>
#include <vector>

namespace fo = fusedopt;

int main()
{
  std::vector<float> p(4, 1.f), g(4, 2.f);
  std::vector<std::int16_t> s(4, 0);
  fo::tensor_list<float> params{{p.data(), 4}};
  fo::tensor_list<float> grads{{g.data(), 4}};
  fo::tensor_list<std::int16_t> states{{s.data(), 4}};
#if defined(FUSEDOPT_COMPILE_FAIL)
  auto const lists = fo::bind(fo::slot::param = params, fo::slot::grad = grads, fo::slot::exp_avg = states);
#else
  auto const lists = fo::bind(fo::slot::param = params, fo::slot::grad = grads, fo::slot::remainder = states);
#endif
  return static_cast<int>(lists.num_tensors()) - 1;
}
