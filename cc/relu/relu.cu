// relu forward / backward with a 1-bit-per-element mask.
//
// Each warp owns a chunk of 32*P consecutive elements of one row (P elements = one 16-byte pack
// per lane), so loads and stores of x/y are 16-byte vectors and the chunk's P mask words come out
// of one warp collective (common/bitmask.cuh) and are stored by lanes 0..P-1 in one access.
#include <algorithm>

#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"
#include "relu/relu_launch.h"

namespace jaxops::relu {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <class T, int P>
__global__ void __launch_bounds__(kThreads)
forward_kernel(const T* __restrict__ x, T* __restrict__ y, uint32_t* __restrict__ mask, int64_t cols,
               int64_t chunks_per_row, int64_t chunks, int64_t wpr, bool vec) {
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  // The loop bound is per warp, so the warp collective below always sees all 32 lanes.
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; chunk < chunks;
       chunk += stride) {
    const cuda::WarpChunk c = cuda::warp_chunk<P>(chunk, chunks_per_row);
    const int64_t base = c.row * cols;
    T v[P];
    cuda::load_run<T, P>(x + base, c.c0, cols, vec, v);
    uint32_t bits = 0;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const auto a = to_acc(v[k]);
      const bool pos = a > 0;
      bits |= static_cast<uint32_t>(pos) << k;
      if (!(pos || a != a)) v[k] = from_acc<T>(acc_t<T>(0));  // NaN propagates like jax.nn.relu
    }
    cuda::store_run<T, P>(y + base, c.c0, cols, vec, v);
    if (wpr > 0) {
      const uint32_t word = cuda::warp_mask_words<P>(bits);
      const int64_t w = c.ch * P + lane;
      if (lane < P && w < wpr) mask[c.row * wpr + w] = word;
    }
  }
}

template <class T, int P>
__global__ void __launch_bounds__(kThreads)
backward_kernel(const T* __restrict__ dy, const uint32_t* __restrict__ mask, T* __restrict__ dx,
                int64_t cols, int64_t chunks_per_row, int64_t chunks, int64_t wpr, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; chunk < chunks;
       chunk += stride) {
    const cuda::WarpChunk c = cuda::warp_chunk<P>(chunk, chunks_per_row);
    if (c.c0 >= cols) continue;  // no warp collective below
    const int64_t base = c.row * cols;
    const uint32_t bits = cuda::mask_bits<P>(mask + c.row * wpr, c.c0);  // P | 32: one word
    T v[P];
    cuda::load_run<T, P>(dy + base, c.c0, cols, vec, v);
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (!((bits >> k) & 1u)) v[k] = from_acc<T>(acc_t<T>(0));
    cuda::store_run<T, P>(dx + base, c.c0, cols, vec, v);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Grid-stride launch: a few waves of full blocks, each warp looping over chunks.
cudaError_t grid_for(int64_t chunks, int* blocks) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info)) return err;
  const int64_t needed = (chunks + kWarps - 1) / kWarps;
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(info.sm_count) * 32)));
  return cudaSuccess;
}

}  // namespace

cudaError_t forward_cuda(cudaStream_t stream, Dtype dtype, const void* x, void* y, uint32_t* mask,
                         int64_t rows, int64_t cols, int64_t words_per_row) {
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int P = 16 / sizeof(T);
    const int64_t cpr = (cols + 32 * P - 1) / (32 * P);
    const bool vec = cols % P == 0 && aligned16(x) && aligned16(y);
    int blocks = 0;
    if (cudaError_t err = grid_for(rows * cpr, &blocks)) return err;
    forward_kernel<T, P><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(x), static_cast<T*>(y), mask,
                                                          cols, cpr, rows * cpr, words_per_row, vec);
  });
  return cudaGetLastError();
}

cudaError_t backward_cuda(cudaStream_t stream, Dtype dtype, const void* dy, const uint32_t* mask,
                          void* dx, int64_t rows, int64_t cols, int64_t words_per_row) {
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int P = 16 / sizeof(T);
    const int64_t cpr = (cols + 32 * P - 1) / (32 * P);
    const bool vec = cols % P == 0 && aligned16(dy) && aligned16(dx);
    int blocks = 0;
    if (cudaError_t err = grid_for(rows * cpr, &blocks)) return err;
    backward_kernel<T, P><<<blocks, kThreads, 0, stream>>>(static_cast<const T*>(dy), mask, static_cast<T*>(dx),
                                                           cols, cpr, rows * cpr, words_per_row, vec);
  });
  return cudaGetLastError();
}

}  // namespace jaxops::relu
