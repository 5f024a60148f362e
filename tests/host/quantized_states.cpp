// 8-bit blockwise-quantized states on the host backend (numeric/quantization.hpp): the maps
// and the quantizer against the independent reference (tests/reference/quantization.hpp),
// blocks of zeros, a huge value, non-finite values, unchanged blocks, sizes that are not
// multiples of the block, chunking, Adam, AdamW, SGD momentum and Lion against their fp32
// runs, the plan's vectorised block update against access::update_block bit for bit, byte
// counts, binding checks and a tensor of more than 2^31 elements.
#include "prelude.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "bits.hpp"
#include "reference/quantization.hpp"

namespace {

using fusedopt_test::assign_state;
using fusedopt_test::keep_state;
using fusedopt_test::read_state;
using fusedopt_test::reference_dequantize;
using fusedopt_test::reference_map_floats;
using fusedopt_test::reference_quantize;
using fusedopt_test::q8_storage;
using fusedopt_test::same_block;
using fusedopt_test::same_blocks;

using m_t = fo::slot::momentum_buffer_t;
/// A slot each map may be bound to: the unsigned map only holds non-negative states.
template <class Q>
using slot_for = std::conditional_t<Q::map_type::is_signed, m_t, fo::slot::exp_avg_sq_t>;

/// Tensors of the given sizes, each its own storage, zeros (scale 0, the code of 0) as torch
/// starts them.
template <class Q>
struct quantized_tensors {
  std::vector<std::int64_t> sizes;
  std::vector<q8_storage<Q>> blocks;

  explicit quantized_tensors(std::vector<std::int64_t> s) : sizes(std::move(s))
  {
    for (auto n : sizes) { blocks.emplace_back(n); }
  }
  [[nodiscard]] fo::tensor_list<Q> list()
  {
    fo::tensor_list<Q> l;
    for (std::size_t t = 0; t < sizes.size(); ++t) { l.push_back(blocks[t].data(), sizes[t]); }
    return l;
  }
};

/// Runs assign_state with `values` (all tensors end to end).
template <class Q>
void assign(quantized_tensors<Q>& q, std::vector<float> const& values, fo::host::options opts = {})
{
  std::vector<std::int64_t> offsets{0};
  for (auto n : q.sizes) { offsets.push_back(offsets.back() + n); }
  fo::host::apply(assign_state<slot_for<Q>>{values.data(), offsets.data()}, fo::bind(slot_for<Q>{} = q.list()),
                  fo::step_info{1}, opts);
}

std::vector<float> slice(std::vector<float> const& v, std::int64_t first, std::int64_t n)
{
  return {v.begin() + first, v.begin() + first + n};
}

}  // namespace

TEMPLATE_TEST_CASE("the dynamic maps are the paper's: every code of a block of scale 1 reads back as its value",
                   "[quantized]", fo::signed_q8, fo::unsigned_q8)
{
  using Q = TestType;
  std::vector<float> const map = reference_map_floats(Q::map_type::is_signed);
  REQUIRE(map.size() == 256);
  CHECK(map[255] == 1.f);
  CHECK(map[Q::map_type::is_signed ? 127 : 0] == 0.f);
  if (Q::map_type::is_signed) {
    CHECK(map[0] == fusedopt_test::Approx(-0.99297).epsilon(1e-5));  // -1 is not a value of the signed map
  }
  q8_storage<Q> block(256);
  block.set_scale(0, 1.f);
  for (int c = 0; c < 256; ++c) { block.set_code(c, c); }
  std::vector<float> out(256, -7.f);
  fo::tensor_list<Q> q{{block.data(), 256}};
  fo::tensor_list<float> p{{out.data(), 256}};
  fo::host::apply(read_state<slot_for<Q>>{}, fo::bind(fo::slot::param = p, slot_for<Q>{} = q));
  for (int c = 0; c < 256; ++c) {
    INFO("code " << c);
    CHECK(fusedopt_test::bits_of(out[static_cast<std::size_t>(c)]) == fusedopt_test::bits_of(map[static_cast<std::size_t>(c)]));
  }
}

