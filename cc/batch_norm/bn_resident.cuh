// Pieces shared by the one-kernel training forwards of batch_norm: bn_resident.cu (x wholly in
// shared memory) and bn_hybrid.cu (a slice of x in shared memory, the rest streamed). Both run
// one block of kThreads per SM as a cooperative grid.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "batch_norm/bn_math.h"
#include "batch_norm/bn_moments.cuh"
#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"

namespace jaxops::batch_norm::resident {

using cuda::from_acc;
using cuda::to_acc;

constexpr int kThreads = 1024;  // one block per SM: its shared memory holds the slice
constexpr int kWarps = kThreads / 32;
constexpr int kLoadUnroll = 4;  // 16-byte packs a thread loads before it stores them: 64 KB in flight per SM
constexpr int kMaxChannels = kThreads;

using FMoments = batch_norm::Moments<float>;  // a block's partial of one channel (bn_moments.cuh)

// The shared-memory layout: C coefficient records, the reduction scratch, then the slice.
struct Smem {
  float4* coef;  // {shift, a, b, unused} per channel
  FMoments* red;  // kThreads entries: thread (j, c) at j * C + c
  unsigned char* data;
};

__host__ __device__ constexpr size_t smem_head(int64_t C) {
  return static_cast<size_t>(C) * sizeof(float4) + kThreads * sizeof(FMoments);
}

__device__ __forceinline__ Smem smem_layout(int64_t C) {
  extern __shared__ __align__(16) unsigned char bn_res_smem[];
  Smem s;
  s.coef = reinterpret_cast<float4*>(bn_res_smem);
  s.red = reinterpret_cast<FMoments*>(bn_res_smem + C * sizeof(float4));
  s.data = bn_res_smem + smem_head(C);
  return s;
}

// Folds red[j * C + c] over j < lanes (a power of two) into red[c], in a fixed tree order.
// Every thread of the block must call it (it synchronises).
template <class Fold>
__device__ __forceinline__ void fold_lanes(FMoments* red, int j, int c, int C, int lanes, Fold fold) {
  for (int s = lanes / 2; s > 0; s /= 2) {
    __syncthreads();
    if (j < s) fold(red[j * C + c], red[(j + s) * C + c]);
  }
  __syncthreads();
}

// Copies the n elements at src into shared memory: 16-byte packs, kLoadUnroll of them in flight
// per thread, then the (last block's) tail element by element.
template <class T, int P>
__device__ __forceinline__ void load_slice(const T* __restrict__ src, T* __restrict__ dst, int n) {
  const int packs = n / P;
  for (int p0 = threadIdx.x; p0 < packs; p0 += kThreads * kLoadUnroll) {
    uint4 w[kLoadUnroll];
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int p = p0 + u * kThreads;
      if (p < packs) w[u] = __ldg(reinterpret_cast<const uint4*>(src) + p);
    }
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int p = p0 + u * kThreads;
      if (p < packs) reinterpret_cast<uint4*>(dst)[p] = w[u];
    }
  }
  for (int i = packs * P + threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
}

// v = act((v - shift) * a + b (+ r)) in place, and the predicate bits (bit k: value k is
// positive; 0 for k >= valid, the values past the end of the array).
template <class T, int P>
__device__ __forceinline__ uint32_t normalize_pack(T (&v)[P], const T (&r)[P], bool with_res, const float (&sh)[P],
                                                   const float (&a)[P], const float (&b)[P], int valid, bool relu) {
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    float z = (to_acc(v[k]) - sh[k]) * a[k] + b[k];  // the streaming apply's formula (bn_elementwise.cu)
    if (with_res) z += to_acc(r[k]);
    if (relu) {
      const bool pos = z > 0.f && k < valid;
      bits |= static_cast<uint32_t>(pos) << k;
      if (!(z > 0.f || z != z)) z = 0.f;  // NaN propagates like jax.nn.relu
    }
    v[k] = from_acc<T>(z);
  }
  return bits;
}

