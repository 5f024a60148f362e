// libFuzzer target for the host backend (issue 15): the fuzzer's bytes choose tensor lists
// (tensor counts, sizes including 0, element types float/double/half/bfloat16, places in one
// arena so that some overlap), a rule (SGD, Adam, AdamW, global-norm clipping chained with SGD
// or AdamW), its hyperparameters, host options and steps. Each case runs bind, make_plan and a
// few steps and checks:
// - bad input (overlapping written memory, sizes that differ between slots, invalid
//   hyperparameters, a missing state slot, a step below 1, too small a reduction capacity) is
//   rejected with fusedopt::error, and valid input never is;
// - a rejected case leaves every byte of the arena as it was;
// - an accepted step changes no byte outside the written tensors, and every written value is
//   within its rounding bound of a double-precision reference (tests/reference/rv.hpp,
//   torch's formulas, fed with the values the backend held before the step).
// A finding prints what failed and aborts, which libFuzzer reports with the input.
//
// FUSEDOPT_FUZZ_PLANT=<relative error> perturbs the reference's parameters by that much, to
// show that the checks catch an error of that size (docs/decisions.md, "Fuzzing").
//
// Without libFuzzer (FUSEDOPT_FUZZ_REPLAY defined) the file gets a main() that runs the files
// named on its command line, so the corpus also runs as an ordinary test.
#include <fusedopt/fusedopt.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../reference/rv.hpp"

namespace {

namespace fo = fusedopt;
namespace slot = fusedopt::slot;
using fusedopt_test::exact;
using fusedopt_test::rv;

// ---- the fuzzer's bytes as choices ------------------------------------------------------

/// Reads the input as a sequence of choices; past its end every read gives 0, which is always
/// a valid (small) choice, so every input is a case.
class input {
 public:
  input(std::uint8_t const* data, std::size_t size) : data_(data), size_(size) {}

  std::uint32_t byte() { return at_ < size_ ? data_[at_++] : 0u; }
  /// A number in [0, n).
  std::uint32_t below(std::uint32_t n)
  {
    std::uint32_t const x = byte() | (byte() << 8);
    return n <= 1 ? 0 : x % n;
  }
  /// True with probability p% (false past the input's end: no rare event by default).
  bool percent(std::uint32_t p) { return below(100) >= 100 - p; }
  template <class T, std::size_t N>
  T pick(T const (&options)[N])
  {
    return options[below(static_cast<std::uint32_t>(N))];
  }

 private:
  std::uint8_t const* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

/// Tensor values come from a generator seeded by the input (splitmix64): a short input still
/// gives varied values, and the input's bytes go to the choices that shape a case.
class values {
 public:
  explicit values(std::uint64_t seed) : state_(seed) {}
  /// A number in [0, 1).
  double unit()
  {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1p-53;
  }

