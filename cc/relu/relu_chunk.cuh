// Device helpers of the relu kernels (relu.cu): where a warp's chunk lies, the relu of one
// element, and the coalesced element-wise path for chunks that cannot take 16-byte packs.
//
// Layout (shared with common/bitmask.cuh): each row is cut into chunks of 32*P elements, one
// chunk per warp; the chunk's mask words are ch*P .. ch*P+P-1 of the row (bit j of word i is
// element 32*i+j of the row). A chunk takes the vector path (lane l: one 16-byte pack, elements
// P*l .. P*l+P-1) when it lies wholly inside the row and the row starts 16-byte aligned; all
// other chunks (the last, partial chunk of each row, and every chunk of a row whose start is not
// 16-byte aligned — vmap rows of a length that is not a multiple of P) take the path below, where
// lane l handles elements 32*k+l for k < P: every load/store instruction of the warp covers 32
// consecutive elements (coalesced) and word k of the chunk is simply the ballot of step k.
// Both paths compute exactly the same values, so results never depend on alignment.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_util.cuh"

namespace jaxops::relu {

struct ChunkPos {
  int64_t row;  // which row (vmap group)
  int64_t ch;   // chunk index inside the row
};

// With one row (every call outside vmap) the chunk index is the position: no 64-bit division.
__device__ __forceinline__ ChunkPos locate(int64_t chunk, int64_t chunks_per_row, int64_t chunks) {
  if (chunks_per_row == chunks) return {0, chunk};
  const int64_t row = chunk / chunks_per_row;
  return {row, chunk - row * chunks_per_row};
}

__device__ __forceinline__ bool aligned16(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15u) == 0;
}

// y = relu(v) in place (NaN propagates like jax.nn.relu); returns v > 0, the mask bit.
template <class T>
__device__ __forceinline__ bool relu_one(T& v) {
  const auto a = cuda::to_acc(v);
  const bool pos = a > 0;
  if (!(pos || a != a)) v = cuda::from_acc<T>(cuda::acc_t<T>(0));
  return pos;
}

// Coalesced forward of one chunk starting at row column `start` (warp-collective when wpr > 0:
// all 32 lanes call it). Columns >= cols are neither read nor written and give 0 bits, so the
// row's last word has its unused bits 0; words past the row's end are not stored.
template <class T, int P>
__device__ __forceinline__ void forward_coalesced(const T* __restrict__ xr, T* __restrict__ yr,
                                                  uint32_t* __restrict__ mr, int64_t ch, int64_t cols,
                                                  int64_t wpr, int lane) {
  const int64_t start = ch * (32 * P);
  uint32_t mine = 0;  // word `lane` of the chunk, for lanes < P
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int64_t c = start + 32 * k + lane;
    bool pos = false;
    if (c < cols) {
      T v = xr[c];
      pos = relu_one(v);
      yr[c] = v;
    }
    if (wpr > 0) {
      const uint32_t word = __ballot_sync(0xffffffffu, pos);
      if (lane == k) mine = word;
    }
  }
  if (wpr > 0 && lane < P && ch * P + lane < wpr) mr[ch * P + lane] = mine;
}

// Coalesced backward of one chunk (warp-collective: all 32 lanes call it). dx = bit ? dy : 0.
template <class T, int P>
__device__ __forceinline__ void backward_coalesced(const T* __restrict__ dyr, const uint32_t* __restrict__ mr,
                                                   T* __restrict__ dxr, int64_t ch, int64_t cols,
                                                   int64_t wpr, int lane) {
  const int64_t start = ch * (32 * P);
  const uint32_t mine = lane < P && ch * P + lane < wpr ? __ldg(mr + ch * P + lane) : 0u;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const uint32_t word = __shfl_sync(0xffffffffu, mine, k);
    const int64_t c = start + 32 * k + lane;
    if (c < cols) dxr[c] = (word >> lane) & 1u ? dyr[c] : cuda::from_acc<T>(cuda::acc_t<T>(0));
  }
}

}  // namespace jaxops::relu
