/// @file cuda/detail/sharded.inl
/// @brief Definitions of cuda/sharded.cuh (included at its end): the flat layout's placement
/// and the sharded plan's construction and step.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../../detail/factored.hpp"
#include "../../detail/phases.hpp"
#include "dispatch.cuh"
#include "tables.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

inline std::int64_t round_up(std::int64_t x, std::int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

/// Chunks the plans cut from a tensor piece of `count` elements that starts 16-byte aligned
/// (head 0: make_layout's chunks are then [0, chunk), [chunk, 2 chunk), ...).
inline std::int64_t chunks_of(std::int64_t count, std::int64_t chunk) { return (count + chunk - 1) / chunk; }

/// Every tensor starts at a multiple of this many elements: 16 bytes for every element type,
/// so every piece of every slot has vector head 0 in a 16-byte-aligned shard.
inline constexpr std::int64_t sharded_alignment = 16;

}  // namespace detail

inline sharded_layout::sharded_layout(std::vector<std::int64_t> sizes, int ranks, std::int64_t chunk_elements)
    : sizes_(std::move(sizes)), offsets_(sizes_.size(), 0), ranks_(ranks), chunk_(chunk_elements)
{
  using detail::round_up;
  constexpr std::int64_t align = detail::sharded_alignment;
  FUSEDOPT_EXPECTS(ranks >= 1, "cuda::sharded_layout: ranks must be at least 1");
  FUSEDOPT_EXPECTS(chunk_ > 0 && chunk_ % align == 0,
                   "cuda::sharded_layout: chunk_elements must be a positive multiple of 16, not " + std::to_string(chunk_));
  std::int64_t aligned_total = 0;
  for (std::size_t t = 0; t < sizes_.size(); ++t) {
    FUSEDOPT_EXPECTS(sizes_[t] >= 0, "cuda::sharded_layout: tensor " + std::to_string(t) + " has a negative size");
    aligned_total += round_up(sizes_[t], align);
  }
  // The smallest shard (whole chunks) the placement fits in: a tensor that would cross a shard
  // boundary starts on a chunk boundary instead, so it is cut on chunk boundaries of its own;
  // each boundary costs under one chunk of padding, so a few rounds find it.
  shard_ = std::max<std::int64_t>(round_up((aligned_total + ranks - 1) / ranks, chunk_), chunk_);
  for (;;) {
    std::int64_t end = 0;
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      std::int64_t o = round_up(end, align);
      if (sizes_[t] > 0 && o / shard_ != (o + sizes_[t] - 1) / shard_) { o = round_up(o, chunk_); }
      offsets_[t] = o;
      end = o + sizes_[t];
    }
    if (end <= flat_elements()) { break; }
    shard_ += chunk_;
  }
}

inline sharded_layout::piece sharded_layout::piece_of(std::size_t t, int rank) const
{
  std::int64_t const begin = std::max(offsets_[t], shard_begin(rank));
  std::int64_t const end = std::min(offsets_[t] + sizes_[t], shard_begin(rank) + shard_);
  if (end <= begin) { return {}; }
  return piece{begin - offsets_[t], end - begin, begin - shard_begin(rank)};
}

template <class T>
tensor_list<T> sharded_layout::shard_list(T* shard, int rank) const
{
  tensor_list<T> list;
  for (std::size_t t = 0; t < sizes_.size(); ++t) {
    piece const p = piece_of(t, rank);
    list.push_back(p.count > 0 ? shard + p.local : nullptr, p.count);
  }
  return list;
}

template <class T>
tensor_list<T> sharded_layout::full_list(T* flat) const
{
  tensor_list<T> list;
  for (std::size_t t = 0; t < sizes_.size(); ++t) { list.push_back(flat + offsets_[t], sizes_[t]); }
  return list;
}

