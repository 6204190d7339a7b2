// CUDA kernels of the reduction family, templated on the operator (reduce_ops.h) and the
// element type, plus the launcher that picks one by shape. Included by one .cu per operator
// group so the instantiations compile in parallel.
//
// Every op runs on an (outer, reduced, inner) view:
//   inner == 1 (row reduction):  warp per row (short rows), block per row, or a grid split of
//                                each row into `splits` chunks whose partial states go to the
//                                workspace and are merged by merge_kernel in a fixed order;
//   inner > 1 (column reduction): a block tile of TX threads x P columns (16-byte loads across
//                                the row) by TY threads down the reduced axis; the reduced axis
//                                may be split into chunks merged the same way.
// No atomics: each output is a fixed tree over a fixed partition, so results are bit-identical
// from call to call on a given device and launch plan (the plan comes from the Python side).
#pragma once
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "common/cuda_util.cuh"
#include "reduce/reduce_cuda.h"
#include "reduce/reduce_ops.h"

namespace jaxops::reduce::kernels {

using cuda::acc_t;
using cuda::load_pack;
using cuda::Pack;
using cuda::to_acc;

constexpr int kUnroll = 4;           // independent 16-byte loads in flight per thread
constexpr int kWarpRowMax = 4096;    // rows up to this length get one warp each (_WARP_ROW_MAX)
constexpr int kBlockThreads = 256;   // column / merge kernels
constexpr int kMaxGrid = INT_MAX;

// Shuffles any trivially copyable State as 32-bit words.
template <class S>
__device__ __forceinline__ S shfl_xor_state(const S& s, int offset) {
  constexpr int kWords = (sizeof(S) + 3) / 4;
  int w[kWords] = {};
  memcpy(w, &s, sizeof(S));
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_xor_sync(0xffffffffu, w[i], offset);
  S out;
  memcpy(&out, w, sizeof(S));
  return out;
}

template <class Op>
__device__ __forceinline__ typename Op::State warp_merge(typename Op::State s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) s = Op::merge(s, shfl_xor_state(s, offset));
  return s;
}

// Block-wide merge (blockDim.x a multiple of 32); the result is valid in thread 0.
template <class Op>
__device__ __forceinline__ typename Op::State block_merge(typename Op::State s) {
  using S = typename Op::State;
  __shared__ S warp_states[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  s = warp_merge<Op>(s);
  if (lane == 0) warp_states[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < nwarps ? warp_states[lane] : Op::identity();
    s = warp_merge<Op>(s);
  }
  __syncthreads();  // warp_states may be reused by the next grid-stride iteration
  return s;
}

// Writes a finished result (or, with `ws`, the partial state) for output `at`.
template <class Op, class T>
__device__ __forceinline__ void emit(void* y, typename Op::State* ws, int64_t at,
                                     const typename Op::State& s, int64_t count) {
  if (ws != nullptr) {
    ws[at] = s;
  } else if constexpr (Op::kIndex) {
    static_cast<int32_t*>(y)[at] = Op::finish(s, count);
  } else {
    static_cast<T*>(y)[at] = cuda::from_acc<T>(Op::finish(s, count));
  }
}

template <class Op, class T, int P>
__device__ __forceinline__ void add_pack(typename Op::State& s, const Pack<T, P>& pk, int64_t idx) {
#pragma unroll
  for (int j = 0; j < P; ++j) Op::add(s, to_acc(pk.v[j]), idx + j);
}

// Adds x[begin, end) (begin, end and the stride multiples of P) element-wise-strided over the
// threads of a group: thread `t` of `nthreads` takes packs t, t + nthreads, ...
template <class Op, class T, int P>
__device__ __forceinline__ void add_span(typename Op::State& s, const T* x, int64_t begin, int64_t end,
                                         int t, int nthreads) {
  const int64_t stride = static_cast<int64_t>(nthreads) * P;
  int64_t c = begin + static_cast<int64_t>(t) * P;
  for (; c + (kUnroll - 1) * stride < end; c += kUnroll * stride) {
    Pack<T, P> pk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) pk[u] = load_pack<T, P>(x + c + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) add_pack<Op, T, P>(s, pk[u], c + u * stride);
  }
  for (; c < end; c += stride) add_pack<Op, T, P>(s, load_pack<T, P>(x + c), c);
}

// inner == 1, short rows: one warp per row.
template <class Op, class T, int P>
__global__ void row_warp_kernel(const T* __restrict__ x, void* y, int64_t rows, int64_t n) {
  const int warps = blockDim.x / 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32; row < rows;
       row += static_cast<int64_t>(gridDim.x) * warps) {
    auto s = Op::identity();
    add_span<Op, T, P>(s, x + row * n, 0, n, threadIdx.x % 32, 32);
    s = warp_merge<Op>(s);
    if (threadIdx.x % 32 == 0) emit<Op, T>(y, nullptr, row, s, n);
  }
}

