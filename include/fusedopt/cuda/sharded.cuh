/// @file cuda/sharded.cuh
/// @brief A sharded optimizer step (ZeRO-1/2): every rank keeps the states of one shard of a
/// flat layout of the parameter tensors; a step reduce-scatters the gradients, runs the rule on
/// the rank's shard with the multi-tensor launch of cuda::plan, and all-gathers the parameters.
/// Rules with reduction passes (clip_by_global_norm, LAMB, LARS, the AMP skip) give the bits
/// of one GPU running the unsharded plan (docs/sharded.md says why).
///
/// @code
/// fo::cuda::sharded_layout layout(sizes, comm.size());          // the same on every rank
/// // this rank's shard of each slot: layout.shard_elements() elements; gradients and
/// // parameters: layout.flat_elements(), every tensor at layout.offset(t)
/// auto lists = fo::bind(fo::slot::param = layout.shard_list(params + layout.shard_begin(rank), rank),
///                       fo::slot::grad = layout.shard_list<float const>(grad_shard, rank),
///                       fo::slot::exp_avg = layout.shard_list(m, rank), fo::slot::exp_avg_sq = layout.shard_list(v, rank));
/// auto plan = fo::cuda::make_sharded_plan(layout, comm, lists, fo::cuda::shard_buffers<float, float>{grads, grad_shard, params});
/// plan.run(fo::rules::adamw{}, {t}, stream);   // reduce-scatter, passes, update, all-gather
/// @endcode
///
/// The communication goes through a *communicator*, any type with these members (each
/// enqueued on `stream`, asynchronous, capturable where the implementation is):
/// @code
/// int rank() const;  int size() const;
/// // send: size() x count elements; recv: this rank's count, reduced over the ranks
/// template <class T> void reduce_scatter(T const* send, T* recv, std::size_t count, gradient_reduction, cudaStream_t);
/// // in place: buffer holds size() x count elements, this rank's at rank() x count
/// template <class T> void all_gather(T* buffer, std::size_t count, cudaStream_t);
/// // in place: consecutive segments, rank q's counts[q] doubles long, every rank's gathered
/// void all_gather_v(double* buffer, std::int64_t const* counts, cudaStream_t);
/// @endcode
/// Two are provided: `cuda::local_group` (cuda/local_group.cuh: N ranks simulated on one GPU,
/// for tests) and `nccl::communicator` (fusedopt/nccl.cuh: one process per GPU). A step calls
/// them in a fixed order: reduce_scatter of the gradients; per reduction pass, one
/// all_gather_v of its chunk partials; all_gather of the parameters.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "../bind.hpp"
#include "../config.hpp"
#include "../detail/rebind.hpp"
#include "../scalar.hpp"
#include "../slots.hpp"
#include "../tensor_list.hpp"
#include "backend.cuh"
#include "detail/policy.cuh"
#include "detail/workspace.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

/// @brief How a reduce-scatter joins the ranks' gradients.
enum class gradient_reduction {
  sum,      ///< the sum over the ranks
  average,  ///< the sum divided by the number of ranks
};

/// @brief Where the tensors lie in one flat buffer of `ranks x shard_elements()` elements, cut
/// into one shard per rank. A tensor may be split between ranks, but only on a chunk boundary
/// of its own (a multiple of `chunk_elements` from its first element), and every tensor starts
/// at a multiple of 16 elements: so the rank's piece of a tensor is cut into exactly the
/// chunks the unsharded plan cuts from it, which is what makes reductions bit-identical
/// (docs/sharded.md). Padding: under 16 elements per tensor and under one chunk per shard
/// boundary. Host data only; the same on every rank.
class sharded_layout {
 public:
  /// One rank's elements of one tensor: `count` elements from the tensor's element `first`,
  /// at element `local` of the rank's shard.
  struct piece {
    std::int64_t first = 0;
    std::int64_t count = 0;
    std::int64_t local = 0;
  };

  /// @brief Places tensors of `sizes` elements, in order, for `ranks` ranks.
  /// @param chunk_elements the chunk length of the plans that will run on it (the policy's,
  /// or cuda::options::chunk_elements); a multiple of 16.
  /// @throws fusedopt::error if ranks < 1, a size is negative or the chunk length is not a
  /// positive multiple of 16.
  sharded_layout(std::vector<std::int64_t> sizes, int ranks,
                 std::int64_t chunk_elements = detail::default_policy::chunk_elements);

