// A user's Muon on the GPU: includes fusedopt/cuda/muon.cuh and links fusedopt::cublas (the
// package defines it where the CUDA toolkit is found). One step over two matrices; 77 without
// a GPU.
#include <fusedopt/cuda/muon.cuh>
#include <fusedopt/fusedopt.cuh>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <vector>

namespace fo = fusedopt;

int main()
{
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  std::vector<float> host_p(24 + 24, 1.0f), host_g(24 + 24);
  for (std::size_t i = 0; i < host_g.size(); ++i) { host_g[i] = std::sin(static_cast<float>(i)); }
  float *p = nullptr, *g = nullptr, *m = nullptr;
  std::size_t const bytes = host_p.size() * sizeof(float);
  if (cudaMalloc(&p, bytes) != cudaSuccess || cudaMalloc(&g, bytes) != cudaSuccess || cudaMalloc(&m, bytes) != cudaSuccess) {
    return 1;
  }
  cudaMemcpy(p, host_p.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(g, host_g.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemset(m, 0, bytes);
  fo::tensor_list<float> params{{p, 24}, {p + 24, 24}}, bufs{{m, 24}, {m + 24, 24}};
  fo::tensor_list<float const> grads{{g, 24}, {g + 24, 24}};
  auto plan = fo::cuda::make_muon_plan(fo::bind(fo::slot::param = params, fo::slot::grad = grads,
                                                fo::slot::momentum_buffer = bufs),
                                       {{4, 6}, {6, 4}});
  fo::rules::muon opt;
  opt.lr = 0.02;
  plan.run(opt, fo::step_info{1});
  cudaMemcpy(host_p.data(), p, bytes, cudaMemcpyDeviceToHost);
  bool ok = cudaDeviceSynchronize() == cudaSuccess;
  for (float v : host_p) { ok = ok && std::isfinite(v) && v != 1.0f && std::abs(v - 0.998f) < 0.1f; }
  std::printf("fusedopt %s Muon consumer (cuBLAS): %s\n", FUSEDOPT_VERSION_STRING, ok ? "ok" : "FAILED");
  cudaFree(p);
  cudaFree(g);
  cudaFree(m);
  return ok ? 0 : 1;
}
