/// @file host/backend.hpp
/// @brief The host backend: runs a rule over bound tensor lists on the CPU.
///
/// Work is cut into chunks of at most `options::chunk_elements` elements of one tensor,
/// spread over OpenMP threads when the program is built with OpenMP (the fusedopt CMake
/// target adds it where found), else run on the calling thread. Each element is loaded once
/// and stored once; elements never depend on each other, so the result is the same bits
/// whatever the number of threads, and whatever the vector width the loops were compiled for
/// (host/instruction_set.hpp: AVX2 or AVX-512 chosen at run time with GCC on x86-64). With
/// 8-bit quantized states bound, chunks hold whole blocks (`chunk_elements` is rounded up to a
/// multiple of the block size) and a block is updated as a whole: the elements of a block
/// depend on each other only through its scale.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../bind.hpp"
#include "../config.hpp"
#include "../detail/access.hpp"
#include "../detail/factored.hpp"
#include "../detail/phases.hpp"
#include "../detail/rebind.hpp"
#include "../reduce.hpp"
#include "../error.hpp"
#include "../rule.hpp"
#include "../scalar.hpp"
#include "instruction_set.hpp"

#if defined(_OPENMP)
#  include <omp.h>
#endif

FUSEDOPT_NAMESPACE_BEGIN
namespace host {

/// @brief How the host backend spreads work.
struct options {
  /// Most threads a plan accepts: OpenMP runtimes abort the process (or crash) when asked for
  /// tens of thousands of threads, so larger requests are rejected with an error instead.
  static constexpr int max_threads = 1024;
  /// Most accumulators a plan accepts: the largest rule in the library needs 3.
  static constexpr int max_reduction_capacity = 1024;

  /// Threads to use: 0 for OpenMP's default, 1 for the calling thread only; at most
  /// `max_threads`.
  int threads = 0;
  /// Elements of one tensor per work item (a few hundred KB across the slots, so a chunk's
  /// data stays in the core's cache while it is updated). Rounded up to whole blocks where
  /// quantized states are bound.
  std::int64_t chunk_elements = std::int64_t{1} << 15;
  /// Accumulators (summed over a rule's reduction passes) the plan keeps room for; a rule
  /// needing more is rejected by run(). At most `max_reduction_capacity`.
  int reduction_capacity = 8;
  /// Widest instruction set the element loops may use: by default the widest the CPU runs
  /// (supported_instruction_set()); a narrower one lets tests and benchmarks compare versions,
  /// which give the same bits.
  instruction_set widest_instruction_set = instruction_set::avx512;
};

/// @brief Lists cut into chunks once; `run` then updates every element with no allocation.
///
/// A plan is made from the lists' geometry (tensor count and sizes): the chunks and the
/// reduction workspace depend on nothing else. Addresses are not geometry: `rebind` points the
/// plan at lists of the same geometry at new addresses (new gradient buffers every step, as
/// PyTorch's `zero_grad(set_to_none=True)` or a caching allocator hand out) in O(tensors) host
/// work with no allocation; only a change of geometry needs a new plan.
template <class... Bindings>
class plan {
  using lists_type = bound_lists<Bindings...>;
  static constexpr std::size_t num_slots = sizeof...(Bindings);

 public:
  /// @brief Cuts the (already validated) lists into chunks and sizes the reduction workspace.
  /// @throws fusedopt::error if `opts.chunk_elements < 1`, `opts.threads` is negative or over
  /// `options::max_threads`, `opts.reduction_capacity` is negative or over
  /// `options::max_reduction_capacity`, the workspace cannot be allocated, or a pointer is not
  /// aligned to its element size.
  explicit plan(lists_type lists, options opts = {}) : lists_(std::move(lists)), options_(opts)
  {
    FUSEDOPT_EXPECTS(options_.chunk_elements >= 1, "host::options::chunk_elements must be at least 1");
    FUSEDOPT_EXPECTS(options_.threads >= 0 && options_.threads <= options::max_threads,
                     "host::options::threads must be between 0 and " + std::to_string(options::max_threads) +
                       ", not " + std::to_string(options_.threads));
    FUSEDOPT_EXPECTS(options_.reduction_capacity >= 0 && options_.reduction_capacity <= options::max_reduction_capacity,
                     "host::options::reduction_capacity must be between 0 and " +
                       std::to_string(options::max_reduction_capacity) + ", not " +
                       std::to_string(options_.reduction_capacity));
    FUSEDOPT_EXPECTS(options_.widest_instruction_set >= instruction_set::baseline &&
                       options_.widest_instruction_set <= instruction_set::avx512,
                     "host::options::widest_instruction_set must be one of host::instruction_set's values");
    instruction_set_ = effective_instruction_set(options_.widest_instruction_set);
    check_alignment(lists_, std::make_index_sequence<num_slots>{});
    written_.assign(lists_);
    std::size_t const n = lists_.num_tensors();
    bases_.resize(n);
    // Whole quantized blocks per chunk: a block's scale depends on all its elements.
    std::int64_t const length = detail::whole_blocks<lists_type>(std::min(options_.chunk_elements, std::int64_t{1} << 40));
    for (std::size_t t = 0; t < n; ++t) {
      fill_bases(bases_[t], t, std::make_index_sequence<num_slots>{});
      std::int64_t const size = lists_.tensor_size(t);
      for (std::int64_t begin = 0; begin < size; begin += std::min(length, size - begin)) {
        chunks_.push_back(chunk{static_cast<std::int64_t>(t), begin, begin + std::min(length, size - begin)});
      }
    }
    try {
      workspace_.resize(static_cast<std::size_t>(options_.reduction_capacity) * (n + 1 + chunks_.size()));
    } catch (std::bad_alloc const&) {
      throw error("fusedopt: host::options::reduction_capacity " + std::to_string(options_.reduction_capacity) +
                  " needs more memory for the reduction workspace than could be allocated");
    }
  }

