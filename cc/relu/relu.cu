// relu forward / backward with a 1-bit-per-element mask.
//
// Each warp owns a chunk of 32*P consecutive elements of one row (P elements = one 16-byte pack
// per lane), so loads and stores of x/y are 16-byte vectors and the chunk's P mask words come out
// of one warp collective (common/bitmask.cuh) and are stored by lanes 0..P-1 in one access.
// Chunks that are not whole 16-byte-aligned runs (a row's partial last chunk; rows of a vmapped
// array whose length is not a multiple of P) take the coalesced element path of relu_chunk.cuh,
// decided per chunk (warp-uniform): an odd element count costs one slow chunk, not a slow kernel.
//
// A warp takes kChunks adjacent chunks an iteration and issues all their loads first: with one
// 16-byte pack a lane in flight (session 42 and before) the SM had 32 KB of loads outstanding,
// about what the H200 needs to cover DRAM latency and nothing to spare. H200, session 43 run 3,
// same process, us (1 chunk, grid capped at 32 blocks an SM -> 2 chunks, the grids below):
//   forward  bf16 67108864 68.3 -> 65.9, 16777233 18.1 -> 17.9 (0.904 -> 0.917 of copy),
//            4194304 5.1 -> 4.1; float32 67108864 134.5 -> 129.8, 16777233 34.8 -> 33.7;
//   backward bf16 67108864 69.9 -> 67.8, 16777233 18.4 -> 18.3; float32 67108864 136.9 -> 133.2,
//            16777233 35.2 -> 34.2.
// Four chunks were slower on the 16M and 67M arrays (bf16 forward 18.2, 67.3) and faster only
// on float32 4194304 (8.0 -> 6.8).
#include <algorithm>

#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "relu/relu_chunk.cuh"
#include "relu/relu_launch.h"

