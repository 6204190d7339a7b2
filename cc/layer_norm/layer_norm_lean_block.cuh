// Session 5: the lean block-per-row forward (`forward_block_lean`) for float / bfloat16 / float16
// rows in 16-byte packs with one parameter group (2048-~100K columns, row cached in shared
// memory). Same structure as forward_block (loads of 4 packs ahead, row in dynamic shared memory)
// but two passes (session 37: the variance in the load pass; a third pass only for rows whose
// first element is far from the mean), with the forward_lean diet: 1/cols once per kernel and
// rsqrtf (no IEEE division or sqrt per row), one-instruction bf16 conversions and packed F2FP
// stores (unpack_floats / pack_floats), y = fma(fma(x - shift, rstd, -mean_rel * rstd), s, b),
// 32-bit pack indices and no 64-bit `row / rows_per_group` per pack for the scale / bias loads
// (groups == 1; kGroups: once a row), and a block sum with a lane tree instead of a serial loop
// over the warps. Since session 55 also single-element rows (not whole 16-byte packs) too short for
// forward_block_skew (layer_norm_skew_block.cuh): 257-383 float32 / 257-767 16-bit columns.
#pragma once
#include "layer_norm/layer_norm_lean.cuh"
#include "layer_norm/layer_norm_lean_bwd.cuh"
#include "layer_norm/layer_norm_split.cuh"

namespace jaxops::layer_norm {

// One element into a row's sums: sum += x - shift (not for rms_norm), sq += (x - shift)^2.
template <bool kRms>
__device__ __forceinline__ void lean_add(float x, float shift, float& sum, float& sq) {
  const float d = kRms ? x : x - shift;
  if constexpr (!kRms) sum += d;
  sq = fmaf(d, d, sq);
}

// The block kernels' load pass: this thread's packs p (p = threadIdx.x + k * blockDim.x) of xr,
// kLoadChunk loads in flight, cached in shared memory when kCache; sum += x - shift (not for
// rms_norm) and sq += (x - shift)^2.
template <class T, int kPack, bool kRms, bool kCache>
__device__ __forceinline__ void lean_load_pass(const T* xr, T* cache, int npacks, float shift, float& sum,
                                               float& sq) {
  constexpr int kLoadChunk = 4;
  for (int p0 = threadIdx.x; p0 < npacks; p0 += kLoadChunk * blockDim.x) {
    Pack<T, kPack> xp[kLoadChunk];
#pragma unroll
    for (int k = 0; k < kLoadChunk; ++k) {
      const int p = p0 + k * blockDim.x;
      if (p < npacks) xp[k] = load_pack<T, kPack>(xr + p * kPack);
    }
#pragma unroll
    for (int k = 0; k < kLoadChunk; ++k) {
      const int p = p0 + k * blockDim.x;
      if (p < npacks) {
        if constexpr (kCache) store_pack(cache + p * kPack, xp[k]);
        float f[kPack];
        unpack_floats<T, kPack>(xp[k], f);
#pragma unroll
        for (int e = 0; e < kPack; ++e) lean_add<kRms>(f[e], shift, sum, sq);
      }
    }
  }
}

// One pack's outputs: fma(fma(x - shift, rstd, c), scale, bias), rms_norm x * rstd * scale.
template <int kPack, bool kRms>
__device__ __forceinline__ void lean_outputs(const float (&f)[kPack], const float (&sf)[kPack],
                                             const float (&bf)[kPack], float shift, float rstd, float c,
                                             float (&out)[kPack]) {
#pragma unroll
  for (int e = 0; e < kPack; ++e) {
    if constexpr (kRms) out[e] = (f[e] * rstd) * sf[e];
    else out[e] = fmaf(fmaf(f[e] - shift, rstd, c), sf[e], bf[e]);
  }
}

// lean_outputs for one element x of column `col` (the head / tail elements of the skewed kernels).
template <class T, bool kRms>
__device__ __forceinline__ T lean_output_at(float x, const T* scale, const T* bias, int col, float shift, float rstd,
                                            float c) {
  const float f[1] = {x}, sf[1] = {to_acc(scale[col])}, bf[1] = {kRms ? 0.0f : to_acc(bias[col])};
  float out[1];
  lean_outputs<1, kRms>(f, sf, bf, shift, rstd, c, out);
  return from_acc<T>(out[0]);
}

// The third pass, for rows whose shifted variance is untrusted: this thread's sum of squares
// around the mean (x - shift - mean_rel) over its packs of `row` (cached or in global memory).
template <class T, int kPack>
__device__ __forceinline__ float recentred_squares(const T* row, int npacks, float shift, float mean_rel) {
  float sq = 0.0f;
  for (int p = threadIdx.x; p < npacks; p += blockDim.x) {
    float f[kPack];
    unpack_floats<T, kPack>(load_pack<T, kPack>(row + p * kPack), f);
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      const float d = (f[e] - shift) - mean_rel;
      sq = fmaf(d, d, sq);
    }
  }
  return sq;
}