  /// @brief True when `lists` have this plan's geometry (the same number of tensors, each of
  /// the same size), so that `rebind(lists)` can take them.
  [[nodiscard]] bool can_rebind(lists_type const& lists) const noexcept
  {
    if (lists.num_tensors() != lists_.num_tensors()) { return false; }
    for (std::size_t t = 0; t < lists.num_tensors(); ++t) {
      if (lists.tensor_size(t) != lists_.tensor_size(t)) { return false; }
    }
    return true;
  }

  /// @brief Points the plan at `lists`, the same geometry at new addresses (validated by
  /// `fusedopt::bind` like any lists). O(tensors) host work, no allocation. Later `run`s update
  /// the new tensors; the old ones are no longer touched.
  /// @throws fusedopt::error, leaving the plan unchanged, if the geometry differs (the message
  /// names the first tensor that differs) or a pointer is not aligned to its element size.
  void rebind(lists_type const& lists)
  {
    FUSEDOPT_EXPECTS(lists.num_tensors() == lists_.num_tensors(),
                     "plan::rebind: the lists hold " + std::to_string(lists.num_tensors()) +
                       " tensors but the plan was made for " + std::to_string(lists_.num_tensors()) +
                       "; make a new plan when the geometry changes");
    for (std::size_t t = 0; t < lists.num_tensors(); ++t) {
      FUSEDOPT_EXPECTS(lists.tensor_size(t) == lists_.tensor_size(t),
                       "plan::rebind: tensor " + std::to_string(t) + " has " + std::to_string(lists.tensor_size(t)) +
                         " elements but the plan was made for " + std::to_string(lists_.tensor_size(t)) +
                         "; make a new plan when the geometry changes");
    }
    check_alignment(lists, std::make_index_sequence<num_slots>{});
    lists_ = lists;  // equal lengths: the vectors reuse their storage
    written_.assign(lists_);
    for (std::size_t t = 0; t < bases_.size(); ++t) { fill_bases(bases_[t], t, std::make_index_sequence<num_slots>{}); }
  }

  /// @brief Pointer to the elements of slot `Slot` as bound (const for a read-only slot).
  template <class Slot>
  using slot_pointer_t = typename lists_type::template element_t<detail::bound_position_v<lists_type, Slot>>*;

  /// @brief Points one slot the rule only reads (bound const, such as the gradients) at
  /// `addresses`, one per tensor, sizes unchanged (new gradient buffers every step). Each
  /// changed address is checked as `fusedopt::bind` checks it (null, element alignment,
  /// overlap with any tensor the rule writes, looked up in memory sorted when the plan was
  /// made): O(k log n) for k changed addresses of n tensors, no allocation, no list to bind.
  /// The same call as cuda::plan's, without the stream. A slot the rule writes moves with
  /// `rebind(lists)`.
  /// @throws fusedopt::error, leaving the plan unchanged, if `count` is not the number of
  /// tensors or an address fails a check.
  template <class Slot>
  void rebind(Slot, slot_pointer_t<Slot> const* addresses, std::size_t count)
  {
    constexpr std::size_t K = detail::bound_position_v<lists_type, Slot>;
    detail::check_rebound_addresses<K>(lists_, written_, addresses, count, "plan::rebind");
    // Checks done: from here the plan changes.
    for (std::size_t t = 0; t < count; ++t) {
      detail::bound_lists_access::repoint<K>(lists_, t, addresses[t]);
      bases_[t][K] = const_cast<void*>(static_cast<void const*>(addresses[t]));
    }
  }

