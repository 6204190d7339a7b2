// The 16-bit register-row backward, two rows an iteration (1032-4096 columns, two packs a
// thread, no prefetch). Per pair of rows, one block sum of four values (two barriers instead of
// four) and one shared-memory round trip of the column sums (8 LDS.128 + 8 STS.128 a thread
// instead of 16 + 16): session 38's ncu put backward_rows_lean on shared memory (short scoreboard
// the top stall). The two rows' x and dy take the registers the prefetched row held. Every sum
// keeps its order (row r's column terms before row r + 1's; the same warp and lane trees), so dx,
// dscale and dbias are bit-identical to backward_rows_lean (checked on the H200, session 40).
// 3 blocks of 256 an SM: 80 registers, 16 bytes spilled (sm_90); 2 blocks without the spill
// measured 0-12 % slower.
#pragma once
#include "layer_norm/layer_norm_lean_bwd.cuh"

namespace jaxops::layer_norm {

// block_sum2_lean for two pairs of floats: each value takes block_sum2_lean's exact trees.
__device__ __forceinline__ void block_sum4_lean(float& a, float& b, float& c, float& d, float4* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  a = cuda::warp_reduce<cuda::SumOp>(a);
  b = cuda::warp_reduce<cuda::SumOp>(b);
  c = cuda::warp_reduce<cuda::SumOp>(c);
  d = cuda::warp_reduce<cuda::SumOp>(d);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = make_float4(a, b, c, d);
  __syncthreads();
  const float4 v = lane < nwarps ? scratch[lane] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  a = cuda::warp_reduce<cuda::SumOp>(v.x);
  b = cuda::warp_reduce<cuda::SumOp>(v.y);
  c = cuda::warp_reduce<cuda::SumOp>(v.z);
  d = cuda::warp_reduce<cuda::SumOp>(v.w);
}

// The row operands of BackwardArgs, typed, in the order the kernels unpack them:
// const auto [x, dy, dx, means, rstds] = backward_rows_of<T>(a).
template <class T>
struct BackwardRows {
  const T* x;
  const T* dy;
  T* dx;
  const float* means;
  const float* rstds;
};

template <class T>
__device__ __forceinline__ BackwardRows<T> backward_rows_of(const BackwardArgs& a) {
  return {static_cast<const T*>(a.x), static_cast<const T*>(a.dy), static_cast<T*>(a.dx),
          static_cast<const float*>(a.mean), static_cast<const float*>(a.rstd)};
}

template <class T, int kPack, int kPacks, bool kRms>
__device__ __forceinline__ void backward_rows_pair_body(const BackwardArgs& a, int64_t used, float4* scratch) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sacc = reinterpret_cast<float*>(smem_raw);  // [kNacc][cols], thread-owned columns
  const Shape& s = a.shape;
  const int cols = static_cast<int>(s.cols);
  const int npacks = cols / kPack;
  const float inv_cols = a.inv_cols;
  const auto [x, dy, dx, means, rstds] = backward_rows_of<T>(a);
  for (int64_t slot = blockIdx.x; slot < s.groups * used; slot += gridDim.x) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols;
    Pack<T, kPack> sp[kPacks];
    const Pack<float, 4> zero{};
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = threadIdx.x + k * blockDim.x;
      if (p < npacks) {
        sp[k] = load_pack<T, kPack>(scale + p * kPack);
#pragma unroll
        for (int c = 0; c < kPack; c += 4) {
          store_pack(sacc + p * kPack + c, zero);
          if constexpr (!kRms) store_pack(sacc + cols + p * kPack + c, zero);
        }
      }
    }
    for (int64_t row = begin; row < end; row += 2) {  // block-uniform: the barriers below are safe
      const bool two = row + 1 < end;
      Pack<T, kPack> xp[2][kPacks], dp[2][kPacks];
      float mean[2] = {0.0f, 0.0f}, rstd[2] = {0.0f, 0.0f};
      load_row_packs<T, kPack, kPacks>(x, dy, row, s.cols, npacks, xp[0], dp[0]);
      if constexpr (!kRms) mean[0] = means[row];
      rstd[0] = rstds[row];
      if (two) {
        load_row_packs<T, kPack, kPacks>(x, dy, row + 1, s.cols, npacks, xp[1], dp[1]);
        if constexpr (!kRms) mean[1] = means[row + 1];
        rstd[1] = rstds[row + 1];
      }
      // Pass 1, both rows: sum(g) and sum(g * (x - mean)), g = dy * scale rounded once.
      float sum_g[2] = {0.0f, 0.0f}, sum_gxm[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (r == 1 && !two) break;
#pragma unroll
        for (int k = 0; k < kPacks; ++k) {
          const int p = threadIdx.x + k * blockDim.x;
          if (p < npacks) add_row_sums<T, kPack, kRms>(xp[r][k], dp[r][k], sp[k], mean[r], sum_g[r], sum_gxm[r]);
        }
      }
      block_sum4_lean(sum_g[0], sum_gxm[0], sum_g[1], sum_gxm[1], scratch);
      float c1[2], c0[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) dx_coefs<kRms>(sum_g[r], sum_gxm[r], rstd[r], inv_cols, c1[r], c0[r]);
      opaque_packs(xp[0]);
      opaque_packs(dp[0]);
      opaque_packs(xp[1]);
      opaque_packs(dp[1]);
      // Pass 2: dx of both rows, and the column sums of the thread's own columns, row by row.
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = threadIdx.x + k * blockDim.x;
        if (p < npacks) {
          float as[kPack], ab[kPack], sf[kPack];
          load_column_sums<kPack, kRms>(sacc, cols, p, as, ab);
          unpack_floats<T, kPack>(sp[k], sf);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (r == 1 && !two) break;
            float xf[kPack], df[kPack], out[kPack];
            unpack_floats<T, kPack>(xp[r][k], xf);
            unpack_floats<T, kPack>(dp[r][k], df);
            dx_pack<kPack, kRms>(xf, df, sf, mean[r], rstd[r], c1[r], c0[r], out, as, ab);
            store_pack(dx + (row + r) * s.cols + p * kPack, pack_floats<T, kPack>(out));
          }
          store_column_sums<kPack, kRms>(sacc, cols, p, as, ab);
        }
      }
    }
    if (store_cluster_sums<T>(a, sacc)) continue;
    copy_slot_sums<kPack, kPacks, kRms>(slot_ptr<T>(a, g, j), cols, sacc, cols, npacks);
  }
}