TEMPLATE_TEST_CASE("quantizing gives the reference's scales and nearest codes, ties to the lower code",
                   "[quantized]", fo::signed_q8, fo::unsigned_q8)
{
  using Q = TestType;
  bool const is_signed = Q::map_type::is_signed;
  std::int64_t const n = 256 * 40 + 77;
  std::vector<float> values = fusedopt_test::mixed_values(n, 3, is_signed);
  // Block 1: scale 1 and every exact midpoint between neighbouring codes that a float holds.
  std::vector<float> const map = reference_map_floats(is_signed);
  values[256] = 1.f;
  int ties = 0;
  for (int c = 0; c + 1 < 256 && ties < 255; ++c) {
    double const mid = (static_cast<double>(map[c]) + map[c + 1]) / 2;
    if (static_cast<double>(static_cast<float>(mid)) == mid) { values[static_cast<std::size_t>(257 + ties++)] = static_cast<float>(mid); }
  }
  for (int i = 257 + ties; i < 512; ++i) { values[static_cast<std::size_t>(i)] = 0.5f; }
  CHECK(ties > 20);
  quantized_tensors<Q> q({n});
  assign(q, values);
  auto const expected = reference_quantize<Q>(values);
  CHECK(same_blocks(q.blocks[0], expected));
  for (int k = 0; k < ties; ++k) {  // the lower of the two codes: the one whose value is below
    std::uint8_t const code = q.blocks[0].code(257 + k);
    CHECK(map[code] < values[static_cast<std::size_t>(257 + k)]);
  }
  // Dequantized, every value is within half a code gap of the scale times its normalised value.
  auto const back = reference_dequantize(q.blocks[0]);
  for (std::int64_t i = 0; i < n; ++i) {
    float const absmax = q.blocks[0].scale(i / 256);
    CHECK(std::fabs(back[static_cast<std::size_t>(i)] - values[static_cast<std::size_t>(i)]) <= 0.06f * absmax);
  }
}

TEMPLATE_TEST_CASE("the bucketed code search agrees with the nearest-value scan near every midpoint and bucket edge",
                   "[quantized]", fo::signed_q8, fo::unsigned_q8)
{
  using Q = TestType;
  bool const is_signed = Q::map_type::is_signed;
  std::vector<float> const map = reference_map_floats(is_signed);
  auto const& library = fo::detail::host_map<typename Q::map_type>;
  std::vector<float> probes{0.f, -0.f, 1.f};
  auto around = [&](double x) {  // x and the floats within 3 ulps of it, both signs
    float f = static_cast<float>(x);
    for (int k = 0; k < 3; ++k) { f = std::nextafter(f, 0.f); }
    for (int k = 0; k < 7; ++k, f = std::nextafter(f, 2.f)) {
      if (std::fabs(f) <= 1.f) {
        probes.push_back(f);
        if (is_signed) { probes.push_back(-f); }
      }
    }
  };
  for (int c = 0; c + 1 < 256; ++c) { around((static_cast<double>(map[c]) + map[c + 1]) / 2); }
  for (float v : map) { around(v); }
  for (int b = 0; b < fo::detail::quantization_buckets; ++b) {  // each bucket's low end: its bits
    around(fo::detail::bits_float(fo::detail::quantization_smallest_bits + (static_cast<std::uint32_t>(b) << 16)));
  }
  // Just above 1 (x * fl(1 / absmax) can round there), and negative q for the unsigned map
  // (the code of 0, the nearest of its values).
  for (float f = 1.f; f < 1.00001f; f = std::nextafter(f, 2.f)) {
    probes.push_back(f);
    probes.push_back(-f);
  }
  if (!is_signed) {
    for (float f : {-0.f, -1e-30f, -1e-7f, -0.3f, -1.f}) { probes.push_back(f); }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-30.f, 0.f);
  for (int i = 0; i < 200000; ++i) {
    float const f = std::pow(2.f, exponent(rng));
    probes.push_back(is_signed && (i & 1) ? -f : f);
  }
  int mismatches = 0;
  for (float q : probes) {
    if (fo::detail::quantize(library, q, 1.f) != fusedopt_test::reference_code(map, q, 1.f)) { ++mismatches; }
  }
  CHECK(mismatches == 0);
  CHECK(probes.size() > 20000);
}