  /// @brief Runs `rule` for one step over every element of every tensor: its reduction
  /// passes first (if it has any), then the update pass (none for a rule that declares
  /// `updates = false`, norm_of), then its after-step hooks.
  /// Synchronous. Not to be called concurrently on one plan (the reduction results live in it).
  /// @throws fusedopt::error if the rule's options need a slot that is not bound, the step
  /// (a value, or read through its host pointer) is below 1, the `advance` counter is at
  /// INT64_MAX, or the rule needs more accumulators than `options::reduction_capacity`.
  template <class Rule>
  void run(Rule const& rule, step_info const& step = {}) const
  {
    constexpr int passes = detail::pass_count_v<Rule>;
    detail::validate_rule(rule, typename lists_type::memory_slots{});
    detail::validate_step(step, true);  // host pointers: readable here
    if constexpr (passes > 0) {
      constexpr int needed = ::fusedopt::detail::accumulators_v<Rule>;
      FUSEDOPT_EXPECTS(needed <= options_.reduction_capacity,
                       "the rule needs " + std::to_string(needed) +
                         " reduction accumulators but host::options::reduction_capacity is " +
                         std::to_string(options_.reduction_capacity));
    }
    constexpr int factored = detail::factor_count_v<Rule>;
    if constexpr (factored > 0) { check_factored(rule, std::make_integer_sequence<int, factored>{}); }
    // Every check is done: from here on memory is written.
    if (step.advance != nullptr) { ++*step.advance; }
    reduced results[passes > 0 ? passes : 1];
    // The passes in chain order: factored passes (if any) before the reduction passes that come
    // after them in the chain.
    if constexpr (passes > 0) { run_passes(rule, step, results, std::make_integer_sequence<int, passes>{}); }
    if constexpr (factored > 0) { run_factored(rule, step, results, passes); }
    if constexpr (!detail::skips_update_v<Rule>) {
      using access = detail::access<Rule, lists_type>;
      auto const body = detail::prepare_final(rule, step, results);
      auto const count = static_cast<std::int64_t>(chunks_.size());
#if defined(_OPENMP)
      int const threads = options_.threads > 0 ? options_.threads : omp_get_max_threads();
#  pragma omp parallel for schedule(static) num_threads(threads)
#endif
      for (std::int64_t c = 0; c < count; ++c) {
        chunk const& work = chunks_[static_cast<std::size_t>(c)];
        detail::run_for(instruction_set_, [&]() FUSEDOPT_HOST_LOOP { run_chunk<access>(body, work); });
      }
    }
    detail::after_step(rule, step, results);
  }

  [[nodiscard]] lists_type const& lists() const { return lists_; }
  [[nodiscard]] std::size_t num_chunks() const { return chunks_.size(); }
  /// @brief The instruction set the loops run with (effective_instruction_set of the options).
  [[nodiscard]] instruction_set used_instruction_set() const { return instruction_set_; }

 private:
  struct chunk {
    std::int64_t tensor, begin, end;
  };

  template <std::size_t... K>
  void fill_bases(std::array<void*, num_slots>& bases, std::size_t t, std::index_sequence<K...>) const
  {
    ((bases[K] = lists_.template address<K>(t)), ...);
  }

  // A misaligned element access is undefined behaviour (and faults on some CPUs): reject it
  // as the CUDA backend does.
  template <std::size_t... K>
  static void check_alignment(lists_type const& lists, std::index_sequence<K...>)
  {
    static constexpr char const* names[] = {Bindings::slot_type::name...};
    std::size_t const alignments[] = {alignof(std::remove_const_t<typename Bindings::element_type>)...};
    for (std::size_t t = 0; t < lists.num_tensors(); ++t) {
      if (lists.tensor_size(t) == 0) { continue; }
      std::uintptr_t const addresses[] = {reinterpret_cast<std::uintptr_t>(lists.template address<K>(t))...};
      for (std::size_t k = 0; k < num_slots; ++k) {
        FUSEDOPT_EXPECTS(addresses[k] % alignments[k] == 0,
                         "tensor " + std::to_string(t) + " of slot '" + names[k] + "' is not aligned to its element size");
      }
    }
  }