 private:
  std::uint64_t state_;
};

[[noreturn]] void finding(std::string const& what)
{
  std::fprintf(stderr, "fusedopt fuzz finding: %s\n", what.c_str());
  std::abort();
}

/// The relative error FUSEDOPT_FUZZ_PLANT puts into the reference (0: none).
double planted()
{
  static double const value = [] {
    char const* s = std::getenv("FUSEDOPT_FUZZ_PLANT");
    return s != nullptr ? std::atof(s) : 0.0;
  }();
  return value;
}

// ---- the arena --------------------------------------------------------------------------

constexpr std::size_t arena_bytes = std::size_t{1} << 16;
alignas(64) unsigned char arena[arena_bytes];

/// One tensor of one slot: where it lies in the arena, and whether the rule may write it.
struct span {
  std::size_t offset = 0;  ///< bytes from the arena's start
  std::int64_t size = 0;   ///< elements
  std::size_t element = 0; ///< bytes per element
  bool null = false;       ///< a null pointer (only with size 0)
  bool writable = false;
  [[nodiscard]] std::size_t end() const { return offset + static_cast<std::size_t>(size) * element; }
};

/// The element of type T at `offset` of `base` (the arena or a copy of it), exactly.
template <class T>
double load(unsigned char const* base, std::size_t offset)
{
  T x;
  std::memcpy(&x, base + offset, sizeof(T));
  return static_cast<double>(fo::to_opmath<fo::opmath_t<T>>(x));
}

template <class T>
void store(std::size_t offset, double value)
{
  T const x = fo::from_opmath<T>(static_cast<fo::opmath_t<T>>(value));
  std::memcpy(arena + offset, &x, sizeof(T));
}

// ---- checks -----------------------------------------------------------------------------

/// The largest finite value of a storage type.
template <class S>
constexpr double largest()
{
  if constexpr (std::is_same_v<S, fo::half>) {
    return 65504.0;
  } else if constexpr (std::is_same_v<S, fo::bfloat16>) {
    return 0x1.fep127;
  } else {
    return static_cast<double>(std::numeric_limits<S>::max());
  }
}

/// Whether a stored value `got` (element type S, arithmetic O) is within the rounding bound
/// of `want` (reference_rv.hpp's tolerance, per slot type).
template <class S, class O>
bool close(double got, rv want)
{
  if (!std::isfinite(want.v)) { return std::isnan(want.v) ? std::isnan(got) : got == want.v; }
  using ps = fusedopt_test::precision<S>;
  using po = fusedopt_test::precision<O>;
  double const tol = ps::store * std::fabs(want.v) + (1 + ps::store) * fusedopt_test::slack * po::op * want.e + ps::floor;
  // A value at or past the type's largest finite one may be stored as an infinity of its sign
  // (half's 65504 is within reach of an update from inconsistent random states).
  if (std::isinf(got)) { return std::fabs(want.v) + tol >= largest<S>() && (got > 0) == (want.v > 0); }
  return std::fabs(got - want.v) <= tol;
}

/// The hyperparameters of one case, with whether the library must reject them.
struct hyper {
  int kind = 0;  // 0 sgd, 1 adam, 2 adamw, 3 clip + sgd, 4 clip + adamw
  double lr = 1e-3, momentum = 0, dampening = 0, weight_decay = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_norm = 1;
  fo::norm_kind norm = fo::norm_kind::l2;
  bool nesterov = false, maximize = false, amsgrad = false;
  bool state_slot = false;  // momentum_buffer (SGD) or max_exp_avg_sq (Adam) bound
  int capacity = 8;
  [[nodiscard]] bool adam() const { return kind == 1 || kind == 2 || kind == 4; }
  [[nodiscard]] bool clip() const { return kind >= 3; }
};

hyper draw_hyper(input& in)
{
  hyper h;
  h.kind = static_cast<int>(in.below(5));
  h.state_slot = in.percent(70);
  h.maximize = in.percent(30);
  double const lrs[] = {0.0, 1e-3, 0.01, 0.1, 0.5};
  double const decays[] = {0.0, 0.0, 1e-2, 0.1};
  double const betas[] = {0.0, 0.5, 0.9, 0.99, 0.999};
  double const epss[] = {1e-8, 1e-6, 1e-3};
  h.lr = in.pick(lrs);
  h.weight_decay = in.pick(decays);
  if (h.adam()) {
    // beta1 >= 0.5: below it torch's lerp switches to end - (end - self) (1 - w), whose
    // rounding is relative to |grad|, while fusedopt's m + (1 - beta1) (g - m) rounds relative
    // to |m| too: a difference of a few ulp of max(|m|, |g|) that the reference's bound does
    // not cover (docs/decisions.md, "Fuzzing the host backend": open).
    double const beta1s[] = {0.5, 0.9, 0.99, 0.999};
    h.beta1 = in.pick(beta1s);
    h.beta2 = in.pick(betas);
    h.eps = in.pick(epss);
    h.amsgrad = in.percent(40);
  } else {
    double const momenta[] = {0.0, 0.5, 0.9};
    double const dampenings[] = {0.0, 0.0, 0.3};
    h.momentum = in.pick(momenta);
    h.dampening = in.pick(dampenings);
    h.nesterov = in.percent(30);
  }
  if (h.clip()) {
    double const norms[] = {1e-3, 0.5, 10.0, 1e9};
    h.max_norm = in.pick(norms);
    h.norm = in.percent(30) ? fo::norm_kind::inf : fo::norm_kind::l2;
    int const capacities[] = {8, 2, 1};
    h.capacity = in.pick(capacities);
  }
  // Now and then, one value the library must refuse.
  if (in.percent(6)) {
    switch (in.below(6)) {
      case 0: h.lr = -0.1; break;
      case 1: h.weight_decay = -0.1; break;
      case 2: h.beta1 = 1.0; break;
      case 3: h.beta2 = -0.5; break;
      case 4: h.eps = -1e-8; break;
      default: h.max_norm = -1; break;
    }
  }
  return h;
}

/// Whether the library must refuse to run these hyperparameters with these slots.
bool invalid(hyper const& h)
{
  if (h.lr < 0 || h.weight_decay < 0) { return true; }
  if (h.clip() && (h.max_norm < 0 || h.capacity < 2)) { return true; }
  if (h.adam()) {
    return !(h.beta1 >= 0 && h.beta1 < 1) || !(h.beta2 >= 0 && h.beta2 < 1) || h.eps < 0 ||
           (h.amsgrad && !h.state_slot);
  }
  return h.momentum < 0 || (h.momentum != 0 && !h.state_slot) ||
         (h.nesterov && !(h.momentum > 0 && h.dampening == 0));
}

// ---- one case ---------------------------------------------------------------------------

/// Element types: P for param, G for grad, S for every state.
template <class P, class G, class S>
class fuzz_case {
  // Slot order in `spans_`: param, grad, then the states the rule has.
  static constexpr int param_slot = 0, grad_slot = 1;
  using O = fo::common_opmath_t<P, G, S>;

