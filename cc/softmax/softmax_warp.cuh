// Softmax warp path (rows of up to kWarpMaxCols columns): the forward and backward kernels, the
// warp shapes by row length, and their grids.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/launch.cuh"
#include "softmax/softmax_common.cuh"
#include "softmax/softmax_window.cuh"

namespace jaxops::softmax {

// Warp path: a group of W lanes per row, K packs of P elements per lane, interleaved so each
// pack index is one coalesced access across the group. kWindow: rows that are not whole packs,
// read through their aligned windows (softmax_window.cuh); W and K then hold the widest window.

// 16-bit rows of up to 16 values a lane are capped at 40 registers (12 blocks a SM, 1536 threads): the
// narrow 16-bit shapes (W = 2, 4) otherwise take 48 and lose a sixth of their rows in flight;
// float32 rows of up to 8 values a lane at 32 (16 blocks, full occupancy, as before session 5).
// Window rows need a few more (their row's window and the edge tests): 56 and 40 registers,
// the most blocks at which they do not spill.
template <class T, int P, int W, int K, bool kWindow>
constexpr int kWarpMinBlocks = sizeof(T) == 2 && K * P <= 16 ? (kWindow ? 9 : 12)
                               : sizeof(T) == 4 && K * P <= 8 ? (kWindow ? 12 : 16)
                                                              : 1;

template <class T, int P, int W, int K, bool kWindow = false>
__global__ void __launch_bounds__(kWarpBlockThreads, (kWarpMinBlocks<T, P, W, K, kWindow>))
forward_warp(const T* __restrict__ x, const bool* __restrict__ mask, T* __restrict__ y, int64_t rows,
             int64_t cols, bool log) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  constexpr int N = K * P;
  static_assert(N <= 32, "masked bits live in one word");
  constexpr int kRowsPerWarp = 32 / W;
  const int lane = threadIdx.x % W;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = int64_t(gridDim.x) * blockDim.x / 32;
  const int64_t total = rows * cols;
  const T ninf = from_acc<T>(neg_inf<A>());
  for (int64_t base = warp * kRowsPerWarp; base < rows; base += nwarps * kRowsPerWarp) {
    const int64_t row = base + (threadIdx.x % 32) / W;
    const bool active = row < rows;
    [[maybe_unused]] const RowWindow<P> w(row, cols);
    A v[K][P];
    uint32_t masked = 0;
    A m = neg_inf<A>();
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = k * W + lane;  // < 2^31: rows here have <= 1024 columns
      if (active && (kWindow ? j < w.packs : j * P < cols)) {
        const int64_t g = kWindow ? w.base + j * P : row * cols + j * P;
        Pack<T, P> pk;
        if constexpr (kWindow) {
          pk = load_window_pack<T, P>(x, g, total, ninf);
          fill_outside<T, P>(pk, w, j, ninf);
        } else {
          pk = load_pack<T, P>(x + g);
        }
        unpack<T, P>(pk, v[k]);
        if (mask) {
          const Pack<bool, P> mk =
              kWindow ? load_window_pack<bool, P>(mask, g, total, true) : load_pack<bool, P>(mask + g);
#pragma unroll
          for (int p = 0; p < P; ++p) {
            if (!mk.v[p]) {
              v[k][p] = neg_inf<A>();
              masked |= 1u << (k * P + p);
            }
          }
        }
#pragma unroll
        for (int p = 0; p < P; ++p) m = max_nan(m, v[k][p]);
      }
    }
    m = warp_reduce<MaxNanOp, W>(m);
    const ExpShift<T> ex(m);
    A s = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = k * W + lane;
      if (active && (kWindow ? j < w.packs : j * P < cols)) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const A e = ex(v[k][p]);
          s += e;
          if (!log) v[k][p] = e;  // softmax's output needs exp once, not twice
        }
      }
    }
    s = warp_reduce<SumOp, W>(s);
    const RowStats<A> st(m, s, log);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = k * W + lane;
      if (active && (kWindow ? j < w.packs : j * P < cols)) {
        A r[P];
#pragma unroll
        for (int p = 0; p < P; ++p) {
          r[p] = log ? st.out(v[k][p], true) : v[k][p] * st.inv_sum;
          if (mask && ((masked >> (k * P + p)) & 1u)) r[p] = masked_out<A>(log);
        }
        if constexpr (kWindow) {
          store_window_pack<T, P>(y, w, j, repack<T, P>(r));
        } else {
          store_pack<T, P>(y + row * cols + j * P, repack<T, P>(r));
        }
      }
    }
  }
}