  template <class Access, class Body>
  FUSEDOPT_HOST_LOOP void run_chunk(Body const& body, chunk const& c) const
  {
    std::array<void*, num_slots> const bases = bases_[static_cast<std::size_t>(c.tensor)];
    // A copy, not a reference: a local body's options (flags, factors) cannot be changed by
    // the loop's stores, so the compiler keeps them in registers and if-converts or unswitches
    // the choices they make (a double tensor's stores may alias a double member of a body
    // reached through a reference, and then every choice stays a branch per element).
    auto const tensor_body = detail::body_for_tensor(body, c.tensor);
    if constexpr (Access::stores_quantized) {
      constexpr std::int64_t block = Access::block_elements;
      for (std::int64_t i = c.begin; i < c.end; i += block) {
        update_block<Access>(tensor_body, bases.data(), c.tensor, i, std::min(block, c.end - i));
      }
    } else {
      for (std::int64_t i = c.begin; i < c.end; ++i) { Access::update(tensor_body, bases.data(), c.tensor, i); }
    }
  }

  // One block of 8-bit states: detail::access::update_block's steps and bits (the definition,
  // which the CUDA backend follows too; tests/host/quantized_states.cpp compares the two), in
  // loops that vectorise. The codes of each quantized slot the rule reads are decoded into a
  // row of the block's map values; the rule runs over the block as over unquantized elements,
  // the new values of quantized slots going to their rows with their largest magnitude and
  // whether one moved; then each slot the block rewrites is encoded from its row.
  // docs/decisions.md, "The host's 8-bit block update".
  template <class Access, class Body>
  FUSEDOPT_HOST_LOOP static void update_block(Body const& body, void* const* bases, std::int64_t tensor,
                                              std::int64_t begin, std::int64_t count)
  {
    using element_type = typename Access::element_type;
    constexpr std::int64_t block = Access::block_elements;
    float rows[num_slots][block];  // quantized slots only
    float scales[num_slots] = {};
    // block_summary's fields, folded in locals: folded into block_summary (its bool with ||,
    // through access::summarize) they kept the loop from vectorising.
    std::uint32_t max_bits[num_slots] = {};
    std::uint32_t changed[num_slots] = {};
    for_each_slot([&](auto k) FUSEDOPT_HOST_LOOP {
      constexpr std::size_t K = decltype(k)::value;
      if constexpr (Access::quantized[K] && Access::loads[K]) {
        using T = typename Access::template element_t<K>;
        scales[K] = detail::load_scale(bases[K], static_cast<std::uint64_t>(begin / block));
        decode_codes<T>(static_cast<std::uint8_t const*>(bases[K]) + begin, count, rows[K]);
      }
    });
    for (std::int64_t n = 0; n < count; ++n) {
      element_type e;
      e.set_position(tensor, begin + n);
      for_each_slot([&](auto k) FUSEDOPT_HOST_LOOP {
        constexpr std::size_t K = decltype(k)::value;
        if constexpr (!Access::quantized[K]) {
          Access::template load_one<K, Access::loads[K]>(e, bases, begin + n, detail::global_maps{});
        } else {
          e.at(K) = Access::loads[K] ? rows[K][n] * scales[K] : 0.f;  // detail::dequantize's multiplication
        }
      });
      Access::clear_registers(e);
      element_type const before = e;
      body(e);
      for_each_slot([&](auto k) FUSEDOPT_HOST_LOOP {
        constexpr std::size_t K = decltype(k)::value;
        if constexpr (!Access::quantized[K]) {
          Access::template store_one<K>(e, bases, begin + n);
        } else if constexpr (Access::stores[K]) {
          std::uint32_t const magnitude = detail::float_bits(e.at(K)) & 0x7fffffffu;
          max_bits[K] = magnitude > max_bits[K] ? magnitude : max_bits[K];
          changed[K] |= !Access::loads[K] || e.at(K) != before.at(K) ? 1u : 0u;
          rows[K][n] = e.at(K);
        }
      });
    }
    typename Access::block_summary s = Access::empty_summary();
    for_each_slot([&](auto k) FUSEDOPT_HOST_LOOP {
      constexpr std::size_t K = decltype(k)::value;
      if constexpr (Access::quantized[K] && Access::stores[K]) {
        s.max_bits[K] = max_bits[K];
        s.changed[K] = changed[K] != 0;
        if (Access::template rewrites<K>(s)) {
          using T = typename Access::template element_t<K>;
          encode_codes<T>(rows[K], count, detail::inverse_scale(detail::bits_float(max_bits[K])),
                          static_cast<std::uint8_t*>(bases[K]) + begin);
        }
      }
    });
    Access::store_scales(bases, begin / block, s);
  }

  template <class F>
  FUSEDOPT_HOST_LOOP static void for_each_slot(F const& f)
  {
    for_each_slot(f, std::make_index_sequence<num_slots>{});
  }
  template <class F, std::size_t... K>
  FUSEDOPT_HOST_LOOP static void for_each_slot(F const& f, std::index_sequence<K...>)
  {
    (f(std::integral_constant<std::size_t, K>{}), ...);
  }

