// The backward of rows no cached kernel holds (on Hopper: float32 and 16-bit rows past the
// 131072 columns of the cluster split, in whole 16-byte packs). backward_block uncached took them
// before session 40: a slot of rows a block (32 rows: 32 SMs busy), x and dy read twice, the
// column sums read and written in global memory every row; 3-50x slower than XLA. Three kernels:
//  1. long_row_sums: a block per (row, chunk of 1024 packs): the chunk's sum(g) and
//     sum(g * (x - mean)) (g = dy * scale rounded once) to the workspace;
//  2. long_row_coefs: a warp per row adds its chunks' sums in a fixed order: the row's dx
//     coefficients c1 = -rstd * mean(g * xhat), c0 = -rstd * mean(g);
//  3. long_row_dx: a block per (column tile, parameter group), a pack a thread, walks the group's
//     rows: dx, and dscale / dbias of its columns summed in registers over the rows in order,
//     written once at the end (no slot partials, no reduce_slots). Deterministic.
// Traffic: x and dy twice, dx once: 5 passes of a row against the bound's 3, so at most 0.6 of
// the bound; measured 0.50-0.59 (H200, session 40).
#pragma once
#include "layer_norm/layer_norm_lean_bwd.cuh"

namespace jaxops::layer_norm {

constexpr int kLongSumThreads = 256, kLongSumPacks = 4;  // a chunk: 1024 packs
constexpr int kLongDxThreads = 128, kLongDxRows = 4;     // rows loaded ahead in long_row_dx

template <class T, int kPack, bool kRms>
__global__ void __launch_bounds__(kLongSumThreads) long_row_sums(BackwardArgs a, int64_t chunks) {
  cuda::enter_kernel();
  __shared__ float2 scratch[32];
  const int64_t row = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const int64_t npacks = a.shape.cols / kPack;
  const T* xr = static_cast<const T*>(a.x) + row * a.shape.cols;
  const T* dyr = static_cast<const T*>(a.dy) + row * a.shape.cols;
  const T* scale = static_cast<const T*>(a.scale) + row / a.shape.rows_per_group * a.shape.cols;
  const float mean = kRms ? 0.0f : static_cast<const float*>(a.mean)[row];
  const int64_t p0 = chunk * (kLongSumThreads * kLongSumPacks) + threadIdx.x;
  Pack<T, kPack> xp[kLongSumPacks], dp[kLongSumPacks], sp[kLongSumPacks];
#pragma unroll
  for (int k = 0; k < kLongSumPacks; ++k) {
    const int64_t p = p0 + k * kLongSumThreads;
    if (p < npacks) {
      xp[k] = load_pack<T, kPack>(xr + p * kPack);
      dp[k] = load_pack<T, kPack>(dyr + p * kPack);
      sp[k] = load_pack<T, kPack>(scale + p * kPack);
    }
  }
  float sum_g = 0.0f, sum_gxm = 0.0f;
#pragma unroll
  for (int k = 0; k < kLongSumPacks; ++k) {
    if (p0 + k * kLongSumThreads < npacks) add_row_sums<T, kPack, kRms>(xp[k], dp[k], sp[k], mean, sum_g, sum_gxm);
  }
  block_sum2_lean(sum_g, sum_gxm, scratch);
  if (threadIdx.x == 0) static_cast<float2*>(a.workspace)[blockIdx.x] = make_float2(sum_g, sum_gxm);
}

// A warp per row: lane l adds chunks l, l + 32, ... in order, then the lane tree.
template <bool kRms>
__global__ void __launch_bounds__(256) long_row_coefs(BackwardArgs a, int64_t chunks) {
  cuda::enter_kernel();
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.shape.rows) return;  // (warp-uniform)
  const float2* part = static_cast<const float2*>(a.workspace) + row * chunks;
  float sum_g = 0.0f, sum_gxm = 0.0f;
  for (int64_t c = lane; c < chunks; c += 32) {
    sum_g += part[c].x;
    sum_gxm += part[c].y;
  }
  sum_g = cuda::warp_reduce<cuda::SumOp>(sum_g);
  sum_gxm = cuda::warp_reduce<cuda::SumOp>(sum_gxm);
  if (lane == 0) {
    const float rstd = static_cast<const float*>(a.rstd)[row];
    const float mgx = sum_gxm * rstd * a.inv_cols;  // mean(g * xhat)
    const float c0 = kRms ? 0.0f : -rstd * (sum_g * a.inv_cols);
    static_cast<float2*>(a.workspace)[a.shape.rows * chunks + row] = make_float2(-rstd * mgx, c0);
  }
}