  [[nodiscard]] int ranks() const { return ranks_; }
  [[nodiscard]] std::size_t num_tensors() const { return sizes_.size(); }
  [[nodiscard]] std::int64_t tensor_size(std::size_t t) const { return sizes_[t]; }
  [[nodiscard]] std::int64_t chunk_elements() const { return chunk_; }
  /// @brief Elements of one rank's shard (a multiple of chunk_elements()).
  [[nodiscard]] std::int64_t shard_elements() const { return shard_; }
  /// @brief Elements of the flat buffer: ranks() x shard_elements().
  [[nodiscard]] std::int64_t flat_elements() const { return shard_ * ranks_; }
  /// @brief First element of rank `rank`'s shard in the flat buffer.
  [[nodiscard]] std::int64_t shard_begin(int rank) const { return shard_ * rank; }
  /// @brief First element of tensor `t` in the flat buffer.
  [[nodiscard]] std::int64_t offset(std::size_t t) const { return offsets_[t]; }
  /// @brief Rank `rank`'s elements of tensor `t` (count 0 when it holds none).
  [[nodiscard]] piece piece_of(std::size_t t, int rank) const;

  /// @brief One entry per tensor: rank `rank`'s piece of it in `shard` (the rank's
  /// shard_elements() elements of some slot), empty (null) where the rank holds none of it.
  /// Bind the plan's lists to these: tensor rows stay the rows of the unsharded lists, so
  /// per-tensor data of a rule (LARS's `exclude`, `groups`' indices) is indexed as before.
  template <class T>
  [[nodiscard]] tensor_list<T> shard_list(T* shard, int rank) const;
  /// @brief One entry per tensor: the whole tensor in `flat` (flat_elements() elements).
  template <class T>
  [[nodiscard]] tensor_list<T> full_list(T* flat) const;

 private:
  std::vector<std::int64_t> sizes_;
  std::vector<std::int64_t> offsets_;
  int ranks_ = 1;
  std::int64_t chunk_ = 0;
  std::int64_t shard_ = 0;
};

/// @brief The buffers a sharded step exchanges, on this rank (device memory, 16-byte aligned).
template <class Grad, class Param>
struct shard_buffers {
  Grad const* gradients = nullptr;  ///< this rank's gradients of every tensor: flat_elements(), laid out as the layout says
  Grad* gradient_shard = nullptr;   ///< their reduction over the ranks, this rank's shard (shard_elements()): slot::grad is bound to it
  Param* parameters = nullptr;      ///< every tensor's parameters (flat_elements()): slot::param is bound to this rank's shard of them
};

/// @brief One rank's sharded plan: a cuda::plan over the rank's shard of every slot, the
/// communicator, and a reduction workspace over the chunks of *all* ranks.
///
/// Contract: every rank builds its plan from the same layout, lists of the same types and the
/// same options, and runs the same rules in the same order (the collectives must match). The
/// lists bind slot::param to this rank's shard of `buffers.parameters` and slot::grad to
/// `buffers.gradient_shard`, through `layout.shard_list` (checked); other slots (states,
/// master weights) are the rank's own shard buffers. Rules that depend on an element's
/// position (stochastic rounding) see the position within the rank's piece, not the tensor's.
template <class Communicator, class Policy, class... B>
class basic_sharded_plan {
 public:
  using lists_type = bound_lists<B...>;
  using grad_type = std::remove_const_t<
    typename lists_type::template element_t<::fusedopt::detail::bound_position_v<lists_type, slot::grad_t>>>;
  using param_type = typename lists_type::template element_t<::fusedopt::detail::bound_position_v<lists_type, slot::param_t>>;

  /// @brief Builds the rank's cuda::plan and a workspace over every rank's chunks (device
  /// memory; synchronises `stream`).
  /// @throws fusedopt::error if the layout is for another number of ranks or another chunk
  /// length than the plan's, the lists do not follow the layout (rows, sizes, addresses), an
  /// address is not 16-byte aligned, or what cuda::plan's constructor throws.
  basic_sharded_plan(sharded_layout layout, Communicator communicator, lists_type lists,
                     shard_buffers<grad_type, param_type> buffers,
                     gradient_reduction reduction = gradient_reduction::average, options opts = {},
                     cudaStream_t stream = nullptr);

