// Muon's step on the GPU (cuda/muon.cuh): time per step, eager and replayed from a CUDA graph,
// over GPT-2 small's 48 hidden matrices and over 200 small matrices, with Newton-Schulz in
// bfloat16 and in float; the same step with ns_steps = 0 (the two fused passes alone) gives the
// share of the step outside the Newton-Schulz stage. A plain table, no Google Benchmark:
//   muon_bench [steps]        (default 50 timed steps after 5 warm-up steps)
// docs/muon.md, "What is left", has what is still to compare (torch.optim.Muon, a batched
// torch implementation: bench/*.py on the GPU machine).
#include <fusedopt/cuda/muon.cuh>
#include <fusedopt/fusedopt.cuh>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace fo = fusedopt;

namespace {

void check(cudaError_t status, char const* what)
{
  if (status != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

struct workload {
  std::string name;
  std::vector<fo::matrix_shape> shapes;
};

std::vector<workload> workloads()
{
  workload gpt2{"GPT-2 small, 48 hidden matrices", {}};
  for (int layer = 0; layer < 12; ++layer) {
    gpt2.shapes.push_back({768, 2304});  // attention c_attn (HF Conv1D: in x out)
    gpt2.shapes.push_back({768, 768});   // attention c_proj
    gpt2.shapes.push_back({768, 3072});  // mlp c_fc
    gpt2.shapes.push_back({3072, 768});  // mlp c_proj
  }
  workload small{"200 small matrices (256x256 .. 1024x256)", {}};
  for (int i = 0; i < 50; ++i) {
    small.shapes.push_back({256, 256});
    small.shapes.push_back({512, 256});
    small.shapes.push_back({256, 512});
    small.shapes.push_back({1024, 256});
  }
  return {gpt2, small};
}

double ns_flops(std::vector<fo::matrix_shape> const& shapes, int steps)
{
  double flops = 0;
  for (auto const& s : shapes) {
    double const a = static_cast<double>(std::min(s.rows, s.cols));
    double const b = static_cast<double>(std::max(s.rows, s.cols));
    flops += 2.0 * (2.0 * a * a * b + a * a * a);  // X X^T, A A, B X
  }
  return flops * steps;
}

template <class NS>
void run_on(workload const& w, int steps, cudaStream_t stream);

template <class NS>
void run(workload const& w, int steps)
{
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  run_on<NS>(w, steps, stream);
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");  // after the plan, whose handle was on it
}

template <class NS>
void run_on(workload const& w, int steps, cudaStream_t stream)
{
  std::int64_t total = 0;
  for (auto const& s : w.shapes) { total += s.rows * s.cols; }
  float *p = nullptr, *g = nullptr, *m = nullptr;
  check(cudaMalloc(&p, total * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&g, total * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&m, total * sizeof(float)), "cudaMalloc");
  {
    std::vector<float> host(static_cast<std::size_t>(total));
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (auto& v : host) { v = normal(rng); }
    check(cudaMemcpy(p, host.data(), total * sizeof(float), cudaMemcpyHostToDevice), "upload");
    for (auto& v : host) { v = normal(rng); }
    check(cudaMemcpy(g, host.data(), total * sizeof(float), cudaMemcpyHostToDevice), "upload");
    check(cudaMemset(m, 0, total * sizeof(float)), "cudaMemset");
  }
  fo::tensor_list<float> params, bufs;
  fo::tensor_list<float const> grads;
  std::int64_t offset = 0;
  for (auto const& s : w.shapes) {
    std::int64_t const n = s.rows * s.cols;
    params.push_back(p + offset, n);
    grads.push_back(g + offset, n);
    bufs.push_back(m + offset, n);
    offset += n;
  }
  auto const plan = fo::cuda::make_muon_plan<NS>(
    fo::bind(fo::slot::param = params, fo::slot::grad = grads, fo::slot::momentum_buffer = bufs), w.shapes, {},
    stream);
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");

  auto time_us = [&](fo::rules::muon const& opt, bool graph) {
    cudaGraphExec_t exec = nullptr;
    cudaGraph_t captured = nullptr;
    if (graph) {
      check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
      plan.run(opt, fo::step_info{1}, stream);
      check(cudaStreamEndCapture(stream, &captured), "capture");
      check(cudaGraphInstantiate(&exec, captured, 0), "instantiate");
    }
    auto step = [&] {
      if (graph) {
        check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
      } else {
        plan.run(opt, fo::step_info{1}, stream);
      }
    };
    for (int i = 0; i < 5; ++i) { step(); }
    check(cudaEventRecord(start, stream), "record");
    for (int i = 0; i < steps; ++i) { step(); }
    check(cudaEventRecord(stop, stream), "record");
    check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    if (graph) {
      (void)cudaGraphExecDestroy(exec);
      (void)cudaGraphDestroy(captured);
    }
    return 1000.0 * ms / steps;
  };

  fo::rules::muon opt;
  fo::rules::muon passes_only = opt;
  passes_only.ns_steps = 0;
  char const* ns_name = sizeof(NS) == 2 ? "bfloat16" : "float";
  for (bool graph : {false, true}) {
    double const full = time_us(opt, graph);
    double const passes = time_us(passes_only, graph);
    std::printf("| %s | %zu | %s | %s | %.1f | %.1f (%.1f%%) | %.1f |\n", w.name.c_str(), w.shapes.size(), ns_name,
                graph ? "graph" : "eager", full, passes, 100.0 * passes / full,
                ns_flops(w.shapes, opt.ns_steps) / ((full - passes) * 1e-6) / 1e12);
  }
  check(cudaEventDestroy(start), "cudaEventDestroy");
  check(cudaEventDestroy(stop), "cudaEventDestroy");
  check(cudaFree(p), "cudaFree");
  check(cudaFree(g), "cudaFree");
  check(cudaFree(m), "cudaFree");
}

}  // namespace

int main(int argc, char** argv)
{
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  int const steps = argc > 1 ? std::atoi(argv[1]) : 50;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("muon_bench on %s, %d timed steps each, fp32 params/grads/buffers\n\n", prop.name, steps);
  std::printf("| workload | matrices | NS | launch | us/step | passes alone, us (share) | NS TFLOP/s |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
  for (auto const& w : workloads()) {
    run<fo::bfloat16>(w, steps);
    run<float>(w, steps);
  }
  return 0;
}
