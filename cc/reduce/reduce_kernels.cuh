// CUDA kernels of the reduction family, templated on the operator (reduce_ops.h) and the
// element type; reduce_launch.cuh picks one by shape.
//
// Every op runs on an (outer, reduced, inner) view:
//   inner == 1 (row reduction):  8-32 lanes per row (short rows), block per row, or a grid split of
//                                each row into `splits` chunks whose partial states go to the
//                                workspace and are merged by merge_kernel in a fixed order;
//   inner > 1 (column reduction): a block tile of TX threads x P columns (16-byte loads across
//                                the row) by TY threads down the reduced axis; the reduced axis
//                                may be split into chunks merged the same way.
// No atomics: each output is a fixed tree over a fixed partition, so results are bit-identical
// from call to call on a given device and launch plan (the plan comes from the Python side).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "reduce/reduce_fast16.cuh"
#include "reduce/reduce_ops.h"
#include "reduce/reduce_plan.cuh"
#include "reduce/reduce_spans.cuh"

namespace jaxops::reduce::kernels {

template <class Op>
__device__ __forceinline__ typename Op::State warp_merge(typename Op::State s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) s = Op::merge(s, cuda::shfl_xor(s, offset));
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

// Lanes that share one output in the block folds below: min(threads / outputs, 32). Both are
// powers of two, so either every warp holds 32 / G whole outputs (G < 32) or one (G == 32).
__device__ __forceinline__ int fold_lanes(int outputs, int threads) {
  const int g = threads / outputs;
  return g < 32 ? g : 32;
}

// One-barrier replacement of a log2(rows)-level shared-memory tree: smem holds `rows` x
// `outputs` states ([row][output]); output `out` is folded by G lanes (lane g takes rows g,
// g + G, ... in order), then an xor-shuffle tree over the G lanes. Fixed order: deterministic.
// Warp-uniform by fold_lanes (an inactive warp has every lane's out >= outputs). Valid in g == 0.
template <class Op>
__device__ __forceinline__ typename Op::State fold_rows(const typename Op::State* smem, int outputs, int rows,
                                                        int out, int g, int G) {
  auto a = Op::identity();
  if (out < outputs) {
    for (int k = g; k < rows; k += G) a = Op::merge(a, smem[k * outputs + out]);
    for (int offset = G / 2; offset > 0; offset /= 2) a = Op::merge(a, cuda::shfl_xor(a, offset));
  }
  return a;
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

// inner == 1, short rows: `group` lanes per row (a power of two, 2..32, warp_row_group), 32 / group
// rows per warp. Short rows get fewer lanes so each lane still has ~warp_lane_packs<Op, T, P>() packs
// (a 1024-long bf16 row is 128 packs: 16 lanes x 8, two rows per warp; a 128-long one 2 lanes x
// 8, sixteen rows per warp). A warp load then covers 16 rows x 32 B: whole sectors, all used.
// Sessions 1-8 kept >= 8 lanes for 128-byte segments a row, which left 128- and 256-column rows
// with 1-4 packs a lane (session 9, H100, bf16 524288x128 / 262144x256 with 8 -> 2 lanes: sum
// 61.6 -> 50.7 / 56.2 -> 45.9 us, max 63.7 -> 50.4 / 51.2 -> 46.2, logsumexp 116.5 -> 49.8 /
// 87.8 -> 47.3, argmax 119.1 -> 51.3 / 87.7 -> 48.0; float32 unchanged within 1 %; 4 lanes sat
// in between). Group merges use xor shuffles with offsets < group, which stay inside the
// aligned group of lanes.
template <class Op, class T, int P, bool V, bool kPeel = false>
__global__ void __launch_bounds__(256, min_blocks<Op, T, P, V>(256))
    row_warp_kernel(const T* __restrict__ x, void* y, int64_t rows, int64_t n, int group) {
  cuda::enter_kernel();
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int per_warp = 32 / group;
  for (int64_t row0 = (static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32) * per_warp; row0 < rows;
       row0 += static_cast<int64_t>(gridDim.x) * warps * per_warp) {  // warp-uniform loop
    const int64_t row = row0 + lane / group;
    auto s = Op::identity();
    if (row < rows)
      add_row_span<Op, T, P, V, int, warp_unroll<Op, T, P>(), false, kPeel>(s, x + row * n, row * n, 0,
                                                                            static_cast<int>(n), lane % group, group);
    for (int offset = group / 2; offset > 0; offset /= 2) s = Op::merge(s, cuda::shfl_xor(s, offset));
    if (lane % group == 0 && row < rows) emit<Op, T>(y, nullptr, row, s, n);
  }
}

// inner == 1: block b = row * splits + split reduces x[row, split*chunk : (split+1)*chunk].
// With ws it writes the partial state ws[b] (merged by merge_kernel); otherwise (splits == 1)
// the finished y[row].
// Idx: the type of offsets inside a row; int for rows that are not whole packs and shorter than
// kNarrowRow (launch_rows), which frees the registers of 64-bit offsets.
template <class Op, class T, int P, bool V, bool kRing = false, bool kPeel = false, class Idx = int64_t>
__global__ void __launch_bounds__(max_row_block_threads<T>(), min_blocks<Op, T, P, V>(max_row_block_threads<T>()))
    row_block_kernel(const T* __restrict__ x, void* y, typename Op::State* ws, int64_t rows, int64_t n,
                     int64_t splits, int64_t chunk) {
  cuda::enter_kernel();
  extern __shared__ __align__(16) unsigned char smem_raw[];  // kRing: the ring (launch_row_kernel)
  uint4* const ring = kRing ? reinterpret_cast<uint4*>(smem_raw) + threadIdx.x : nullptr;
  for (int64_t b = blockIdx.x; b < rows * splits; b += gridDim.x) {
    const int64_t row = b / splits, split = b % splits;
    const int64_t begin = split * chunk;
    const int64_t end = begin + chunk < n ? begin + chunk : n;
    auto s = Op::identity();
    if (begin < end)
      add_row_span<Op, T, P, V, Idx, unroll_for<Op, T, P>(), kRing, kPeel>(
          s, x + row * n, row * n, static_cast<Idx>(begin), static_cast<Idx>(end), threadIdx.x, blockDim.x, ring);
    s = block_merge<Op>(s);
    if (threadIdx.x == 0) emit<Op, T>(y, ws, b, s, n);
  }
}

// inner > 1. Block (TX, TY); block b = (o * splits + split) * tiles + tile covers columns
// [tile*TX*P, ...) of rows [split*chunk, ...) of slab o. Thread (tx, ty) keeps P column states
// over rows ty, ty + TY, ...; the TY states per column are folded through shared memory.
// With ws (splits > 1) it writes partial states ws[o, split, c], merged by merge_kernel.
template <class Op, class T, int P, bool V>
__global__ void __launch_bounds__(256, min_blocks<Op, T, P, V>(256))
    column_kernel(const T* __restrict__ x, void* y, typename Op::State* ws, int64_t outer, int64_t n,
                  int64_t inner, int64_t splits, int64_t chunk, int64_t tiles) {
  cuda::enter_kernel();
  using S = typename Op::State;
  extern __shared__ __align__(16) unsigned char smem_raw[];
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
    if constexpr (arg16_path<Op, T, P>()) {  // packed bf16/f16 loop (reduce_fast16.cuh)
      const int64_t r0 = begin + ty;
      if (col < inner && r0 < end)
        arg16_stream<Op, T, unroll_for<Op, T, P>(), V, int64_t>(s, x + (o * n + r0) * inner + col,
                                                             (end - r0 + TY - 1) / TY, static_cast<int64_t>(TY) * inner,
                                                             r0, TY, 0);
    } else if constexpr (ext16_path<Op, T, P>()) {
      const int64_t r0 = begin + ty;
      if (col < inner && r0 < end)
        ext16_stream<Op, T, unroll_for<Op, T, P>(), V, int64_t>(
            s, x + (o * n + r0) * inner + col, (end - r0 + TY - 1) / TY, static_cast<int64_t>(TY) * inner);
    } else if (col < inner) {
      const T* xo = x + o * n * inner + col;
      constexpr int U = unroll_for<Op, T, P>();  // rows in flight per thread (16 B each when P > 1)
      int64_t r = begin + ty;
      for (; r + (U - 1) * TY < end; r += U * TY) {
        Pack<T, P> pk[U];
#pragma unroll
        for (int u = 0; u < U; ++u) pk[u] = load_pack_v<T, P, V>(xo + (r + u * TY) * inner);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < P; ++j) Op::add(s[j], to_acc(pk[u].v[j]), r + u * TY);
      }
      for (; r < end; r += TY) {
        const Pack<T, P> pk = load_pack_v<T, P, V>(xo + r * inner);
#pragma unroll
        for (int j = 0; j < P; ++j) Op::add(s[j], to_acc(pk.v[j]), r);
      }
    }
    // The TY states of each of the O = TX * P columns: one barrier, then G lanes per column
    // (fold_rows) instead of a log2(TY)-level tree with a barrier per level.
    const int O = TX * P, t = ty * TX + tx, G = fold_lanes(O, TX * TY), out = t / G, g = t % G;
#pragma unroll
    for (int j = 0; j < P; ++j) smem[ty * O + tx * P + j] = s[j];
    __syncthreads();
    const S r = fold_rows<Op>(smem, O, TY, out, g, G);
    const int64_t c = tile * O + out;  // this lane's column when g == 0 and out < O
    if (g == 0 && out < O && c < inner) emit<Op, T>(y, ws, (o * splits + split) * inner + c, r, n);
    __syncthreads();  // smem is rewritten by the next grid-stride iteration
  }
}

// Merges ws[o, 0..splits, i] into y[o, i] in a fixed order: thread (tx, ty) folds splits
// ty, ty + TY, ... of column tile*TX + tx, then fold_rows over ty. The second kernel of every
// split launch: a fused last-block merge (session 5: arrival counters, atomicInc,
// __threadfence) measured 1-4 µs slower on columns and equal on rows on the H100, and its
// shared counters would be unsafe for concurrent launches on two streams, so it was removed.
template <class Op, class T>
__global__ void merge_kernel(const typename Op::State* __restrict__ ws, void* y, int64_t outer,
                             int64_t splits, int64_t inner, int64_t tiles, int64_t count) {
  cuda::enter_kernel();
  using S = typename Op::State;
  extern __shared__ __align__(16) unsigned char smem_raw[];
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
    const int t = ty * TX + tx, G = fold_lanes(TX, TX * TY), out = t / G;
    const S r = fold_rows<Op>(smem, TX, TY, out, t % G, G);
    const int64_t c = (b % tiles) * TX + out;
    if (t % G == 0 && out < TX && c < inner) emit<Op, T>(y, nullptr, o * inner + c, r, count);
    __syncthreads();
  }
}

}  // namespace jaxops::reduce::kernels