  // The codes of a whole block of T (blockwise8) as eight-byte words: f(first, position) for
  // each word, at byte `position` of the block's codes, whose first four codes are those of
  // elements first .. first + 3 and the next four those of first + word_stride<T> .. + 3
  // (code_position's lane order: elements 128 g + 4 l at byte 4 G l + 4 g, G = Block / 128;
  // element order below 256). Written out so that the loops step both indices (code_position
  // per run cost more instructions than the lookups); covers_codes checks them against it.
  template <class T>
  static constexpr int word_stride = T::block_elements >= 256 ? 128 : 4;
  template <class T, class F>
  FUSEDOPT_HOST_LOOP static constexpr void for_each_code_word(F const& f)
  {
    constexpr int block = T::block_elements;
    if constexpr (block >= 256) {
      for (int g = 0; g < block / 128; g += 2) {
        for (int l = 0; l < 32; ++l) { f(128 * g + 4 * l, block / 32 * l + 4 * g); }
      }
    } else {
      for (int first = 0; first < block; first += 8) { f(first, first); }
    }
  }
  template <class T>
  static constexpr bool covers_codes()
  {
    bool ok = true;
    int words = 0;
    for_each_code_word<T>([&](int first, int position) {
      for (int k = 0; k < 4; ++k) {
        ok = ok && T::code_position(first + k) == position + k &&
             T::code_position(first + word_stride<T> + k) == position + 4 + k;
      }
      ++words;
    });
    return ok && words * 8 == T::block_elements;
  }
  // Byte k of an eight-byte word read from memory, as a shift of the word.
  static constexpr int byte_shift(int k)
  {
#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return 56 - 8 * k;
#else
    return 8 * k;
#endif
  }

  // row[j] = the map value of element j's code, j < count (the whole block or its last part).
  template <class T>
  FUSEDOPT_HOST_LOOP static void decode_codes(std::uint8_t const* codes, std::int64_t count, float* row)
  {
    static_assert(covers_codes<T>(), "for_each_code_word walks code_position's layout");
    auto const& values = detail::map_of<typename T::map_type>().values;
    if (count == T::block_elements) {
      // Indices shifted out of a word in a register, one load each: the loop vectorised with
      // gathers (emulated or not) took twice as long.
      for_each_code_word<T>([&](int first, int position) FUSEDOPT_HOST_LOOP {
        std::uint64_t word;
        std::memcpy(&word, codes + position, sizeof word);
        for (int k = 0; k < 4; ++k) {
          row[first + k] = values[(word >> byte_shift(k)) & 0xffu];
          row[first + word_stride<T> + k] = values[(word >> byte_shift(4 + k)) & 0xffu];
        }
      });
    } else {
      for (int j = 0; j < count; ++j) { row[j] = values[codes[T::code_position(j)]]; }
    }
  }

  // Stores the codes of row[j], j < count, in a block whose inverse_scale is `inverse`.
  template <class T>
  FUSEDOPT_HOST_LOOP static void encode_codes(float const* row, std::int64_t count, float inverse, std::uint8_t* codes)
  {
    auto const& map = detail::map_of<typename T::map_type>();
    if (count == T::block_elements) {
      std::uint8_t quantized[T::block_elements];  // in element order: a loop that vectorises
      for (int j = 0; j < T::block_elements; ++j) { quantized[j] = detail::quantize(map, row[j], inverse); }
      for_each_code_word<T>([&](int first, int position) FUSEDOPT_HOST_LOOP {
        std::memcpy(codes + position, quantized + first, 4);
        std::memcpy(codes + position + 4, quantized + first + word_stride<T>, 4);
      });
    } else {
      for (int j = 0; j < count; ++j) { codes[T::code_position(j)] = detail::quantize(map, row[j], inverse); }
    }
  }

  // ---- factored passes (factored.hpp; the order of their additions: detail/factored.hpp) ----