namespace detail {

/// The options of the plan over one rank's shard: its workspace is the sharded plan's.
inline options without_workspace(options opts)
{
  opts.reduction_capacity = 0;
  return opts;
}

/// Checks that `lists` follow `layout` on `rank`: a row per tensor of the rank's piece size,
/// slot::grad in `gradient_shard` and slot::param in the rank's shard of `parameters` where
/// the layout puts them, every address 16-byte aligned (vector head 0, as in the unsharded plan).
template <class... B, class G, class P, std::size_t... K>
void check_shard_lists(sharded_layout const& layout, int rank, bound_lists<B...> const& lists, G const* gradient_shard,
                       P const* parameters, std::index_sequence<K...>)
{
  using Lists = bound_lists<B...>;
  static constexpr char const* names[] = {B::slot_type::name...};
  constexpr std::size_t grad = ::fusedopt::detail::bound_position_v<Lists, slot::grad_t>;
  constexpr std::size_t param = ::fusedopt::detail::bound_position_v<Lists, slot::param_t>;
  FUSEDOPT_EXPECTS(lists.num_tensors() == layout.num_tensors(),
                   "cuda::sharded_plan: the lists hold " + std::to_string(lists.num_tensors()) +
                     " tensors but the layout " + std::to_string(layout.num_tensors()) + "; bind layout.shard_list(...)");
  for (std::size_t t = 0; t < layout.num_tensors(); ++t) {
    sharded_layout::piece const p = layout.piece_of(t, rank);
    std::string const where = "cuda::sharded_plan: tensor " + std::to_string(t) + " on rank " + std::to_string(rank);
    FUSEDOPT_EXPECTS(lists.tensor_size(t) == p.count, where + " has " + std::to_string(lists.tensor_size(t)) +
                                                        " elements but the layout gives the rank " +
                                                        std::to_string(p.count) + "; bind layout.shard_list(...)");
    if (p.count == 0) { continue; }
    void const* const addresses[] = {lists.template address<K>(t)...};
    for (std::size_t k = 0; k < sizeof...(K); ++k) {
      FUSEDOPT_EXPECTS(reinterpret_cast<std::uintptr_t>(addresses[k]) % 16 == 0,
                       where + " of slot '" + names[k] +
                         "' is not 16-byte aligned; allocate every shard buffer 16-byte aligned (cudaMalloc does)");
    }
    FUSEDOPT_EXPECTS(addresses[grad] == static_cast<void const*>(gradient_shard + p.local),
                     where + ": slot 'grad' must be bound to shard_buffers::gradient_shard through layout.shard_list");
    FUSEDOPT_EXPECTS(addresses[param] == static_cast<void const*>(parameters + layout.shard_begin(rank) + p.local),
                     where + ": slot 'param' must be bound to this rank's shard of shard_buffers::parameters "
                             "(layout.shard_list(parameters + layout.shard_begin(rank), rank))");
  }
}

}  // namespace detail

