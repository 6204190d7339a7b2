// backward_warp (a warp a row, column sums in the warp's shared-memory slice) with session 5's lean
// arithmetic, for 16-byte packs of float / 16-bit types: 16-bit rows of 33-64 packs (264-512
// columns), float32 rows of 65-256 packs (260-1024 columns).
//
// Why (session 50): backward_warp keeps session 4's row arithmetic (two IEEE divisions a row,
// xhat computed twice, dx as rstd * ((g - mg) - xhat * mgx)), which session 49's profile found
// instruction-bound in the narrow team kernel; the lean rewrite took that kernel's bf16
// layer_norm_bwd from 0.78 to 0.84 of its bound. bf16 174762x384 (48 packs: lanes 16-31 idle in
// the second round) reads 0.70 of its bound, 131072x512 0.84. Measured in session 53 (run 1, H200):
// bf16 174762x384 135.7 -> 121.7 us (0.70 -> 0.78), 254200x264 184.9 -> 158.2, float32 level.
// Column sums keep backward_warp's order (each warp's rows in order into its slice, then the
// warps in order): dscale / dbias stay bit-reproducible.
#pragma once
#include "layer_norm/layer_norm_lean_bwd.cuh"

namespace jaxops::layer_norm {

template <class T, int kPack, int kPacks, int kMinBlocks, bool kRms>
__global__ void __launch_bounds__(256, kMinBlocks) backward_warp_lean(BackwardArgs a, int64_t used) {
  static_assert(sizeof(acc_t<T>) == 4, "float statistics");
  cuda::enter_kernel();
  using L = WarpAccLayout<float, kPack, kPacks>;
  constexpr int kNacc = kRms ? 1 : 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const Shape s = a.shape;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  const int npacks = static_cast<int>(s.cols / kPack);
  const float inv_cols = 1.0f / static_cast<float>(s.cols);
  float* slices = reinterpret_cast<float*>(smem_raw);  // [nwarps][kNacc][kSlice]
  float* acc_s = slices + warp * kNacc * L::kSlice;
  float* acc_b = acc_s + L::kSlice;  // layer_norm only
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
    L::zero(acc_s, acc_b, !kRms, lane);
    // The row is warp-uniform, so the shuffles below always see the whole warp.
    for (int64_t row = begin + warp; row < end; row += nwarps) {
      const float mean = kRms ? 0.0f : means[row], rstd = rstds[row];
      Pack<T, kPack> xp[kPacks], dp[kPacks];
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * 32;
        if (p < npacks) {
          xp[k] = load_pack<T, kPack>(x + row * s.cols + p * kPack);
          dp[k] = load_pack<T, kPack>(dy + row * s.cols + p * kPack);
        }
      }
      float sum_g = 0.0f, sum_gxm = 0.0f;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * 32;
        if (p < npacks)
          add_row_sums<T, kPack, kRms>(xp[k], dp[k], load_pack<T, kPack>(scale + p * kPack), mean, sum_g, sum_gxm);
      }
      if constexpr (!kRms) sum_g = team_sum<32>(sum_g);
      sum_gxm = team_sum<32>(sum_gxm);
      float c1, c0;
      dx_coefs<kRms>(sum_g, sum_gxm, rstd, inv_cols, c1, c0);
      // As in backward_warp: x and dy live only in their storage type across the reductions, and
      // the scale packs are re-read (an L1 hit), not kept.
      opaque_packs(xp);
      opaque_packs(dp);
      asm volatile("" ::: "memory");
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + k * 32;
        if (p < npacks) {
          float as[kPack], ab[kPack];
          L::load(acc_s, acc_b, !kRms, lane, k, as, ab);
          float xf[kPack], df[kPack], sf[kPack], out[kPack];
          unpack_floats<T, kPack>(xp[k], xf);
          unpack_floats<T, kPack>(dp[k], df);
          unpack_floats<T, kPack>(load_pack<T, kPack>(scale + p * kPack), sf);
          dx_pack<kPack, kRms>(xf, df, sf, mean, rstd, c1, c0, out, as, ab);
          store_pack(dx + row * s.cols + p * kPack, pack_floats<T, kPack>(out));
          L::store(acc_s, acc_b, !kRms, lane, k, as, ab);
        }
      }
    }
    __syncthreads();  // every warp's slice is complete
    float* out = slot_ptr<T>(a, g, j);
    for (int c = threadIdx.x; c < kNacc * static_cast<int>(s.cols); c += blockDim.x) {
      const int which = c / static_cast<int>(s.cols);
      const int at = which * L::kSlice + L::column(c % s.cols);
      float total = 0.0f;
      for (int w = 0; w < nwarps; ++w) total += slices[w * kNacc * L::kSlice + at];
      out[c] = total;
    }
    __syncthreads();  // the slices are zeroed again by the next slot
  }
}

}  // namespace jaxops::layer_norm