template <class T, int kPack, bool kRms>
__global__ void __launch_bounds__(kLongDxThreads) long_row_dx(BackwardArgs a, int64_t chunks) {
  cuda::enter_kernel();
  const int64_t npacks = a.shape.cols / kPack, rows = a.shape.rows_per_group, g = blockIdx.y;
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kLongDxThreads + threadIdx.x;
  if (p >= npacks) return;  // (no barriers below)
  // Row r below is row g * rows_per_group + r of x.
  const int64_t first = g * rows * a.shape.cols + p * kPack;
  const T* x = static_cast<const T*>(a.x) + first;
  const T* dy = static_cast<const T*>(a.dy) + first;
  T* dx = static_cast<T*>(a.dx) + first;
  const float* means = static_cast<const float*>(a.mean) + (kRms ? 0 : g * rows);
  const float* rstds = static_cast<const float*>(a.rstd) + g * rows;
  const float2* coefs = static_cast<const float2*>(a.workspace) + a.shape.rows * chunks + g * rows;
  const int64_t param = g * a.shape.cols + p * kPack;
  float sf[kPack], as[kPack], ab[kPack];
  unpack_floats<T, kPack>(load_pack<T, kPack>(static_cast<const T*>(a.scale) + param), sf);
#pragma unroll
  for (int e = 0; e < kPack; ++e) as[e] = ab[e] = 0.0f;
  for (int64_t r0 = 0; r0 < rows; r0 += kLongDxRows) {
    Pack<T, kPack> xp[kLongDxRows], dp[kLongDxRows];
#pragma unroll
    for (int r = 0; r < kLongDxRows; ++r) {
      if (r0 + r < rows) {
        xp[r] = load_pack<T, kPack>(x + (r0 + r) * a.shape.cols);
        dp[r] = load_pack<T, kPack>(dy + (r0 + r) * a.shape.cols);
      }
    }
#pragma unroll
    for (int r = 0; r < kLongDxRows; ++r) {
      if (r0 + r < rows) {
        const int64_t row = r0 + r;
        const float mean = kRms ? 0.0f : means[row], rstd = rstds[row];
        const float2 c = coefs[row];
        float xf[kPack], df[kPack], out[kPack];
        unpack_floats<T, kPack>(xp[r], xf);
        unpack_floats<T, kPack>(dp[r], df);
#pragma unroll
        for (int e = 0; e < kPack; ++e) {
          const float xhat = kRms ? xf[e] * rstd : (xf[e] - mean) * rstd;
          const float gv = mul_rn(df[e], sf[e]);
          out[e] = fmaf(gv, rstd, fmaf(xhat, c.x, c.y));
          as[e] = fmaf(df[e], xhat, as[e]);
          if constexpr (!kRms) ab[e] += df[e];
        }
        store_pack(dx + row * a.shape.cols, pack_floats<T, kPack>(out));
      }
    }
  }
  store_pack(static_cast<T*>(a.dscale) + param, pack_floats<T, kPack>(as));
  if constexpr (!kRms) store_pack(static_cast<T*>(a.dbias) + param, pack_floats<T, kPack>(ab));
}

}  // namespace jaxops::layer_norm
