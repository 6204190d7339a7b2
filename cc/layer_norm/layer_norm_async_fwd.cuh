// layer_norm forward for rows of 16-32 KB (session 41; float32 8-32 KB since session 46):
// forward_block_lean's row with the next row's x copied into a second shared-memory buffer by
// cp.async while this row is reduced and written, on a persistent grid. forward_block_lean runs
// load -> block sum -> write strictly in turn, one row a block: DRAM reads stop during the block
// sum and the write pass unless the SM's other block happens to be loading. Session 40's ncu put
// layer_norm on the first use of a just-loaded x pack (long scoreboard, DRAM 68 % busy at f32 8192
// columns). Here two rows' reads are in flight for most of a row's time, and they hold no
// registers (cp.async writes shared memory directly).
// Each thread copies, reduces and writes only its own packs (p = tid, tid + blockDim, ...), so
// the only barriers are the block sums'. The per-thread order of the additions is forward_block_
// lean's, so y, mean and rstd are bit-identical to it (checked on the H200 at 9 shapes).
// rms_norm keeps forward_block_lean: its row has fewer instructions between loads, and this
// kernel lost 5-9 % there (f32 8192x8192 133.5 -> 140.2 us).
// forward_block_async_held (session 46) is the same loop for 16-bit rows of 8-16 KB, where the
// plain one loses to forward_block_lean: the block keeps its scale and bias packs in
// registers, so a row's write pass issues no parameter loads (two L2 loads and their addresses a
// pack, every row, in the lean kernels). Held for 32 KB rows too (512 threads, 2 blocks an SM) it
// lost: f32 8192x8192 140.6 -> 142.9 us.
#pragma once
#include <cuda_pipeline.h>

#include "layer_norm/layer_norm_lean_block.cuh"

namespace jaxops::layer_norm {

// The rows it takes have 513-2048 packs: 160-512 threads of <= 4 packs.
constexpr int kAsyncForwardThreads = 512;

template <class T, int kPack>
__device__ __forceinline__ void request_row(T* buf, const T* xr, int npacks) {
  for (int p = threadIdx.x; p < npacks; p += blockDim.x) __pipeline_memcpy_async(buf + p * kPack, xr + p * kPack, 16);
  __pipeline_commit();
}

// y's pack p of a row: the cached x, scaled and shifted (forward_block_lean's formula and order).
template <class T, int kPack>
__device__ __forceinline__ void write_pack(T* yr, const T* cache, int p, const Pack<T, kPack>& sp,
                                           const Pack<T, kPack>& bp, float shift, float rstd, float c) {
  float f[kPack], sf[kPack], bf[kPack], out[kPack];
  unpack_floats<T, kPack>(load_pack<T, kPack>(cache + p * kPack), f);
  unpack_floats<T, kPack>(sp, sf);
  unpack_floats<T, kPack>(bp, bf);
#pragma unroll
  for (int e = 0; e < kPack; ++e) out[e] = fmaf(fmaf(f[e] - shift, rstd, c), sf[e], bf[e]);
  store_pack(yr + p * kPack, pack_floats<T, kPack>(out));
}

// kHeld > 0: the thread's scale and bias packs (p = tid + k * blockDim, k < kHeld; the launcher
// makes kHeld * blockDim cover the row) are loaded once and stay in registers for all the block's
// rows, instead of coming from L2 again every row.
template <class T, int kPack, int kHeld>
__device__ __forceinline__ void forward_block_async_body(const ForwardArgs& a) {
  static_assert(sizeof(T) <= 4 && kPack * sizeof(T) == 16, "16-byte packs of float / 16-bit types");
  constexpr int kWriteChunk = sizeof(T) == 4 ? 2 : 1;
  __shared__ float2 scratch[32];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Shape& s = a.shape;
  const int npacks = static_cast<int>(s.cols / kPack);
  T* const buf0 = reinterpret_cast<T*>(smem_raw);
  T* const buf1 = buf0 + s.cols;
  const auto [inv_cols, eps, x, y, scale, bias] = lean_setup<T>(a);
  Pack<T, kPack> held_s[kHeld > 0 ? kHeld : 1], held_b[kHeld > 0 ? kHeld : 1];
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int p = threadIdx.x + k * blockDim.x;
    if (p < npacks) {
      held_s[k] = load_pack<T, kPack>(scale + p * kPack);
      held_b[k] = load_pack<T, kPack>(bias + p * kPack);
    }
  }
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
    if constexpr (kHeld > 0) {
      // (16-bit packs: keeps the compiler from hoisting their float conversions out of the row
      // loop, 64 more live registers.)
      opaque_packs(held_s);
      opaque_packs(held_b);
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < npacks) {
          write_pack<T, kPack>(yr, cache, p, held_s[k], held_b[k], shift, rstd, c);
        }
      }
    } else {
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
            write_pack<T, kPack>(yr, cache, p, sp[k], bp[k], shift, rstd, c);
          }
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

// 3 blocks of 512 an SM: <= 40 registers, and 3 x 64 KB of shared memory at 32 KB rows.
template <class T, int kPack>
__global__ void __launch_bounds__(kAsyncForwardThreads, 3) forward_block_async(ForwardArgs a) {
  cuda::enter_kernel();
  forward_block_async_body<T, kPack, 0>(a);
}

// 16-bit rows of 8-16 KB (513-1024 packs: 160-256 threads of <= 4 packs) with the parameters
// held: 64 registers, 4 blocks of 256 an SM (at 3 blocks, 72 registers: bf16 8192x8192 76.2 us
// against the lean kernel's 73.1).
constexpr int kHeldForwardThreads = 256;
template <class T, int kPack>
__global__ void __launch_bounds__(kHeldForwardThreads, 4) forward_block_async_held(ForwardArgs a) {
  cuda::enter_kernel();
  forward_block_async_body<T, kPack, 4>(a);
}

}  // namespace jaxops::layer_norm