  // The tables are host memory here: each entry must describe its tensor's elements.
  template <class Rule, int... J>
  void check_factored(Rule const& rule, std::integer_sequence<int, J...>) const
  {
    (check_factored_table(detail::factor_owner<J>(rule).factors(), detail::factor_stores_v<Rule, J>), ...);
  }
  // A pass that stores (stored_by_pass) must visit every element: an entry with statistics for
  // every tensor with elements.
  template <class T>
  void check_factored_table(factored_table<T> const& table, bool stores) const
  {
    std::size_t const n = lists_.num_tensors();
    FUSEDOPT_EXPECTS(table.num_tensors == static_cast<std::int64_t>(n) && (n == 0 || table.tensors != nullptr),
                     "factored statistics: the table has " + std::to_string(table.num_tensors) +
                       " entries for lists of " + std::to_string(n) + " tensors");
    for (std::size_t t = 0; t < n; ++t) {
      factored_tensor<T> const& e = table.tensors[t];
      FUSEDOPT_EXPECTS(!stores || lists_.tensor_size(t) == 0 || e.rows > 0,
                       "factored statistics: entry " + std::to_string(t) +
                         " has none, but the pass stores every element (a vector needs its row statistics: "
                         "factored_layout::add_torch_shape(dims, true))");
      if (e.rows == 0) { continue; }
      FUSEDOPT_EXPECTS(e.matrices * e.rows * e.cols == lists_.tensor_size(t) && e.row != nullptr,
                       "factored statistics: entry " + std::to_string(t) + " (" + std::to_string(e.matrices) + " x " +
                         std::to_string(e.rows) + " x " + std::to_string(e.cols) + ") does not describe tensor " +
                         std::to_string(t) + " of " + std::to_string(lists_.tensor_size(t)) + " elements");
    }
  }

  // The factored passes that come after `before` reduction passes in the chain.
  template <class Rule>
  void run_factored(Rule const& rule, step_info const& step, reduced const* results, int before) const
  {
    run_factored(rule, step, results, before, std::make_integer_sequence<int, detail::factor_count_v<Rule>>{});
  }
  template <class Rule, int... J>
  void run_factored(Rule const& rule, step_info const& step, reduced const* results, int before,
                    std::integer_sequence<int, J...>) const
  {
    ((detail::factor_before_v<Rule, J> == before ? run_factored_pass<Rule, J>(rule, step, results) : void()), ...);
    (void)rule, (void)step, (void)results, (void)before;
  }

  // Tiles, then the fold of every statistic, then the row totals and line factors, tensor by
  // tensor; every addition in the order of detail/factored.hpp, whatever the threads.
  template <class Rule, int J>
  void run_factored_pass(Rule const& rule, step_info const& step, reduced const* results) const
  {
    using access = detail::access<Rule, lists_type>;
    using reads = typename detail::factor_traits<Rule, J>::reads;
    using stores = typename detail::factor_traits<Rule, J>::stores;
    using T = detail::factor_state_t<Rule, J>;
    auto const owner = detail::factor_owner<J>(rule);
    factored_table<T> const table = owner.factors();
    auto const body = detail::prepare_factor_pass<J>(rule, step, results);
    auto const fold = owner.prepare_fold(step);
    auto const factors = detail::prepare_line_factors<J>(rule, step);
#if defined(_OPENMP)
    int const threads = options_.threads > 0 ? options_.threads : omp_get_max_threads();
#endif
    for (std::size_t t = 0; t < bases_.size(); ++t) {
      factored_tensor<T> const e = table.tensors[t];
      if (e.rows == 0 || e.matrices == 0) { continue; }
      auto const tiles = e.tiles();
      void* const* bases = bases_[t].data();
      auto const tensor = static_cast<std::int64_t>(t);
#if defined(_OPENMP)
#  pragma omp parallel for schedule(static) num_threads(threads)
#endif
      for (std::int64_t k = 0; k < tiles; ++k) { sum_tile<access, reads, stores>(body, e, bases, tensor, k); }
      std::int64_t const lines = e.lines();
#if defined(_OPENMP)
#  pragma omp parallel for schedule(static) num_threads(threads)
#endif
      for (std::int64_t k = 0; k < lines; ++k) { fold_line(fold, e, k); }
      if (e.row_total != nullptr) {
        for (std::int64_t m = 0; m < e.matrices; ++m) {
          e.row_total[m] = row_total(e, m);
          double const mean = detail::row_mean(e.row_total[m], e.rows);
          for (std::int64_t r = m * e.rows; r < (m + 1) * e.rows; ++r) { detail::write_row_factor(factors, e, r, mean); }
          for (std::int64_t c = m * e.cols; c < (m + 1) * e.cols; ++c) { detail::write_col_factor(factors, e, c); }
        }
      } else {
        for (std::int64_t r = 0; r < lines; ++r) { detail::write_vector_factor(factors, e, r); }
      }
    }
  }

