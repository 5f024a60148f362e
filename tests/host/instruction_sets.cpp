// The host loops' versions (host/instruction_set.hpp: baseline, AVX2, AVX-512, those this CPU
// runs) give the baseline's bits: optimizers over tensors of odd sizes that start off every
// vector boundary, chunks that end mid-vector, 8-bit quantized states, reduction passes, and
// the 16-bit conversions over special values. A version that fused a * b + c into an FMA, widened a reduction's
// lanes or narrowed a conversion differently fails here, as does a square root without the C
// library's bits (math::sqrt is a builtin of its own on the host: numeric/math.hpp).
#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <tuple>
#include <utility>
#include <vector>

#include "bits.hpp"
#include "prelude.hpp"
#include "reference/harness.hpp"

namespace {

using fo::host::instruction_set;
using fusedopt_test::bits_of;
using fusedopt_test::float_of;

// Sizes around every vector width (4 to 16 floats, 8 to 32 16-bit values), and past a chunk.
std::vector<std::int64_t> const odd_sizes{1, 3, 7, 15, 17, 31, 33, 63, 65, 127, 129, 1000, 4097};
// Chunks that end in the middle of every vector width.
constexpr std::int64_t odd_chunk = 100;

// One slot's tensors, back to back with one element between them and the first one past the
// allocation's start: no tensor starts on a 16-byte boundary (8-bit states, whose storage must,
// one 16-byte unit apart). Quantized states start as torch's do, at zero.
template <class T>
class slot_memory {
 public:
  slot_memory(std::vector<std::int64_t> const& sizes, std::uint64_t seed, double lo, double hi) : sizes_(sizes)
  {
    std::int64_t next = 1;
    for (auto n : sizes) {
      offsets_.push_back(next);
      if constexpr (fo::is_blockwise_v<T>) {
        next += T::units_for(n) + 1;
      } else {
        next += n + 1;
      }
    }
    values_.resize(static_cast<std::size_t>(next));
    fusedopt_test::random r(seed);
    for (auto& v : values_) {
      if constexpr (fo::is_blockwise_v<T>) {
        v = T{};  // zeros: scale 0 reads every code as 0
      } else {
        // Signed values when lo < 0: magnitudes in [|hi| / 100, |hi|) with a random sign.
        double const x = r.uniform(lo < 0 ? hi / 100 : lo, hi);
        v = fusedopt_test::from_double<T>(lo < 0 && r.uniform(0, 1) < 0.5 ? -x : x);
      }
    }
  }

  template <class U = T>
  [[nodiscard]] fo::tensor_list<U> list()
  {
    fo::tensor_list<U> l;
    for (std::size_t i = 0; i < sizes_.size(); ++i) { l.push_back(values_.data() + offsets_[i], sizes_[i]); }
    return l;
  }
  [[nodiscard]] fo::tensor_list<T const> const_list() { return list<T const>(); }
  [[nodiscard]] std::vector<T>& values() { return values_; }
  [[nodiscard]] std::vector<unsigned char> bytes() const
  {
    std::vector<unsigned char> b(values_.size() * sizeof(T));
    std::memcpy(b.data(), values_.data(), b.size());
    return b;
  }

