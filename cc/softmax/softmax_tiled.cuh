// Short rows that are not whole 16-byte packs (77, 197 or 33 tokens), staged in shared memory by
// tiles of consecutive rows.
//
// The warp kernels read such rows through their aligned windows (softmax_window.cuh): a window's
// edge packs are shared with the neighbouring rows, loaded twice and written element by element,
// and most lanes hold a partial or idle pack (ncu, session 31 run 6: bf16 262144x77 forward, ~53
// instructions an element, 0.54 of the copy bandwidth). Consecutive rows are contiguous, though:
// a tile of R rows, R a multiple of the pack width P, starts on a pack boundary and is whole
// packs (but for the array's last). So a block copies its tile in by cp.async and out by aligned
// 16-byte stores, every pack once, and in between W lanes a row compute it in shared memory.
#pragma once
#include <cstdint>

#include <cuda_pipeline.h>

#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "softmax/softmax_common.cuh"
#include "softmax/softmax_window.cuh"

namespace jaxops::softmax {

constexpr int kTiledBlockThreads = 256;
constexpr int kTiledPerLane = 16;  // values a lane: rows of up to 32 * 16 = 512 columns
constexpr int64_t kTiledMaxCols = 32 * kTiledPerLane;
constexpr int kTiledStages = 2;    // tile buffers a block: one computed while the next arrives
constexpr int kTiledForwardMinBlocks = 6;
constexpr int kTiledBackwardMinBlocks = 5;

// Rows of a block's tile at W lanes a row: one for each group of W threads. At W <= 32 that is
// at least 8 rows, a multiple of every pack width P, so every tile starts on a pack boundary.
template <int W>
constexpr int kTileRows = kTiledBlockThreads / W;

// Where a tile lies in the array: its first element and how many it holds.
struct TileSpan {
  int64_t first;
  int n;
};

__device__ __forceinline__ TileSpan tile_span(int64_t tile, int tile_rows, int64_t rows, int64_t cols) {
  const int64_t row0 = tile * tile_rows;
  const int64_t nrows = rows - row0 < tile_rows ? rows - row0 : tile_rows;
  return {row0 * cols, int(nrows * cols)};
}

// Requests a tile of P-element packs by cp.async: no registers hold the packs, so each thread
// keeps all of its kPacks copies in flight. Elements past the array's end (its last pack only)
// belong to no row and are never read.
template <class T, int P, int kPacks>
__device__ __forceinline__ void request_tile(T* __restrict__ tile, const T* __restrict__ src, TileSpan s,
                                             int64_t total) {
  const int npacks = (s.n + P - 1) / P;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int i = threadIdx.x + k * kTiledBlockThreads;
    if (i < npacks) request_window_pack<T, P>(tile + i * P, src, s.first + int64_t(i) * P, total);
  }
}

// Copies a tile back to global memory by whole packs; the array's last pack element-wise.
template <class T, int P, int kPacks>
__device__ __forceinline__ void store_tile(T* __restrict__ dst, const T* __restrict__ tile, TileSpan s,
                                           int64_t total) {
  const int npacks = (s.n + P - 1) / P;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int i = threadIdx.x + k * kTiledBlockThreads;
    if (i >= npacks) continue;
    const int64_t g = s.first + int64_t(i) * P;
    const Pack<T, P> pk = load_pack<T, P>(tile + i * P);
    if (g + P <= total) {
      store_pack<T, P>(dst + g, pk);
    } else {
#pragma unroll
      for (int p = 0; p < P; ++p)
        if (g + p < total) dst[g + p] = pk.v[p];
    }
  }
}

// A block's tile buffers. Buffer b: `arrays` arrays of T at (b * arrays + i) * n elements, then
// the flags at byte kTiledStages * arrays * n * sizeof(T) + b * n (n = R * cols, a multiple of
// P, so every array starts on a 16-byte boundary and every flag array on a P-byte one).
template <class T>
struct TileBuffers {
  unsigned char* smem;
  int n, arrays;
  __device__ __forceinline__ T* values(int b, int i) const {
    return reinterpret_cast<T*>(smem) + (size_t(b) * arrays + i) * n;
  }
  __device__ __forceinline__ bool* flags(int b) const {
    return reinterpret_cast<bool*>(smem + size_t(kTiledStages) * arrays * n * sizeof(T)) + size_t(b) * n;
  }
};