 public:
  explicit fuzz_case(input& in) : in_(in), h_(draw_hyper(in)), values_(in.byte() | (in.byte() << 8) | (in.byte() << 16)) {}

  void run()
  {
    slots_ = 2 + (h_.adam() ? 2 + (h_.state_slot ? 1 : 0) : (h_.state_slot ? 1 : 0));
    layout();
    fill();
    std::vector<unsigned char> const before(arena, arena + arena_bytes);
    bool const bad_lists = mismatched_ || overlapping();
    if (h_.adam()) {
      if (h_.state_slot) {
        go(bad_lists, before, slot::exp_avg = list<S>(2), slot::exp_avg_sq = list<S>(3),
           slot::max_exp_avg_sq = list<S>(4));
      } else {
        go(bad_lists, before, slot::exp_avg = list<S>(2), slot::exp_avg_sq = list<S>(3));
      }
    } else if (h_.state_slot) {
      go(bad_lists, before, slot::momentum_buffer = list<S>(2));
    } else {
      go(bad_lists, before);
    }
  }

 private:
  [[nodiscard]] std::size_t element_size(int s) const
  {
    return s == param_slot ? sizeof(P) : s == grad_slot ? sizeof(G) : sizeof(S);
  }

  /// Places every tensor of every slot: packed with gaps (no overlap) or anywhere (overlap
  /// likely), sometimes with a size that differs between slots or a null empty tensor.
  void layout()
  {
    tensors_ = in_.below(7);
    bool const anywhere = in_.percent(25);
    std::vector<std::int64_t> sizes(tensors_);
    for (auto& n : sizes) {
      std::int64_t const choices[] = {0, 1, 2, 7, 8, 9, 31, 64, 100, 257};
      n = in_.percent(80) ? in_.pick(choices) : static_cast<std::int64_t>(in_.below(600));
    }
    // Packed, every slot's tensors (one element longer, gaps of up to 4) must fit the arena.
    auto const needed = [&] {
      std::size_t bytes = 0;
      for (int s = 0; s < slots_; ++s) {
        for (auto n : sizes) { bytes += (static_cast<std::size_t>(n) + 5) * element_size(s); }
      }
      return bytes;
    };
    while (needed() > arena_bytes) {
      for (auto& n : sizes) { n /= 2; }
    }
    spans_.assign(static_cast<std::size_t>(slots_), std::vector<span>(tensors_));
    std::size_t cursor = 0;
    for (int s = 0; s < slots_; ++s) {
      std::size_t const e = element_size(s);
      for (std::size_t t = 0; t < tensors_; ++t) {
        span& sp = spans_[static_cast<std::size_t>(s)][t];
        sp.element = e;
        sp.writable = s != grad_slot;
        sp.size = sizes[t];
        if (in_.percent(2)) { sp.size += 1; }
        mismatched_ = mismatched_ || sp.size != spans_[0][t].size;
        std::size_t const bytes = static_cast<std::size_t>(sp.size) * e;
        std::size_t offset = anywhere ? in_.below(static_cast<std::uint32_t>(arena_bytes)) : cursor + e * in_.below(4);
        offset = std::min((offset + e - 1) / e * e, (arena_bytes - bytes) / e * e);  // aligned, inside
        sp.offset = offset;
        sp.null = sp.size == 0 && in_.percent(20);
        cursor = std::max(cursor, sp.end());
      }
    }
  }