 private:
  std::vector<std::int64_t> sizes_;
  std::vector<std::int64_t> offsets_;
  std::vector<T> values_;
};

// The value range of each slot a case binds, in binding order.
struct range {
  double lo, hi;
};

// Three steps of `rule` (step 1 and later ones: momentum's first step, bias corrections) over
// fresh slots of types T... bound by `bind`, with at most `set`'s loops; every slot's bytes.
template <class... T, class Rule, class Bind, std::size_t... K>
std::vector<std::vector<unsigned char>> run_steps(instruction_set set, Rule const& rule, Bind const& bind,
                                                  std::vector<range> const& ranges, std::index_sequence<K...>)
{
  std::tuple<slot_memory<T>...> slots{slot_memory<T>(odd_sizes, 11 + K, ranges[K].lo, ranges[K].hi)...};
  fo::host::options opts;
  opts.widest_instruction_set = set;
  opts.chunk_elements = odd_chunk;
  auto plan = fo::host::make_plan(bind(std::get<K>(slots)...), opts);
  CHECK(plan.used_instruction_set() == set);
  for (std::int64_t step = 1; step <= 3; ++step) { plan.run(rule, fo::step_info{step}); }
  return {std::get<K>(slots).bytes()...};
}

// Every version this machine runs gives the baseline's bytes in every slot.
template <class... T, class Rule, class Bind>
void expect_same_bits_in_every_version(Rule const& rule, Bind const& bind, std::vector<range> const& ranges)
{
  auto const sets = fo::host::runnable_instruction_sets();
  if (sets.size() == 1) { WARN("only one version of the host loops runs here: nothing to compare"); }
  auto const baseline = run_steps<T...>(sets.front(), rule, bind, ranges, std::index_sequence_for<T...>{});
  for (auto set : sets) {
    INFO("version " << fo::host::instruction_set_name(set) << " against " << fo::host::instruction_set_name(sets.front()));
    CHECK(same(run_steps<T...>(set, rule, bind, ranges, std::index_sequence_for<T...>{}), baseline));
  }
}

range const params{-1, 1}, grads{-1e-2, 1e-2}, first_moments{-1e-3, 1e-3}, second_moments{1e-9, 1e-5};
std::vector<range> const adam_ranges{params, grads, first_moments, second_moments};
std::vector<range> const sgd_ranges{params, grads, first_moments};

// param, grad, exp_avg, exp_avg_sq and, with amsgrad, max_exp_avg_sq.
struct bind_adam_slots {
  template <class P, class G, class M, class V, class... Max>
  auto operator()(P& p, G& g, M& m, V& v, Max&... vmax) const
  {
    return fo::bind(param = p.list(), grad = g.const_list(), exp_avg = m.list(), exp_avg_sq = v.list(),
                    (max_exp_avg_sq = vmax.list())...);
  }
};
struct bind_sgd_slots {
  template <class P, class G, class B>
  auto operator()(P& p, G& g, B& b) const
  {
    return fo::bind(param = p.list(), grad = g.const_list(), momentum_buffer = b.list());
  }
};

// master -> param and param -> master in one element: both conversions in every loop version.
struct swap_param_and_master {
  using reads = fo::slots<fo::slot::param_t, fo::slot::master_t>;
  using writes = fo::slots<fo::slot::param_t, fo::slot::master_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    auto const stored = e[param];
    e[param] = e[master];
    e[master] = stored;
  }
};

// Every 16-bit pattern as param, and as master floats near every rounding boundary of both
// types (ties, subnormals, overflow, infinities, NaNs) and a stride through all 2^32.
template <class Half>
void expect_conversions_in_every_version()
{
  std::vector<std::int64_t> const sizes{65536 + 3};
  std::vector<std::uint32_t> floats;
  for (std::uint32_t boundary : {0u, 0x00010000u, 0x33000000u, 0x38800000u, 0x3f808000u, 0x3f818000u, 0x477ff000u,
                                 0x7f7f8000u, 0x7f800000u, 0x7fc00000u}) {
    for (std::uint32_t d = 0; d < 1024; ++d) {
      for (std::uint32_t sign : {0u, 0x80000000u}) {
        floats.push_back(sign | ((boundary + d) & 0x7fffffffu));
        floats.push_back(sign | ((boundary - d) & 0x7fffffffu));
      }
    }
  }
  for (std::uint32_t u = 0; floats.size() < static_cast<std::size_t>(sizes[0]); u += 104729u * 641u) { floats.push_back(u); }

  for (auto set : fo::host::runnable_instruction_sets()) {
    INFO("version " << fo::host::instruction_set_name(set));
    slot_memory<Half> halves(sizes, 1, 0, 1);
    slot_memory<float> masters(sizes, 2, 0, 1);
    auto const elements = static_cast<std::size_t>(sizes[0]);
    for (std::size_t i = 1; i <= elements; ++i) {  // the tensor starts at 1
      halves.values()[i] = Half::from_bits(static_cast<std::uint16_t>(i - 1));
      masters.values()[i] = float_of(floats[i - 1]);
    }
    auto const halves_before = halves.values();
    auto const masters_before = masters.values();
    fo::host::options opts;
    opts.widest_instruction_set = set;
    opts.chunk_elements = odd_chunk;
    fo::host::apply(swap_param_and_master{}, fo::bind(param = halves.list(), master = masters.list()), fo::step_info{1},
                    opts);
    std::size_t mismatches = 0, first = 0;
    for (std::size_t i = 1; i <= elements; ++i) {
      if (halves.values()[i].bits != Half(masters_before[i]).bits ||
          bits_of(masters.values()[i]) != bits_of(static_cast<float>(halves_before[i]))) {
        first = mismatches++ == 0 ? i : first;
      }
    }
    INFO("first mismatch at " << first << ": float bits " << bits_of(masters_before[first]) << ", 16-bit "
                              << halves_before[first].bits);
    CHECK(mismatches == 0);
  }
}