template <class Communicator, class Policy, class... B>
basic_sharded_plan<Communicator, Policy, B...>::basic_sharded_plan(sharded_layout layout, Communicator communicator,
                                                                   lists_type lists,
                                                                   shard_buffers<grad_type, param_type> buffers,
                                                                   gradient_reduction reduction, options opts,
                                                                   cudaStream_t stream)
    : layout_(std::move(layout)),
      communicator_(std::move(communicator)),
      local_(lists, detail::without_workspace(opts), stream),
      buffers_(buffers),
      reduction_(reduction)
{
  static_assert(!(is_blockwise_v<typename B::element_type> || ...),
                "fusedopt: sharded plans do not take quantized states yet");
  int const ranks = communicator_.size();
  int const rank = communicator_.rank();
  FUSEDOPT_EXPECTS(ranks == layout_.ranks(), "cuda::sharded_plan: the communicator has " + std::to_string(ranks) +
                                               " ranks but the layout was made for " + std::to_string(layout_.ranks()));
  FUSEDOPT_EXPECTS(rank >= 0 && rank < ranks, "cuda::sharded_plan: the communicator's rank is out of range");
  std::int64_t const chunk = detail::chunk_length<Policy, lists_type>(opts);
  FUSEDOPT_EXPECTS(chunk == layout_.chunk_elements(),
                   "cuda::sharded_plan: the plan cuts chunks of " + std::to_string(chunk) +
                     " elements but the layout was made for " + std::to_string(layout_.chunk_elements()));
  FUSEDOPT_EXPECTS(buffers_.gradients != nullptr && buffers_.gradient_shard != nullptr && buffers_.parameters != nullptr,
                   "cuda::sharded_plan: shard_buffers must not hold null pointers");
  detail::check_shard_lists(layout_, rank, lists, buffers_.gradient_shard, buffers_.parameters,
                            std::index_sequence_for<B...>{});
  // The unsharded plan's chunk numbering: tensor by tensor, each cut from its element 0.
  // Rank q's pieces are consecutive in it (the flat order is the tensor order), so its chunks
  // are rank_chunks_[q] consecutive numbers: the all_gather_v's segments.
  std::vector<detail::chunk_range> ranges(layout_.num_tensors(), detail::chunk_range{0, 0});
  std::int64_t chunks = 0;
  for (std::size_t t = 0; t < layout_.num_tensors(); ++t) {
    ranges[t] = detail::chunk_range{chunks, detail::chunks_of(layout_.tensor_size(t), chunk)};
    chunks += ranges[t].count;
  }
  rank_chunks_.assign(static_cast<std::size_t>(ranks), 0);
  for (int q = 0; q < ranks; ++q) {
    for (std::size_t t = 0; t < layout_.num_tensors(); ++t) {
      rank_chunks_[static_cast<std::size_t>(q)] += detail::chunks_of(layout_.piece_of(t, q).count, chunk);
    }
    if (q < rank) { first_chunk_ += rank_chunks_[static_cast<std::size_t>(q)]; }
  }
  counts_.assign(static_cast<std::size_t>(ranks), 0);
  workspace_ = detail::reduction_workspace(opts.reduction_capacity, ranges, chunks, stream);
}

template <class Communicator, class Policy, class... B>
template <class Rule, int P, int... J>
void basic_sharded_plan<Communicator, Policy, B...>::run_passes(Rule const& rule, step_info const& step,
                                                                detail::pass_results<P> const& results,
                                                                cudaStream_t stream, std::integer_sequence<int, J...>)
{
  (run_pass<Rule, J>(rule, step, results, stream), ...);
}

template <class Communicator, class Policy, class... B>
template <class Rule, int J, int P>
void basic_sharded_plan<Communicator, Policy, B...>::run_pass(Rule const& rule, step_info const& step,
                                                              detail::pass_results<P> const& results, cudaStream_t stream)
{
  // The rank's chunk partials at their unsharded numbers; every rank's gathered; then the
  // unsharded plan's finalize over all of them: the same fold, the same bits, on every rank.
  constexpr int n = ::fusedopt::detail::pass_traits<Rule, J>::reduction::size;
  detail::plan_steps::pass<J>(local_, rule, step, results, workspace_.partials, first_chunk_, stream);
  for (std::size_t q = 0; q < counts_.size(); ++q) { counts_[q] = rank_chunks_[q] * n; }
  communicator_.all_gather_v(workspace_.partials, counts_.data(), stream);
  detail::plan_steps::finalize<J>(local_, rule, step, workspace_, results, stream);
}

template <class Communicator, class Policy, class... B>
template <class Rule>
void basic_sharded_plan<Communicator, Policy, B...>::check(Rule const& rule, step_info const& step) const
{
  static_assert(::fusedopt::detail::factor_count_v<Rule> == 0,
                "fusedopt: sharded plans cannot run rules with factored passes (Adafactor, ...): a shard cuts "
                "the matrices whose rows and columns they sum");
  detail::plan_steps::check_capacity<Rule>(workspace_);
  detail::plan_steps::check(local_, rule, step);
}

