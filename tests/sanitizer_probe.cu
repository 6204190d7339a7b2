// Positive control of test_sanitizer.py's kernel filter (--kernel-name kns=jaxops): the same
// out-of-bounds read in a kernel inside namespace jaxops, which memcheck must report, and in one
// outside it, which the filter must skip. `probe inside` / `probe outside` picks the kernel.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

namespace jaxops {
__global__ void probe_out_of_bounds(const float* x, float* y) { y[0] = x[64 + threadIdx.x]; }
}  // namespace jaxops

__global__ void outside_out_of_bounds(const float* x, float* y) { y[0] = x[64 + threadIdx.x]; }

int main(int argc, char** argv) {
  float *x = nullptr, *y = nullptr;
  if (cudaMalloc(&x, 64 * sizeof(float)) != cudaSuccess || cudaMalloc(&y, sizeof(float)) != cudaSuccess) return 2;
  if (argc > 1 && std::strcmp(argv[1], "inside") == 0) {
    jaxops::probe_out_of_bounds<<<1, 1>>>(x, y);
  } else {
    outside_out_of_bounds<<<1, 1>>>(x, y);
  }
  std::printf("probe ran: %s\n", cudaGetErrorString(cudaDeviceSynchronize()));
  return 0;
}