// Element p of a pack as its accumulator value, for a value converted once already. bf16: the
// byte-permute form of the conversion (unpack shifts and masks), so the compiler does not keep the
// first conversion's float registers alive until this use instead of the pack's.
template <class T, int P>
__device__ __forceinline__ acc_t<T> reconvert(const Pack<T, P>& pk, int p) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> && P % 2 == 0) {
    uint32_t w[P / 2];
    memcpy(w, &pk, sizeof(w));
    return __uint_as_float(__byte_perm(w[p / 2], 0u, p % 2 == 0 ? 0x1044u : 0x3244u));
  } else {
    return to_acc(pk.v[p]);
  }
}

// The backward's unmasked 16-bit rows of 32 values a lane (1024 columns) are held to 72 registers,
// 7 blocks an SM. Unbounded and maskable they took 96 (5 blocks an SM) and read at 0.82 of the
// 3-pass bound on the H200, where 16 values a lane (60 registers) reach 0.95; capped, 0.93
// (session 35 run 3, bf16 65536x1024: softmax 115.0 -> 101.9 µs, log_softmax 117.4 -> 97.6).
// The mask's flags and bits cost 16 registers: only the kernel without them fits 72 unspilled.
template <class T, int P, int K, bool kWindow, bool kMaskable>
constexpr bool kWarpBackwardCapped = sizeof(T) == 2 && P == 8 && K == 4 && !kWindow && !kMaskable;

template <class T, int P, int W, int K, bool kWindow = false, bool kMaskable = true>
__global__ void __launch_bounds__(kWarpBlockThreads, (kWarpBackwardCapped<T, P, K, kWindow, kMaskable> ? 7 : 1))
backward_warp(const T* __restrict__ y, const T* __restrict__ dy, const bool* __restrict__ mask,
              T* __restrict__ dx, int64_t rows, int64_t cols, bool log) {
  cuda::enter_kernel();
  if constexpr (!kMaskable) mask = nullptr;
  using A = acc_t<T>;
  constexpr int N = K * P;
  static_assert(N <= 32, "masked bits live in one word");
  constexpr int kRowsPerWarp = 32 / W;
  const int lane = threadIdx.x % W;
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = int64_t(gridDim.x) * blockDim.x / 32;
  const int64_t total = rows * cols;
  const T zero = from_acc<T>(A(0));
  for (int64_t base = warp * kRowsPerWarp; base < rows; base += nwarps * kRowsPerWarp) {
    const int64_t row = base + (threadIdx.x % 32) / W;
    const bool active = row < rows;
    [[maybe_unused]] const RowWindow<P> w(row, cols);
    // The loaded packs stay in registers as they came (16-bit: half the registers of their
    // float values), converted again for the output.
    Pack<T, P> py[K], pg[K];
    uint32_t masked = 0;
    A s = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = k * W + lane;
      if (active && (kWindow ? j < w.packs : j * P < cols)) {
        const int64_t g = kWindow ? w.base + j * P : row * cols + j * P;
        Pack<bool, P> mk;
        if constexpr (kWindow) {
          // Other rows' y and dy read as 0: their products add nothing (NaN there would).
          py[k] = load_window_pack<T, P>(y, g, total, zero);
          pg[k] = load_window_pack<T, P>(dy, g, total, zero);
          fill_outside<T, P>(py[k], w, j, zero);
          fill_outside<T, P>(pg[k], w, j, zero);
          if (mask) mk = load_window_pack<bool, P>(mask, g, total, true);
        } else {
          py[k] = load_pack<T, P>(y + g);
          pg[k] = load_pack<T, P>(dy + g);
          if (mask) mk = load_pack<bool, P>(mask + g);
        }
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const A yy = to_acc(py[k].v[p]);
          A g = to_acc(pg[k].v[p]);
          if (mask && !mk.v[p]) {
            g = 0;
            masked |= 1u << (k * P + p);
          }
          s += log ? g : yy * g;
        }
      }
    }
    s = warp_reduce<SumOp, W>(s);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int j = k * W + lane;
      if (active && (kWindow ? j < w.packs : j * P < cols)) {
        Pack<T, P> out;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const A yy = reconvert<T, P>(py[k], p), g = reconvert<T, P>(pg[k], p);
          A r = log ? g - fast_exp(yy) * s : yy * (g - s);
          if ((masked >> (k * P + p)) & 1u) r = 0;
          out.v[p] = from_acc<T>(r);
        }
        if constexpr (kWindow) {
          store_window_pack<T, P>(dx, w, j, out);
        } else {
          store_pack<T, P>(dx + row * cols + j * P, out);
        }
      }
    }
  }
}