template <class Communicator, class Policy, class... B>
void basic_sharded_plan<Communicator, Policy, B...>::reduce_scatter(cudaStream_t stream)
{
  auto const shard = static_cast<std::size_t>(layout_.shard_elements());
  communicator_.reduce_scatter(buffers_.gradients, buffers_.gradient_shard, shard, reduction_, stream);
}

template <class Communicator, class Policy, class... B>
template <class Rule>
void basic_sharded_plan<Communicator, Policy, B...>::update(Rule const& rule, step_info const& step,
                                                            cudaStream_t stream)
{
  check(rule, step);
  enqueue_update(rule, step, stream);
}

template <class Communicator, class Policy, class... B>
template <class Rule>
void basic_sharded_plan<Communicator, Policy, B...>::enqueue_update(Rule const& rule, step_info const& step,
                                                                    cudaStream_t stream)
{
  constexpr int passes = ::fusedopt::detail::pass_count_v<Rule>;
  detail::plan_steps::begin(local_, step, stream);
  auto const results =
    detail::make_pass_results<Rule>(workspace_.results, workspace_.rows(), std::make_integer_sequence<int, passes>{});
  if constexpr (passes > 0) { run_passes(rule, step, results, stream, std::make_integer_sequence<int, passes>{}); }
  detail::plan_steps::update(local_, rule, step, results, stream);
  // After-step hooks see the results of every tensor (as on one GPU), on every rank.
  detail::plan_steps::after_step(local_, rule, step, results, stream);
}

template <class Communicator, class Policy, class... B>
void basic_sharded_plan<Communicator, Policy, B...>::all_gather(cudaStream_t stream)
{
  communicator_.all_gather(buffers_.parameters, static_cast<std::size_t>(layout_.shard_elements()), stream);
}

template <class Communicator, class Policy, class... B>
template <class Rule>
void basic_sharded_plan<Communicator, Policy, B...>::run(Rule const& rule, step_info const& step, cudaStream_t stream)
{
  check(rule, step);
  // Every check is done: from here on work is enqueued.
  reduce_scatter(stream);
  enqueue_update(rule, step, stream);
  all_gather(stream);
}

// ---- bucket_schedule ----------------------------------------------------------------------

inline bucket_schedule::bucket_schedule(std::size_t buckets)
{
  FUSEDOPT_EXPECTS(buckets > 0, "cuda::bucket_schedule: at least one bucket");
  events_.reserve(2 + 2 * buckets);
  try {
    for (std::size_t e = 0; e < 2 + 2 * buckets; ++e) {
      cudaEvent_t event = nullptr;
      FUSEDOPT_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
      events_.push_back(event);
    }
    int least = 0, greatest = 0;
    FUSEDOPT_CUDA_TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t stream = nullptr;
    FUSEDOPT_CUDA_TRY(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, greatest));
    communication_ = stream;
    FUSEDOPT_CUDA_TRY(cudaGetDevice(&device_));
  } catch (...) {
    release();
    throw;
  }
}

inline bucket_schedule::~bucket_schedule() { release(); }

