// Kernel launches with optional thread-block clusters and large dynamic shared memory; only
// stream work and function attributes, so they are safe inside CUDA-graph capture.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_util.cuh"

namespace jaxops::cuda {

template <class T>
constexpr T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Raises the kernel's dynamic shared-memory limit when static plus dynamic memory may exceed the
// default 48 KB (the jaxops kernels keep under 1 KB of static scratch).
template <class Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes + 1024 <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

// Launches `kernel` on `grid` blocks grouped in clusters of `cluster` blocks (1 = no cluster).
template <class Kernel, class... Args>
cudaError_t launch_clustered(Kernel kernel, int64_t grid, int threads, size_t smem, int cluster,
                             cudaStream_t stream, Args... args) {
  if (cudaError_t err = allow_dynamic_smem(kernel, smem); err != cudaSuccess) return err;
  if (cluster > 8) {
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        err != cudaSuccess)
      return err;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = cluster > 1 ? 1 : 0;
  if (cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...); err != cudaSuccess) return err;
  return cudaGetLastError();
}

// How many clusters of `cluster` blocks of this shape the device holds at once (0: none fit).
template <class Kernel>
int64_t resident_clusters(Kernel kernel, int threads, size_t smem, int cluster, const DeviceInfo& dev) {
  if (allow_dynamic_smem(kernel, smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cluster <= 1) {
    int per_sm = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return int64_t(per_sm) * dev.sm_count;
  }
  if (cluster > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(cluster);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  int active = 0;
  if (cudaOccupancyMaxActiveClusters(&active, kernel, &config) != cudaSuccess) {
    cudaGetLastError();  // a refused shape is an answer, not an error for the next launch
    return 0;
  }
  return active;
}

}  // namespace jaxops::cuda