  /// Whether a written tensor shares a byte with any other non-empty tensor (bind's rule).
  [[nodiscard]] bool overlapping() const
  {
    std::vector<span> all;
    for (auto const& s : spans_) {
      for (auto const& sp : s) {
        if (sp.size > 0) { all.push_back(sp); }
      }
    }
    for (std::size_t a = 0; a < all.size(); ++a) {
      for (std::size_t b = a + 1; b < all.size(); ++b) {
        bool const share = all[a].offset < all[b].end() && all[b].offset < all[a].end();
        if (share && (all[a].writable || all[b].writable)) { return true; }
      }
    }
    return false;
  }

  /// A value of slot s: gradients 0 or 1e-3..100 in magnitude, second moments >= 0.
  double draw_value(int s)
  {
    double const magnitude = values_.unit() < 0.1 ? 0.0 : std::exp(std::log(1e-3) + values_.unit() * std::log(1e5));
    double const sign = values_.unit() < 0.5 ? -1.0 : 1.0;
    bool const second_moment = h_.adam() && s >= 3;
    if (s == grad_slot) { return sign * magnitude; }
    if (second_moment) { return magnitude; }
    return sign * std::min(magnitude, 10.0);
  }

  void fill()
  {
    for (std::size_t i = 0; i < arena_bytes; ++i) { arena[i] = static_cast<unsigned char>(i * 131u + 7u); }
    for (int s = 0; s < slots_; ++s) { fill_slot(s); }
  }
  void fill_slot(int s)
  {
    for (auto const& sp : spans_[static_cast<std::size_t>(s)]) {
      for (std::int64_t i = 0; i < sp.size; ++i) {
        std::size_t const at = sp.offset + static_cast<std::size_t>(i) * sp.element;
        double const v = draw_value(s);
        if (s == param_slot) {
          store<P>(at, v);
        } else if (s == grad_slot) {
          store<G>(at, v);
        } else {
          store<S>(at, v);
        }
      }
    }
  }

  template <class T>
  fo::tensor_list<T> list(int s) const
  {
    fo::tensor_list<T> l;
    for (auto const& sp : spans_[static_cast<std::size_t>(s)]) {
      T* p = sp.null ? nullptr : reinterpret_cast<T*>(arena + sp.offset);
      l.push_back(p, sp.size);
    }
    return l;
  }

  template <class... States>
  void go(bool bad_lists, std::vector<unsigned char> const& before, States... states)
  {
    bool bound = false;
    try {
      auto lists = fo::bind(slot::param = list<P>(param_slot), slot::grad = list<G const>(grad_slot), states...);
      bound = true;
      if (bad_lists) { finding(describe() + ": bind accepted lists that overlap or differ in size"); }
      // Adam's rules need its states bound; SGD's are the others (both kinds are checked
      // for misuse at run time anyway: a missing optional slot, invalid options).
      constexpr bool adam = (std::is_same_v<typename States::slot_type, slot::exp_avg_t> || ...);
      steps<adam>(lists);
    } catch (fo::error const& e) {
      if (bound) { finding(describe() + ": unexpected error: " + e.what()); }
      if (!bad_lists) { finding(describe() + ": bind rejected valid lists: " + e.what()); }
      unchanged(before, "a rejected bind");
    }
  }

