// The team backward (one row a team of kWidth lanes, kPacks packs a lane, column sums in registers)
// with session 5's lean arithmetic (layer_norm_lean_bwd.cuh), for 16-byte packs of float / 16-bit
// types: rows of <= 32 packs (one pack a lane) and float32 rows of 33-63 packs (two, a full warp).
//
// Why (session 49, ncu, H200, layer_norm_bwd 524288x128): backward_team<bf16, 8, 1, 16> issues
// 76.4M warp instructions (about 36 thread instructions an element) at 73 % issue activity with
// 2.25 cycles of "not selected" stall an issue and DRAM at 56 %: bound by instructions, not by
// loads in flight (two packs a lane and more blocks an SM both lost). Its row costs two IEEE
// divisions (mean(g), mean(g * xhat)), the scale loaded twice, xhat computed twice and dx as
// rstd * ((g - mg) - xhat * mgx). Here, as in backward_rows_lean:
//  - 1/cols once per kernel, the sums scaled by multiplications (dx_coefs);
//  - sum(g * (x - mean)) in the first pass, so it needs no xhat (add_row_sums);
//  - dx = fma(g, rstd, fma(xhat, c1, c0)) (dx_pack), bfloat16 unpacked with one SHL / LOP3 an
//    element and packed two at a time (F2FP);
//  - the lane's scale packs loaded once a slot (its columns are the same every row) and held
//    packed, opaque every row so that their floats are not kept live (16-bit);
//  - rms_norm its own instantiation (kRms): no mean, no mean(g), no dbias accumulator.
// Column sums keep backward_team's fixed order (a team's rows in order, the teams of a warp by
// shuffles, the warps in order: store_team_sums, then reduce_slots): dscale / dbias stay
// bit-reproducible.
#pragma once
#include "layer_norm/layer_norm_lean_bwd.cuh"

namespace jaxops::layer_norm {

// Launched like backward_team (256 threads, nacc x cols floats of dynamic shared memory, one
// slot of rows a block per iteration). kMinBlocks > 0 caps the registers for that many blocks an
// SM; 0 leaves ptxas its own choice.
template <class T, int kPack, int kPacks, int kWidth, bool kRms, int kMinBlocks>
__global__ void __launch_bounds__(256, kMinBlocks) backward_team_lean(BackwardArgs a, int64_t used) {
  static_assert(sizeof(acc_t<T>) == 4, "float statistics");
  cuda::enter_kernel();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* buf = reinterpret_cast<float*>(smem_raw);
  const Shape s = a.shape;
  const int teams = blockDim.x / kWidth, team = threadIdx.x / kWidth, lane = threadIdx.x % kWidth;
  const int npacks = static_cast<int>(s.cols / kPack);
  const float inv_cols = a.inv_cols;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const float* means = static_cast<const float*>(a.mean);
  const float* rstds = static_cast<const float*>(a.rstd);
  for (int64_t slot = blockIdx.x; slot < s.groups * used; slot += gridDim.x) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols;
    Pack<T, kPack> sp[kPacks];
    float acc_s[kPacks][kPack], acc_b[kPacks][kPack];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = lane + k * kWidth;
      sp[k] = p < npacks ? load_pack<T, kPack>(scale + p * kPack) : Pack<T, kPack>{};
#pragma unroll
      for (int e = 0; e < kPack; ++e) acc_s[k][e] = acc_b[k][e] = 0.0f;
    }
    for (int64_t base = begin; base < end; base += teams) {
      const int64_t row = base + team;
      const bool valid_row = row < end;
      float mean = 0.0f, rstd = 0.0f;
      if (valid_row) {
        if constexpr (!kRms) mean = means[row];
        rstd = rstds[row];
      }
      if constexpr (sizeof(T) == 2) opaque_packs(sp);
      Pack<T, kPack> xp[kPacks], dp[kPacks];
      float sum_g = 0.0f, sum_gxm = 0.0f;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * kWidth;
        if (valid_row && p < npacks) {
          xp[k] = load_pack<T, kPack>(x + row * s.cols + p * kPack);
          dp[k] = load_pack<T, kPack>(dy + row * s.cols + p * kPack);
          add_row_sums<T, kPack, kRms>(xp[k], dp[k], sp[k], mean, sum_g, sum_gxm);
        }
      }
      if constexpr (!kRms) sum_g = team_sum<kWidth>(sum_g);
      sum_gxm = team_sum<kWidth>(sum_gxm);
      if (!valid_row) continue;
      float c1, c0;
      dx_coefs<kRms>(sum_g, sum_gxm, rstd, inv_cols, c1, c0);
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * kWidth;
        if (p < npacks) {
          float xf[kPack], df[kPack], sf[kPack], out[kPack];
          unpack_floats<T, kPack>(xp[k], xf);
          unpack_floats<T, kPack>(dp[k], df);
          unpack_floats<T, kPack>(sp[k], sf);
          dx_pack<kPack, kRms>(xf, df, sf, mean, rstd, c1, c0, out, acc_s[k], acc_b[k]);
          store_pack(dx + row * s.cols + p * kPack, pack_floats<T, kPack>(out));
        }
      }
    }
    store_team_sums<T, float, kPack, kPacks, kWidth>(a, g, j, !kRms, acc_s, acc_b, buf);
    __syncthreads();  // buf is rewritten by the next slot
  }
}

}  // namespace jaxops::layer_norm