  template <class Access, class Reads, class Stores, class Body, class T>
  static void sum_tile(Body const& body, factored_tensor<T> const& e, void* const* bases, std::int64_t tensor,
                       std::int64_t k)
  {
    constexpr std::int64_t H = factored_tile_rows, B = factored_tile_cols;
    std::int64_t const per_matrix = e.row_tiles() * e.col_tiles();
    std::int64_t const m = k / per_matrix;
    std::int64_t const i = k % per_matrix / e.col_tiles();
    std::int64_t const j = k % e.col_tiles();
    std::int64_t const h = std::min(H, e.rows - i * H);
    std::int64_t const w = std::min(B, e.cols - j * B);
    std::int64_t const first = (m * e.rows + i * H) * e.cols + j * B;
    auto const tensor_body = detail::body_for_tensor(body, tensor);
    double columns[B] = {};
    double* const row_out = e.row_partials(m, j) + i * H;
    constexpr int lanes = detail::factored_row_lanes;
    for (std::int64_t r = 0; r < h; ++r) {
      double v[B];
      for (std::int64_t c = 0; c < B; ++c) {
        v[c] = c < w ? detail::factor_value<Access, Reads, Stores>(tensor_body, bases, tensor, first + r * e.cols + c) : 0.0;
      }
      for (std::int64_t c = 0; c < w; ++c) { columns[c] += v[c]; }
      double lane[lanes];
      for (int l = 0; l < lanes; ++l) { lane[l] = v[l] + v[l + lanes]; }
      row_out[r] = detail::lane_tree(lane);
    }
    if (e.col != nullptr) {
      double* const col_out = e.col_partials(m, i) + j * B;
      for (std::int64_t c = 0; c < w; ++c) { col_out[c] = columns[c]; }
    }
  }

  template <class Fold, class T>
  static void fold_line(Fold const& fold, factored_tensor<T> const& e, std::int64_t k)
  {
    std::int64_t const row_lines = e.matrices * e.rows;
    double sum = 0.0;
    if (k < row_lines) {
      std::int64_t const m = k / e.rows, r = k % e.rows;
      for (std::int64_t j = 0; j < e.col_tiles(); ++j) { sum += e.row_partials(m, j)[r]; }
      detail::fold_statistic(fold, e.row + k, sum, e.cols);
    } else {
      std::int64_t const l = k - row_lines;
      std::int64_t const m = l / e.cols, c = l % e.cols;
      for (std::int64_t i = 0; i < e.row_tiles(); ++i) { sum += e.col_partials(m, i)[c]; }
      detail::fold_statistic(fold, e.col + l, sum, e.rows);
    }
  }

  template <class T>
  static double row_total(factored_tensor<T> const& e, std::int64_t m)
  {
    constexpr int lanes = detail::factored_total_lanes;
    double lane[lanes] = {};
    T const* const row = e.row + m * e.rows;
    for (std::int64_t r = 0; r < e.rows; ++r) {
      lane[r % lanes] += static_cast<double>(to_opmath<opmath_t<T>>(row[r]));
    }
    return detail::lane_tree(lane);
  }

  // Pass J's results go after those of the passes before it: for each pass, N values per
  // tensor, N over all tensors, N per chunk (the chunk partials), then the F finished values
  // per tensor of a rule that finishes its results (N + F within the capacity).
  template <class Rule, int... J>
  void run_passes(Rule const& rule, step_info const& step, reduced* results, std::integer_sequence<int, J...>) const
  {
    std::size_t offset = 0;
    ((run_factored(rule, step, results, J), run_pass<Rule, J>(rule, step, results, offset)), ...);
  }

  template <class Rule, int J>
  void run_pass(Rule const& rule, step_info const& step, reduced* results, std::size_t& offset) const
  {
    using traits = detail::pass_traits<Rule, J>;
    using reduction = typename traits::reduction;
    using access = detail::access<Rule, lists_type>;
    constexpr int n = reduction::size;
    constexpr int f = traits::finished_size;
    std::size_t const tensors = bases_.size();
    double* const per_tensor = workspace_.data() + offset;
    double* const all = per_tensor + tensors * n;
    double* const partials = all + n;
    double* const finished = partials + chunks_.size() * n;
    offset += static_cast<std::size_t>(n) * (tensors + 1 + chunks_.size()) + static_cast<std::size_t>(f) * tensors;

    auto const body = detail::prepare_pass<J>(rule, step, results);
    auto const count = static_cast<std::int64_t>(chunks_.size());
#if defined(_OPENMP)
    int const threads = options_.threads > 0 ? options_.threads : omp_get_max_threads();
#  pragma omp parallel for schedule(static) num_threads(threads)
#endif
    for (std::int64_t c = 0; c < count; ++c) {
      chunk const& work = chunks_[static_cast<std::size_t>(c)];
      detail::run_for(instruction_set_, [&]() FUSEDOPT_HOST_LOOP {
        reduce_chunk<access, typename traits::reads, reduction>(body, work, partials + c * n);
      });
    }
    // Fixed order from here: chunks of a tensor in chunk order, then tensors in tensor order.
    for (std::size_t t = 0; t < tensors; ++t) {
      for (int k = 0; k < n; ++k) { per_tensor[t * n + k] = reduction::template identity<double>(k); }
    }
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      auto const t = static_cast<std::size_t>(chunks_[c].tensor);
      for (int k = 0; k < n; ++k) {
        per_tensor[t * n + k] = reduction::combine(k, per_tensor[t * n + k], partials[c * n + k]);
      }
    }
    for (int k = 0; k < n; ++k) {
      double total = reduction::template identity<double>(k);
      for (std::size_t t = 0; t < tensors; ++t) { total = reduction::combine(k, total, per_tensor[t * n + k]); }
      all[k] = total;
    }
    if constexpr (f > 0) {
      auto const finish = detail::prepare_finish<J>(rule, step);
      for (std::size_t t = 0; t < tensors; ++t) {
        finish(static_cast<std::int64_t>(t), per_tensor + t * n, finished + t * f);
      }
    }
    results[J] = reduced{per_tensor, all, n, static_cast<std::int64_t>(tensors), finished, f};
  }