  template <bool Adam, class Lists>
  void steps(Lists const& lists)
  {
    fo::host::options opts;
    std::int64_t const chunks[] = {1, 3, 8, 64, 1000, std::int64_t{1} << 15};
    opts.chunk_elements = in_.pick(chunks);
    opts.threads = static_cast<int>(in_.below(3));
    opts.reduction_capacity = h_.capacity;
    auto plan = fo::host::make_plan(lists, opts);
    std::int64_t t = 1 + static_cast<std::int64_t>(in_.below(4));
    if (in_.percent(3)) { t = -static_cast<std::int64_t>(in_.below(3)); }  // 0, -1, -2: rejected
    int const count = 1 + static_cast<int>(in_.below(3));
    for (int k = 0; k < count; ++k, ++t) {
      if (k > 0) { fill_slot(grad_slot); }  // a new gradient every step
      if (!step<Adam>(plan, t)) { return; }
    }
  }

  /// One step: returns false when it was (rightly) rejected.
  template <bool Adam, class Plan>
  bool step(Plan const& plan, std::int64_t t)
  {
    std::vector<unsigned char> const before(arena, arena + arena_bytes);
    bool const must_fail = invalid(h_) || t < 1;
    double total_norm = -1;
    int nonfinite = -1;
    try {
      run_rule<Adam>(plan, t, &total_norm, &nonfinite);
      if (must_fail) { finding(describe() + ": step " + std::to_string(t) + " ran with options it must refuse"); }
    } catch (fo::error const& e) {
      if (!must_fail) { finding(describe() + ": a valid step was refused: " + e.what()); }
      unchanged(before, "a refused step");
      return false;
    }
    outside_unchanged(before);
    check(before, t, total_norm, nonfinite);
    return true;
  }

  template <bool Adam, class Plan>
  void run_rule(Plan const& plan, std::int64_t t, double* total_norm, int* nonfinite) const
  {
    fo::step_info const info{t};
    fo::rules::sgd sgd;
    sgd.lr = h_.lr;
    sgd.momentum = h_.momentum;
    sgd.dampening = h_.dampening;
    sgd.weight_decay = h_.weight_decay;
    sgd.nesterov = h_.nesterov;
    sgd.maximize = h_.maximize;
    auto const adam_like = [&](auto opt) {
      opt.lr = h_.lr;
      opt.beta1 = h_.beta1;
      opt.beta2 = h_.beta2;
      opt.eps = h_.eps;
      opt.weight_decay = h_.weight_decay;
      opt.amsgrad = h_.amsgrad;
      opt.maximize = h_.maximize;
      return opt;
    };
    fo::rules::clip_by_global_norm const clip{h_.max_norm, h_.norm, false, nonfinite, total_norm};
    if constexpr (Adam) {
      if (h_.kind == 1) {
        plan.run(adam_like(fo::rules::adam{}), info);
      } else if (h_.kind == 2) {
        plan.run(adam_like(fo::rules::adamw{}), info);
      } else {
        plan.run(fo::chain(clip, adam_like(fo::rules::adamw{})), info);
      }
    } else {
      if (h_.kind == 0) {
        plan.run(sgd, info);
      } else {
        plan.run(fo::chain(clip, sgd), info);
      }
    }
  }

  void unchanged(std::vector<unsigned char> const& before, char const* when) const
  {
    if (std::memcmp(before.data(), arena, arena_bytes) != 0) { finding(describe() + ": " + when + " wrote memory"); }
  }

  /// No byte outside the written tensors changed (gradients, gaps, the rest of the arena).
  void outside_unchanged(std::vector<unsigned char> const& before) const
  {
    std::vector<bool> written(arena_bytes, false);
    for (auto const& s : spans_) {
      for (auto const& sp : s) {
        if (!sp.writable) { continue; }
        for (std::size_t b = sp.offset; b < sp.end(); ++b) { written[b] = true; }
      }
    }
    for (std::size_t b = 0; b < arena_bytes; ++b) {
      if (!written[b] && arena[b] != before[b]) {
        finding(describe() + ": byte " + std::to_string(b) + " outside every written tensor changed");
      }
    }
  }