TEST_CASE("blocks of zeros, one huge value, subnormal values, and sizes that are not multiples of the block", "[quantized]")
{
  std::vector<std::int64_t> const sizes = {1, 255, 256, 257, 1000, 4097};
  std::int64_t total = 0;
  for (auto s : sizes) { total += s; }
  std::vector<float> values = fusedopt_test::mixed_values(total, 5, true);
  std::int64_t const last = total - 4097;             // the last tensor
  std::fill(values.begin() + last, values.begin() + last + 256, 0.f);  // its block 0: zeros
  values[static_cast<std::size_t>(last + 256 + 3)] = 3e38f;            // block 1: one huge value
  values[static_cast<std::size_t>(last + 512 + 9)] = -3e38f;           // block 2: one huge negative
  for (int i = 0; i < 256; ++i) {  // block 3: subnormal magnitudes only (1 / absmax would overflow)
    values[static_cast<std::size_t>(last + 768 + i)] = (i % 2 ? -1e-39f : 2e-40f) * static_cast<float>(i % 7);
  }
  auto const chunk = GENERATE(std::int64_t{1} << 15, std::int64_t{1}, std::int64_t{300});  // rounded up to 256, 512
  fo::host::options opts;
  opts.chunk_elements = chunk;
  quantized_tensors<fo::signed_q8> q(sizes);
  assign(q, values, opts);
  std::int64_t at = 0;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    INFO("tensor " << t << " of " << sizes[t] << " elements, chunks of " << chunk);
    // Each tensor's blocks are its own: the reference quantizes every tensor on its own.
    CHECK(same_blocks(q.blocks[t], reference_quantize<fo::signed_q8>(slice(values, at, sizes[t]))));
    at += sizes[t];
  }
  auto const& big = q.blocks.back();
  auto codes_of_block = [&big](std::int64_t b) {
    std::vector<int> codes;
    for (std::int64_t i = 256 * b; i < 256 * (b + 1); ++i) { codes.push_back(big.code(i)); }
    return codes;
  };
  auto const all_zero = [](std::vector<int> const& codes) {
    return std::all_of(codes.begin(), codes.end(), [](int c) { return c == 127; });
  };
  CHECK(big.scale(0) == 0.f);
  CHECK(all_zero(codes_of_block(0)));
  CHECK(big.scale(1) == 3e38f);
  CHECK(big.code(256 + 3) == 255);  // exactly the value: 1 * absmax
  CHECK(big.scale(2) == 3e38f);
  CHECK(big.code(512 + 9) == 0);  // -0.99297 * absmax: the signed map's most negative value
  for (int i = 0; i < 256; ++i) {
    if (i != 3) { CHECK(big.code(256 + i) == 127); }  // all below 1e-6 of the scale: 0
  }
  float subnormal_max = 0.f;
  for (int i = 0; i < 256; ++i) { subnormal_max = std::max(subnormal_max, std::fabs(values[static_cast<std::size_t>(last + 768 + i)])); }
  CHECK(subnormal_max > 0.f);
  CHECK(subnormal_max < std::numeric_limits<float>::min());
  CHECK(big.scale(3) == subnormal_max);  // kept; every code that of 0: the block reads back as zeros
  CHECK(all_zero(codes_of_block(3)));
}

TEST_CASE("a block with a non-finite value keeps its codes and scale; its neighbours are updated",
          "[quantized][nonfinite]")
{
  float const bad = GENERATE(std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity());
  std::int64_t const n = 256 * 3 + 10;
  quantized_tensors<fo::signed_q8> q({n});
  std::vector<float> const first = fusedopt_test::mixed_values(n, 7, true);
  assign(q, first);
  q8_storage<fo::signed_q8> const before = q.blocks[0];
  std::vector<float> second = fusedopt_test::mixed_values(n, 8, true);
  second[256 + 100] = bad;  // block 1
  second[n - 1] = bad;      // block 3, the partial last one
  assign(q, second);
  auto const expected = reference_quantize<fo::signed_q8>(second);
  CHECK(same_block(q.blocks[0], 0, expected, 0));
  CHECK(same_block(q.blocks[0], 2, expected, 2));
  CHECK(same_block(q.blocks[0], 1, before, 1));
  CHECK(same_block(q.blocks[0], 3, before, 3));
  CHECK(std::isfinite(q.blocks[0].scale(1)));
}

TEST_CASE("a block whose values come out as loaded keeps its bits (quantizing them again could move them)",
          "[quantized]")
{
  std::int64_t const n = 700;
  quantized_tensors<fo::signed_q8> q({n});
  q8_storage<fo::signed_q8>& blocks = q.blocks[0];
  for (std::int64_t b = 0; b < blocks.blocks(); ++b) {
    blocks.set_scale(b, 0.37f + static_cast<float>(b));
    // No element takes code 255 (the value 1): requantizing would shrink the scale.
    for (std::int64_t i = 256 * b; i < std::min(n, 256 * (b + 1)); ++i) {
      blocks.set_code(i, static_cast<int>(((i % 256) * 37 + b) % 200));
    }
  }
  q8_storage<fo::signed_q8> const before = blocks;
  fo::host::apply(keep_state<m_t>{}, fo::bind(fo::slot::momentum_buffer = q.list()));
  CHECK(same_blocks(blocks, before));

  // A step skip_if_nonfinite skips leaves every state as it was, param and states alike.
  std::vector<float> param(n, 1.f), grad(n, 0.5f);
  grad[5] = std::numeric_limits<float>::quiet_NaN();
  fo::tensor_list<float> p{{param.data(), n}};
  fo::tensor_list<float const> g{{grad.data(), n}};
  fo::rules::sgd sgd;
  sgd.lr = 0.1;
  sgd.momentum = 0.9;
  float found_inf = 0.f;
  auto plan = fo::host::make_plan(fo::bind(fo::slot::param = p, fo::slot::grad = g, fo::slot::momentum_buffer = q.list()));
  plan.run(fo::rules::skip_if_nonfinite(sgd, &found_inf), fo::step_info{2});
  CHECK(found_inf == 1.f);
  CHECK(same_blocks(blocks, before));
  CHECK(std::all_of(param.begin(), param.end(), [](float x) { return x == 1.f; }));
}