// Runs body(t, b) on each of this block's tiles t (blockIdx.x, + gridDim.x, ...) once tile t
// has arrived in buffer b. request(t, b) asks for tile t into buffer b and commits a cp.async
// group, empty past the last tile, so tile t's group is always kTiledStages - 1 back; tiles
// t + gridDim.x, ... are on their way while body works on tile t.
template <class Request, class Body>
__device__ __forceinline__ void for_each_tile(int64_t ntiles, Request&& request, Body&& body) {
#pragma unroll
  for (int k = 0; k < kTiledStages - 1; ++k) request(blockIdx.x + int64_t(k) * gridDim.x, k);
  int b = 0;
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x, b = b + 1 == kTiledStages ? 0 : b + 1) {
    request(t + int64_t(kTiledStages - 1) * gridDim.x, b == 0 ? kTiledStages - 1 : b - 1);
    __pipeline_wait_prior(kTiledStages - 1);
    __syncthreads();
    body(t, b);
    __syncthreads();  // a later request overwrites this buffer
  }
}

// Tiled forward: W lanes a row, C / P packs a thread, persistent (for_each_tile). The row's
// outputs replace its values in the tile, each element written by the thread that read it.
template <class T, int P, int W, int C>
__global__ void __launch_bounds__(kTiledBlockThreads, kTiledForwardMinBlocks)
forward_tiled(const T* __restrict__ x, const bool* __restrict__ mask, T* __restrict__ y, int64_t rows, int64_t cols,
              bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  static_assert(C % P == 0, "a thread copies C / P packs");
  constexpr int R = kTileRows<W>;
  constexpr int kPacks = C / P;  // R * W * C / P packs over kTiledBlockThreads threads
  extern __shared__ __align__(16) unsigned char tiled_smem[];
  const TileBuffers<T> buf{tiled_smem, int(R * cols), 1};
  const int64_t total = rows * cols;
  const int64_t ntiles = (rows + R - 1) / R;
  const int slot = threadIdx.x / W, lane = threadIdx.x % W;
  const auto request = [&](int64_t t, int b) {
    if (t < ntiles) {
      const TileSpan s = tile_span(t, R, rows, cols);
      request_tile<T, P, kPacks>(buf.values(b, 0), x, s, total);
      if (mask) request_tile<bool, P, kPacks>(buf.flags(b), mask, s, total);
    }
    __pipeline_commit();
  };
  for_each_tile(ntiles, request, [&](int64_t t, int b) {
    const TileSpan s = tile_span(t, R, rows, cols);
    // Three passes over the row in shared memory (max, sum, output) rather than its values held
    // in registers: values in registers took 56-71 registers, fewer blocks an SM, and lost
    // 10-15 % (session 31 runs 3-4).
    const int n = int64_t(slot) * cols < s.n ? int(cols) : 0;
    T* const row = buf.values(b, 0) + slot * cols;
    const bool* const rflags = buf.flags(b) + slot * cols;
    A m = neg_inf<A>();
#pragma unroll 4
    for (int e = lane; e < n; e += W) m = max_nan(m, !mask || rflags[e] ? to_acc(row[e]) : neg_inf<A>());
    m = warp_reduce<MaxNanOp, W>(m);
    const ExpShift<T> ex(m);
    A sum = 0;
#pragma unroll 4
    for (int e = lane; e < n; e += W) sum += ex(!mask || rflags[e] ? to_acc(row[e]) : neg_inf<A>());
    sum = warp_reduce<SumOp, W>(sum);
    const RowStats<A> st(m, sum, log);
#pragma unroll 4
    for (int e = lane; e < n; e += W) {
      const A r = !mask || rflags[e] ? st.out(to_acc(row[e]), log) : masked_out<A>(log);
      row[e] = from_acc<T>(r);
    }
    __syncthreads();
    store_tile<T, P, kPacks>(y, buf.values(b, 0), s, total);
  });
}