  // A chunk is accumulated in the arithmetic type; when a float sum comes out non-finite it
  // is accumulated again in double (detail::sums_finite: squares of |x| > 1.8e19 overflow
  // float, not double), as the CUDA backend does for a thread's share of a chunk. Finite sums
  // pay one test per chunk and keep their bits.
  template <class Access, class Reads, class Reduction, class Body>
  FUSEDOPT_HOST_LOOP void reduce_chunk(Body const& body, chunk const& c, double* partial) const
  {
    using T = typename Access::value_type;
    constexpr int n = Reduction::size;
    auto const narrow = reduce_lanes<Access, Reads, Reduction, T>(body, c);
    if constexpr (detail::widens_overflowing_sums_v<Reduction, T>) {
      if (!detail::sums_finite<Reduction>(narrow)) {
        auto const wide = reduce_lanes<Access, Reads, Reduction, double>(body, c);
        for (int k = 0; k < n; ++k) { partial[k] = wide[k]; }
        return;
      }
    }
    for (int k = 0; k < n; ++k) { partial[k] = static_cast<double>(narrow[k]); }
  }

  // Elements go round-robin into `lanes` accumulators of type A that are combined in lane
  // order at the end: independent chains the compiler can vectorise, and the same bits for
  // any thread count.
  template <class Access, class Reads, class Reduction, class A, class Body>
  FUSEDOPT_HOST_LOOP accumulator<A, Reduction::size> reduce_lanes(Body const& body, chunk const& c) const
  {
    constexpr int n = Reduction::size;
    constexpr int lanes = 8;
    accumulator<A, n> acc[lanes];
    for (auto& a : acc) {
      for (int k = 0; k < n; ++k) { a[k] = Reduction::template identity<A>(k); }
    }
    std::array<void*, num_slots> const bases = bases_[static_cast<std::size_t>(c.tensor)];
    auto const& tensor_body = detail::body_for_tensor(body, c.tensor);
    std::int64_t i = c.begin;
    for (; i + lanes <= c.end; i += lanes) {
      for (int l = 0; l < lanes; ++l) {
        Access::template accumulate<Reads>(tensor_body, bases.data(), c.tensor, i + l, acc[l]);
      }
    }
    for (int l = 0; i < c.end; ++i, ++l) {
      Access::template accumulate<Reads>(tensor_body, bases.data(), c.tensor, i, acc[l]);
    }
    accumulator<A, n> total;
    for (int k = 0; k < n; ++k) {
      total[k] = acc[0][k];
      for (int l = 1; l < lanes; ++l) { total[k] = Reduction::combine(k, total[k], acc[l][k]); }
    }
    return total;
  }

  lists_type lists_;
  // The memory of every tensor the rule writes, sorted: rebind(slot, addresses) checks against it.
  detail::written_memory written_;
  options options_;
  instruction_set instruction_set_ = instruction_set::baseline;
  std::vector<std::array<void*, num_slots>> bases_;
  std::vector<chunk> chunks_;
  mutable std::vector<double> workspace_;  // reduction results and chunk partials
};

/// @brief Makes a host plan over `lists` (see plan).
template <class... Bindings>
[[nodiscard]] plan<Bindings...> make_plan(bound_lists<Bindings...> lists, options opts = {})
{
  return plan<Bindings...>(std::move(lists), opts);
}

/// @brief One-shot: runs `rule` once over `lists`. Builds a plan each call (allocates); keep
/// a plan for repeated steps.
template <class Rule, class... Bindings>
void apply(Rule const& rule, bound_lists<Bindings...> const& lists, step_info const& step = {}, options opts = {})
{
  plan<Bindings...>(lists, opts).run(rule, step);
}

}  // namespace host
FUSEDOPT_NAMESPACE_END
