/// @file cuda/muon.cuh
/// @brief Muon on the GPU: two fused passes (cuda::plan) around a batched Newton-Schulz over
/// cuBLASLt strided-batched matmuls, one batch per group of same-shaped matrices.
///
/// @code
/// #include <fusedopt/cuda/muon.cuh>   // link cuBLASLt: CMake target fusedopt::cublas
/// auto lists = fo::bind(fo::slot::param = p, fo::slot::grad = g, fo::slot::momentum_buffer = m);
/// auto plan = fo::cuda::make_muon_plan(lists, shapes, {}, stream);   // allocates once
/// fo::rules::muon opt;
/// for (std::int64_t t = 1; t <= steps; ++t) plan.run(opt, fo::step_info{t}, stream);
/// @endcode
///
/// A step enqueues, on the caller's stream: pass 1 (a reduction pass, its finalize and the
/// update pass of rules::muon_momentum: buffers, and the normalised inputs in the plan's
/// workspace); per group and iteration, three cublasLtMatmul (bfloat16 or float in and out,
/// float accumulation, the coefficients as alpha and beta, C and D apart: the matrices
/// ping-pong between the workspace and a scratch copy), and after an odd number of iterations
/// one device-to-device copy per group back into the workspace; pass 2 (rules::muon_apply).
/// The cuBLASLt descriptors, layouts and algorithms are made when the plan is built. No
/// allocation, heuristic query or host synchronisation in a step: capturable in a CUDA graph
/// (cuBLASLt runs in the plan's own workspace).
///
/// Not included by fusedopt.cuh: this header alone needs cuBLASLt (`-lcublasLt`).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
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
/// Builds the message of a failed cuBLAS(Lt) call: the call as written, the status's name and text.
[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, char const* call, char const* file, int line)
{
  throw error(std::string("cuBLAS call '") + call + "' failed: " + cublasLtGetStatusName(status) + ": " +
              cublasLtGetStatusString(status) + " (" + file + ":" + std::to_string(line) + ")");
}
}  // namespace detail
}  // namespace cuda
FUSEDOPT_NAMESPACE_END

/// Evaluates a cuBLAS or cuBLASLt call (both return cublasStatus_t) once; throws fusedopt::error naming the call and the status when it
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
  /// Device memory cuBLASLt may use, part of the plan's one allocation (cuBLAS recommends 32 MiB
  /// on Hopper, 4 MiB before): every cublasLtMatmul's workspace and its heuristics' limit
  /// (CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES). 0: none (algorithms that need some, split-K
  /// among them, are then not chosen).
  std::size_t cublas_workspace_bytes = std::size_t{32} << 20;
};

