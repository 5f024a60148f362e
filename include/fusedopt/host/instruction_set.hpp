/// @file host/instruction_set.hpp
/// @brief The instruction sets the host backend's element loops are compiled for, and the
/// choice among them at run time.
///
/// With GCC on x86-64 (not under nvcc) each loop of a host plan is compiled three times: with
/// the translation unit's own flags (`baseline`: SSE2 unless `-march` says more), for AVX2 and
/// for AVX-512 (F, BW, VL, DQ: the vector part of x86-64-v4). A version is a thin wrapper with
/// a `target` attribute into which the loop, marked always-inline, is inlined, so the rule's
/// code is compiled for the wrapper's vectors; a plan runs the widest version the CPU supports
/// (`__builtin_cpu_supports`, read once), at most `host::options::widest_instruction_set`.
/// Versions that the translation unit's flags already cover are not compiled (with
/// `-march=native` there is only the baseline).
///
/// With GCC (any CPU, not under nvcc) the baseline is a wrapper too, and every wrapper asks for
/// the vectoriser's dynamic cost model (`vect-cost-model=dynamic`, -O3's): at -O2 GCC 12 uses
/// the "very cheap" model, which vectorises no loop whose trip count it does not know, so a
/// user's -O2 build (CMake's RelWithDebInfo) got scalar loops. The square root needs no flag
/// either (numeric/math.hpp): the loops vectorise at -O2 and -O3 with no other option.
///
/// Every version gives the same bits: the wrappers are compiled with `fp-contract=off`, so
/// none fuses `a * b + c` into an FMA (the CUDA backend's tests use `-fmad=false` for the
/// same reason). The baseline is compiled as the translation unit says: with a `-march` that
/// has FMA, add `-ffp-contract=off` to keep its bits (fusedopt_torch does).
///
/// Elsewhere (clang, MSVC, nvcc, other CPUs) only the baseline is compiled. Clang is left out
/// because it contracts inside each expression of the rule (`-ffp-contract=on`), where a
/// wrapper's attribute cannot reach. Define `FUSEDOPT_HOST_DISPATCH` to 0 before including
/// fusedopt to compile only the baseline with GCC too (less code, faster builds).
#pragma once

#include <vector>

#include "../config.hpp"

#if !defined(FUSEDOPT_HOST_DISPATCH)
#  if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__) && defined(__x86_64__)
#    define FUSEDOPT_HOST_DISPATCH 1
#  else
#    define FUSEDOPT_HOST_DISPATCH 0
#  endif
#endif

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#  define FUSEDOPT_HOST_WRAPPED_BASELINE 1
#else
#  define FUSEDOPT_HOST_WRAPPED_BASELINE 0
#endif

#if FUSEDOPT_HOST_DISPATCH || FUSEDOPT_HOST_WRAPPED_BASELINE
/// Marks a loop (a lambda or function) that must be inlined into each version's wrapper:
/// left out of line it would run with the baseline's vectors in every version, and with the
/// translation unit's cost model.
#  define FUSEDOPT_HOST_LOOP __attribute__((always_inline))
#else
#  define FUSEDOPT_HOST_LOOP
#endif

FUSEDOPT_NAMESPACE_BEGIN
namespace host {

/// @brief The versions of the host backend's loops, narrowest first.
enum class instruction_set : int {
  baseline = 0,  ///< the translation unit's own flags (x86-64: SSE2 unless -march says more)
  avx2 = 1,      ///< 32-byte vectors (no FMA)
  avx512 = 2,    ///< 64-byte vectors: AVX-512 F, BW, VL and DQ (no FMA)
};

/// @brief "baseline", "avx2" or "avx512".
constexpr char const* instruction_set_name(instruction_set set) noexcept
{
  switch (set) {
    case instruction_set::avx2: return "avx2";
    case instruction_set::avx512: return "avx512";
    default: return "baseline";
  }
}

}  // namespace host

// In fusedopt::detail, not host::detail: the host backend names fusedopt::detail as `detail`.
namespace detail {

/// The widest set the translation unit's flags already give the baseline.
inline constexpr host::instruction_set compiled_instruction_set =
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
  host::instruction_set::avx512;
#elif defined(__AVX2__)
  host::instruction_set::avx2;
#else
  host::instruction_set::baseline;
#endif

#if FUSEDOPT_HOST_DISPATCH
template <class Loop>
__attribute__((target("avx2"), optimize("fp-contract=off", "vect-cost-model=dynamic"))) void run_avx2(Loop const& loop)
{
  loop();
}
template <class Loop>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), optimize("fp-contract=off", "vect-cost-model=dynamic")))
void run_avx512(Loop const& loop)
{
  loop();
}
#endif
#if FUSEDOPT_HOST_WRAPPED_BASELINE
// The translation unit's flags but the dynamic cost model; never inlined, since inlined into its
// caller the loop would be compiled with the caller's settings.
template <class Loop>
__attribute__((noinline, optimize("vect-cost-model=dynamic"))) void run_baseline(Loop const& loop)
{
  loop();
}
#endif

/// Runs `loop` (a FUSEDOPT_HOST_LOOP callable) in its version for `set`, an
/// effective_instruction_set.
template <class Loop>
FUSEDOPT_HOST_LOOP inline void run_for(host::instruction_set set, Loop const& loop)
{
#if FUSEDOPT_HOST_DISPATCH
  if constexpr (compiled_instruction_set < host::instruction_set::avx512) {
    if (set == host::instruction_set::avx512) { return run_avx512(loop); }
  }
  if constexpr (compiled_instruction_set < host::instruction_set::avx2) {
    if (set == host::instruction_set::avx2) { return run_avx2(loop); }
  }
#else
  (void)set;
#endif
#if FUSEDOPT_HOST_WRAPPED_BASELINE
  run_baseline(loop);
#else
  loop();
#endif
}

}  // namespace detail

namespace host {

/// @brief The widest set whose version this translation unit compiled and this CPU runs
/// (`baseline`, or what the flags give it, where only the baseline is compiled: see the
/// file's notes). The CPU is asked once per program, in a function-local static: the only
/// state the backend keeps.
inline instruction_set supported_instruction_set() noexcept
{
#if FUSEDOPT_HOST_DISPATCH
  static instruction_set const widest = [] {
    __builtin_cpu_init();  // a no-op after libgcc's own start-up; needed before it
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      return instruction_set::avx512;
    }
    return __builtin_cpu_supports("avx2") ? instruction_set::avx2 : instruction_set::baseline;
  }();
  return widest < detail::compiled_instruction_set ? detail::compiled_instruction_set : widest;
#else
  return detail::compiled_instruction_set;
#endif
}

/// @brief The set a plan's loops run with when at most `widest` is wanted: the narrower of
/// `widest` and supported_instruction_set(), never below what the baseline already uses.
inline instruction_set effective_instruction_set(instruction_set widest) noexcept
{
  instruction_set const supported = supported_instruction_set();
  instruction_set const chosen = widest < supported ? widest : supported;
  return chosen < detail::compiled_instruction_set ? detail::compiled_instruction_set : chosen;
}

/// @brief Each version this program can run, narrowest first (versions that the baseline's
/// flags already cover are one): what tests and benchmarks compare.
inline std::vector<instruction_set> runnable_instruction_sets()
{
  std::vector<instruction_set> sets;
  for (auto set : {instruction_set::baseline, instruction_set::avx2, instruction_set::avx512}) {
    instruction_set const used = effective_instruction_set(set);
    if (sets.empty() || sets.back() != used) { sets.push_back(used); }
  }
  return sets;
}

}  // namespace host
FUSEDOPT_NAMESPACE_END