// inner == 1: block b = row * splits + split reduces x[row, split*chunk : (split+1)*chunk].
// With ws it writes the partial state ws[b]; otherwise (splits == 1) the finished y[row].
template <class Op, class T, int P>
__global__ void row_block_kernel(const T* __restrict__ x, void* y, typename Op::State* ws, int64_t rows,
                                 int64_t n, int64_t splits, int64_t chunk) {
  for (int64_t b = blockIdx.x; b < rows * splits; b += gridDim.x) {
    const int64_t row = b / splits, split = b % splits;
    const int64_t begin = split * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    auto s = Op::identity();
    if (begin < end) add_span<Op, T, P>(s, x + row * n, begin, end, threadIdx.x, blockDim.x);
    s = block_merge<Op>(s);
    if (threadIdx.x == 0) emit<Op, T>(y, ws, b, s, n);
  }
}

// inner > 1. Block (TX, TY); block b = (o * splits + split) * tiles + tile covers columns
// [tile*TX*P, ...) of rows [split*chunk, ...) of slab o. Thread (tx, ty) keeps P column states
// over rows ty, ty + TY, ...; the TY states per column are merged by a shared-memory tree.
template <class Op, class T, int P>
__global__ void column_kernel(const T* __restrict__ x, void* y, typename Op::State* ws, int64_t outer,
                              int64_t n, int64_t inner, int64_t splits, int64_t chunk, int64_t tiles) {
  using S = typename Op::State;
  extern __shared__ unsigned char smem_raw[];
  S* smem = reinterpret_cast<S*>(smem_raw);  // [TY][TX * P]
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  for (int64_t b = blockIdx.x; b < outer * splits * tiles; b += gridDim.x) {
    const int64_t tile = b % tiles, os = b / tiles, split = os % splits, o = os / splits;
    const int64_t col = (tile * TX + tx) * P;
    const int64_t begin = split * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    S s[P];
#pragma unroll
    for (int j = 0; j < P; ++j) s[j] = Op::identity();
    if (col < inner) {
      const T* xo = x + o * n * inner + col;
      int64_t r = begin + ty;
      for (; r + (kUnroll - 1) * TY < end; r += kUnroll * TY) {
        Pack<T, P> pk[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) pk[u] = load_pack<T, P>(xo + (r + u * TY) * inner);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int j = 0; j < P; ++j) Op::add(s[j], to_acc(pk[u].v[j]), r + u * TY);
      }
      for (; r < end; r += TY) {
        const Pack<T, P> pk = load_pack<T, P>(xo + r * inner);
#pragma unroll
        for (int j = 0; j < P; ++j) Op::add(s[j], to_acc(pk.v[j]), r);
      }
    }
#pragma unroll
    for (int j = 0; j < P; ++j) smem[(ty * TX + tx) * P + j] = s[j];
    __syncthreads();
    for (int half = TY / 2; half > 0; half /= 2) {
      if (ty < half) {
#pragma unroll
        for (int j = 0; j < P; ++j) {
          S& a = smem[(ty * TX + tx) * P + j];
          a = Op::merge(a, smem[((ty + half) * TX + tx) * P + j]);
        }
      }
      __syncthreads();
    }
    if (ty == 0 && col < inner) {
#pragma unroll
      for (int j = 0; j < P; ++j)
        emit<Op, T>(y, ws, (o * splits + split) * inner + col + j, smem[tx * P + j], n);
    }
    __syncthreads();  // smem is rewritten by the next grid-stride iteration
  }
}

// Merges ws[o, 0..splits, i] into y[o, i] in a fixed order: thread (tx, ty) folds splits
// ty, ty + TY, ... of column tile*TX + tx, then a shared-memory tree over ty.
template <class Op, class T>
__global__ void merge_kernel(const typename Op::State* __restrict__ ws, void* y, int64_t outer,
                             int64_t splits, int64_t inner, int64_t tiles, int64_t count) {
  using S = typename Op::State;
  extern __shared__ unsigned char smem_raw[];
  S* smem = reinterpret_cast<S*>(smem_raw);  // [TY][TX]
  const int tx = threadIdx.x, ty = threadIdx.y, TX = blockDim.x, TY = blockDim.y;
  for (int64_t b = blockIdx.x; b < outer * tiles; b += gridDim.x) {
    const int64_t o = b / tiles, col = (b % tiles) * TX + tx;
    S s = Op::identity();
    if (col < inner) {
      const S* wc = ws + o * splits * inner + col;
      int64_t k = ty;
      for (; k + 3 * TY < splits; k += 4 * TY) {  // four independent loads in flight
        S part[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) part[u] = wc[(k + u * TY) * inner];
#pragma unroll
        for (int u = 0; u < 4; ++u) s = Op::merge(s, part[u]);
      }
      for (; k < splits; k += TY) s = Op::merge(s, wc[k * inner]);
    }
    smem[ty * TX + tx] = s;
    __syncthreads();
    for (int half = TY / 2; half > 0; half /= 2) {
      if (ty < half) smem[ty * TX + tx] = Op::merge(smem[ty * TX + tx], smem[(ty + half) * TX + tx]);
      __syncthreads();
    }
    if (ty == 0 && col < inner) emit<Op, T>(y, nullptr, o * inner + col, smem[tx], count);
    __syncthreads();
  }
}