/// @brief Muon's steps over bound lists of 2-D parameters in device memory (slots param, grad,
/// momentum_buffer, in any order), Newton-Schulz in `NS` (fusedopt::bfloat16 as torch, or
/// float). Owns one device allocation (every matrix in NS, the GEMMs' scratch for the largest
/// group, the per-matrix learning-rate ratios, cuBLASLt's workspace), a cuBLASLt handle and,
/// per group, the descriptors, layouts and algorithms of its three GEMMs; move-only. The plan runs on the device current when it was built.
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
  /// ratio tables, creates the cuBLASLt handle, makes each group's matmul descriptors and
  /// layouts and picks their algorithms (cublasLtMatmulAlgoGetHeuristic), plans both passes and
  /// runs one Newton-Schulz iteration over the zeroed workspace (so that cuBLASLt loads its
  /// kernels before a step is captured), on `stream`, synchronised. Do not build a plan while `stream` is being captured.
  /// @param shapes one per tensor, row-major (torch's `p.shape`): rows x cols must be the
  /// tensor's size; sides and group sizes must fit in an int.
  /// @throws fusedopt::error on a shape that does not fit its tensor, options cuda::plan rejects,
  /// a group for whose GEMMs cuBLASLt has no algorithm, or a failed CUDA or cuBLASLt call.
  muon_plan(lists_type lists, std::vector<matrix_shape> const& shapes, muon_options opts = {},
            cudaStream_t stream = nullptr)
      : layout_(shapes, lists.num_tensors(), [&lists](std::size_t t) { return lists.tensor_size(t); }),
        memory_(allocate(layout_, opts.cublas_workspace_bytes, stream)),
        handle_(create_handle()),
        gemms_(prepare_gemms(layout_, handle_.get(), memory_)),
        lists_(lists),
        input_(input_lists(lists), input_options(opts.passes), stream),
        output_(output_lists(lists), output_options(opts.passes), stream)
  {
    // One iteration over the zeroed workspace now: cuBLASLt loads its kernels (lazily loaded
    // modules) here, not in the first step, which may be captured.
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
  /// (muon::validate) or a step value below 1; or on a failed launch or cuBLASLt call.
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
    void operator()(cublasLtHandle_t h) const noexcept { (void)cublasLtDestroy(h); }
  };
  struct desc_destroy {
    void operator()(cublasLtMatmulDesc_t d) const noexcept { (void)cublasLtMatmulDescDestroy(d); }
  };
  struct layout_destroy {
    void operator()(cublasLtMatrixLayout_t l) const noexcept { (void)cublasLtMatrixLayoutDestroy(l); }
  };
  struct preference_destroy {
    void operator()(cublasLtMatmulPreference_t p) const noexcept { (void)cublasLtMatmulPreferenceDestroy(p); }
  };
  using handle_ptr = std::unique_ptr<std::remove_pointer_t<cublasLtHandle_t>, handle_destroy>;
  using desc_ptr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulDesc_t>, desc_destroy>;
  using layout_ptr = std::unique_ptr<std::remove_pointer_t<cublasLtMatrixLayout_t>, layout_destroy>;
  using preference_ptr = std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, preference_destroy>;

  // One GEMM of one group, ready for cublasLtMatmul: its shape (detail::newton_schulz_gemm_shape),
  // descriptor (ops, compute and scale types, host pointer mode), layouts (C's is D's) and the
  // algorithm the heuristics picked when the plan was built.
  struct prepared_gemm {
    ::fusedopt::detail::gemm_shape shape;
    desc_ptr desc;
    layout_ptr a;
    layout_ptr b;
    layout_ptr cd;
    cublasLtMatmulAlgo_t algo{};
  };
  // Per group, its three GEMMs by ns_gemm; empty for a group of empty matrices.
  using group_gemms = std::array<prepared_gemm, ::fusedopt::detail::ns_gemm_kinds>;

  // The plan's one allocation, cut in 256-byte-aligned parts (cuBLASLt's workspace needs 256).
  struct workspace {
    std::unique_ptr<void, device_free> memory;
    std::size_t bytes = 0;
    double* ratios = nullptr;  // [original..., match_rms_adamw...]
    NS* matrices = nullptr;    // every group's matrices
    NS* copies = nullptr;      // room for the largest group's matrices: X's other ping-pong buffer
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

  static handle_ptr create_handle()
  {
    cublasLtHandle_t handle = nullptr;
    FUSEDOPT_CUBLAS_TRY(cublasLtCreate(&handle));
    return handle_ptr(handle);
  }

  template <class V>
  static void set_layout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attribute, V value)
  {
    FUSEDOPT_CUBLAS_TRY(cublasLtMatrixLayoutSetAttribute(layout, attribute, &value, sizeof(value)));
  }
  template <class V>
  static void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, V value)
  {
    FUSEDOPT_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
  }
  template <class V>
  static void set_preference(cublasLtMatmulPreference_t preference, cublasLtMatmulPreferenceAttributes_t attribute,
                             V value)
  {
    FUSEDOPT_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
  }

  // A column-major rows x cols matrix of NS with leading dimension ld, `batch` of them `stride`
  // elements apart.
  static layout_ptr make_layout(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t stride,
                                std::int64_t batch)
  {
    cublasLtMatrixLayout_t raw = nullptr;
    FUSEDOPT_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&raw, data_type, static_cast<std::uint64_t>(rows),
                                                   static_cast<std::uint64_t>(cols), ld));
    layout_ptr layout(raw);
    set_layout(raw, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, static_cast<std::int32_t>(batch));
    set_layout(raw, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, static_cast<std::int64_t>(stride));
    return layout;
  }

  // The largest power of two (at most 256) that divides every address a group's GEMMs are
  // given: the workspace's parts are 256-byte aligned, the group's offset and its matrix
  // strides multiples of 8 elements. The heuristics assume 256 unless told (MIN_ALIGNMENT_*).
  static std::uint32_t group_alignment(::fusedopt::detail::muon_layout::group const& g)
  {
    std::uint64_t const bytes[] = {static_cast<std::uint64_t>(g.offset) * sizeof(NS),
                                   static_cast<std::uint64_t>(g.stride) * sizeof(NS),
                                   static_cast<std::uint64_t>(g.square_stride) * sizeof(NS)};
    std::uint32_t alignment = 256;
    for (std::uint64_t b : bytes) {
      while (alignment > 1 && b % alignment != 0) { alignment /= 2; }
    }
    return alignment;
  }

  // Made once, when the plan is built: per group and GEMM kind, the descriptor, the layouts
  // and the algorithm. Float accumulation and float alpha and beta (host pointers), NS in and
  // out; CUBLAS_COMPUTE_32F without a fast mode: no TF32 for the float iteration. Split-K only
  // with its partial sums in float in the workspace, reduced in a separate step
  // (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE): neither in place in the output nor in the output
  // type, so no bfloat16 partial sums and one rounding per element, as the handle's
  // CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION gave the GemmEx plan.
  static std::vector<group_gemms> prepare_gemms(::fusedopt::detail::muon_layout const& layout,
                                                cublasLtHandle_t handle, workspace const& memory)
  {
    using ::fusedopt::detail::gemm_shape;
    using ::fusedopt::detail::ns_gemm;
    std::vector<group_gemms> all(layout.groups.size());
    for (std::size_t gi = 0; gi < layout.groups.size(); ++gi) {
      auto const& g = layout.groups[gi];
      std::string const group_name = std::to_string(g.count) + " matrices of " + std::to_string(g.shape.rows) +
                                     " x " + std::to_string(g.shape.cols);
      FUSEDOPT_EXPECTS(g.large <= INT_MAX && g.count <= INT_MAX && g.stride <= INT_MAX,
                       "muon plan: a group of " + group_name + " does not fit cuBLASLt's int dimensions");
      if (g.small == 0 || g.large == 0) { continue; }  // newton_schulz_gemms runs nothing
      preference_ptr preference;
      {
        cublasLtMatmulPreference_t raw = nullptr;
        FUSEDOPT_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&raw));
        preference.reset(raw);
      }
      set_preference(preference.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                     static_cast<std::uint64_t>(memory.cublas_bytes));
      // No split-K (NONE) or split-K with float partial sums (COMPUTE_TYPE); not INPLACE, not OUTPUT_TYPE.
      set_preference(preference.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                     static_cast<std::uint32_t>(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
      std::uint32_t const alignment = group_alignment(g);
      for (auto const attribute : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                   CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
        set_preference(preference.get(), attribute, alignment);
      }
      for (ns_gemm const kind : {ns_gemm::gram, ns_gemm::poly, ns_gemm::update}) {
        prepared_gemm& p = all[gi][static_cast<std::size_t>(kind)];
        p.shape = ::fusedopt::detail::newton_schulz_gemm_shape(g, kind);
        gemm_shape const& s = p.shape;
        {
          cublasLtMatmulDesc_t raw = nullptr;
          FUSEDOPT_CUBLAS_TRY(cublasLtMatmulDescCreate(&raw, CUBLAS_COMPUTE_32F, CUDA_R_32F));
          p.desc.reset(raw);
        }
        set_desc(p.desc.get(), CUBLASLT_MATMUL_DESC_POINTER_MODE, static_cast<std::int32_t>(CUBLASLT_POINTER_MODE_HOST));
        set_desc(p.desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, static_cast<std::int32_t>(operation(s.op_a)));
        set_desc(p.desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, static_cast<std::int32_t>(operation(s.op_b)));
        p.a = make_layout(s.a_rows(), s.a_cols(), s.lda, s.stride_a, s.batch);
        p.b = make_layout(s.b_rows(), s.b_cols(), s.ldb, s.stride_b, s.batch);
        p.cd = make_layout(s.m, s.n, s.ldc, s.stride_c, s.batch);
        cublasLtMatmulHeuristicResult_t result{};
        int returned = 0;
        cublasStatus_t const status = cublasLtMatmulAlgoGetHeuristic(handle, p.desc.get(), p.a.get(), p.b.get(),
                                                                      p.cd.get(), p.cd.get(), preference.get(), 1,
                                                                      &result, &returned);
        char const* const names[] = {"A = X X^T", "B = c A A + b A", "X = B X + a X"};
        std::string const what = std::string("muon plan: cuBLASLt has no algorithm for the GEMM ") +
                                 names[static_cast<std::size_t>(kind)] + " of the group of " + group_name + " (" +
                                 (std::is_same_v<NS, bfloat16> ? "bfloat16" : "float") +
                                 ", float accumulation, split-K only with float partial sums, " +
                                 std::to_string(memory.cublas_bytes) + " bytes of workspace, " +
                                 std::to_string(alignment) + "-byte alignment)";
        if (status == CUBLAS_STATUS_NOT_SUPPORTED) { throw error(what + ": " + cublasLtGetStatusName(status)); }
        FUSEDOPT_CUBLAS_TRY(status);
        FUSEDOPT_EXPECTS(returned > 0 && result.state == CUBLAS_STATUS_SUCCESS, what);
        p.algo = result.algo;
      }
    }
    return all;
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

  // detail::newton_schulz_gemms (rules/muon.hpp) has the sequence and why; here its GEMMs go
  // to cublasLtMatmul with the group's prepared descriptor, layouts and algorithm, its copy to
  // the stream. Nothing is allocated or queried.
  void newton_schulz(rules::muon const& opt, cudaStream_t stream) const
  {
    if (opt.ns_steps == 0) { return; }
    auto const copy = [stream](NS* destination, NS const* source, std::int64_t elements, std::int64_t stride,
                               std::int64_t count) {
      std::size_t const pitch = static_cast<std::size_t>(stride) * sizeof(NS);
      FUSEDOPT_CUDA_TRY(cudaMemcpy2DAsync(destination, pitch, source, pitch,
                                          static_cast<std::size_t>(elements) * sizeof(NS),
                                          static_cast<std::size_t>(count), cudaMemcpyDeviceToDevice, stream));
    };
    for (std::size_t gi = 0; gi < layout_.groups.size(); ++gi) {
      auto const& g = layout_.groups[gi];
      group_gemms const& prepared = gemms_[gi];
      auto const gemm = [&](::fusedopt::detail::ns_gemm kind, ::fusedopt::detail::gemm_shape const& shape,
                            float alpha, NS const* a, NS const* b, float beta, NS const* c, NS* d) {
        prepared_gemm const& p = prepared[static_cast<std::size_t>(kind)];
        FUSEDOPT_EXPECTS(shape == p.shape, "muon plan: a Newton-Schulz GEMM differs from the one prepared");
        FUSEDOPT_CUBLAS_TRY(cublasLtMatmul(handle_.get(), p.desc.get(), &alpha, a, p.a.get(), b, p.b.get(), &beta, c,
                                           p.cd.get(), d, p.cd.get(), &p.algo, memory_.cublas, memory_.cublas_bytes,
                                           stream));
      };
      ::fusedopt::detail::newton_schulz_gemms(g, memory_.matrices + g.offset, memory_.copies, memory_.gram,
                                              memory_.poly, opt, copy, gemm);
    }
  }

  static cublasOperation_t operation(::fusedopt::detail::gemm_op op)
  {
    return op == ::fusedopt::detail::gemm_op::t ? CUBLAS_OP_T : CUBLAS_OP_N;
  }

  ::fusedopt::detail::muon_layout layout_;
  workspace memory_;
  handle_ptr handle_;
  std::vector<group_gemms> gemms_;  // per group; its Lt objects die before the handle
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