namespace {

/// One quantized run and one fp32 run of `rule` side by side, the fp32 states set to the
/// dequantized quantized ones before every step (teacher forcing): the parameters must agree
/// bit for bit and the quantized states must be the reference's quantization of the fp32
/// states after the step. `States` are pairs (slot, quantized type).
template <class Rule, class... States>
class fp32_comparison {
 public:
  fp32_comparison(Rule rule, std::vector<std::int64_t> sizes)
    : rule_(rule), sizes_(std::move(sizes)), q_{quantized_tensors<typename States::second_type>(sizes_)...}
  {
    for (auto s : sizes_) { total_ += s; }
    param_q_ = param_f_ = fusedopt_test::mixed_values(total_, 11, true);
    fp32_.assign(sizeof...(States), std::vector<float>(static_cast<std::size_t>(total_)));
  }

  void run(int steps)
  {
    for (int t = 1; t <= steps; ++t) {
      INFO("step " << t);
      step(t, std::index_sequence_for<States...>{});
    }
  }

 private:
  template <std::size_t K>
  using state_t = std::tuple_element_t<K, std::tuple<States...>>;

  template <class T>
  fo::tensor_list<T> list_of(T* data) const
  {
    fo::tensor_list<T> l;
    std::int64_t at = 0;
    for (auto s : sizes_) {
      l.push_back(data + at, s);
      at += s;
    }
    return l;
  }

  template <std::size_t K>
  void dequantize_state()
  {
    auto& out = fp32_[K];
    out.clear();
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      auto const part = reference_dequantize(std::get<K>(q_).blocks[t]);
      out.insert(out.end(), part.begin(), part.end());
    }
  }

  template <std::size_t K>
  void check_state() const
  {
    using Q = typename state_t<K>::second_type;
    std::int64_t first = 0;
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      INFO("state " << K << ", tensor " << t);
      CHECK(same_blocks(std::get<K>(q_).blocks[t], reference_quantize<Q>(slice(fp32_[K], first, sizes_[t]))));
      first += sizes_[t];
    }
  }

  template <std::size_t... K>
  void step(int t, std::index_sequence<K...>)
  {
    std::vector<float> grad = fusedopt_test::mixed_values(total_, 100 + static_cast<std::uint64_t>(t), true);
    for (auto& x : grad) { x = std::max(-1.f, std::min(1.f, x)); }
    fo::tensor_list<float const> const g = list_of<float const>(grad.data());
    (dequantize_state<K>(), ...);
    fo::host::apply(rule_, fo::bind(fo::slot::param = list_of(param_q_.data()), fo::slot::grad = g,
                                    (typename state_t<K>::first_type{} = std::get<K>(q_).list())...),
                    fo::step_info{t});
    fo::host::apply(rule_, fo::bind(fo::slot::param = list_of(param_f_.data()), fo::slot::grad = g,
                                    (typename state_t<K>::first_type{} = list_of(fp32_[K].data()))...),
                    fo::step_info{t});
    CHECK(std::memcmp(param_q_.data(), param_f_.data(), param_q_.size() * sizeof(float)) == 0);
    (check_state<K>(), ...);
  }

  Rule rule_;
  std::vector<std::int64_t> sizes_;
  std::int64_t total_ = 0;
  std::vector<float> param_q_, param_f_;
  std::tuple<quantized_tensors<typename States::second_type>...> q_;
  std::vector<std::vector<float>> fp32_;
};

template <class Rule, class... States>
void check_against_fp32(Rule const& rule, std::vector<std::int64_t> const& sizes, int steps, States...)
{
  fp32_comparison<Rule, States...>(rule, sizes).run(steps);
}

/// momentum = values[index % 1024]: only the position decides.
struct by_position {
  float const* values;
  using reads = fo::slots<>;
  using writes = fo::slots<m_t>;
  template <class E>
  void operator()(E& e, fo::step_info const&) const
  {
    e[fo::slot::momentum_buffer] = values[e.index() % 1024];
  }
};

template <class Slot, class Q>
using state = std::pair<Slot, Q>;

}  // namespace