// y = act((x - shift) * a + b (+ res)) for the lane's P elements at local index i0 (< n), and
// the predicate bits (bit k: element i0 + k is positive; 0 past the end).
template <class T, int P>
__device__ __forceinline__ uint32_t apply_pack(const T* __restrict__ xs, const T* __restrict__ res,
                                               T* __restrict__ y, const float (&sh)[P], const float (&a)[P],
                                               const float (&b)[P], int i0, int n, bool relu) {
  const bool full = i0 + P <= n;
  T v[P], r[P];
  if (full) {
    const uint4 w = *reinterpret_cast<const uint4*>(xs + i0);  // one 16-byte shared load
    memcpy(&v, &w, sizeof(v));
    if (res) cuda::load_vec<T, P>(res + i0, r);
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      v[k] = i0 + k < n ? xs[i0 + k] : from_acc<T>(0.f);
      r[k] = res && i0 + k < n ? res[i0 + k] : from_acc<T>(0.f);
    }
  }
  const uint32_t bits = normalize_pack<T, P>(v, r, res != nullptr, sh, a, b, n - i0, relu);
  if (full) {
    cuda::store_vec<T, P>(y + i0, v);
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (i0 + k < n) y[i0 + k] = v[k];
  }
  return bits;
}

// After the grid barrier: every block merges all blocks' partials (ws: (blocks, 3, C) of shifted
// sum, shifted mean, M2) the same way, so every block gets bit-identical coefficients: thread j
// folds blocks j, j + lanes, ... in order, then the fixed tree over j. count(bk) is block bk's row
// count. Writes the coefficients into sm.coef and, from block 0, mean and var.
template <class T, class Count>
__device__ __forceinline__ void merge_partials(const T* __restrict__ x, const float* ws, const float* __restrict__ scale,
                                               const float* __restrict__ bias, float* __restrict__ mean_out,
                                               float* __restrict__ var_out, const Smem& sm, int C, int lanes,
                                               float eps, Count count) {
  const int j = threadIdx.x / C, c = threadIdx.x - j * C;
  const bool active = j < lanes;
  const float piv = active ? pivot_of(to_acc(x[c])) : 0.f;
  FMoments v{0.f, 0.f, 0.f, 0.f};
  if (active)
    for (int64_t bk = j; bk < gridDim.x; bk += lanes) {
      const float* p = ws + bk * 3 * int64_t(C) + c;  // written in this launch: not through __ldg
      v.merge(FMoments{count(bk), __ldcg(p), __ldcg(p + C), __ldcg(p + 2 * C)});
    }
  __syncthreads();
  sm.red[threadIdx.x] = v;
  fold_lanes(sm.red, j, c, C, lanes, [](FMoments& d, const FMoments& o) { d.merge(o); });
  if (active && j == 0) {
    const FMoments t = sm.red[c];
    const float mean = t.mean(piv), var = t.var();
    if (blockIdx.x == 0) {
      mean_out[c] = mean;
      var_out[c] = var;
    }
    const Coef<float> q = forward_coef<float>(scale[c], bias[c], mean, var, eps);
    sm.coef[c] = make_float4(q.shift, q.a, q.b, 0.f);
  }
  __syncthreads();
}

// Whether p is 16-byte aligned. Unlike bn_elementwise.cu's aligned16 this ignores
// JAXOPS_BN_ELEMENT_LOADS: the one-kernel forwards have no element-load twin (the alignment test
// runs with JAXOPS_BN_RESIDENT=0).
inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Launches a grid of `blocks` blocks of kThreads, one an SM, as a cooperative launch: it fails
// rather than start a grid whose blocks cannot all be resident at once (the grid barrier would
// wait forever). Host side.
inline cudaError_t launch_cooperative(const void* kernel, int64_t blocks, size_t smem, cudaStream_t stream,
                                      void** args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelExC(&config, kernel, args);
}

}  // namespace jaxops::batch_norm::resident