  /// Every written element against the reference fed with the values before the step.
  void check(std::vector<unsigned char> const& before, std::int64_t t, double total_norm, int nonfinite)
  {
    auto const value = [&](unsigned char const* base, int s, std::size_t tensor, std::int64_t i) {
      span const& sp = spans_[static_cast<std::size_t>(s)][tensor];
      std::size_t const at = sp.offset + static_cast<std::size_t>(i) * sp.element;
      return s == param_slot ? load<P>(base, at) : s == grad_slot ? load<G>(base, at) : load<S>(base, at);
    };
    auto const old = [&](int s, std::size_t tensor, std::int64_t i) { return value(before.data(), s, tensor, i); };
    auto const now = [&](int s, std::size_t tensor, std::int64_t i) { return value(arena, s, tensor, i); };

    rv coefficient = exact(1);
    bool scaled = false;
    if (h_.clip()) {
      long double sum = 0, largest = 0;
      std::int64_t longest = 0;
      for (std::size_t tensor = 0; tensor < tensors_; ++tensor) {
        std::int64_t const n = spans_[grad_slot][tensor].size;
        longest = std::max(longest, n);
        for (std::int64_t i = 0; i < n; ++i) {
          long double const g = old(grad_slot, tensor, i);
          sum += g * g;
          largest = std::max(largest, g < 0 ? -g : g);
        }
      }
      double const want = h_.norm == fo::norm_kind::l2 ? static_cast<double>(std::sqrt(sum)) : static_cast<double>(largest);
      // A float sum of n positive terms is within n u of the true sum; the norm, half that.
      double const terms = static_cast<double>(std::min<std::int64_t>(longest, 1 << 15) / 8 + 64);
      double const bound = h_.norm == fo::norm_kind::inf ? 0.0 : terms * fusedopt_test::precision<O>::op;
      if (!(std::fabs(total_norm - want) <= bound * want) || nonfinite != 0) {
        finding(describe() + ": global norm " + std::to_string(total_norm) + ", want " + std::to_string(want));
      }
      // Teacher forcing: the coefficient from the norm the library found, as the rule forms it.
      double const c = h_.max_norm / (total_norm + 1e-6);
      if (!(c > 1.0)) {
        scaled = true;
        coefficient = fusedopt_test::coefficient<O>(exact(h_.max_norm) / (exact(total_norm) + exact(1e-6)));
      }
    }

    double const plant = planted();
    for (std::size_t tensor = 0; tensor < tensors_; ++tensor) {
      for (std::int64_t i = 0; i < spans_[param_slot][tensor].size; ++i) {
        rv param = exact(old(param_slot, tensor, i));
        rv grad = exact(old(grad_slot, tensor, i));
        if (scaled) { grad = grad * coefficient; }
        rv a = exact(slots_ > 2 ? old(2, tensor, i) : 0.0);
        rv b = exact(slots_ > 3 ? old(3, tensor, i) : 0.0);
        rv c = exact(slots_ > 4 ? old(4, tensor, i) : 0.0);
        if (h_.adam()) {
          fusedopt_test::adam_reference const ref{h_.lr,           h_.beta1,       h_.beta2,   h_.eps,
                                                  h_.weight_decay, h_.amsgrad,     h_.maximize, h_.kind != 1};
          ref.step<O>(t, param, grad, a, b, c);
        } else {
          fusedopt_test::sgd_reference const ref{h_.lr, h_.momentum, h_.dampening, h_.weight_decay, h_.nesterov,
                                                 h_.maximize};
          ref.step<O>(t <= 1, param, grad, a);
        }
        param.v *= 1 + plant;
        expect<P>(param_slot, tensor, i, now(param_slot, tensor, i), param);
        if (slots_ > 2) { expect<S>(2, tensor, i, now(2, tensor, i), a); }
        if (slots_ > 3) { expect<S>(3, tensor, i, now(3, tensor, i), b); }
        if (slots_ > 4) { expect<S>(4, tensor, i, now(4, tensor, i), c); }
      }
    }
  }