TEST_CASE("Adam, AdamW, SGD momentum, Lion, LAMB, clip + AdamW and AdEMAMix on 8-bit states: the fp32 step on "
          "the dequantized states, requantized",
          "[quantized][optimizers]")
{
  std::vector<std::int64_t> const sizes = {3, 256, 1000, 513};
  using m_state = state<fo::slot::exp_avg_t, fo::signed_q8>;
  using v_state = state<fo::slot::exp_avg_sq_t, fo::unsigned_q8>;
  SECTION("Adam")
  {
    fo::rules::adam adam;
    adam.lr = 1e-2;
    check_against_fp32(adam, sizes, 5, m_state{}, v_state{});
  }
  SECTION("AdamW")
  {
    fo::rules::adamw adamw;
    adamw.lr = 1e-2;
    adamw.weight_decay = 0.1;
    check_against_fp32(adamw, sizes, 5, m_state{}, v_state{});
  }
  SECTION("SGD with momentum")
  {
    fo::rules::sgd sgd;
    sgd.lr = 0.1;
    sgd.momentum = 0.9;
    sgd.nesterov = true;
    check_against_fp32(sgd, sizes, 5, state<fo::slot::momentum_buffer_t, fo::signed_q8>{});
  }
  SECTION("Lion")
  {
    fo::rules::lion lion;
    lion.lr = 1e-3;
    lion.weight_decay = 0.5;
    check_against_fp32(lion, sizes, 5, m_state{});
  }
  // Rules with reduction passes: LAMB's passes read the moments (dequantized) to form each
  // tensor's update norm; the clip's pass reads the gradients only.
  SECTION("LAMB")
  {
    fo::rules::lamb lamb;
    lamb.lr = 1e-2;
    lamb.weight_decay = 0.01;
    check_against_fp32(lamb, sizes, 5, m_state{}, v_state{});
  }
  SECTION("clip_by_global_norm + AdamW")
  {
    fo::rules::clip_by_global_norm clip;
    clip.max_norm = 1.0;
    fo::rules::adamw adamw;
    adamw.lr = 1e-2;
    check_against_fp32(fo::chain(clip, adamw), sizes, 5, m_state{}, v_state{});
  }
  SECTION("AdEMAMix (its three EMAs 8-bit, both schedulers running)")
  {
    check_against_fp32(fusedopt_test::scheduled_ademamix(), sizes, 5, m_state{},
                       state<fo::slot::exp_avg_slow_t, fo::signed_q8>{}, v_state{});
  }
}

namespace {

/// One step of `rule` through detail::access::update_block, block by block: the scalar
/// statement of a block's update (each element's code and scale loaded, each code searched on
/// its own), which the host plan's vectorised block update must match bit for bit.
template <class Rule, class... B, std::size_t... K>
void scalar_block_step(Rule const& rule, fo::bound_lists<B...> const& lists, fo::step_info const& step,
                       std::index_sequence<K...>)
{
  using access = fo::detail::access<Rule, fo::bound_lists<B...>>;
  fo::reduced results[1];
  auto const body = fo::detail::prepare_final(rule, step, results);
  for (std::size_t t = 0; t < lists.num_tensors(); ++t) {
    void* bases[] = {lists.template address<K>(t)...};
    auto const tensor = static_cast<std::int64_t>(t);
    auto const tensor_body = fo::detail::body_for_tensor(body, tensor);
    std::int64_t const n = lists.tensor_size(t);
    for (std::int64_t i = 0; i < n; i += access::block_elements) {
      access::update_block(tensor_body, bases, tensor, i, std::min(access::block_elements, n - i));
    }
  }
}

/// Parameters of type P, gradients, and the 8-bit states `States` (pairs of slot and storage
/// type), tensors end to end: one copy stepped by a host plan, one by scalar_block_step.
template <class P, class... States>
class block_update_comparison {
 public:
  explicit block_update_comparison(std::vector<std::int64_t> sizes) : sizes_(std::move(sizes))
  {
    for (auto n : sizes_) { total_ += n; }
    std::vector<float> const start = fusedopt_test::mixed_values(total_, 21, true);
    for (auto& param : params_) {
      for (float x : start) { param.push_back(static_cast<P>(x)); }
    }
    for (auto& copy : states_) { copy = {std::vector<typename States::second_type>(units<typename States::second_type>())...}; }
    grad_.resize(static_cast<std::size_t>(total_), P(0.f));
  }