  /// @brief Enqueues one sharded step on `stream`: reduce-scatter of the gradients, the rule's
  /// reduction passes (each: pass on the shard, all_gather_v of the chunk partials, the
  /// finalize over every rank's partials), the update of the shard, the after-step hooks, the
  /// all-gather of the parameters. No allocation, no host synchronisation; capturable where
  /// the communicator is.
  /// @throws fusedopt::error as cuda::plan::run (before anything is enqueued), or as the
  /// communicator throws.
  template <class Rule>
  void run(Rule const& rule, step_info const& step = {}, cudaStream_t stream = nullptr);

  /// @brief What `run` checks before it enqueues anything (the rule, the step, the reduction
  /// workspace); enqueues nothing. bucket_schedule checks every bucket's plan with it first.
  /// @throws fusedopt::error as run.
  template <class Rule>
  void check(Rule const& rule, step_info const& step = {}) const;

  /// @name The three phases of run, for a caller that schedules them itself (bucket_schedule
  /// overlaps them across plans). run = check, reduce_scatter, update, all_gather.
  /// @{
  /// @brief Enqueues the reduce-scatter of the gradients into the gradient shard.
  void reduce_scatter(cudaStream_t stream = nullptr);
  /// @brief Checks (as `check`), then enqueues the rule's passes (with their collectives), the
  /// update of the shard and the after-step hooks.
  template <class Rule>
  void update(Rule const& rule, step_info const& step = {}, cudaStream_t stream = nullptr);
  /// @brief Enqueues the all-gather of the parameters.
  void all_gather(cudaStream_t stream = nullptr);
  /// @}

  [[nodiscard]] sharded_layout const& layout() const { return layout_; }
  /// @brief The plan over this rank's shard.
  [[nodiscard]] basic_plan<Policy, B...> const& local_plan() const { return local_; }
  [[nodiscard]] Communicator& communicator() { return communicator_; }

 private:
  friend class bucket_schedule;  // checks every bucket's plan, then enqueues without checking again

  /// update without its checks (the caller made them).
  template <class Rule>
  void enqueue_update(Rule const& rule, step_info const& step, cudaStream_t stream);
  template <class Rule, int P, int... J>
  void run_passes(Rule const& rule, step_info const& step, detail::pass_results<P> const& results,
                  cudaStream_t stream, std::integer_sequence<int, J...>);
  template <class Rule, int J, int P>
  void run_pass(Rule const& rule, step_info const& step, detail::pass_results<P> const& results, cudaStream_t stream);

  sharded_layout layout_;
  Communicator communicator_;
  basic_plan<Policy, B...> local_;
  shard_buffers<grad_type, param_type> buffers_;
  gradient_reduction reduction_;
  detail::reduction_workspace workspace_;  // rows: every tensor; partials: every rank's chunks
  std::int64_t first_chunk_ = 0;           // this rank's first chunk in the unsharded numbering
  std::vector<std::int64_t> rank_chunks_;  // chunks of each rank
  std::vector<std::int64_t> counts_;       // all_gather_v's counts of the pass in flight (no allocation per step)
};

