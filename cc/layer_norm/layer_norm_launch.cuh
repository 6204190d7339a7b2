// Host-side helpers of the layer_norm launchers: path choice by row length, block sizes,
// dynamic shared memory and occupancy.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/cuda_util.cuh"
#include "common/launch.cuh"

namespace jaxops::layer_norm {

// Lanes per row for rows of `npacks` packs that fit one lane's single pack: a power of two.
inline int team_width(int64_t npacks) {
  int w = 1;
  while (w < npacks && w < 32) w *= 2;
  return w;
}

// f(std::integral_constant<int, W>{}) for the team width W = width (1, 2, 4, 8, 16; else 32): the
// team kernels take their width as a template argument.
template <class F>
auto with_team_width(int width, F&& f) {
  switch (width) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    case 16: return f(std::integral_constant<int, 16>{});
    default: return f(std::integral_constant<int, 32>{});
  }
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

// Threads for a register-row kernel holding `per_thread` packs a thread: whole warps, at least 64.
inline int register_row_threads(int64_t npacks, int per_thread) {
  return static_cast<int>(std::max<int64_t>((npacks + per_thread - 1) / per_thread + 31, 64) / 32 * 32);
}

// Opts `kernel` into `smem` bytes of dynamic shared memory (cuda::allow_dynamic_smem counts the
// static part too) and returns how many of its blocks fit on one SM (at least 1). Remembered per
// kernel, device and shape: the queries would otherwise cost host time at every launch (the
// attribute, set by the first call, persists).
template <class Kernel>
cudaError_t prepare(Kernel kernel, int threads, size_t smem, const cuda::DeviceInfo& info, int* blocks_per_sm) {
  cudaError_t status = cudaSuccess;
  int n = 0;
  remembered(reinterpret_cast<const void*>(kernel), info.device, threads, int64_t(smem), &n, [&](int* r) {
    status = cuda::allow_dynamic_smem(kernel, smem);
    if (status == cudaSuccess) status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(r, kernel, threads, smem);
    return status == cudaSuccess;
  });
  if (status != cudaSuccess) return status;
  *blocks_per_sm = std::max(n, 1);
  return cudaSuccess;
}

// Shared memory a block may use besides `static_bytes` of static shared memory.
inline size_t dynamic_smem_limit(const cuda::DeviceInfo& info, size_t static_bytes) {
  return static_cast<size_t>(info.max_smem_optin) > static_bytes ? info.max_smem_optin - static_bytes : 0;
}

}  // namespace jaxops::layer_norm