  /// Steps 1..steps with new gradients each step: some blocks all zero (their states unchanged
  /// where they were zero), one NaN and one infinity (their blocks keep their states).
  template <class Rule>
  void run(Rule const& rule, int steps, fo::host::options const& opts)
  {
    auto plan = fo::host::make_plan(lists(0), opts);
    for (int t = 1; t <= steps; ++t) {
      INFO("step " << t);
      std::vector<float> const values = fusedopt_test::mixed_values(total_, 200 + static_cast<std::uint64_t>(t), true);
      for (std::size_t i = 0; i < grad_.size(); ++i) { grad_[i] = static_cast<P>(std::max(-1.f, std::min(1.f, values[i]))); }
      std::fill(grad_.begin(), grad_.begin() + std::min<std::int64_t>(total_, 300), P(0.f));
      grad_[static_cast<std::size_t>(total_ / 2)] = P(std::numeric_limits<float>::quiet_NaN());
      grad_[static_cast<std::size_t>(total_ - 1)] = P(std::numeric_limits<float>::infinity());
      plan.run(rule, fo::step_info{t});
      scalar_block_step(rule, lists(1), fo::step_info{t}, std::make_index_sequence<2 + sizeof...(States)>{});
      CHECK(same_params());
      CHECK(same_states(std::index_sequence_for<States...>{}));
    }
  }

 private:
  template <class Q>
  std::int64_t units() const
  {
    std::int64_t all = 0;
    for (auto n : sizes_) { all += Q::units_for(n); }
    return all;
  }
  template <class T>
  fo::tensor_list<T> list_of(T* data) const
  {
    fo::tensor_list<T> l;
    for (auto n : sizes_) {
      l.push_back(data, n);
      if constexpr (fo::is_blockwise_v<T>) {
        data += T::units_for(n);
      } else {
        data += n;
      }
    }
    return l;
  }
  auto lists(std::size_t copy) { return lists(copy, std::index_sequence_for<States...>{}); }
  template <std::size_t... K>
  auto lists(std::size_t copy, std::index_sequence<K...>)
  {
    return fo::bind(fo::slot::param = list_of(params_[copy].data()), fo::slot::grad = list_of<P const>(grad_.data()),
                    (typename States::first_type{} = list_of(std::get<K>(states_[copy]).data()))...);
  }
  // The same bits, or NaN in both (a NaN's payload may come from either operand).
  bool same_params() const
  {
    for (std::size_t i = 0; i < params_[0].size(); ++i) {
      float const a = static_cast<float>(params_[0][i]);
      float const b = static_cast<float>(params_[1][i]);
      bool const same = std::memcmp(&params_[0][i], &params_[1][i], sizeof(P)) == 0;
      if (!same && !(std::isnan(a) && std::isnan(b))) { return false; }
    }
    return true;
  }
  template <std::size_t... K>
  bool same_states(std::index_sequence<K...>) const
  {
    return ((std::memcmp(std::get<K>(states_[0]).data(), std::get<K>(states_[1]).data(),
                         std::get<K>(states_[0]).size() * 16) == 0) &&
            ...);
  }

  std::vector<std::int64_t> sizes_;
  std::int64_t total_ = 0;
  std::vector<P> params_[2];
  std::vector<P> grad_;
  std::tuple<std::vector<typename States::second_type>...> states_[2];
};

}  // namespace

TEMPLATE_TEST_CASE("the host's vectorised block update gives the bits of access::update_block's, one element at a time",
                   "[quantized][blocks]", float, fo::bfloat16)
{
  using P = TestType;
  using m_state = state<fo::slot::exp_avg_t, fo::signed_q8>;
  using v_state = state<fo::slot::exp_avg_sq_t, fo::unsigned_q8>;
  std::vector<std::int64_t> const sizes = {1, 255, 256, 257, 1000, 4097, 3 * 256};
  auto const set = GENERATE_COPY(from_range(fo::host::runnable_instruction_sets()));
  INFO("instruction set " << fo::host::instruction_set_name(set));
  fo::host::options opts;
  opts.widest_instruction_set = set;
  opts.threads = 2;
  opts.chunk_elements = 300;  // chunks of 512: several a tensor
  SECTION("Adam")
  {
    fo::rules::adam adam;
    adam.lr = 1e-2;
    block_update_comparison<P, m_state, v_state>(sizes).run(adam, 4, opts);
  }
  SECTION("AdamW")
  {
    fo::rules::adamw adamw;
    adamw.lr = 1e-2;
    adamw.weight_decay = 0.1;
    block_update_comparison<P, m_state, v_state>(sizes).run(adamw, 4, opts);
  }
  SECTION("Lion")
  {
    fo::rules::lion lion;
    lion.lr = 1e-3;
    lion.weight_decay = 0.5;
    block_update_comparison<P, m_state>(sizes).run(lion, 4, opts);
  }
  SECTION("SGD with Nesterov momentum, blocks of 32 to 2048")
  {
    fo::rules::sgd sgd;
    sgd.lr = 0.1;
    sgd.momentum = 0.9;
    sgd.nesterov = true;
    std::vector<std::int64_t> const long_sizes = {1, 31, 32, 33, 2047, 2048, 2049, 5000};
    using fo::signed_dynamic_map;
    block_update_comparison<P, state<m_t, fo::signed_q8>>(sizes).run(sgd, 4, opts);
    block_update_comparison<P, state<m_t, fo::blockwise8<signed_dynamic_map, 32>>>(long_sizes).run(sgd, 3, opts);
    block_update_comparison<P, state<m_t, fo::blockwise8<signed_dynamic_map, 128>>>(long_sizes).run(sgd, 3, opts);
    block_update_comparison<P, state<m_t, fo::blockwise8<signed_dynamic_map, 512>>>(long_sizes).run(sgd, 3, opts);
    block_update_comparison<P, state<m_t, fo::blockwise8<signed_dynamic_map, 2048>>>(long_sizes).run(sgd, 3, opts);
  }
}

