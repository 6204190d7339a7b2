// layer_norm forward for rows of 16-32 KB (session 41): forward_block_lean's row with the next
// row's x copied into a second shared-memory buffer by cp.async while this row is reduced and
// written, on a persistent grid. forward_block_lean runs load -> block sum -> write strictly in
// turn, one row a block: DRAM reads stop during the block sum and the write pass unless the SM's
// other block happens to be loading. Session 40's ncu put layer_norm on the first use of a
// just-loaded x pack (long scoreboard, DRAM 68 % busy at f32 8192 columns). Here two rows' reads
// are in flight for most of a row's time, and they hold no registers (cp.async writes shared
// memory directly).
// Each thread copies, reduces and writes only its own packs (p = tid, tid + blockDim, ...), so
// the only barriers are the block sums'. The per-thread order of the additions is forward_block_
// lean's, so y, mean and rstd are bit-identical to it (checked on the H200 at 9 shapes).
// rms_norm keeps forward_block_lean: its row has fewer instructions between loads, and this
// kernel lost 5-9 % there (f32 8192x8192 133.5 -> 140.2 us).
#pragma once
#include <cuda_pipeline.h>

#include "layer_norm/layer_norm_lean_block.cuh"

namespace jaxops::layer_norm {

// The rows it takes have 1025-2048 packs: 257-512 threads of 4 packs.
constexpr int kAsyncForwardThreads = 512;

template <class T, int kPack>
__device__ __forceinline__ void request_row(T* buf, const T* xr, int npacks) {
  for (int p = threadIdx.x; p < npacks; p += blockDim.x) __pipeline_memcpy_async(buf + p * kPack, xr + p * kPack, 16);
  __pipeline_commit();
}

// 3 blocks of 512 an SM: <= 40 registers, and 3 x 64 KB of shared memory at 32 KB rows.
template <class T, int kPack>
__global__ void __launch_bounds__(kAsyncForwardThreads, 3) forward_block_async(ForwardArgs a) {
  cuda::enter_kernel();
  static_assert(sizeof(T) <= 4 && kPack * sizeof(T) == 16, "16-byte packs of float / 16-bit types");
  constexpr int kWriteChunk = sizeof(T) == 4 ? 2 : 1;
  __shared__ float2 scratch[32];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Shape& s = a.shape;
  const int npacks = static_cast<int>(s.cols / kPack);
  T* const buf0 = reinterpret_cast<T*>(smem_raw);
  T* const buf1 = buf0 + s.cols;
  const auto [inv_cols, eps, x, y, scale, bias] = lean_setup<T>(a);
  if (blockIdx.x < s.rows) request_row<T, kPack>(buf0, x + blockIdx.x * s.cols, npacks);
  int which = 0;
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x, which ^= 1) {
    T* const cache = which ? buf1 : buf0;
    const int64_t next = row + gridDim.x;
    if (next < s.rows) {
      request_row<T, kPack>(which ? buf0 : buf1, x + next * s.cols, npacks);
    } else {
      __pipeline_commit();  // an empty group: wait_prior(1) below still means "this row's"
    }
    const float shift = to_acc(x[row * s.cols]);
    __pipeline_wait_prior(1);
    float sum = 0.0f, sq = 0.0f, unused = 0.0f;
#pragma unroll 4
    for (int p = threadIdx.x; p < npacks; p += blockDim.x) {
      float f[kPack];
      unpack_floats<T, kPack>(load_pack<T, kPack>(cache + p * kPack), f);
#pragma unroll
      for (int e = 0; e < kPack; ++e) {
        const float d = f[e] - shift;
        sum += d;
        sq = fmaf(d, d, sq);
      }
    }
    block_sum2_lean(sum, sq, scratch);
    const float mean_rel = sum * inv_cols;
    float var;
    if (!shifted_variance(mean_rel, sq * inv_cols, &var)) {
      sq = recentred_squares<T, kPack>(cache, npacks, shift, mean_rel);
      block_sum2_lean(sq, unused, scratch);
      var = sq * inv_cols;
    }
    const float rstd = rsqrtf(var + eps);
    const float c = -mean_rel * rstd;
    T* yr = y + row * s.cols;
    for (int p0 = threadIdx.x; p0 < npacks; p0 += kWriteChunk * blockDim.x) {
      Pack<T, kPack> sp[kWriteChunk], bp[kWriteChunk];
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < npacks) {
          sp[k] = load_pack<T, kPack>(scale + p * kPack);
          bp[k] = load_pack<T, kPack>(bias + p * kPack);
        }
      }
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < npacks) {
          float f[kPack], sf[kPack], bf[kPack], out[kPack];
          unpack_floats<T, kPack>(load_pack<T, kPack>(cache + p * kPack), f);
          unpack_floats<T, kPack>(sp[k], sf);
          unpack_floats<T, kPack>(bp[k], bf);
#pragma unroll
          for (int e = 0; e < kPack; ++e) out[e] = fmaf(fmaf(f[e] - shift, rstd, c), sf[e], bf[e]);
          store_pack(yr + p * kPack, pack_floats<T, kPack>(out));
        }
      }
    }
    if (threadIdx.x == 0) {
      if (a.mean) static_cast<float*>(a.mean)[row] = shift + mean_rel;
      static_cast<float*>(a.rstd)[row] = rstd;
    }
  }
  __pipeline_wait_prior(0);  // (only empty groups can be left; nothing reads them)
}

}  // namespace jaxops::layer_norm
