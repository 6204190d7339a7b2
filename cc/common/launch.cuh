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

// Lets `kernel` launch with `bytes` of dynamic shared memory. The static part counts towards
// the default 48 KB (a launch at 48 KB dynamic + 256 B static fails, under CUDA-graph capture
// too). The limit is raised once, to the most the device allows, and never lowered, so callers
// asking for different sizes at the same time cannot shrink it under each other.
template <class Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  cudaFuncAttributes attr;
  if (cudaError_t err = cudaFuncGetAttributes(&attr, kernel); err != cudaSuccess) return err;
  DeviceInfo dev;
  if (cudaError_t err = device_info(&dev); err != cudaSuccess) return err;
  const size_t optin = static_cast<size_t>(dev.max_smem_optin);
  const size_t most = optin > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  if (bytes > most) return cudaErrorInvalidValue;
  const bool over_default = bytes + attr.sharedSizeBytes > 48 * 1024 ||
                            bytes > static_cast<size_t>(attr.maxDynamicSharedSizeBytes);
  if (!over_default || static_cast<size_t>(attr.maxDynamicSharedSizeBytes) >= most) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most));
}

// Launch configuration for `grid` blocks in clusters of `cluster` (1: no cluster attribute).
// `attr` must outlive the configuration.
inline cudaLaunchConfig_t cluster_config(int64_t grid, int threads, size_t smem, int cluster,
                                         cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = cluster;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = cluster > 1 ? 1 : 0;
  return config;
}

// Clusters of more than 8 blocks need an opt-in per kernel.
template <class Kernel>
cudaError_t allow_cluster(Kernel kernel, int cluster) {
  if (cluster <= 8) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}

// Launches `kernel` on `grid` blocks grouped in clusters of `cluster` blocks (1 = no cluster).
template <class Kernel, class... Args>
cudaError_t launch_clustered(Kernel kernel, int64_t grid, int threads, size_t smem, int cluster,
                             cudaStream_t stream, Args... args) {
  if (cudaError_t err = allow_dynamic_smem(kernel, smem); err != cudaSuccess) return err;
  if (cudaError_t err = allow_cluster(kernel, cluster); err != cudaSuccess) return err;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = cluster_config(grid, threads, smem, cluster, stream, &attr);
  if (cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...); err != cudaSuccess) return err;
  return cudaGetLastError();
}

// How many clusters of `cluster` blocks of this shape the device holds at once (0: none fit).
// A refused shape is an answer, not an error for the next launch: errors are cleared.
template <class Kernel>
int64_t resident_clusters(Kernel kernel, int threads, size_t smem, int cluster, const DeviceInfo& dev) {
  if (allow_dynamic_smem(kernel, smem) != cudaSuccess || allow_cluster(kernel, cluster) != cudaSuccess) {
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
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t config = cluster_config(cluster, threads, smem, cluster, nullptr, &attr);
  int active = 0;
  if (cudaOccupancyMaxActiveClusters(&active, kernel, &config) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return active;
}

}  // namespace jaxops::cuda