inline unsigned grid_for(int64_t blocks) {
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

inline int pow2_at_least(int64_t v, int cap) {
  int p = 1;
  while (p < v && p < cap) p *= 2;
  return p;
}

template <class Op, class T>
cudaError_t merge_partials(const typename Op::State* ws, void* y, const Plan& p, cudaStream_t stream) {
  // Narrow column tiles (<= 8) leave >= 32 lanes per column folding splits, so few columns
  // with many splits (a tall column reduction) still merge with plenty of parallelism.
  const int TX = pow2_at_least(p.inner, 8), TY = kBlockThreads / TX;
  const int64_t tiles = (p.inner + TX - 1) / TX;
  const size_t smem = sizeof(typename Op::State) * kBlockThreads;
  merge_kernel<Op, T><<<grid_for(p.outer * tiles), dim3(TX, TY), smem, stream>>>(
      ws, y, p.outer, p.splits, p.inner, tiles, p.reduced);
  return cudaGetLastError();
}

template <class Op, class T, int P>
cudaError_t launch_rows(const T* x, void* y, typename Op::State* ws, const Plan& p, cudaStream_t stream) {
  const int64_t n = p.reduced;
  if (p.splits == 1 && n <= kWarpRowMax) {
    constexpr int kWarps = 8;
    row_warp_kernel<Op, T, P><<<grid_for((p.outer + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
        x, y, p.outer, n);
    return cudaGetLastError();
  }
  // Chunks are whole packs; chunk >= n / splits so `splits` chunks cover the row.
  int64_t chunk = (n + p.splits - 1) / p.splits;
  chunk = (chunk + P - 1) / P * P;
  const int threads = chunk >= 32768 ? 512 : 256;
  const bool split = p.splits > 1;
  row_block_kernel<Op, T, P><<<grid_for(p.outer * p.splits), threads, 0, stream>>>(
      x, y, split ? ws : nullptr, p.outer, n, p.splits, chunk);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess || !split) return err;
  return merge_partials<Op, T>(ws, y, p, stream);
}

template <class Op, class T, int P>
cudaError_t launch_columns(const T* x, void* y, typename Op::State* ws, const Plan& p, cudaStream_t stream) {
  const int TX = pow2_at_least((p.inner + P - 1) / P, 32), TY = kBlockThreads / TX;
  const int64_t tiles = (p.inner + TX * P - 1) / (TX * P);
  const int64_t chunk = (p.reduced + p.splits - 1) / p.splits;
  const size_t smem = sizeof(typename Op::State) * P * kBlockThreads;
  const bool split = p.splits > 1;
  column_kernel<Op, T, P><<<grid_for(p.outer * p.splits * tiles), dim3(TX, TY), smem, stream>>>(
      x, y, split ? ws : nullptr, p.outer, p.reduced, p.inner, p.splits, chunk, tiles);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess || !split) return err;
  return merge_partials<Op, T>(ws, y, p, stream);
}

// Picks the kernel for one (Op, T). Packs are 16 bytes when the contiguous extent and the
// base pointer allow it, otherwise single elements (no intermediate widths: fewer kernels).
template <class Op, class T>
cudaError_t launch(const Plan& p, cudaStream_t stream) {
  using S = typename Op::State;
  static_assert(sizeof(S) == 4 || sizeof(S) == 8 || sizeof(S) == 16, "state sizes match state_bytes()");
  if (p.outer * p.inner == 0) return cudaSuccess;
  constexpr int kPack = 16 / sizeof(T);
  const T* x = static_cast<const T*>(p.x);
  S* ws = static_cast<S*>(p.ws);
  const int64_t contiguous = p.inner == 1 ? p.reduced : p.inner;
  const bool wide = contiguous % kPack == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (p.inner == 1)
    return wide ? launch_rows<Op, T, kPack>(x, p.y, ws, p, stream) : launch_rows<Op, T, 1>(x, p.y, ws, p, stream);
  return wide ? launch_columns<Op, T, kPack>(x, p.y, ws, p, stream)
              : launch_columns<Op, T, 1>(x, p.y, ws, p, stream);
}

}  // namespace jaxops::reduce::kernels

// Defines `cudaError_t NAME(const Plan&, cudaStream_t)` running OP_A<A> when p.kind == KIND_A
// and OP_B<A> otherwise, where OP_A / OP_B are alias templates on the accumulator type A.
#define JAXOPS_REDUCE_LAUNCHER(NAME, KIND_A, OP_A, OP_B)                                  \
  cudaError_t NAME(const Plan& p, cudaStream_t stream) {                                 \
    JAXOPS_DISPATCH_FLOAT(p.dtype, T, {                                                   \
      using A = ::jaxops::cuda::acc_t<T>;                                                 \
      return p.kind == KIND_A ? kernels::launch<OP_A<A>, T>(p, stream)                    \
                              : kernels::launch<OP_B<A>, T>(p, stream);                   \
    });                                                                                   \
    return cudaErrorInvalidValue;                                                         \
  }