// kSplit (session 32): rows beyond one block's shared memory split over the blocks of a cluster
// (layer_norm_split.cuh); this block caches and writes only its own packs, and the row sums are
// added across the cluster. The shift is the row's first element in every block.
// kFromL2 (session 39, split rows past 64 KB a block): nothing cached in shared memory; the later
// passes re-read the block's part of the row from global memory, mostly from L2 (see forward_split).
// Its write pass walks the part backwards (session 40), so that the first re-reads are of the packs
// the load pass read last, the likeliest still in L2: H200, f32 rms_norm 128x524288 213 -> 207 us,
// rms_norm 2.4 % faster over six shapes, layer_norm level (+-2 %); bit-identical.
// kGroups (session 41): per-example parameters (vmap, groups > 1), the row's scale / bias found
// once a row (row / rows_per_group); before, these rows took forward_block / forward_uncached,
// which ran the vmap benchmark's forwards at 0.3-0.6 of the copy bandwidth.
template <class T, int kPack, bool kRms, bool kSplit = false, bool kFromL2 = false, bool kGroups = false>
__device__ __forceinline__ void forward_block_lean_body(const ForwardArgs& a, float2* scratch,
                                                        float2 (*parts)[32]) {
  constexpr int kWriteChunk = sizeof(T) == 4 ? 2 : 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* cache = reinterpret_cast<T*>(smem_raw);
  const Shape& s = a.shape;
  const RowPart part = row_part<kSplit>(static_cast<int>(s.cols / kPack));
  const int npacks = part.count;  // (shared memory bounds it)
  const int64_t first = int64_t{part.first} * kPack;
  const auto [inv_cols, eps, x_row0, y_row0, scale_all, bias_all] = lean_setup<T>(a);
  const T* x = x_row0 + first;
  T* y = y_row0 + first;
  const T* scale0 = scale_all + first;
  const T* bias0 = kRms ? nullptr : bias_all + first;
  int parity = 0;
  for (int64_t row = kSplit ? part.slot0 : blockIdx.x; row < s.rows; row += kSplit ? part.slot_step : gridDim.x) {
    const T* xr = x + row * s.cols;
    const float shift = kRms ? 0.0f : to_acc(x_row0[row * s.cols]);
    float sum = 0.0f, sq = 0.0f, unused = 0.0f;
    lean_load_pass<T, kPack, kRms, !kFromL2>(xr, cache, npacks, shift, sum, sq);
    if constexpr (kSplit) split_row_sums<kSplit>(sum, sq, parts, parity);
    else block_sum2_lean(sum, sq, scratch);
    parity ^= 1;
    const float mean_rel = kRms ? 0.0f : sum * inv_cols;
    float var;
    // Untrusted (a uniform branch: every thread holds the same sums): the variance around the
    // mean from the cached row, an extra shared-memory pass and block sum.
    if (!shifted_variance(mean_rel, sq * inv_cols, &var) && !kRms) {
      sq = recentred_squares<T, kPack>(kFromL2 ? xr : cache, npacks, shift, mean_rel);
      if constexpr (kSplit) split_row_sums<kSplit>(sq, unused, parts, parity);
      else block_sum2_lean(sq, unused, scratch);
      parity ^= 1;
      var = sq * inv_cols;
    }
    const float rstd = rsqrtf(var + eps);
    const float c = kRms ? 0.0f : -mean_rel * rstd;
    T* yr = y + row * s.cols;
    const int64_t group_offset = kGroups ? row / s.rows_per_group * s.cols : 0;
    const T* scale = scale0 + group_offset;
    const T* bias = kRms ? nullptr : bias0 + group_offset;
    constexpr bool kReverse = kFromL2;
    const int write_step = kWriteChunk * blockDim.x;
    const int last_p0 = threadIdx.x + (npacks > 0 ? (npacks - 1) / write_step * write_step : 0);
    for (int p0 = kReverse ? last_p0 : threadIdx.x; kReverse ? p0 >= 0 : p0 < npacks;
         p0 += kReverse ? -write_step : write_step) {
      Pack<T, kPack> sp[kWriteChunk], bp[kWriteChunk], xq[kWriteChunk];
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < npacks) {
          if constexpr (kFromL2) xq[k] = load_pack<T, kPack>(xr + p * kPack);
          sp[k] = load_pack<T, kPack>(scale + p * kPack);
          if constexpr (!kRms) bp[k] = load_pack<T, kPack>(bias + p * kPack);
        }
      }
#pragma unroll
      for (int k = 0; k < kWriteChunk; ++k) {
        const int p = p0 + k * blockDim.x;
        if (p < npacks) {
          float f[kPack], sf[kPack], bf[kPack], out[kPack];
          unpack_floats<T, kPack>(kFromL2 ? xq[k] : load_pack<T, kPack>(cache + p * kPack), f);
          unpack_floats<T, kPack>(sp[k], sf);
          if constexpr (!kRms) unpack_floats<T, kPack>(bp[k], bf);
          lean_outputs<kPack, kRms>(f, sf, bf, shift, rstd, c, out);
          store_pack(yr + p * kPack, pack_floats<T, kPack>(out));
        }
      }
    }
    if (threadIdx.x == 0 && part.first == 0) {
      if (!kRms && a.mean) static_cast<float*>(a.mean)[row] = shift + mean_rel;
      static_cast<float*>(a.rstd)[row] = rstd;
    }
  }
  leave_cluster<kSplit>();
}