TEST_CASE("8-bit AdamW moves at most 16.1 bytes per element with fp32 params, 10.1 with bf16", "[quantized][bytes]")
{
  using fp32_lists = decltype(fo::bind(fo::slot::param = fo::tensor_list<float>{}, fo::slot::grad = fo::tensor_list<float const>{},
                                       fo::slot::exp_avg = fo::tensor_list<fo::signed_q8>{},
                                       fo::slot::exp_avg_sq = fo::tensor_list<fo::unsigned_q8>{}));
  using bf16_lists =
    decltype(fo::bind(fo::slot::param = fo::tensor_list<fo::bfloat16>{}, fo::slot::grad = fo::tensor_list<fo::bfloat16 const>{},
                      fo::slot::exp_avg = fo::tensor_list<fo::signed_q8>{}, fo::slot::exp_avg_sq = fo::tensor_list<fo::unsigned_q8>{}));
  double const fp32 = fo::memory_traffic<fo::rules::adamw, fp32_lists>::exact_bytes;
  double const bf16 = fo::memory_traffic<fo::rules::adamw, bf16_lists>::exact_bytes;
  CHECK(fp32 == 16.0 + 4 * 4.0 / 256);  // 4 + 4 + 1 + 1 read, 4 + 1 + 1 written, four scales per 256
  CHECK(bf16 == 10.0 + 4 * 4.0 / 256);
  CHECK(fp32 <= 16.1);
  CHECK(bf16 <= 10.1);
  CHECK(fo::bytes_per_element_v<fo::rules::adamw, fp32_lists> == 16);  // codes only
}

TEST_CASE("8-bit AdEMAMix moves 18.1 bytes per element with fp32 params (36 with fp32 states)", "[quantized][bytes]")
{
  using lists = decltype(fo::bind(fo::slot::param = fo::tensor_list<float>{}, fo::slot::grad = fo::tensor_list<float const>{},
                                  fo::slot::exp_avg = fo::tensor_list<fo::signed_q8>{},
                                  fo::slot::exp_avg_slow = fo::tensor_list<fo::signed_q8>{},
                                  fo::slot::exp_avg_sq = fo::tensor_list<fo::unsigned_q8>{}));
  // 4 + 4 + 3 x 1 read, 4 + 3 x 1 written, six scales per 256
  CHECK(fo::memory_traffic<fo::rules::ademamix, lists>::exact_bytes == 18.0 + 6 * 4.0 / 256);
}

TEST_CASE("binding checks quantized tensors' memory by their whole storage, and its alignment", "[quantized][bind]")
{
  // 257 elements: 2 blocks, 256 bytes of scales, 512 of codes: 48 units of 16 bytes.
  REQUIRE(fo::signed_q8::units_for(257) == 48);
  std::vector<fo::signed_q8> units(96);
  fo::tensor_list<fo::signed_q8> adjacent{{units.data(), 257}, {units.data() + 48, 257}};
  CHECK_NOTHROW(fo::bind(fo::slot::momentum_buffer = adjacent));
  fo::tensor_list<fo::signed_q8> overlapping{{units.data(), 257}, {units.data() + 47, 256}};
  expect_error([&] { (void)fo::bind(fo::slot::momentum_buffer = overlapping); }, {"overlaps", "momentum_buffer"});
  auto* const misaligned = reinterpret_cast<fo::signed_q8*>(reinterpret_cast<unsigned char*>(units.data()) + 4);
  fo::tensor_list<fo::signed_q8> shifted{{misaligned, 256}};
  expect_error([&] { (void)fo::bind(fo::slot::momentum_buffer = shifted); }, {"16-byte aligned", "momentum_buffer"});
}

