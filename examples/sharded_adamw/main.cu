// A sharded AdamW step over NCCL, one process per GPU (ZeRO-1/2): every rank holds the whole
// parameters and its own gradients, and the Adam moments of its shard only. A step
// reduce-scatters the gradients (averaged), updates the rank's shard, and all-gathers the
// parameters (fusedopt/nccl.cuh, docs/sharded.md).
//
//   WORLD_SIZE=2 RANK=0 FUSEDOPT_NCCL_ID=/tmp/nccl.id ./fusedopt_example_sharded_adamw &
//   WORLD_SIZE=2 RANK=1 FUSEDOPT_NCCL_ID=/tmp/nccl.id ./fusedopt_example_sharded_adamw
//
// Without WORLD_SIZE it runs one rank. Rank 0 writes the NCCL id to the file FUSEDOPT_NCCL_ID
// names; the other ranks read it from there (any out-of-band channel would do). Exits with 77
// (skipped) without a GPU.
#include <fusedopt/fusedopt.cuh>
#include <fusedopt/nccl.cuh>

#include "nccl_id.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace fo = fusedopt;

namespace {

int env_int(char const* name, int fallback)
{
  char const* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

template <class T>
T* device_zeros(std::int64_t n)
{
  T* p = nullptr;
  FUSEDOPT_CUDA_TRY(cudaMalloc(&p, static_cast<std::size_t>(n) * sizeof(T)));
  FUSEDOPT_CUDA_TRY(cudaMemset(p, 0, static_cast<std::size_t>(n) * sizeof(T)));
  return p;
}

}  // namespace

int main()
{
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  int const world = env_int("WORLD_SIZE", 1);
  int const rank = env_int("RANK", 0);
  char const* id_path = std::getenv("FUSEDOPT_NCCL_ID");
  try {
    FUSEDOPT_CUDA_TRY(cudaSetDevice(env_int("LOCAL_RANK", rank) % devices));
    ncclComm_t comm = nullptr;
    FUSEDOPT_NCCL_TRY(ncclCommInitRank(&comm, world, fusedopt_examples::shared_nccl_id(rank, world, id_path ? id_path : "/tmp/fusedopt_nccl.id"), rank));
    cudaStream_t stream = nullptr;
    FUSEDOPT_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    // A small transformer-like list of tensors: embeddings, then blocks of weights and biases.
    std::vector<std::int64_t> sizes = {50257 * 64, 1024 * 64};
    for (int block = 0; block < 4; ++block) {
      for (std::int64_t s : {64 * 192, 192, 64 * 64, 64, 64 * 256, 256, 256 * 64, 64, 64, 64}) { sizes.push_back(s); }
    }
    fo::cuda::sharded_layout const layout(sizes, world);
    float* params = device_zeros<float>(layout.flat_elements());   // every tensor, on every rank
    float* grads = device_zeros<float>(layout.flat_elements());    // this rank's backward writes here
    float* grad_shard = device_zeros<float>(layout.shard_elements());
    float* exp_avg = device_zeros<float>(layout.shard_elements());
    float* exp_avg_sq = device_zeros<float>(layout.shard_elements());
    std::vector<float> ones(static_cast<std::size_t>(layout.flat_elements()), 1.f);
    FUSEDOPT_CUDA_TRY(cudaMemcpy(grads, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));

    auto lists = fo::bind(fo::slot::param = layout.shard_list(params + layout.shard_begin(rank), rank),
                          fo::slot::grad = layout.shard_list(static_cast<float const*>(grad_shard), rank),
                          fo::slot::exp_avg = layout.shard_list(exp_avg, rank),
                          fo::slot::exp_avg_sq = layout.shard_list(exp_avg_sq, rank));
    auto plan = fo::cuda::make_sharded_plan(layout, fo::nccl::communicator(comm), lists,
                                            fo::cuda::shard_buffers<float, float>{grads, grad_shard, params},
                                            fo::cuda::gradient_reduction::average, {}, stream);
    fo::rules::clip_by_global_norm clip;  // the norm over every rank's shard
    fo::rules::adamw adamw;
    adamw.lr = 1e-3;
    auto const step = fo::chain(clip, adamw);
    for (std::int64_t t = 1; t <= 10; ++t) { plan.run(step, {t}, stream); }
    FUSEDOPT_CUDA_TRY(cudaStreamSynchronize(stream));

    float first = 0.f;
    FUSEDOPT_CUDA_TRY(cudaMemcpy(&first, params, sizeof first, cudaMemcpyDeviceToHost));
    std::printf("rank %d of %d: %lld parameters in %zu tensors, shard of %lld; param[0] after 10 steps = %.6f\n", rank,
                world, static_cast<long long>(layout.flat_elements()), sizes.size(),
                static_cast<long long>(layout.shard_elements()), static_cast<double>(first));
    for (void* p : {static_cast<void*>(params), static_cast<void*>(grads), static_cast<void*>(grad_shard),
                    static_cast<void*>(exp_avg), static_cast<void*>(exp_avg_sq)}) {
      FUSEDOPT_CUDA_TRY(cudaFree(p));
    }
    FUSEDOPT_CUDA_TRY(cudaStreamDestroy(stream));
    FUSEDOPT_NCCL_TRY(ncclCommDestroy(comm));
  } catch (std::exception const& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