template <class T, int kPack, bool kSplit = false, bool kFromL2 = false, bool kGroups = false>
__device__ __forceinline__ void forward_block_lean_kernel_body(const ForwardArgs& a) {
  static_assert(sizeof(T) <= 4 && (kPack * sizeof(T) == 16 || kPack == 1),
                "16-byte packs of float / 16-bit types, or single elements (session 55)");
  __shared__ float2 scratch[32];  // (one array for both bodies: 256 bytes, as forward_block)
  __shared__ float2 parts[kSplit ? 2 : 1][32];  // (split rows only)
  if (a.shape.rms) forward_block_lean_body<T, kPack, true, kSplit, kFromL2, kGroups>(a, scratch, parts);
  else forward_block_lean_body<T, kPack, false, kSplit, kFromL2, kGroups>(a, scratch, parts);
}

template <class T, int kPack, bool kSplit = false, bool kFromL2 = false, bool kGroups = false>
__global__ void __launch_bounds__(1024) forward_block_lean(ForwardArgs a) {
  cuda::enter_kernel();
  forward_block_lean_kernel_body<T, kPack, kSplit, kFromL2, kGroups>(a);
}

// Session 6: the same kernel for <= 256 threads, capped at 48 registers. ptxas gives
// forward_block_lean 50 registers for 16-bit types (sm_90), which the SM allocates as 56: 4 blocks
// of 256 threads (8192 columns) an SM, 9 of 128 (4096). At 48: 5 blocks of 256 (80 KB of row loads
// in flight an SM instead of 64) and 10 of 128. H100, session 6: bf16 8192x8192 layer_norm
// 99.0 -> 94.8 us (0.898 -> 0.938 of copy), 16384x4096 94.3 -> 93.3.
template <class T, int kPack>
__global__ void __launch_bounds__(256, 5) forward_block_lean_256(ForwardArgs a) {
  cuda::enter_kernel();
  forward_block_lean_kernel_body<T, kPack>(a);
}

}  // namespace jaxops::layer_norm
