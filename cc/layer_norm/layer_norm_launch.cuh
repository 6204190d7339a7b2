// Host-side helpers of the layer_norm launchers: path choice by row length, block sizes,
// dynamic shared memory and occupancy.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_util.cuh"

namespace jaxops::layer_norm {

// Lanes per row for rows of `npacks` packs that fit one lane's single pack: a power of two.
inline int team_width(int64_t npacks) {
  int w = 1;
  while (w < npacks && w < 32) w *= 2;
  return w;
}

// Packs per lane (a power of two) for a full-warp team.
inline int team_packs(int64_t npacks) {
  int k = 1;
  while (k * 32 < npacks) k *= 2;
  return k;
}

// Threads for a block-per-row kernel: about `per_thread` packs per thread, 128..1024 threads.
inline int block_threads(int64_t npacks, int per_thread) {
  const int64_t t = (npacks + per_thread - 1) / per_thread;
  return static_cast<int>(std::clamp<int64_t>((t + 31) / 32 * 32, 128, 1024));
}

// Raises the kernel's dynamic shared-memory limit when static + dynamic shared memory exceed the
// 48 KB a block gets without opting in, and returns how many of its blocks fit on one SM (at
// least 1). The static part counts: backward_block (layer_norm, bf16 rows of 4096) asks for
// exactly 48 KB dynamic + 256 bytes of static scratch; the old check (dynamic > 48 KB) did not
// opt in, and the launch under CUDA-graph capture (XLA command buffers) failed with "invalid
// argument". The limit is raised once, to its maximum (opt-in minus static) rather than to
// `smem`: it only ever goes up, so concurrent callers asking for different sizes cannot lower
// it under each other.
template <class Kernel>
cudaError_t prepare(Kernel kernel, int threads, size_t smem, int* blocks_per_sm) {
  constexpr size_t kDefaultLimit = 48 * 1024;
  if (smem > 0) {
    cudaFuncAttributes attr;
    if (cudaError_t err = cudaFuncGetAttributes(&attr, kernel); err != cudaSuccess) return err;
    cuda::DeviceInfo info;
    if (cudaError_t err = cuda::device_info(&info); err != cudaSuccess) return err;
    const size_t most =
        static_cast<size_t>(info.max_smem_optin) > attr.sharedSizeBytes ? info.max_smem_optin - attr.sharedSizeBytes : 0;
    if (smem > most) return cudaErrorInvalidValue;  // the launcher's size check let too much through
    const bool over_default = smem + attr.sharedSizeBytes > kDefaultLimit ||
                              smem > static_cast<size_t>(attr.maxDynamicSharedSizeBytes);
    if (over_default && static_cast<size_t>(attr.maxDynamicSharedSizeBytes) < most) {
      if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(most));
          err != cudaSuccess)
        return err;
    }
  }
  int n = 0;
  if (cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
      err != cudaSuccess)
    return err;
  *blocks_per_sm = std::max(n, 1);
  return cudaSuccess;
}

// Shared memory a block may use besides `static_bytes` of static shared memory.
inline size_t dynamic_smem_limit(const cuda::DeviceInfo& info, size_t static_bytes) {
  return static_cast<size_t>(info.max_smem_optin) > static_bytes ? info.max_smem_optin - static_bytes : 0;
}

}  // namespace jaxops::layer_norm