// Tiled backward: y and dy tiles (and the flags) in each buffer; dx replaces y in the tile.
template <class T, int P, int W, int C>
__global__ void __launch_bounds__(kTiledBlockThreads, kTiledBackwardMinBlocks)
backward_tiled(const T* __restrict__ y, const T* __restrict__ dy, const bool* __restrict__ mask,
               T* __restrict__ dx, int64_t rows, int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  static_assert(C % P == 0, "a thread copies C / P packs");
  constexpr int R = kTileRows<W>;
  constexpr int kPacks = C / P;
  extern __shared__ __align__(16) unsigned char tiled_smem[];
  const TileBuffers<T> buf{tiled_smem, int(R * cols), 2};
  const int64_t total = rows * cols;
  const int64_t ntiles = (rows + R - 1) / R;
  const int slot = threadIdx.x / W, lane = threadIdx.x % W;
  const auto request = [&](int64_t t, int b) {
    if (t < ntiles) {
      const TileSpan s = tile_span(t, R, rows, cols);
      request_tile<T, P, kPacks>(buf.values(b, 0), y, s, total);
      request_tile<T, P, kPacks>(buf.values(b, 1), dy, s, total);
      if (mask) request_tile<bool, P, kPacks>(buf.flags(b), mask, s, total);
    }
    __pipeline_commit();
  };
  for_each_tile(ntiles, request, [&](int64_t t, int b) {
    const TileSpan s = tile_span(t, R, rows, cols);
    // Two passes over the row in shared memory (the sum, then dx), as in the forward.
    const int n = int64_t(slot) * cols < s.n ? int(cols) : 0;
    T* const yrow = buf.values(b, 0) + slot * cols;
    const T* const grow = buf.values(b, 1) + slot * cols;
    const bool* const rflags = buf.flags(b) + slot * cols;
    A sum = 0;
#pragma unroll 4
    for (int e = lane; e < n; e += W) {
      const A g = !mask || rflags[e] ? to_acc(grow[e]) : A(0);
      sum += log ? g : to_acc(yrow[e]) * g;
    }
    sum = warp_reduce<SumOp, W>(sum);
#pragma unroll 4
    for (int e = lane; e < n; e += W) {
      const A yy = to_acc(yrow[e]), g = to_acc(grow[e]);
      const A r = log ? g - fast_exp(yy) * sum : yy * (g - sum);
      yrow[e] = from_acc<T>(!mask || rflags[e] ? r : A(0));
    }
    __syncthreads();
    store_tile<T, P, kPacks>(dx, buf.values(b, 0), s, total);
  });
}

// Shared memory of a block's tile buffers at W lanes a row: `arrays` arrays of T (forward 1,
// backward 2) and the flags when masked.
template <class T>
size_t tiled_smem_bytes(int W, int64_t cols, int arrays, bool masked) {
  const size_t n = size_t(kTiledBlockThreads / W) * size_t(cols);
  return kTiledStages * n * (arrays * sizeof(T) + (masked ? 1 : 0));
}

// Calls f(IC<W>) with the fewest lanes a row for which kTiledPerLane values a lane hold `cols`
// columns; cudaErrorInvalidValue past kTiledMaxCols.
template <class F>
cudaError_t with_tile_shape(int64_t cols, F&& f) {
  constexpr int C = kTiledPerLane;
  if (cols <= C) return f(std::integral_constant<int, 1>{});
  if (cols <= 2 * C) return f(std::integral_constant<int, 2>{});
  if (cols <= 4 * C) return f(std::integral_constant<int, 4>{});
  if (cols <= 8 * C) return f(std::integral_constant<int, 8>{});
  if (cols <= 16 * C) return f(std::integral_constant<int, 16>{});
  if (cols <= 32 * C) return f(std::integral_constant<int, 32>{});
  return cudaErrorInvalidValue;
}

}  // namespace jaxops::softmax