namespace jaxops::relu {
namespace {

using cuda::acc_t;
using cuda::from_acc;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <class T, int P>
__device__ __forceinline__ void forward_chunk(const T* __restrict__ x, T* __restrict__ y, uint32_t* __restrict__ mask,
                                              int64_t chunk, int64_t cols, int64_t chunks_per_row, int64_t chunks,
                                              int64_t wpr, int lane) {
  const ChunkPos at = locate(chunk, chunks_per_row, chunks);
  const T* xr = x + at.row * cols;
  T* yr = y + at.row * cols;
  uint32_t* mr = mask + at.row * wpr;
  const int64_t start = at.ch * (32 * P);
  if (start + 32 * P <= cols && aligned16(xr, yr)) {
    T v[P];
    cuda::load_vec<T, P>(xr + start + lane * P, v);
    uint32_t bits = 0;
#pragma unroll
    for (int k = 0; k < P; ++k) bits |= static_cast<uint32_t>(relu_one(v[k])) << k;
    cuda::store_vec<T, P>(yr + start + lane * P, v);
    if (wpr > 0) {
      // a whole chunk inside the row: its P words all exist (ch*P + P <= cols/32 <= wpr)
      const uint32_t word = cuda::warp_mask_words<P>(bits);
      if (lane < P) mr[at.ch * P + lane] = word;
    }
  } else {
    forward_coalesced<T, P>(xr, yr, mr, at.ch, cols, wpr, lane);
  }
}

// kChunks adjacent chunks a warp an iteration: with one row, aligned, and all of them whole, a
// lane's packs are loaded before any is used; otherwise one chunk at a time.
constexpr int kChunks = 2;

template <class T, int P>
__global__ void __launch_bounds__(kThreads)
forward_kernel(const T* __restrict__ x, T* __restrict__ y, uint32_t* __restrict__ mask, int64_t cols,
               int64_t chunks_per_row, int64_t chunks, int64_t wpr) {
  cuda::enter_kernel();
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * kChunks;
  const bool fast = chunks_per_row == chunks && aligned16(x, y);
  // The loop bound and the path choice are per warp, so the warp collectives see all 32 lanes.
  for (int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kChunks; c0 < chunks;
       c0 += stride) {
    if (fast && (c0 + kChunks) * (32 * P) <= cols) {
      T v[kChunks][P];
#pragma unroll
      for (int u = 0; u < kChunks; ++u) cuda::load_vec<T, P>(x + (c0 + u) * (32 * P) + lane * P, v[u]);
#pragma unroll
      for (int u = 0; u < kChunks; ++u) {
        uint32_t bits = 0;
#pragma unroll
        for (int k = 0; k < P; ++k) bits |= static_cast<uint32_t>(relu_one(v[u][k])) << k;
        cuda::store_vec<T, P>(y + (c0 + u) * (32 * P) + lane * P, v[u]);
        if (wpr > 0) {
          const uint32_t word = cuda::warp_mask_words<P>(bits);
          if (lane < P) mask[(c0 + u) * P + lane] = word;
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < kChunks; ++u)
        if (c0 + u < chunks) forward_chunk<T, P>(x, y, mask, c0 + u, cols, chunks_per_row, chunks, wpr, lane);
    }
  }
}

template <class T, int P>
__device__ __forceinline__ void backward_chunk(const T* __restrict__ dy, const uint32_t* __restrict__ mask,
                                               T* __restrict__ dx, int64_t chunk, int64_t cols,
                                               int64_t chunks_per_row, int64_t chunks, int64_t wpr, int lane) {
  const ChunkPos at = locate(chunk, chunks_per_row, chunks);
  const T* dyr = dy + at.row * cols;
  T* dxr = dx + at.row * cols;
  const uint32_t* mr = mask + at.row * wpr;
  const int64_t start = at.ch * (32 * P);
  if (start + 32 * P <= cols && aligned16(dyr, dxr)) {
    const int64_t c0 = start + lane * P;
    const uint32_t bits = cuda::mask_bits<P>(mr, c0);  // P | 32: one word
    T v[P];
    cuda::load_vec<T, P>(dyr + c0, v);
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (!((bits >> k) & 1u)) v[k] = from_acc<T>(acc_t<T>(0));
    cuda::store_vec<T, P>(dxr + c0, v);
  } else {
    backward_coalesced<T, P>(dyr, mr, dxr, at.ch, cols, wpr, lane);  // warp-collective
  }
}

template <class T, int P>
__global__ void __launch_bounds__(kThreads)
backward_kernel(const T* __restrict__ dy, const uint32_t* __restrict__ mask, T* __restrict__ dx,
                int64_t cols, int64_t chunks_per_row, int64_t chunks, int64_t wpr) {
  cuda::enter_kernel();
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * kChunks;
  const bool fast = chunks_per_row == chunks && aligned16(dy, dx);
  for (int64_t c0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * kChunks; c0 < chunks;
       c0 += stride) {
    if (fast && (c0 + kChunks) * (32 * P) <= cols) {
      T v[kChunks][P];
      uint32_t bits[kChunks];
#pragma unroll
      for (int u = 0; u < kChunks; ++u) {
        const int64_t e = (c0 + u) * (32 * P) + lane * P;
        bits[u] = cuda::mask_bits<P>(mask, e);
        cuda::load_vec<T, P>(dy + e, v[u]);
      }
#pragma unroll
      for (int u = 0; u < kChunks; ++u) {
#pragma unroll
        for (int k = 0; k < P; ++k)
          if (!((bits[u] >> k) & 1u)) v[u][k] = from_acc<T>(acc_t<T>(0));
        cuda::store_vec<T, P>(dx + (c0 + u) * (32 * P) + lane * P, v[u]);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kChunks; ++u)
        if (c0 + u < chunks) backward_chunk<T, P>(dy, mask, dx, c0 + u, cols, chunks_per_row, chunks, wpr, lane);
    }
  }
}

// Blocks of a grid-stride launch: one iteration a warp, up to per_sm blocks an SM (then each warp
// loops). The caps are session 43's fastest (run 3): the forward is fastest with no loop at all
// (1024 an SM caps it only past ~2.8e8 float32 / 5.5e8 bf16 elements; 64 an SM was 0.2-1 %
// slower, 32 up to 2 %), the backward at 64 (the only cap above 32 measured there).
constexpr int kForwardBlocksPerSm = 1024;
constexpr int kBackwardBlocksPerSm = 64;

cudaError_t grid_for(int64_t chunks, int per_sm, int* blocks) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info)) return err;
  const int64_t needed = (chunks + kWarps * kChunks - 1) / (kWarps * kChunks);
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(info.sm_count) * per_sm)));
  return cudaSuccess;
}

}  // namespace

cudaError_t forward_cuda(cudaStream_t stream, Dtype dtype, const void* x, void* y, uint32_t* mask,
                         int64_t rows, int64_t cols, int64_t words_per_row) {
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int P = 16 / sizeof(T);
    const int64_t cpr = (cols + 32 * P - 1) / (32 * P);
    int blocks = 0;
    if (cudaError_t err = grid_for(rows * cpr, kForwardBlocksPerSm, &blocks)) return err;
    if (cudaError_t err = cuda::launch_kernel(forward_kernel<T, P>, blocks, kThreads, 0, stream,
        static_cast<const T*>(x), static_cast<T*>(y), mask, cols, cpr, rows * cpr, words_per_row)) return err;
  });
  return cudaGetLastError();
}

cudaError_t backward_cuda(cudaStream_t stream, Dtype dtype, const void* dy, const uint32_t* mask,
                          void* dx, int64_t rows, int64_t cols, int64_t words_per_row) {
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int P = 16 / sizeof(T);
    const int64_t cpr = (cols + 32 * P - 1) / (32 * P);
    int blocks = 0;
    if (cudaError_t err = grid_for(rows * cpr, kBackwardBlocksPerSm, &blocks)) return err;
    if (cudaError_t err = cuda::launch_kernel(backward_kernel<T, P>, blocks, kThreads, 0, stream,
        static_cast<const T*>(dy), mask, static_cast<T*>(dx), cols, cpr, rows * cpr, words_per_row)) return err;
  });
  return cudaGetLastError();
}

}  // namespace jaxops::relu