  template <class T>
  void expect(int s, std::size_t tensor, std::int64_t i, double got, rv want) const
  {
    if (!close<T, O>(got, want)) {
      char buffer[200];
      std::snprintf(buffer, sizeof buffer, ": slot %d tensor %zu element %lld: got %.17g, want %.17g (bound %g u)", s,
                    tensor, static_cast<long long>(i), got, want.v, want.e);
      finding(describe() + buffer);
    }
  }

  [[nodiscard]] std::string describe() const
  {
    char const* const kinds[] = {"sgd", "adam", "adamw", "clip+sgd", "clip+adamw"};
    std::string where;
    for (std::size_t s = 0; s < spans_.size(); ++s) {
      where += "\n  slot " + std::to_string(s) + ":";
      for (auto const& sp : spans_[s]) {
        where += " [" + std::to_string(sp.offset) + ", " + std::to_string(sp.end()) + ")" + (sp.null ? "null" : "");
      }
    }
    return std::string(kinds[h_.kind]) + "<" + fo::dtype_name<P>() + "," + fo::dtype_name<G>() + "," +
           fo::dtype_name<S>() + "> " + std::to_string(tensors_) + " tensors lr=" + std::to_string(h_.lr) +
           " wd=" + std::to_string(h_.weight_decay) + " momentum=" + std::to_string(h_.momentum) +
           " betas=" + std::to_string(h_.beta1) + "," + std::to_string(h_.beta2) + " amsgrad=" +
           std::to_string(h_.amsgrad) + " nesterov=" + std::to_string(h_.nesterov) +
           " maximize=" + std::to_string(h_.maximize) + " state_slot=" + std::to_string(h_.state_slot) + where;
  }

  input& in_;
  hyper h_;
  values values_;
  int slots_ = 2;
  std::size_t tensors_ = 0;
  bool mismatched_ = false;
  std::vector<std::vector<span>> spans_;
};

template <class P, class G, class S>
void run_case(input& in)
{
  fuzz_case<P, G, S>(in).run();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size)
{
  input in(data, size);
  using half = fo::half;
  using bf16 = fo::bfloat16;
  // Element types (param, grad, states): uniform lists, and the mixed ones of mixed-precision
  // training.
  switch (in.below(8)) {
    case 0: run_case<float, float, float>(in); break;
    case 1: run_case<double, double, double>(in); break;
    case 2: run_case<half, half, half>(in); break;
    case 3: run_case<bf16, bf16, bf16>(in); break;
    case 4: run_case<bf16, float, float>(in); break;
    case 5: run_case<half, half, float>(in); break;
    case 6: run_case<float, bf16, bf16>(in); break;
    default: run_case<double, float, double>(in); break;
  }
  return 0;
}

#if defined(FUSEDOPT_FUZZ_REPLAY)
#  include <algorithm>
#  include <filesystem>
#  include <fstream>
#  include <iterator>

/// Runs every file named on the command line, and every file in the directories named there,
/// through the target: the corpus as an ordinary test (tests/CMakeLists.txt, fuzz_replay).
int main(int argc, char** argv)
{
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    std::filesystem::path const path(argv[i]);
    if (std::filesystem::is_directory(path)) {
      for (auto const& entry : std::filesystem::directory_iterator(path)) {
        if (entry.is_regular_file()) { files.push_back(entry.path()); }
      }
    } else {
      files.push_back(path);
    }
  }
  std::sort(files.begin(), files.end());
  for (auto const& file : files) {
    std::ifstream f(file, std::ios::binary);
    if (!f) {
      std::fprintf(stderr, "cannot read %s\n", file.c_str());
      return 1;
    }
    std::vector<std::uint8_t> const bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
  }
  std::printf("%zu inputs, no finding\n", files.size());
  return files.empty() ? 1 : 0;  // an empty corpus tests nothing
}
#endif