/// @brief Runs the steps of several sharded plans, one per *bucket* of the parameters, so that
/// the reduce-scatter of bucket k + 1 overlaps the update of bucket k (ZeRO's and FSDP's
/// bucketing): the collectives go on a communication stream in a fixed order (every bucket's
/// reduce-scatter, then each bucket's all-gather as soon as its update is done), the updates
/// on the compute stream, each after its bucket's reduce-scatter. Events (made once, here)
/// join the two streams; a step allocates nothing and does not synchronise the host.
///
/// @code
/// // one sharded_layout, shard buffers and sharded plan per bucket, all with the same communicator
/// fo::cuda::bucket_schedule schedule(plans.size());  // after cudaSetDevice(the rank's GPU)
/// schedule.run(plans, fo::rules::adamw{}, {t}, compute_stream);
/// @endcode
///
/// The schedule owns a communication stream made at the device's greatest stream priority
/// (on the device current at construction; its events and stream belong to that device, so
/// make the schedule on the rank's GPU and run it with streams of that GPU): `run` without a
/// communication stream uses it. The priority matters: NCCL's kernels then get SMs ahead of the
/// update's blocks, so that the collectives are not held back behind the update they should
/// hide. Measured on two H200s (GPT-2 medium, docs/sharded.md): 61-81% of the update hidden with
/// it, 10-24% with a communication stream at the default priority. A step captured in a CUDA
/// graph keeps the priority only if the graph is instantiated with
/// `cudaGraphInstantiateFlagUseNodePriority` (otherwise its kernels run at the priority of the
/// stream the graph is launched on).
///
/// Every bucket's plan is checked before anything is enqueued, so a step that throws leaves
/// every bucket as it was. The rule runs per bucket: rules with reduction passes or after-step
/// hooks (clip_by_global_norm, LAMB, LARS, the AMP skip) would reduce over one bucket instead of
/// every tensor and are rejected at compile time; run one sharded plan over all tensors for
/// them. `step.advance`, when set, is advanced once (by the first bucket's update). Work the
/// caller enqueued on `compute` before `run` (the backward pass that wrote the gradients) comes
/// before the first reduce-scatter; the next work on `compute` comes after the last all-gather.
class bucket_schedule {
 public:
  /// @brief Makes the events for `buckets` buckets and the communication stream (non-blocking,
  /// the greatest priority of the current device).
  /// @throws fusedopt::error if buckets is 0, or a CUDA call fails.
  explicit bucket_schedule(std::size_t buckets);
  ~bucket_schedule();
  bucket_schedule(bucket_schedule&& other) noexcept
      : events_(std::move(other.events_)),
        communication_(std::exchange(other.communication_, nullptr)),
        device_(std::exchange(other.device_, -1))
  {
  }
  bucket_schedule& operator=(bucket_schedule&& other) noexcept;
  bucket_schedule(bucket_schedule const&) = delete;
  bucket_schedule& operator=(bucket_schedule const&) = delete;

  [[nodiscard]] std::size_t buckets() const { return events_.empty() ? 0 : (events_.size() - 2) / 2; }

  /// @brief Enqueues one step of every plan in `plans` (a vector of sharded plans, one per
  /// bucket, in the same order on every rank).
  /// `communication`: a stream of the caller's; create it at the greatest priority
  /// (`cudaStreamCreateWithPriority` with `cudaDeviceGetStreamPriorityRange`'s greatest), or
  /// the update delays the collectives (see above).
  /// @throws fusedopt::error if the schedule was moved from, plans.size() is not buckets(),
  /// the streams are equal or of another device than the schedule's (under stream capture,
  /// where CUDA cannot be asked a stream's device: the current device is), as the
  /// plans' `check` throws (before anything is enqueued), or as a CUDA call or the
  /// communicator throws.
  template <class Plans, class Rule>
  void run(Plans& plans, Rule const& rule, step_info const& step, cudaStream_t compute, cudaStream_t communication);

  /// @brief As above, the collectives on the schedule's own high-priority stream (a moved-from
  /// schedule has none, and the form above refuses it first).
  template <class Plans, class Rule>
  void run(Plans& plans, Rule const& rule, step_info const& step, cudaStream_t compute)
  {
    run(plans, rule, step, compute, communication_);
  }

  /// @brief The schedule's own communication stream (nullptr once moved from).
  [[nodiscard]] cudaStream_t communication_stream() const { return communication_; }

 private:
  void release() noexcept;
  // [0]: compute reached the step; [1]: the last all-gather is done; then per bucket k:
  // [2 + 2k] its reduce-scatter is done, [3 + 2k] its update is done.
  std::vector<cudaEvent_t> events_;
  cudaStream_t communication_ = nullptr;
  int device_ = -1;  // where the events and the stream were made
};

/// @brief A sharded plan with the default tuning policy.
template <class Communicator, class... B>
using sharded_plan = basic_sharded_plan<Communicator, detail::default_policy, B...>;

/// @brief Makes a sharded plan (see basic_sharded_plan).
template <class Policy = detail::default_policy, class Communicator, class... B, class G, class P>
[[nodiscard]] basic_sharded_plan<Communicator, Policy, B...> make_sharded_plan(
  sharded_layout layout, Communicator communicator, bound_lists<B...> lists, shard_buffers<G, P> buffers,
  gradient_reduction reduction = gradient_reduction::average, options opts = {}, cudaStream_t stream = nullptr)
{
  return basic_sharded_plan<Communicator, Policy, B...>(std::move(layout), std::move(communicator), std::move(lists),
                                                        buffers, reduction, opts, stream);
}

}  // namespace cuda
FUSEDOPT_NAMESPACE_END

#include "detail/sharded.inl"
