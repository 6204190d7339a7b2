// Session 55: the lean block forward for rows that are not whole 16-byte packs (float32 widths not
// a multiple of 4, 16-bit widths not a multiple of 8) past 256 columns, one parameter group.
// forward_block_lean<T, 1> reads them one element a load: 0.41-0.50 of the copy bandwidth for bf16
// (H100, session 55), its load and store instructions the limit. Here each row is a head of up to
// kPack - 1 elements before its first 16-byte boundary, whole 16-byte packs (cached in shared
// memory, as in forward_block_lean), and a tail of up to kPack - 1; the head and tail elements go
// one a thread to the block's first threads, which keep them in a register between the passes.
// x and y rows have the same skew (the same offset row * cols; the launcher checks that x, y,
// scale and bias are 16-byte aligned). The scale and bias are skewed against the row's packs by
// its head: the write pass is instantiated for each head (a uniform branch a row) and builds each
// pack's scale / bias from two aligned packs by moves fixed at compile time.
#pragma once
#include <type_traits>

#include "layer_norm/layer_norm_lean.cuh"
#include "layer_norm/layer_norm_lean_block.cuh"

namespace jaxops::layer_norm {

// Elements [kHead, kHead + kPack) of the 2 kPack elements lo, hi.
template <int kHead, class T, int kPack>
__device__ __forceinline__ Pack<T, kPack> shifted_pack(const Pack<T, kPack>& lo, const Pack<T, kPack>& hi) {
  Pack<T, kPack> r;
#pragma unroll
  for (int e = 0; e < kPack; ++e) r.v[e] = e + kHead < kPack ? lo.v[e + kHead] : hi.v[e + kHead - kPack];
  return r;
}

// Parameter elements [kHead + p * kPack, kHead + (p + 1) * kPack): all lie in the row (the body's
// pack p), but the aligned pack after them may end past `cols`; only its first kHead elements are
// needed, so the row's last packs read those one at a time (nothing read past the parameters).
template <int kHead, class T, int kPack>
__device__ __forceinline__ Pack<T, kPack> skewed_param(const T* param, int p, int cols) {
  const Pack<T, kPack> lo = load_pack<T, kPack>(param + p * kPack);
  if constexpr (kHead == 0) {
    return lo;
  } else {
    const int next = (p + 1) * kPack;
    Pack<T, kPack> hi;
    if (next + kPack <= cols) {
      hi = load_pack<T, kPack>(param + next);
    } else {
#pragma unroll
      for (int e = 0; e < kHead; ++e) hi.v[e] = param[next + e];
    }
    return shifted_pack<kHead>(lo, hi);
  }
}

// f(std::integral_constant<int, head>) for head in [kHead, kPack): a chain of uniform branches.
template <int kHead, int kPack, class F>
__device__ __forceinline__ void with_head(int head, F&& f) {
  if constexpr (kHead + 1 < kPack) {
    if (head != kHead) return with_head<kHead + 1, kPack>(head, f);
  }
  f(std::integral_constant<int, kHead>{});
}

// The write pass over the row's packs for a row of head kHead: y = (x - shift) * rstd + c, times
// the scale, plus the bias (rms_norm: x * rstd * scale).
template <int kHead, class T, int kPack, bool kRms>
__device__ __forceinline__ void write_skewed_packs(const T* cache, T* yb, const T* scale, const T* bias,
                                                   int npacks, int cols, float shift, float rstd, float c) {
  constexpr int kWriteChunk = sizeof(T) == 4 ? 2 : 1;
  for (int p0 = threadIdx.x; p0 < npacks; p0 += kWriteChunk * blockDim.x) {
    Pack<T, kPack> sp[kWriteChunk], bp[kWriteChunk];
#pragma unroll
    for (int k = 0; k < kWriteChunk; ++k) {
      const int p = p0 + k * blockDim.x;
      if (p < npacks) {
        sp[k] = skewed_param<kHead, T, kPack>(scale, p, cols);
        if constexpr (!kRms) bp[k] = skewed_param<kHead, T, kPack>(bias, p, cols);
      }
    }
#pragma unroll
    for (int k = 0; k < kWriteChunk; ++k) {
      const int p = p0 + k * blockDim.x;
      if (p < npacks) {
        float f[kPack], sf[kPack], bf[kPack], out[kPack];
        unpack_floats<T, kPack>(load_pack<T, kPack>(cache + p * kPack), f);
        unpack_floats<T, kPack>(sp[k], sf);
        if constexpr (!kRms) unpack_floats<T, kPack>(bp[k], bf);
        lean_outputs<kPack, kRms>(f, sf, bf, shift, rstd, c, out);
        store_pack(yb + p * kPack, pack_floats<T, kPack>(out));
      }
    }
  }
}

template <class T, int kPack, bool kRms>
__device__ __forceinline__ void forward_skew_body(const ForwardArgs& a, float2* scratch) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* cache = reinterpret_cast<T*>(smem_raw);
  const Shape& s = a.shape;
  const int cols = static_cast<int>(s.cols);  // (shared memory bounds it)
  const auto [inv_cols, eps, x, y, scale, bias] = lean_setup<T>(a);
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    const int64_t start = row * s.cols;
    const int head = static_cast<int>((kPack - start % kPack) % kPack);
    const int npacks = (cols - head) / kPack;
    const int loose = cols - npacks * kPack;  // head + tail, < 2 kPack <= blockDim.x
    const T* xb = x + start + head;  // 16-byte aligned
    const float shift = kRms ? 0.0f : to_acc(x[start]);
    float sum = 0.0f, sq = 0.0f, unused = 0.0f;
    // This thread's head or tail element (column lc), if any.
    const int lc = threadIdx.x < head ? threadIdx.x : threadIdx.x + npacks * kPack;
    const bool has_loose = threadIdx.x < loose;
    float xl = 0.0f;
    if (has_loose) {
      xl = to_acc(x[start + lc]);
      lean_add<kRms>(xl, shift, sum, sq);
    }
    lean_load_pass<T, kPack, kRms, true>(xb, cache, npacks, shift, sum, sq);
    block_sum2_lean(sum, sq, scratch);
    const float mean_rel = kRms ? 0.0f : sum * inv_cols;
    float var;
    if (!shifted_variance(mean_rel, sq * inv_cols, &var) && !kRms) {  // (uniform, as forward_block_lean)
      sq = recentred_squares<T, kPack>(cache, npacks, shift, mean_rel);
      if (has_loose) {
        const float d = (xl - shift) - mean_rel;
        sq = fmaf(d, d, sq);
      }
      block_sum2_lean(sq, unused, scratch);
      var = sq * inv_cols;
    }
    const float rstd = rsqrtf(var + eps);
    const float c = kRms ? 0.0f : -mean_rel * rstd;
    T* yr = y + start;
    const T* row_scale = scale;  // (C++17 lambdas cannot capture structured bindings)
    const T* row_bias = bias;
    with_head<0, kPack>(head, [&](auto h) {
      write_skewed_packs<decltype(h)::value, T, kPack, kRms>(cache, yr + head, row_scale, row_bias, npacks, cols,
                                                            shift, rstd, c);
    });
    if (has_loose) yr[lc] = lean_output_at<T, kRms>(xl, scale, bias, lc, shift, rstd, c);
    if (threadIdx.x == 0) {
      if (!kRms && a.mean) static_cast<float*>(a.mean)[row] = shift + mean_rel;
      static_cast<float*>(a.rstd)[row] = rstd;
    }
  }
}

template <class T, int kPack>
__global__ void __launch_bounds__(1024) forward_block_skew(ForwardArgs a) {
  static_assert(sizeof(T) <= 4 && kPack * sizeof(T) == 16, "16-byte packs of float / 16-bit types");
  cuda::enter_kernel();
  __shared__ float2 scratch[32];
  if (a.shape.rms) forward_skew_body<T, kPack, true>(a, scratch);
  else forward_skew_body<T, kPack, false>(a, scratch);
}

}  // namespace jaxops::layer_norm
