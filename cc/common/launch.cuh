// Kernel launches with optional thread-block clusters and large dynamic shared memory; only
// stream work and function attributes, so they are safe inside CUDA-graph capture.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/cuda_util.cuh"
#include "common/memo.h"

namespace jaxops::cuda {

// Programmatic dependent launch (sm_90+): a kernel launched with the attribute is scheduled while
// the previous one drains and holds at griddepcontrol.wait until that grid has finished and its
// writes are visible. It shortens the boundary between the kernels of one handler (session 9, H100:
// two-kernel full reductions 0.4-0.6 us, bf16 rms_norm backward 150.1 -> 146.1 us); the ~1.4 us gap
// between two custom calls stays (it lies in XLA's runtime, not in the launch). So every jaxops
// kernel starts with `enter_kernel()`; it waits before touching global memory (reads and writes,
// which may reuse a buffer the previous kernel still reads), then lets the next grid be
// scheduled. Both instructions are no-ops for kernels launched without the attribute.
__device__ __forceinline__ void enter_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches on this device overlap the previous kernel's tail. JAXOPS_PDL=0 turns it off
// (read once per process), for same-run comparisons and as an escape hatch.
inline bool dependent_launch(const DeviceInfo& dev) {
  static const bool enabled = [] {
    const char* v = std::getenv("JAXOPS_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled && dev.cc_major >= 9;
}

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

// Launch configuration for `grid` blocks in clusters of `cluster` (1: no cluster attribute),
// overlapping the previous kernel when `overlap` (see enter_kernel). `attrs` holds two
// entries and must outlive the configuration.
inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, int cluster, bool overlap,
                                        cudaStream_t stream, cudaLaunchAttribute* attrs) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = 0;
  if (cluster > 1) {
    cudaLaunchAttribute& a = attrs[config.numAttrs++];
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = cluster;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
  }
  if (overlap) {
    cudaLaunchAttribute& a = attrs[config.numAttrs++];
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
  }
  return config;
}

// Launches `kernel` (which must begin with enter_kernel()) on `grid` x `block` threads in clusters
// of `cluster` blocks (1: none), overlapping the previous kernel when `overlap` and the device
// allows it. Returns the launch's error and clears the runtime's error state.
template <class Kernel, class... Args>
cudaError_t launch_configured(bool overlap, Kernel kernel, dim3 grid, dim3 block, size_t smem, int cluster,
                              cudaStream_t stream, Args... args) {
  DeviceInfo dev;
  if (cudaError_t err = device_info(&dev); err != cudaSuccess) return err;
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t config =
      launch_config(grid, block, smem, cluster, overlap && dependent_launch(dev), stream, attrs);
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, args...);
  const cudaError_t last = cudaGetLastError();
  return err != cudaSuccess ? err : last;
}

// The usual launch: overlaps the previous kernel where the device allows it.
template <class Kernel, class... Args>
cudaError_t launch_kernel(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  return launch_configured(true, kernel, grid, block, smem, 1, stream, args...);
}

// For kernels measured slower when overlapped: scheduled only once the previous kernel is done.
template <class Kernel, class... Args>
cudaError_t launch_serial(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  return launch_configured(false, kernel, grid, block, smem, 1, stream, args...);
}

// Clusters of more than 8 blocks need an opt-in per kernel.
template <class Kernel>
cudaError_t allow_cluster(Kernel kernel, int cluster) {
  if (cluster <= 8) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}

// Launches `kernel` (which must begin with enter_kernel()) on `grid` blocks grouped in clusters of
// `cluster` blocks (1 = no cluster), overlapping the previous kernel where the device allows it.
template <class Kernel, class... Args>
cudaError_t launch_clustered(Kernel kernel, int64_t grid, int threads, size_t smem, int cluster,
                             cudaStream_t stream, Args... args) {
  if (cudaError_t err = allow_dynamic_smem(kernel, smem); err != cudaSuccess) return err;
  if (cudaError_t err = allow_cluster(kernel, cluster); err != cudaSuccess) return err;
  return launch_configured(true, kernel, dim3(static_cast<unsigned>(grid)), dim3(threads), smem, cluster, stream,
                           args...);
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
  cudaLaunchAttribute attrs[2];
  const cudaLaunchConfig_t config = launch_config(dim3(cluster), dim3(threads), smem, cluster, false, nullptr, attrs);
  int active = 0;
  if (cudaOccupancyMaxActiveClusters(&active, kernel, &config) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return active;
}

// resident_clusters, remembered per (kernel, device, shape): launchers that size their grid by
// it every call would otherwise pay its occupancy query (and attribute calls) each time. The
// kernel's attributes, set by the first query, persist for the device. 0 (nothing fits) is
// not remembered.
template <class Kernel>
int64_t remembered_resident_clusters(Kernel kernel, int threads, size_t smem, int cluster, const DeviceInfo& dev) {
  int64_t resident = 0;
  remembered(reinterpret_cast<const void*>(kernel), dev.device, int64_t{threads} * 64 + cluster, int64_t(smem),
             &resident, [&](int64_t* r) {
               *r = resident_clusters(kernel, threads, smem, cluster, dev);
               return *r > 0;
             });
  return resident;
}

}  // namespace jaxops::cuda