inline bucket_schedule& bucket_schedule::operator=(bucket_schedule&& other) noexcept
{
  if (this != &other) {
    release();
    events_ = std::move(other.events_);
    communication_ = std::exchange(other.communication_, nullptr);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

inline void bucket_schedule::release() noexcept
{
  // A destructor must not throw; destroying an event or a stream only fails when the context is gone.
  for (cudaEvent_t event : events_) { (void)cudaEventDestroy(event); }
  events_.clear();
  if (communication_ != nullptr) { (void)cudaStreamDestroy(communication_); }
  communication_ = nullptr;
}

template <class Plans, class Rule>
void bucket_schedule::run(Plans& plans, Rule const& rule, step_info const& step, cudaStream_t compute,
                          cudaStream_t communication)
{
  static_assert(::fusedopt::detail::pass_count_v<Rule> == 0 && !::fusedopt::detail::needs_after_step<Rule>::value,
                "fusedopt: bucket_schedule runs the rule on each bucket alone; a rule with reduction passes or "
                "after-step hooks (clip_by_global_norm, LAMB, LARS, the AMP skip) needs every tensor in one "
                "step: run one sharded plan over all of them");
  FUSEDOPT_EXPECTS(!events_.empty(), "cuda::bucket_schedule: this schedule was moved from");
  std::size_t const n = buckets();
  FUSEDOPT_EXPECTS(static_cast<std::size_t>(plans.size()) == n,
                   "cuda::bucket_schedule: " + std::to_string(plans.size()) + " plans for a schedule of " +
                     std::to_string(n) + " buckets");
  FUSEDOPT_EXPECTS(compute != communication,
                   "cuda::bucket_schedule: the compute and communication streams must differ (one stream "
                   "cannot overlap them; run each plan instead)");
  // The events belong to the device the schedule was made on: a stream of another device
  // would fail in the first cudaEventRecord with an unhelpful error. Runtimes before 12.8
  // cannot ask a stream its device, and CUDA refuses cudaStreamGetDevice while the stream is
  // being captured: there the current device stands in.
  auto const device_of = [](cudaStream_t s) {
    int device = -1;
#if CUDART_VERSION >= 12080
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FUSEDOPT_CUDA_TRY(cudaStreamIsCapturing(s, &capture));
    if (capture == cudaStreamCaptureStatusNone) {
      FUSEDOPT_CUDA_TRY(cudaStreamGetDevice(s, &device));
      return device;
    }
#else
    (void)s;
#endif
    FUSEDOPT_CUDA_TRY(cudaGetDevice(&device));
    return device;
  };
  for (cudaStream_t s : {compute, communication}) {
    int const device = device_of(s);
    FUSEDOPT_EXPECTS(device == device_, "cuda::bucket_schedule: made on device " + std::to_string(device_) +
                                          ", run with a stream of device " + std::to_string(device) +
                                          " (make the schedule after cudaSetDevice of the rank's GPU)");
  }
  // Later buckets read the step the first one advanced (same stream, in order).
  step_info later = step;
  later.advance = nullptr;
  std::size_t k = 0;
  for (auto& plan : plans) { plan.check(rule, k++ == 0 ? step : later); }
  // Every check is done: from here on work is enqueued.
  auto event = [&](std::size_t i) { return events_[i]; };
  FUSEDOPT_CUDA_TRY(cudaEventRecord(event(0), compute));
  FUSEDOPT_CUDA_TRY(cudaStreamWaitEvent(communication, event(0), 0));
  k = 0;
  for (auto& plan : plans) {
    plan.reduce_scatter(communication);
    FUSEDOPT_CUDA_TRY(cudaEventRecord(event(2 + 2 * k), communication));
    ++k;
  }
  k = 0;
  for (auto& plan : plans) {
    FUSEDOPT_CUDA_TRY(cudaStreamWaitEvent(compute, event(2 + 2 * k), 0));
    plan.enqueue_update(rule, k == 0 ? step : later, compute);
    FUSEDOPT_CUDA_TRY(cudaEventRecord(event(3 + 2 * k), compute));
    FUSEDOPT_CUDA_TRY(cudaStreamWaitEvent(communication, event(3 + 2 * k), 0));
    plan.all_gather(communication);
    ++k;
  }
  FUSEDOPT_CUDA_TRY(cudaEventRecord(event(1), communication));
  FUSEDOPT_CUDA_TRY(cudaStreamWaitEvent(compute, event(1), 0));
}

}  // namespace cuda
FUSEDOPT_NAMESPACE_END
