// Lean per-pack arithmetic for the softmax forward kernels. The 16-bit kernels are issue-bound
// (session-5 Nsight: ~29-31 instructions an element against Triton's ~27), so each helper is
// written for the fewest SASS instructions an element:
//  - max: one FMNMX.NAN (max.NaN.f32) an element instead of compare + NaN test + select;
//    bf16/f16 packs reduce pairs first with one HMNMX2.NAN per two elements;
//  - exp: one MUFU.EX2 on an argument already scaled by log2(e) (ex2.approx.ftz: no denormal
//    fix-up, which __expf spends three instructions on); 16-bit inputs fold the scale and the
//    max into one FFMA, float32 keeps (v - max) * log2(e) for float32 accuracy at large |max|;
//  - bf16 <-> float: one shift or mask an element in, one F2FP per pair out.
// float64 keeps the exact library functions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda_util.cuh"

namespace jaxops::softmax {

using cuda::acc_t;
using cuda::Pack;

constexpr float kLog2e = 1.4426950408889634f;

// NaN-propagating max (jnp.max semantics), one instruction for float.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ double max_nan(double a, double b) { return (a != a || a > b) ? a : b; }

// 2^v, flushing results below 2^-126 to zero (they vanish against a row sum >= 1 anyway).
__device__ __forceinline__ float exp2_ftz(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// e^v: ex2 of the scaled argument (float), the library exp (double).
__device__ __forceinline__ float exp_of(float v) { return exp2_ftz(v * kLog2e); }
__device__ __forceinline__ double exp_of(double v) { return exp(v); }

// exp(v - max) for one row. 16-bit inputs carry < 9 significant bits, so fma(v, log2e, -max*log2e)
// (one rounding of max*log2e more) is far below their precision; float32 subtracts first.
template <class T>
struct ExpShift {
  using A = acc_t<T>;
  A max, shifted_max;
  __device__ __forceinline__ explicit ExpShift(A m) : max(m), shifted_max(A(0)) {
    if constexpr (sizeof(T) == 2) shifted_max = -m * kLog2e;
  }
  __device__ __forceinline__ A operator()(A v) const {
    if constexpr (sizeof(T) == 2) {
      return exp2_ftz(fmaf(v, kLog2e, shifted_max));
    } else {
      return exp_of(v - max);
    }
  }
};

// A part of a row's softmax statistics, as the online softmax keeps them: its max and the sum of
// exp(v - max) over its values. Parts combine into the whole row's in one step (MaxSumOp), so a
// row's threads, blocks and cluster meet once instead of twice (max first, then the sum).
template <class A>
struct MaxSum {
  A max, sum;
};

// The shift a part's sum is taken at: its max, or 0 where the max is -inf (the part holds only
// -inf), so such a part sums to 0 instead of NaN (-inf - -inf). +inf and NaN still make the
// sum NaN, as in jax.nn.
template <class A>
__device__ __forceinline__ A sum_shift(A max) {
  return max == -A(INFINITY) ? A(0) : max;
}

struct MaxSumOp {
  template <class S>
  __device__ __forceinline__ S operator()(const S& a, const S& b) const {
    const auto m = max_nan(a.max, b.max);
    const auto shift = sum_shift(m);
    return {m, a.sum * exp_of(a.max - shift) + b.sum * exp_of(b.max - shift)};
  }
  template <class S>
  __device__ __forceinline__ static S identity() {
    using A = decltype(S::max);
    return {-A(INFINITY), A(0)};
  }
};

// Pack -> P accumulator values.
template <class T, int P>
__device__ __forceinline__ void unpack(const Pack<T, P>& pk, acc_t<T> (&out)[P]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && P % 2 == 0) {
    // A bf16 is the top half of its float: low element = word << 16, high = word & 0xffff0000.
    uint32_t w[P / 2];
    memcpy(w, &pk, sizeof(w));
#pragma unroll
    for (int j = 0; j < P / 2; ++j) {
      out[2 * j] = __uint_as_float(w[j] << 16);
      out[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int p = 0; p < P; ++p) out[p] = cuda::to_acc(pk.v[p]);
  }
}

// P accumulator values -> pack, two elements per conversion for 16-bit types.
template <class T, int P>
__device__ __forceinline__ Pack<T, P> repack(const acc_t<T> (&in)[P]) {
  Pack<T, P> pk;
  if constexpr (std::is_same_v<T, __nv_bfloat16> && P % 2 == 0) {
#pragma unroll
    for (int j = 0; j < P / 2; ++j) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(in[2 * j], in[2 * j + 1]);
      memcpy(&pk.v[2 * j], &h, sizeof(h));
    }
  } else if constexpr (std::is_same_v<T, __half> && P % 2 == 0) {
#pragma unroll
    for (int j = 0; j < P / 2; ++j) {
      const __half2 h = __floats2half2_rn(in[2 * j], in[2 * j + 1]);
      memcpy(&pk.v[2 * j], &h, sizeof(h));
    }
  } else {
#pragma unroll
    for (int p = 0; p < P; ++p) pk.v[p] = cuda::from_acc<T>(in[p]);
  }
  return pk;
}

// NaN-propagating max of a pack folded into m: 16-bit pairs meet in packed HMNMX2 first (exact:
// the max of 16-bit values is one of them), then one conversion per half and two float maxes.
template <class T, int P>
__device__ __forceinline__ acc_t<T> pack_max(acc_t<T> m, const Pack<T, P>& pk) {
  if constexpr ((std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) && P >= 4 && P % 4 == 0) {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    T2 h[P / 2];
    memcpy(h, &pk, sizeof(h));
#pragma unroll
    for (int step = 1; step < P / 2; step *= 2) {
#pragma unroll
      for (int j = 0; j + step < P / 2; j += 2 * step) h[j] = __hmax2_nan(h[j], h[j + step]);
    }
    return max_nan(m, max_nan(__low2float(h[0]), __high2float(h[0])));
  } else {
    acc_t<T> v[P];
    unpack<T, P>(pk, v);
#pragma unroll
    for (int p = 0; p < P; ++p) m = max_nan(m, v[p]);
    return m;
  }
}

// Asks L2 to fetch `bytes` (a multiple of 16) from `src` (16-byte aligned) in 4 KB bulk requests
// (Hopper's cp.async.bulk.prefetch: one instruction per chunk, no registers or shared memory
// held, nothing to wait for), issued by lane 0 of each warp in turn: the instruction takes its
// operands in uniform registers, so lanes with different addresses would be serialized anyway.
// A hint only: older architectures skip it. The lean backward uses it, at one block per SM, to
// fetch its next row while it reduces the current one, when DRAM would otherwise idle (all blocks
// of the grid reduce in step). blockDim.x must be a multiple of 32.
__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr unsigned kChunk = 4096;
  if (threadIdx.x % 32 != 0) return;
  const char* base = static_cast<const char*>(src);
  for (unsigned at = threadIdx.x / 32 * kChunk; at < bytes; at += blockDim.x / 32 * kChunk) {
    const unsigned n = bytes - at < kChunk ? bytes - at : kChunk;
    asm volatile(
        "{\n\t.reg .u64 g;\n\tcvta.to.global.u64 g, %0;\n\tcp.async.bulk.prefetch.L2.global [g], %1;\n\t}"
        :
        : "l"(base + at), "r"(n)
        : "memory");
  }
#else
  (void)src;
  (void)bytes;
#endif
}

}  // namespace jaxops::softmax