template <class T, int kPack, int kPacks>
__global__ void __launch_bounds__(256, 3) backward_rows_lean_pair(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  static_assert(sizeof(T) == 2 && kPack == 8, "8-element packs of bfloat16 / float16");
  __shared__ float4 scratch[32];
  if (a.shape.rms) backward_rows_pair_body<T, kPack, kPacks, true>(a, used, scratch);
  else backward_rows_pair_body<T, kPack, kPacks, false>(a, used, scratch);
}

// 16-bit layer_norm rows of 6152-8192 columns, one pack a thread (up to 1024 threads, one block an
// SM), the column sums in registers, x and dy of the next kAhead rows in a cp.async ring in shared
// memory behind the column sums ([kAhead][2][cols] of T; each thread copies and reads back only its
// own pack, so no barrier), and two rows an iteration: one block sum of four values a pair
// (block_sum4_lean, the same trees as block_sum2_lean) and row r's column terms added before row
// r + 1's, so the bits equal backward_rows_lean_1024's (its register-prefetch fallback).
// H200, bf16 layer_norm_bwd, us (register prefetch / ring of 4, one row an iteration (session 44) /
// this kernel (session 45)): 8192x8192 120.7 / 116.6 / 114.2; 16384x6152 192.4 / 185.3 / 174.6;
// 16384x8192 - / 215.0 / 214.2. A ring of 5 rows lost (8192x8192 120.6). The kernel is near its
// issue limit (ncu, session 44: the SM issues on ~70 % of cycles, the top stalls the block sum's
// shuffles), so the gain is the half as many barriers and reductions a row, not the loads.
template <class T, int kPack, int kAhead>
__global__ void __launch_bounds__(1024, 1) backward_rows_lean_1024_ring(BackwardArgs a, int64_t used) {
  cuda::enter_kernel();
  static_assert(sizeof(T) == 2 && kPack == 8 && kAhead % 2 == 0, "8-element packs of 16-bit types, rows in pairs");
  __shared__ float4 scratch[32];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sacc = reinterpret_cast<float*>(smem_raw);  // [2][cols], the slot's column sums at its end
  const Shape& s = a.shape;
  const int cols = static_cast<int>(s.cols);
  const int npacks = cols / kPack;
  const float inv_cols = a.inv_cols;
  const auto [x, dy, dx, means, rstds] = backward_rows_of<T>(a);
  T* const ring = reinterpret_cast<T*>(sacc + 2 * cols);
  const int p = threadIdx.x;
  for (int64_t slot = blockIdx.x; slot < s.groups * used; slot += gridDim.x) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    Pack<T, kPack> sp{};
    if (p < npacks) sp = load_pack<T, kPack>(static_cast<const T*>(a.scale) + g * s.cols + p * kPack);
    float racc_s[kPack], racc_b[kPack];
#pragma unroll
    for (int e = 0; e < kPack; ++e) racc_s[e] = racc_b[e] = 0.0f;
#pragma unroll
    for (int i = 0; i < kAhead; ++i) request_ring_row<T, kPack>(ring, i, cols, x, dy, begin + i, end, s.cols, npacks);
    float mean[2] = {0.0f, 0.0f}, rstd[2] = {0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (begin + r < end) {
        mean[r] = means[begin + r];
        rstd[r] = rstds[begin + r];
      }
    }
    int stage = 0;
    for (int64_t row = begin; row < end; row += 2) {  // block-uniform: the barriers below are safe
      const bool two = row + 1 < end;
      __pipeline_wait_prior(kAhead - 2);  // rows `row` and `row + 1` have landed
      Pack<T, kPack> xp[2], dp[2];
      float sum_g[2] = {0.0f, 0.0f}, sum_gxm[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (p < npacks && (r == 0 || two)) {
          const T* xs = ring + int64_t{stage + r} * 2 * cols;
          xp[r] = load_pack<T, kPack>(xs + p * kPack);
          dp[r] = load_pack<T, kPack>(xs + cols + p * kPack);
          add_row_sums<T, kPack, false>(xp[r], dp[r], sp, mean[r], sum_g[r], sum_gxm[r]);
        }
      }
      // Refill both entries kAhead rows on (the opaque asm: their shared loads have returned).
      opaque_packs(xp);
      opaque_packs(dp);
      request_ring_row<T, kPack>(ring, stage, cols, x, dy, row + kAhead, end, s.cols, npacks);
      request_ring_row<T, kPack>(ring, stage + 1, cols, x, dy, row + kAhead + 1, end, s.cols, npacks);
      stage = stage + 2 == kAhead ? 0 : stage + 2;
      float mean_n[2] = {0.0f, 0.0f}, rstd_n[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (row + 2 + r < end) {
          mean_n[r] = means[row + 2 + r];
          rstd_n[r] = rstds[row + 2 + r];
        }
      }
      block_sum4_lean(sum_g[0], sum_gxm[0], sum_g[1], sum_gxm[1], scratch);
      float c1[2], c0[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) dx_coefs<false>(sum_g[r], sum_gxm[r], rstd[r], inv_cols, c1[r], c0[r]);
      opaque_packs(xp);
      opaque_packs(dp);
      if (p < npacks) {
        float sf[kPack];
        unpack_floats<T, kPack>(sp, sf);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (r == 1 && !two) break;
          float xf[kPack], df[kPack], out[kPack];
          unpack_floats<T, kPack>(xp[r], xf);
          unpack_floats<T, kPack>(dp[r], df);
          dx_pack<kPack, false>(xf, df, sf, mean[r], rstd[r], c1[r], c0[r], out, racc_s, racc_b);
          store_pack(dx + (row + r) * s.cols + p * kPack, pack_floats<T, kPack>(out));
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mean[r] = mean_n[r];
        rstd[r] = rstd_n[r];
      }
    }
    if (p < npacks) store_column_sums<kPack, false>(sacc, cols, p, racc_s, racc_b);
    if (store_cluster_sums<T>(a, sacc)) continue;
    copy_slot_sums<kPack, 1, false>(slot_ptr<T>(a, g, j), cols, sacc, cols, npacks);
  }
}

}  // namespace jaxops::layer_norm
