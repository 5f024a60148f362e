/// @file cuda/muon.cuh
/// @brief Muon on the GPU: two fused passes (cuda::plan) around a batched Newton-Schulz over
/// cuBLAS strided-batched GEMMs, one batch per group of same-shaped matrices.
///
/// @code
/// #include <fusedopt/cuda/muon.cuh>   // link cuBLAS: CMake target fusedopt::cublas
/// auto lists = fo::bind(fo::slot::param = p, fo::slot::grad = g, fo::slot::momentum_buffer = m);
/// auto plan = fo::cuda::make_muon_plan(lists, shapes, {}, stream);   // allocates once
/// fo::rules::muon opt;
/// for (std::int64_t t = 1; t <= steps; ++t) plan.run(opt, fo::step_info{t}, stream);
/// @endcode
///
/// A step enqueues, on the caller's stream: pass 1 (a reduction pass, its finalize and the
/// update pass of rules::muon_momentum: buffers, and the normalised inputs in the plan's
/// workspace); per group and iteration, two device-to-device copies and three
/// cublasGemmStridedBatchedEx (bfloat16 or float in and out, float accumulation, the
/// coefficients as alpha and beta); pass 2 (rules::muon_apply). No allocation, no host
/// synchronisation: capturable in a CUDA graph (cuBLAS runs in the plan's own workspace).
///
/// Not included by fusedopt.cuh: this header alone needs cuBLAS (`-lcublas`).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../bind.hpp"
#include "../config.hpp"
#include "../detail/muon_lists.hpp"
#include "../detail/rebind.hpp"
#include "../error.hpp"
#include "../rules/muon.hpp"
#include "../scalar.hpp"
#include "backend.cuh"
#include "error.cuh"

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {
/// Builds the message of a failed cuBLAS call: the call as written, the status's name and text.
[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, char const* call, char const* file, int line)
{
  throw error(std::string("cuBLAS call '") + call + "' failed: " + cublasGetStatusName(status) + ": " +
              cublasGetStatusString(status) + " (" + file + ":" + std::to_string(line) + ")");
}
}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END