// param = sqrt(grad): fo::math::sqrt, on the host the builtin declared not to set errno.
struct sqrt_of_grad {
  using reads = fo::slots<fo::slot::grad_t>;
  using writes = fo::slots<fo::slot::param_t>;
  template <class E>
  FUSEDOPT_HOST_DEVICE void operator()(E& e, fo::step_info const&) const
  {
    e[param] = fo::math::sqrt(e[grad]);
  }
};

template <class T, class Bits>
T value_of(Bits bits)
{
  static_assert(sizeof(T) == sizeof(Bits), "one pattern per value");
  T value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Every version's square root over `patterns` has the bits of the C library's `library`: the
// same correctly rounded value, a NaN's payload kept (and quieted), the default NaN for a
// negative input, -0 for -0.
template <class T, class Bits>
void expect_library_sqrt_in_every_version(std::vector<Bits> const& patterns, T (*library)(T))
{
  std::vector<std::int64_t> const sizes{static_cast<std::int64_t>(patterns.size())};
  for (auto set : fo::host::runnable_instruction_sets()) {
    INFO("version " << fo::host::instruction_set_name(set));
    slot_memory<T> roots(sizes, 1, 0, 1);
    slot_memory<T> inputs(sizes, 2, 0, 1);
    for (std::size_t i = 0; i < patterns.size(); ++i) { inputs.values()[i + 1] = value_of<T>(patterns[i]); }  // starts at 1
    fo::host::options opts;
    opts.widest_instruction_set = set;
    opts.chunk_elements = odd_chunk;
    fo::host::apply(sqrt_of_grad{}, fo::bind(param = roots.list(), grad = inputs.const_list()), fo::step_info{1}, opts);
    std::size_t mismatches = 0, first = 0;
    for (std::size_t i = 0; i < patterns.size(); ++i) {
      T const expected = library(value_of<T>(patterns[i]));
      if (std::memcmp(&roots.values()[i + 1], &expected, sizeof(T)) != 0) { first = mismatches++ == 0 ? i : first; }
    }
    INFO("first mismatch for the pattern " << patterns[first]);
    CHECK(mismatches == 0);
  }
}

}  // namespace

TEST_CASE("host loop versions: math::sqrt gives the C library's bits", "[instruction_sets]")
{
  SECTION("float")
  {
    std::vector<std::uint32_t> patterns{0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u,
                                        0x7fc12345u, 0xffa00001u, 0x7f800001u, 0x00000001u, 0x007fffffu, 0x80000001u,
                                        0xbf800000u, 0x3f800000u, 0x7f7fffffu, 0x40800000u};
    for (std::uint32_t u = 7; patterns.size() < 100000; u += 104729u * 41u) { patterns.push_back(u); }
    expect_library_sqrt_in_every_version<float>(patterns, ::sqrtf);
  }
  SECTION("double")
  {
    std::vector<std::uint64_t> patterns{0, 0x8000000000000000u, 0x7ff0000000000000u, 0xfff0000000000000u,
                                        0x7ff8000000000000u, 0xfff8000000000000u, 0x7ff8123456789abcu,
                                        0x7ff0000000000001u, 0x0000000000000001u, 0xbff0000000000000u,
                                        0x3ff0000000000000u, 0x7fefffffffffffffu};
    for (std::uint64_t u = 7; patterns.size() < 100000; u += 0x9e3779b97f4a7c15u) { patterns.push_back(u); }
    expect_library_sqrt_in_every_version<double>(patterns, ::sqrt);
  }
}

