// Session 56: the forward of rows that are not whole 16-byte packs past 256 columns, up to 1024
// (layer_norm_fwd.cu's kWarpSkewMaxCols), a warp a row: forward_block_skew's head / 16-byte packs /
// tail split (layer_norm_skew_block.cuh) with forward_lean's registers and warp sums instead of a
// block, shared memory and two barriers a row. forward_block_skew ran 257 columns 1.5x slower than
// the scalar kernel, most of its 128 threads idle (session 55). This kernel runs 257 columns 3-4x
// faster than the block kernel, 1001 columns 1.15-1.6x (H100, session 56).
#pragma once
#include "layer_norm/layer_norm_skew_block.cuh"

namespace jaxops::layer_norm {

template <class T, int kPack, int kPacks, bool kRms>
__device__ __forceinline__ void forward_warp_skew_body(const ForwardArgs& a) {
  const Shape& s = a.shape;
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int cols = static_cast<int>(s.cols);  // <= 256 packs here
  const auto [inv_cols, eps, x, y, scale, bias] = lean_setup<T>(a);
  const T* row_scale = scale;  // (C++17 lambdas cannot capture structured bindings)
  const T* row_bias = bias;
  const int64_t step = static_cast<int64_t>(gridDim.x) * warps;
  // Warp-uniform rows: the shuffles need every lane.
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32; row < s.rows; row += step) {
    const int64_t start = row * s.cols;
    const int head = static_cast<int>((kPack - start % kPack) % kPack);
    const int npacks = (cols - head) / kPack;
    const int loose = cols - npacks * kPack;  // head + tail, < 2 kPack <= 32
    const T* xb = x + start + head;  // 16-byte aligned
    Pack<T, kPack> xp[kPacks];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int p = lane + 32 * k;
      if (p < npacks) xp[k] = load_pack<T, kPack>(xb + p * kPack);
    }
    const int lc = lane < head ? lane : lane + npacks * kPack;  // this lane's head or tail column
    const bool has_loose = lane < loose;
    const float xl = has_loose ? to_acc(x[start + lc]) : 0.0f;
    const float shift = kRms ? 0.0f : to_acc(x[start]);
    const auto each_packed = [&](auto f) {  // f(x) over this lane's packed elements
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        if (lane + 32 * k < npacks) {
          float v[kPack];
          unpack_floats<T, kPack>(xp[k], v);
#pragma unroll
          for (int e = 0; e < kPack; ++e) f(v[e]);
        }
      }
    };
    float mean_rel = 0.0f;
    if constexpr (!kRms) {
      float sum = has_loose ? xl - shift : 0.0f;
      each_packed([&](float v) { sum += v - shift; });
      mean_rel = team_sum<32>(sum) * inv_cols;
    }
    const float dl = (xl - shift) - mean_rel;
    float sq = has_loose ? dl * dl : 0.0f;
    each_packed([&](float v) {
      const float q = (v - shift) - mean_rel;
      sq = fmaf(q, q, sq);
    });
    const float rstd = rsqrtf(team_sum<32>(sq) * inv_cols + eps);
    const float c = kRms ? 0.0f : -mean_rel * rstd;
    T* yr = y + start;
    with_head<0, kPack>(head, [&](auto h) {
      constexpr int kHead = decltype(h)::value;
#pragma unroll
      for (int k = 0; k < kPacks; ++k) {
        const int p = lane + 32 * k;
        if (p < npacks) {
          float f[kPack], sf[kPack], bf[kPack], out[kPack];
          unpack_floats<T, kPack>(xp[k], f);
          unpack_floats<T, kPack>(skewed_param<kHead, T, kPack>(row_scale, p, cols), sf);
          if constexpr (!kRms) unpack_floats<T, kPack>(skewed_param<kHead, T, kPack>(row_bias, p, cols), bf);
          lean_outputs<kPack, kRms>(f, sf, bf, shift, rstd, c, out);
          store_pack(yr + head + p * kPack, pack_floats<T, kPack>(out));
        }
      }
    });
    if (has_loose) yr[lc] = lean_output_at<T, kRms>(xl, scale, bias, lc, shift, rstd, c);
    if (lane == 0) {
      if (!kRms && a.mean) static_cast<float*>(a.mean)[row] = shift + mean_rel;
      static_cast<float*>(a.rstd)[row] = rstd;
    }
  }
}

template <class T, int kPack, int kPacks>
__global__ void __launch_bounds__(128) forward_warp_skew(ForwardArgs a) {
  static_assert(sizeof(T) <= 4 && kPack * sizeof(T) == 16, "16-byte packs of float / 16-bit types");
  cuda::enter_kernel();
  if (a.shape.rms) forward_warp_skew_body<T, kPack, kPacks, true>(a);
  else forward_warp_skew_body<T, kPack, kPacks, false>(a);
}

}  // namespace jaxops::layer_norm