TEST_CASE("the storage layout: scales reversed before 256-byte aligned codes, a lane's codes side by side",
          "[quantized][layout]")
{
  // Written from the layout's description, byte by byte, for blocks of 256 and of 64.
  std::int64_t const n = 400;  // two blocks of 256: 8 bytes of scales padded to 256
  std::vector<fo::signed_q8> units(static_cast<std::size_t>(fo::signed_q8::units_for(n)));
  CHECK(fo::signed_q8::bytes_for(n) == 256 + 512);
  fo::quantized_state<fo::signed_q8> state(units.data(), n);
  state.set_scale(0, 2.f);
  state.set_scale(1, -3.f);
  state.set_code(0, 11);          // lane 0, group 0, element 0 of its four: codes byte 0
  state.set_code(4 + 1, 12);      // lane 1, group 0, element 1: byte 8 + 1
  state.set_code(128 + 2, 13);    // lane 0, group 1, element 2: byte 4 + 2
  state.set_code(256 + 127, 14);  // block 1, lane 31, group 0, element 3: byte 256 + 248 + 3
  auto const* bytes = reinterpret_cast<unsigned char const*>(units.data());
  float first = 0.f, second = 0.f;
  std::memcpy(&first, bytes + 252, 4);
  std::memcpy(&second, bytes + 248, 4);
  CHECK(first == 2.f);
  CHECK(second == -3.f);
  CHECK(bytes[256 + 0] == 11);
  CHECK(bytes[256 + 9] == 12);
  CHECK(bytes[256 + 6] == 13);
  CHECK(bytes[256 + 256 + 251] == 14);
  CHECK(state.value(0) == fo::detail::host_map<fo::signed_dynamic_map>.values[11] * 2.f);
  expect_error([&] { (void)state.code(n); }, {"element 400", "400 elements"});
  expect_error([&] { state.set_scale(2, 1.f); }, {"block 2", "2 blocks"});
  expect_error([&] { (void)state.scale(-1); }, {"block -1"});
  // Blocks under 128 elements keep element order.
  using small = fo::blockwise8<fo::signed_dynamic_map, 64>;
  CHECK(small::code_offset(64 + 37) == 64 + 37);
  CHECK(small::bytes_for(65) == 256 + 128);
  // And the test's own reader (tests/reference) agrees with the library's.
  q8_storage<fo::signed_q8> mine(n);
  fo::quantized_state<fo::signed_q8> theirs(mine.data(), n);
  for (std::int64_t i = 0; i < n; i += 7) { theirs.set_code(i, static_cast<std::uint8_t>(i % 251)); }
  theirs.set_scale(1, 0.5f);
  for (std::int64_t i = 0; i < n; i += 7) { CHECK(mine.code(i) == i % 251); }
  CHECK(mine.scale(1) == 0.5f);
}

TEST_CASE("a quantized tensor of more than 2^31 elements", "[quantized][big]")
{
#if defined(__SANITIZE_ADDRESS__)
  // 2^31 elements under ASan take minutes on the CI's two cores; the Release build runs it.
  WARN("skipped under AddressSanitizer");
  return;
#endif
  std::int64_t const n = (std::int64_t{1} << 31) + 300;
  std::vector<float> values(1024);
  for (std::size_t i = 0; i < values.size(); ++i) { values[i] = static_cast<float>(i % 97) - 48.f; }
  // Every block holds the same values but for the last, partial one (300 - 256 = 44 elements).
  q8_storage<fo::signed_q8> blocks(n, false);
  fo::tensor_list<fo::signed_q8> list{{blocks.data(), n}};
  fo::host::apply(by_position{values.data()}, fo::bind(fo::slot::momentum_buffer = list));
  std::int64_t const around = (std::int64_t{1} << 31) / 256;  // the block at 2^31
  for (std::int64_t b : {std::int64_t{0}, around - 1, around, blocks.blocks() - 2}) {
    INFO("block " << b);
    std::vector<float> const block_values(values.begin() + static_cast<std::ptrdiff_t>((b * 256) % 1024),
                                          values.begin() + static_cast<std::ptrdiff_t>((b * 256) % 1024 + 256));
    CHECK(same_block(blocks, b, reference_quantize<fo::signed_q8>(block_values), 0));
  }
  std::int64_t const last = blocks.blocks() - 1;
  std::vector<float> const tail(values.begin() + static_cast<std::ptrdiff_t>((last * 256) % 1024),
                                values.begin() + static_cast<std::ptrdiff_t>((last * 256) % 1024 + 44));
  CHECK(same_block(blocks, last, reference_quantize<fo::signed_q8>(tail), 0));
}