TEST_CASE("host loop versions: optimizers give the baseline's bits", "[instruction_sets]")
{
  SECTION("Adam fp32, L2 weight decay")
  {
    fo::rules::adam rule;
    rule.weight_decay = 1e-2;
    expect_same_bits_in_every_version<float, float, float, float>(rule, bind_adam_slots{}, adam_ranges);
  }
  SECTION("AdamW, bf16 params and grads, fp32 moments")
  {
    expect_same_bits_in_every_version<fo::bfloat16, fo::bfloat16, float, float>(fo::rules::adamw{}, bind_adam_slots{},
                                                                                 adam_ranges);
  }
  SECTION("Adam with amsgrad, half params and grads, maximize")
  {
    fo::rules::adam rule;
    rule.amsgrad = true;
    rule.maximize = true;
    auto ranges = adam_ranges;
    ranges.push_back(second_moments);
    expect_same_bits_in_every_version<fo::half, fo::half, float, float, float>(rule, bind_adam_slots{}, ranges);
  }
  SECTION("SGD, Nesterov momentum, fp32")
  {
    fo::rules::sgd rule;
    rule.lr = 1e-2;
    rule.momentum = 0.9;
    rule.nesterov = true;
    rule.weight_decay = 1e-4;
    expect_same_bits_in_every_version<float, float, float>(rule, bind_sgd_slots{}, sgd_ranges);
  }
  SECTION("SGD, dampened momentum, bf16 params and buffers, double")
  {
    fo::rules::sgd rule;
    rule.lr = 1e-2;
    rule.momentum = 0.9;
    rule.dampening = 0.1;
    expect_same_bits_in_every_version<fo::bfloat16, fo::bfloat16, fo::bfloat16>(rule, bind_sgd_slots{}, sgd_ranges);
    expect_same_bits_in_every_version<double, double, double>(rule, bind_sgd_slots{}, sgd_ranges);
  }
  SECTION("AdamW, 8-bit blockwise moments: blocks updated as a whole")
  {
    expect_same_bits_in_every_version<float, float, fo::signed_q8, fo::unsigned_q8>(fo::rules::adamw{},
                                                                                   bind_adam_slots{}, adam_ranges);
  }
  SECTION("clipping by the global norm, then AdamW: a reduction pass")
  {
    fo::rules::clip_by_global_norm clip;
    clip.max_norm = 0.1;
    expect_same_bits_in_every_version<float, float, float, float>(fo::chain(clip, fo::rules::adamw{}),
                                                                  bind_adam_slots{}, adam_ranges);
  }
  SECTION("LAMB, bf16 params: per-tensor reductions of several slots")
  {
    expect_same_bits_in_every_version<fo::bfloat16, float, float, float>(fo::rules::lamb{}, bind_adam_slots{},
                                                                         adam_ranges);
  }
}

TEST_CASE("host loop versions: 16-bit conversions give the scalar conversions' bits", "[instruction_sets][dtypes]")
{
  SECTION("bfloat16") { expect_conversions_in_every_version<fo::bfloat16>(); }
  SECTION("half") { expect_conversions_in_every_version<fo::half>(); }
}

TEST_CASE("host loop versions: the choice follows the options and the CPU", "[instruction_sets]")
{
  auto const supported = fo::host::supported_instruction_set();
  CHECK(fo::host::effective_instruction_set(instruction_set::avx512) == supported);
  auto const sets = fo::host::runnable_instruction_sets();
  CHECK(sets.back() == supported);
  for (auto set : sets) { CHECK(fo::host::effective_instruction_set(set) == set); }
  fo::host::options opts;
  opts.widest_instruction_set = static_cast<instruction_set>(7);
  std::vector<float> p(4), g(4);
  auto const lists = fo::bind(param = fo::tensor_list<float>{{p.data(), 4}}, grad = fo::tensor_list<float const>{{g.data(), 4}});
  expect_error([&] { (void)fo::host::make_plan(lists, opts); }, {"widest_instruction_set"});
}
