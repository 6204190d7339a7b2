// Device helpers shared by every CUDA family: element conversions, 16-byte packs, NaN-aware
// max, warp/block reductions, dtype dispatch and cached device properties.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/device_info.h"
#include "common/dtype.h"

namespace jaxops::cuda {

template <class T> struct acc { using type = float; };
template <> struct acc<double> { using type = double; };
template <class T> using acc_t = typename acc<T>::type;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }

template <class T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }

// N elements moved as one aligned access (16 bytes for the widest pack).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
// Global stores go through an unsigned vector and __stwb: a struct copy (or even a plain
// `*(uint4*)p = w`) is split by nvcc into N scalar stores wherever a scalar tail path writes the
// same addresses (session-3 PTX: softmax's cached kernels stored bf16 packs as 8 x st.global.u16),
// which makes 16-bit kernels LSU-bound far below the DRAM bandwidth. __stwb is st.global: shared
// (and distributed shared) memory keeps the plain copy; __isGlobal folds where the space is known.
template <class T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& pk) {
  constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  if constexpr (kBytes == 16 || kBytes == 8 || kBytes == 4) {
    if (__isGlobal(p)) {
      if constexpr (kBytes == 16) {
        uint4 w;
        memcpy(&w, &pk, 16);
        __stwb(reinterpret_cast<uint4*>(p), w);
      } else if constexpr (kBytes == 8) {
        uint2 w;
        memcpy(&w, &pk, 8);
        __stwb(reinterpret_cast<uint2*>(p), w);
      } else {
        unsigned int w;
        memcpy(&w, &pk, 4);
        __stwb(reinterpret_cast<unsigned int*>(p), w);
      }
      return;
    }
  }
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

// Largest pack (elements per access, up to 16 bytes) that divides `cols` and the pointers' alignment.
template <class T>
inline int pack_size_for(int64_t cols, const void* const* ptrs, int nptrs) {
  int pack = 16 / static_cast<int>(sizeof(T));
  while (pack > 1) {
    bool ok = cols % pack == 0;
    for (int i = 0; i < nptrs && ok; ++i)
      ok = reinterpret_cast<uintptr_t>(ptrs[i]) % (pack * sizeof(T)) == 0;
    if (ok) break;
    pack /= 2;
  }
  return pack;
}

// max that propagates NaN, like jnp.max (fmaxf would drop it).
template <class A>
__device__ __forceinline__ A nan_max(A a, A b) {
  return (a != a || a > b) ? a : b;
}

struct SumOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
  template <class A> __device__ __forceinline__ static A identity() { return A(0); }
};
struct MaxOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return nan_max(a, b); }
  template <class A> __device__ __forceinline__ static A identity() { return -A(INFINITY); }
};

// __shfl_xor_sync for any trivially copyable value (a float, or a struct of partial statistics),
// moved as 32-bit words.
template <class S>
__device__ __forceinline__ S shfl_xor(const S& s, int offset, int width = 32) {
  if constexpr (std::is_arithmetic_v<S>) {
    return __shfl_xor_sync(0xffffffffu, s, offset, width);
  } else {
    constexpr int kWords = (sizeof(S) + 3) / 4;
    int w[kWords] = {};
    memcpy(w, &s, sizeof(S));
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = __shfl_xor_sync(0xffffffffu, w[i], offset, width);
    S out;
    memcpy(&out, w, sizeof(S));
    return out;
  }
}

// Reduction over groups of `width` consecutive lanes (width a power of two up to 32).
template <class Op, int width = 32, class A>
__device__ __forceinline__ A warp_reduce(A v, Op op = Op{}) {
#pragma unroll
  for (int offset = width / 2; offset > 0; offset /= 2) v = op(v, shfl_xor(v, offset, width));
  return v;
}

// Block-wide reduction; every thread gets the result. `scratch` holds 33 values.
template <class Op, class A>
__device__ __forceinline__ A block_reduce(A v, A* scratch, Op op = Op{}) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  v = warp_reduce<Op>(v, op);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    A w = lane < nwarps ? scratch[lane] : Op::template identity<A>();
    w = warp_reduce<Op>(w, op);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  return scratch[32];
}

}  // namespace jaxops::cuda

// Runs the statement with `T` bound to the CUDA element type of a jaxops::Dtype.
#define JAXOPS_DISPATCH_FLOAT(dtype, T, ...)                 \
  switch (dtype) {                                            \
    case ::jaxops::Dtype::kF32: { using T = float; __VA_ARGS__; break; }          \
    case ::jaxops::Dtype::kF64: { using T = double; __VA_ARGS__; break; }         \
    case ::jaxops::Dtype::kBF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    case ::jaxops::Dtype::kF16: { using T = __half; __VA_ARGS__; break; }         \
    default: return cudaErrorInvalidValue;                    \
  }