template <int V> using IC = std::integral_constant<int, V>;

// Calls f(IC<W>, IC<K>) with the smallest warp shape that holds `cols` columns in packs of P
// with at least MinK packs a lane. The forward asks for MinK = 2: a warp then covers two short
// rows (or twice the bytes of one) per iteration, doubling the independent loads each warp
// keeps in flight, which short rows need to saturate DRAM.
template <int P, int MinK, class F>
cudaError_t with_warp_shape(int64_t cols, F&& f) {
  static_assert(MinK == 1 || MinK == 2, "warp shapes exist for one or two packs a lane");
  const int64_t packs = ceil_div<int64_t>(cols, P);
  if constexpr (MinK == 1) {
    if (packs <= 1) return f(IC<1>{}, IC<1>{});
    if (packs <= 2) return f(IC<2>{}, IC<1>{});
    if (packs <= 4) return f(IC<4>{}, IC<1>{});
    if (packs <= 8) return f(IC<8>{}, IC<1>{});
    if (packs <= 16) return f(IC<16>{}, IC<1>{});
    if (packs <= 32) return f(IC<32>{}, IC<1>{});
  } else {
    if (packs <= 2) return f(IC<1>{}, IC<2>{});
    if (packs <= 4) return f(IC<2>{}, IC<2>{});
    if (packs <= 8) return f(IC<4>{}, IC<2>{});
    if (packs <= 16) return f(IC<8>{}, IC<2>{});
    if (packs <= 32) return f(IC<16>{}, IC<2>{});
  }
  if (packs <= 64) return f(IC<32>{}, IC<2>{});
  if (packs <= 128) return f(IC<32>{}, IC<4>{});
  if constexpr (P <= 4) {
    if (packs <= 256) return f(IC<32>{}, IC<8>{});
  }
  if constexpr (P <= 2) {
    if (packs <= 512) return f(IC<32>{}, IC<16>{});
  }
  if constexpr (P == 1) {
    if (packs <= 1024) return f(IC<32>{}, IC<32>{});
  }
  return cudaErrorInvalidValue;
}

// The warp backward's grid: at most 32 blocks an SM, each looping over row groups (the backward
// was not measured with one row group per warp).
inline int64_t warp_grid(int64_t rows, int width, const DeviceInfo& dev) {
  const int64_t rows_per_block = kWarpBlockThreads / 32 * (32 / width);
  return std::min<int64_t>(ceil_div<int64_t>(rows, rows_per_block), int64_t(dev.sm_count) * 32);
}

// The warp forward's grid: one row group per warp, as many blocks as the rows need (5-10 % faster
// than a persistent grid of 32 blocks an SM for bf16, 3-5 % for float32; session 5). The kernel
// still loops over row groups, which only grids of more than 2^31 - 1 blocks need.
inline int64_t forward_warp_grid(int64_t rows, int width) {
  const int64_t rows_per_block = kWarpBlockThreads / 32 * (32 / width);
  return std::min<int64_t>(ceil_div<int64_t>(rows, rows_per_block), INT32_MAX);
}

}  // namespace jaxops::softmax