/// Evaluates a cuBLAS call once; throws fusedopt::error naming the call and the status when it
/// does not return CUBLAS_STATUS_SUCCESS.
#define FUSEDOPT_CUBLAS_TRY(call)                                                                   \
  do {                                                                                              \
    ::cublasStatus_t const fusedopt_cublas_status_ = (call);                                        \
    if (fusedopt_cublas_status_ != ::CUBLAS_STATUS_SUCCESS) {                                       \
      ::fusedopt::cuda::detail::throw_cublas_error(fusedopt_cublas_status_, #call, __FILE__, __LINE__); \
    }                                                                                               \
  } while (0)

FUSEDOPT_NAMESPACE_BEGIN
namespace cuda {

/// @brief Options of a CUDA muon plan.
struct muon_options {
  /// The two fused passes' options (pass 1 keeps room for its one accumulator; pass 2 needs none).
  options passes{};
  /// Device memory cuBLAS may use, part of the plan's one allocation (cuBLAS recommends 32 MiB
  /// on Hopper, 4 MiB before). 0: cuBLAS uses none (some GEMM algorithms are then unavailable).
  std::size_t cublas_workspace_bytes = std::size_t{32} << 20;
};

/// @brief Muon's steps over bound lists of 2-D parameters in device memory (slots param, grad,
/// momentum_buffer, in any order), Newton-Schulz in `NS` (fusedopt::bfloat16 as torch, or
/// float). Owns one device allocation (every matrix in NS, the GEMMs' scratch for the largest
/// group, the per-matrix learning-rate ratios, cuBLAS's workspace) and a cuBLAS handle;
/// move-only. The plan runs on the device current when it was built.
template <class NS, class... B>
class muon_plan {
  static_assert(std::is_same_v<NS, bfloat16> || std::is_same_v<NS, float>,
                "cuda::muon_plan<NS>: Newton-Schulz runs in fusedopt::bfloat16 or float");

 private:
  using traits = ::fusedopt::detail::muon_lists<NS, B...>;

 public:
  using lists_type = typename traits::lists_type;
  /// Pass 1's lists and plan: gradients and buffers in, Newton-Schulz inputs out.
  using input_lists_type = typename traits::input_lists_type;
  using input_plan = typename traits::template input_plan<plan>;
  /// Pass 2's lists and plan: the orthogonalised matrices into the parameters.
  using output_lists_type = typename traits::output_lists_type;
  using output_plan = typename traits::template output_plan<plan>;

  /// @brief Groups the tensors by shape, allocates the workspace (cudaMalloc), uploads the
  /// ratio tables, creates the cuBLAS handle, plans both passes and runs one Newton-Schulz
  /// iteration over the zeroed workspace (so that cuBLAS loads its kernels before a step is
  /// captured), on `stream`, synchronised. Do not build a plan while `stream` is being captured.
  /// @param shapes one per tensor, row-major (torch's `p.shape`): rows x cols must be the
  /// tensor's size; sides and group sizes must fit in an int (cuBLAS's dimensions).
  /// @throws fusedopt::error on a shape that does not fit its tensor, options cuda::plan rejects,
  /// or a failed CUDA or cuBLAS call.
  muon_plan(lists_type lists, std::vector<matrix_shape> const& shapes, muon_options opts = {},
            cudaStream_t stream = nullptr)
      : layout_(shapes, lists.num_tensors(), [&lists](std::size_t t) { return lists.tensor_size(t); }),
        memory_(allocate(layout_, opts.cublas_workspace_bytes, stream)),
        handle_(create_handle()),
        lists_(lists),
        input_(input_lists(lists), input_options(opts.passes), stream),
        output_(output_lists(lists), output_options(opts.passes), stream)
  {
    for (auto const& g : layout_.groups) {
      FUSEDOPT_EXPECTS(g.large <= INT_MAX && g.count <= INT_MAX && g.stride <= INT_MAX,
                       "muon plan: a group of " + std::to_string(g.count) + " matrices of " +
                         std::to_string(g.shape.rows) + " x " + std::to_string(g.shape.cols) +
                         " does not fit cuBLAS's int dimensions");
    }
    // One iteration over the zeroed workspace now: cuBLAS chooses and loads its kernels
    // (lazily loaded modules, heuristics) here, not in the first step, which may be captured.
    rules::muon warm_up;
    warm_up.ns_steps = 1;
    newton_schulz(warm_up, stream);
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));
  }

  muon_plan(muon_plan&&) noexcept = default;
  muon_plan& operator=(muon_plan&&) noexcept = default;
  muon_plan(muon_plan const&) = delete;
  muon_plan& operator=(muon_plan const&) = delete;
  ~muon_plan() = default;

  /// @brief Enqueues one Muon step on `stream`: pass 1, Newton-Schulz over every group of
  /// same-shaped matrices, pass 2. No allocation, copy to the host or synchronisation;
  /// capturable. `opt.lr`, `weight_decay`, `momentum` and `step.step` may be device pointers,
  /// read when the kernels run (with `step.advance`, pass 1 counts the step on the device).
  /// The workspace belongs to the plan: do not run one plan on two streams at once.
  /// @throws fusedopt::error, before anything is enqueued, on invalid options
  /// (muon::validate) or a step value below 1; or on a failed launch or cuBLAS call.
  void run(rules::muon const& opt, step_info const& step = {}, cudaStream_t stream = nullptr) const
  {
    opt.validate();
    auto const first = rules::make_muon_momentum<NS>(opt);
    auto const second = rules::make_muon_apply(opt, ratios(opt.adjust_lr));
    ::fusedopt::detail::validate_rule(second, typename output_lists_type::memory_slots{});
    ::fusedopt::detail::validate_step(step, false);
    input_.run(first, step, stream);
    newton_schulz(opt, stream);
    step_info after = step;
    after.advance = nullptr;  // pass 1 counted the step
    output_.run(second, after, stream);
  }

  /// @brief True when `lists` have this plan's geometry (cuda::plan::can_rebind of both passes).
  [[nodiscard]] bool can_rebind(lists_type const& lists) const
  {
    if (lists.num_tensors() != lists_.num_tensors()) { return false; }
    for (std::size_t t = 0; t < lists.num_tensors(); ++t) {
      if (lists.tensor_size(t) != lists_.tensor_size(t)) { return false; }
    }
    return input_.can_rebind(input_lists(lists)) && output_.can_rebind(output_lists(lists));
  }

  /// @brief Points the plan at `lists`, the same geometry at new addresses (cuda::plan::rebind
  /// of both passes, on `stream`). @throws fusedopt::error if the geometry differs.
  void rebind(lists_type const& lists, cudaStream_t stream = nullptr)
  {
    FUSEDOPT_EXPECTS(can_rebind(lists),
                     "muon_plan::rebind: the lists do not have the plan's geometry; make a new plan");
    input_.rebind(input_lists(lists), stream);
    output_.rebind(output_lists(lists), stream);
    lists_ = lists;
  }

  /// @brief Points the gradients at `addresses`, one per tensor (cuda::plan::rebind(slot, ...)).
  void rebind(slot::grad_t, typename input_plan::template slot_pointer_t<slot::grad_t> const* addresses,
              std::size_t count, cudaStream_t stream = nullptr)
  {
    input_.rebind(slot::grad, addresses, count, stream);
    for (std::size_t t = 0; t < count; ++t) {
      ::fusedopt::detail::bound_lists_access::repoint<traits::grad_at>(lists_, t, addresses[t]);
    }
  }

  /// @brief Tensor `t`'s matrix in the workspace (device memory), row-major like the
  /// parameter: after a step, the orthogonalised update O that pass 2 applied (in NS).
  [[nodiscard]] NS const* matrix(std::size_t t) const { return memory_.matrices + layout_.offsets[t]; }
  /// @brief The groups of same-shaped matrices and where the workspace keeps them.
  [[nodiscard]] ::fusedopt::detail::muon_layout const& layout() const { return layout_; }
  [[nodiscard]] lists_type const& lists() const { return lists_; }
  /// @brief Bytes of the plan's device allocation.
  [[nodiscard]] std::size_t workspace_bytes() const { return memory_.bytes; }

 private:
  struct device_free {
    void operator()(void* p) const noexcept { (void)cudaFree(p); }  // fails only when the context is gone
  };
  struct handle_destroy {
    void operator()(cublasHandle_t h) const noexcept
    {
      // Off the last step's stream first: the caller may have destroyed it already.
      (void)cublasSetStream(h, nullptr);
      (void)cublasDestroy(h);
    }
  };

  // The plan's one allocation, cut in 256-byte-aligned parts (cuBLAS's workspace needs 256).
  struct workspace {
    std::unique_ptr<void, device_free> memory;
    std::size_t bytes = 0;
    double* ratios = nullptr;  // [original..., match_rms_adamw...]
    NS* matrices = nullptr;    // every group's matrices
    NS* copies = nullptr;      // the largest group's matrices: the GEMMs' input while X is rewritten
    NS* gram = nullptr;        // the largest group's A = X X^T
    NS* poly = nullptr;        // the largest group's B = b A + c A A
    void* cublas = nullptr;
    std::size_t cublas_bytes = 0;
  };

  static std::size_t aligned(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

  static workspace allocate(::fusedopt::detail::muon_layout const& layout, std::size_t cublas_bytes,
                            cudaStream_t stream)
  {
    std::vector<double> const ratios = layout.ratio_tables();
    std::size_t const sizes[] = {aligned(ratios.size() * sizeof(double)),
                                 aligned(static_cast<std::size_t>(layout.matrix_elements) * sizeof(NS)),
                                 aligned(static_cast<std::size_t>(layout.largest_group_elements) * sizeof(NS)),
                                 aligned(static_cast<std::size_t>(layout.largest_group_squares) * sizeof(NS)),
                                 aligned(static_cast<std::size_t>(layout.largest_group_squares) * sizeof(NS)),
                                 aligned(cublas_bytes)};
    workspace w;
    for (std::size_t s : sizes) { w.bytes += s; }
    void* memory = nullptr;
    FUSEDOPT_CUDA_TRY(cudaMalloc(&memory, w.bytes > 0 ? w.bytes : 256));
    w.memory.reset(memory);
    auto* base = static_cast<unsigned char*>(memory);
    w.ratios = reinterpret_cast<double*>(base);
    base += sizes[0];
    w.matrices = reinterpret_cast<NS*>(base);
    base += sizes[1];
    w.copies = reinterpret_cast<NS*>(base);
    base += sizes[2];
    w.gram = reinterpret_cast<NS*>(base);
    base += sizes[3];
    w.poly = reinterpret_cast<NS*>(base);
    base += sizes[4];
    w.cublas = cublas_bytes > 0 ? base : nullptr;
    w.cublas_bytes = cublas_bytes;
    // Zeroed: the padding between matrices is read by nothing, but stays defined.
    FUSEDOPT_CUDA_TRY(cudaMemsetAsync(memory, 0, w.bytes, stream));
    if (!ratios.empty()) {
      FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(w.ratios, ratios.data(), ratios.size() * sizeof(double), cudaMemcpyHostToDevice,
                                        stream));
    }
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));  // `ratios` is pageable and about to go
    return w;
  }

  static std::unique_ptr<cublasContext, handle_destroy> create_handle()
  {
    cublasHandle_t handle = nullptr;
    FUSEDOPT_CUBLAS_TRY(cublasCreate(&handle));
    std::unique_ptr<cublasContext, handle_destroy> owned(handle);
    // Float accumulation throughout: no bfloat16 split-K reductions (torch allows them by
    // default; the host reference has none), no TF32 for the float iteration.
    FUSEDOPT_CUBLAS_TRY(cublasSetMathMode(
      handle, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    return owned;
  }

  static options input_options(options opts)
  {
    opts.reduction_capacity = std::max(opts.reduction_capacity, 1);
    return opts;
  }
  static options output_options(options opts)
  {
    opts.reduction_capacity = 0;  // muon_apply has no reduction pass
    return opts;
  }

  [[nodiscard]] double const* ratios(rules::muon_lr_adjustment adjustment) const
  {
    return memory_.ratios + (adjustment == rules::muon_lr_adjustment::original ? 0 : layout_.shapes.size());
  }

  template <class T>
  tensor_list<T> workspace_list(lists_type const& lists) const
  {
    tensor_list<T> list;
    list.reserve(layout_.offsets.size());
    for (std::size_t t = 0; t < layout_.offsets.size(); ++t) {
      list.push_back(memory_.matrices + layout_.offsets[t], lists.tensor_size(t));
    }
    return list;
  }

  input_lists_type input_lists(lists_type const& lists) const { return traits::input_lists(lists, workspace_list<NS>(lists)); }
  output_lists_type output_lists(lists_type const& lists) const { return traits::output_lists(lists, workspace_list<NS const>(lists)); }

  static constexpr cudaDataType_t data_type = std::is_same_v<NS, bfloat16> ? CUDA_R_16BF : CUDA_R_32F;

  // C = alpha op(A) op(B) + beta C over `batch` matrices (column-major, as cuBLAS sees them).
  void gemm(cublasOperation_t ta, cublasOperation_t tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
            NS const* a, std::int64_t lda, std::int64_t stride_a, NS const* b, std::int64_t ldb, std::int64_t stride_b,
            float beta, NS* c, std::int64_t ldc, std::int64_t stride_c, std::int64_t batch) const
  {
    FUSEDOPT_CUBLAS_TRY(cublasGemmStridedBatchedEx(
      handle_.get(), ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, a, data_type,
      static_cast<int>(lda), static_cast<long long>(stride_a), b, data_type, static_cast<int>(ldb),
      static_cast<long long>(stride_b), &beta, c, data_type, static_cast<int>(ldc), static_cast<long long>(stride_c),
      static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  // detail::newton_schulz_gemms (rules/muon.hpp) has the sequence and why; here its copies
  // and GEMMs go to the stream and cuBLAS.
  void newton_schulz(rules::muon const& opt, cudaStream_t stream) const
  {
    if (opt.ns_steps == 0) { return; }
    FUSEDOPT_CUBLAS_TRY(cublasSetStream(handle_.get(), stream));
    // After the stream: cublasSetStream puts the handle back on cuBLAS's own workspace pool.
    FUSEDOPT_CUBLAS_TRY(cublasSetWorkspace(handle_.get(), memory_.cublas, memory_.cublas_bytes));
    auto const copy = [stream](NS* destination, NS const* source, std::int64_t elements) {
      FUSEDOPT_CUDA_TRY(cudaMemcpyAsync(destination, source, static_cast<std::size_t>(elements) * sizeof(NS),
                                        cudaMemcpyDeviceToDevice, stream));
    };
    auto const gemm_call = [this](::fusedopt::detail::gemm_op ta, ::fusedopt::detail::gemm_op tb, auto... rest) {
      gemm(operation(ta), operation(tb), rest...);
    };
    for (auto const& g : layout_.groups) {
      ::fusedopt::detail::newton_schulz_gemms(g, memory_.matrices + g.offset, memory_.copies, memory_.gram,
                                              memory_.poly, opt, copy, gemm_call);
    }
  }

  static cublasOperation_t operation(::fusedopt::detail::gemm_op op)
  {
    return op == ::fusedopt::detail::gemm_op::t ? CUBLAS_OP_T : CUBLAS_OP_N;
  }

  ::fusedopt::detail::muon_layout layout_;
  workspace memory_;
  std::unique_ptr<cublasContext, handle_destroy> handle_;
  lists_type lists_;
  input_plan input_;
  output_plan output_;
};

/// @brief Makes a CUDA muon plan (see muon_plan); `NS` is the Newton-Schulz type
/// (`make_muon_plan<float>(...)` for a float iteration).
template <class NS = bfloat16, class... B>
[[nodiscard]] muon_plan<NS, B...> make_muon_plan(bound_lists<B...> lists, std::vector<matrix_shape> const& shapes,
                                                 muon_options opts = {}, cudaStream_t stream = nullptr)
{
  return muon_plan<NS, B...>(std::move(lists), shapes, opts, stream);
}

}  // namespace cuda
FUSEDOPT_NAMESPACE_END
