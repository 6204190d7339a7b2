// CUDA softmax / log_softmax forward over the last axis (the paths: softmax_route.cuh).
#include <cstdint>

#include "common/cluster.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "softmax/softmax_cached.cuh"
#include "softmax/softmax_cuda.h"
#include "softmax/softmax_plan.cuh"
#include "softmax/softmax_route.cuh"
#include "softmax/softmax_test_hooks.h"
#include "softmax/softmax_tiled.cuh"
#include "softmax/softmax_uncached.cuh"
#include "softmax/softmax_warp.cuh"

namespace jaxops::softmax {
namespace {

// Host dispatch of the forward: the launchers of the three paths (softmax_warp.cuh,
// softmax_cached.cuh, softmax_uncached.cuh) and the rules that choose among them; plans and grids
// in softmax_plan.cuh, what the backward shares in softmax_route.cuh.

// Smallest cluster whose cp.async forward takes one (max, sum) reduction a row (forward_cached's
// kPairStats). H100, session 12, same build, µs two reductions -> one: 4-16 block clusters gain
// (f32 256x262144 (16 blocks) 202.3-204.3 -> 191.0-192.2, 512x131072 (8) 196.9-197.1 -> 192.5-193.9;
// bf16 262144 (8) 103.8-104.1 -> 99.9-100.1, 131072 (4) 103.1-103.2 -> 101.5-101.6), while one- or
// two-block plans lose (f32 2048x32768 (2) 194.0-194.7 -> 197.1-197.3, bf16 32768 (1) 98.9-99.8 ->
// 102.2-102.4): the fewer blocks meet, the less a cluster barrier costs against the pair
// reduction's longer shuffle chain and softmax's second exp; <= 8192 columns are equal.
constexpr int kPairStatsMinCluster = 4;

// The cp.async cached forward (16-byte packs, float32 and 16-bit types; float64's kernel spills
// its log), masked (kMaskable) or not: false when no cluster can cache the row. kWindow: rows
// that are not whole packs, planned for their widest window.
template <class T, int P, bool kWindow, bool kMaskable>
bool launch_async_forward(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log,
                          cudaStream_t stream, const DeviceInfo& dev, cudaError_t* err) {
  const int64_t plan_cols = kWindow ? window_cols<P>(cols) : cols;
  const size_t col_bytes = sizeof(T) + (kMaskable ? 1 : 0);  // the mask's slice is cached too
  CachedPlan plan;
  if (!remembered_plan(forward_cached<T, P, kMaskable, false, kWindow>, plan_cols, P, col_bytes, dev, &plan)) {
    return false;
  }
  // Only rows long enough for a large cluster look up the pair kernel's own plan.
  CachedPlan pair;
  if (plan.cluster >= kPairStatsMinCluster &&
      remembered_plan(forward_cached<T, P, kMaskable, true, kWindow>, plan_cols, P, col_bytes, dev, &pair) &&
      pair.cluster >= kPairStatsMinCluster) {
    *err = launch_clustered(forward_cached<T, P, kMaskable, true, kWindow>, async_cached_grid(rows, pair),
                            pair.threads, pair.smem, pair.cluster, stream, x, mask, y, rows, cols, pair.slice, log);
    return true;
  }
  *err = launch_clustered(forward_cached<T, P, kMaskable, false, kWindow>, async_cached_grid(rows, plan),
                          plan.threads, plan.smem, plan.cluster, stream, x, mask, y, rows, cols, plan.slice, log);
  return true;
}

template <class T, int P, bool kWindow>
bool launch_async_forward(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log,
                          cudaStream_t stream, const DeviceInfo& dev, cudaError_t* err) {
  return mask ? launch_async_forward<T, P, kWindow, true>(x, mask, y, rows, cols, log, stream, dev, err)
              : launch_async_forward<T, P, kWindow, false>(x, nullptr, y, rows, cols, log, stream, dev, err);
}

template <class T, int P>
cudaError_t forward_packed(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log,
                           cudaStream_t stream, const DeviceInfo& dev) {
  if (cols <= kWarpMaxCols) {
    return with_warp_shape<P, 2>(cols, [&](auto w, auto k) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      return cuda::launch_kernel(forward_warp<T, P, W, K>, forward_warp_grid(rows, W), kWarpBlockThreads, 0, stream, x,
          mask, y, rows, cols, log);
    });
  }
  // 16-byte packs of float32 and 16-bit types: the cp.async kernels alone, whose plans leave room
  // for a masked row's mask slice (planned without it, the masked kernel would write past its
  // shared memory). Other pack widths: the register-staged maskable kernel.
  if constexpr (kAsyncPack<T, P> && sizeof(T) <= 4) {
    cudaError_t err;
    if (launch_async_forward<T, P, false>(x, mask, y, rows, cols, log, stream, dev, &err)) return err;
  } else {
    CachedPlan plan;
    if (remembered_plan(forward_cached<T, P, true, false>, cols, P, sizeof(T), dev, &plan)) {
      return launch_clustered(forward_cached<T, P, true, false>, cached_grid(rows, plan), plan.threads, plan.smem,
                              plan.cluster, stream, x, mask, y, rows, cols, plan.slice, log);
    }
  }
  return cuda::launch_kernel(forward_uncached<T, P>, uncached_grid(rows, dev), 1024, 0, stream, x, mask, y, rows, cols,
      log);
}

// Warp-path rows read their windows only where that measured faster than element loads (H100,
// session 29 runs 1 and 3, µs window / elements, bf16 then float32): up to 128 window columns
// (524288x33 47.5 / 158.2, 57.6 / 158.2; 262144x77 48.6 / 79.5, 63.0 / 79.6); from 129 on the
// element kernel's 32 lanes a row win (131072x129 47.7 / 46.1, 55.8 / 52.1; 65536x257 44.9 /
// 39.6, 65.2 / 51.2; 16384x1001 36.1 / 32.3, 65.1 / 54.1). Unexplained: the window warp kernels
// carry the edge tests and 54-56 registers (16-bit) against the element kernels' 20-40; not
// profiled. A masked forward takes the window at every width: the element kernel's
// flag-at-a-time mask reads lost wherever measured (session 30, masked 16384x1001 50.9 / 116.9,
// 73.0 / 133.1; 262144x77 62.6 / 79.5, 73.6 / 79.9).
constexpr int64_t kForwardWarpWindowMaxCols = 128;

// Windows longer than this leave the warp kernels for the cp.async cached ones (one block a row).
// H100, session 30, µs warp / cached, window rows: float32 16384x1001 54.1 / 46.6, masked 72.9 /
// 52.4; 16384x769 38.5 / 38.2, masked 59.6 / 45.7; 32768x513 58.4 / 63.4, masked 84.8 / 76.5.
// bf16: the warp forward wins at every width (1001 32.7 / 47.7, masked 51.0 / 58.6; 513 49.5 /
// 84.5). Rows that are whole packs measured within a few % either way (1024, 520, 776) and keep
// the warp kernels.
template <class T>
int64_t forward_warp_window_limit(bool masked) {
  if (sizeof(T) < 4) return kWarpMaxCols;
  return masked ? 512 : 768;
}

// Which rows that are not whole packs the tiled kernels take (softmax_tiled.cuh), against the
// window and element warp kernels. H100, session 31 runs 3 and 7, µs tiled / warp, 80 % masks:
//  - 16-bit to 256: 33 39.9 / 47.5, 77 41.0 / 48.8, 129 38.1 / 46.1, 197 48.1 / 51.4, 257 38.4 /
//    39.7; past it the element kernel's whole-warp rows win (383 52.2 / 41.5, 509 34.2 / 27.2).
//  - float32 to 64 (33: 52.4 / 58.1; 77 66.5 / 62.9, 509 54.4 / 47.0).
// The tiled kernels run close to their issue limit (ncu, run 6: bf16 262144x77 forward at 74 % of
// the SM's throughput, 53 instructions an element, the same count as the window kernel's); a
// version owning whole packs per thread, with row statistics combined from each pack's parts,
// was slower still (run 7: 77 columns 56.8 µs forward) and was dropped.
bool use_tiled_forward(int64_t cols, int elem_bytes) {
  if (tiled_mode() != WindowMode::kAuto) return tiled_mode() == WindowMode::kAlways && cols <= kTiledMaxCols;
  return cols <= (elem_bytes < 4 ? 256 : 64);
}

template <class T, int P>
cudaError_t forward_tiled_rows(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log,
                               cudaStream_t stream, const DeviceInfo& dev) {
  return with_tile_shape(cols, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const auto kernel = forward_tiled<T, P, W, kTiledPerLane>;
    const size_t smem = tiled_smem_bytes<T>(W, cols, 1, mask != nullptr);
    return launch_clustered(kernel, tiled_grid(kernel, rows, kTileRows<W>, kTiledBlockThreads, smem, dev),
                            kTiledBlockThreads, smem, 1, stream, x, mask, y, rows, cols, log);
  });
}

// Rows that are not whole 16-byte packs, through their aligned windows: the warp path for short
// windows (the limits above), else the cp.async cached forward. False when neither applies.
template <class T, int P>
bool forward_window(const T* x, const bool* mask, T* y, int64_t rows, int64_t cols, bool log, cudaStream_t stream,
                    const DeviceInfo& dev, cudaError_t* err) {
  if (use_tiled_forward(cols, sizeof(T))) {
    *err = forward_tiled_rows<T, P>(x, mask, y, rows, cols, log, stream, dev);
    return true;
  }
  if (window_cols<P>(cols) <= forward_warp_window_limit<T>(mask != nullptr)) {
    if (window_mode() == WindowMode::kAuto && !mask && window_cols<P>(cols) > kForwardWarpWindowMaxCols) return false;
    *err = with_warp_shape<P, 2>(window_cols<P>(cols), [&](auto w, auto k) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      return cuda::launch_kernel(forward_warp<T, P, W, K, true>, forward_warp_grid(rows, W), kWarpBlockThreads, 0,
                                 stream, x, mask, y, rows, cols, log);
    });
    return true;
  }
  return launch_async_forward<T, P, true>(x, mask, y, rows, cols, log, stream, dev, err);
}

}  // namespace

cudaError_t forward_cuda(Dtype dtype, const void* x, const bool* mask, void* y, int64_t rows, int64_t cols,
                         bool log, cudaStream_t stream) {
  DeviceInfo dev;
  if (cudaError_t err = device_info(&dev); err != cudaSuccess) return err;
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int kWide = 16 / sizeof(T);
    const T* xt = static_cast<const T*>(x);
    T* yt = static_cast<T*>(y);
    if (use_wide_pack<T>(cols, x, y, nullptr, mask))
      return forward_packed<T, kWide>(xt, mask, yt, rows, cols, log, stream, dev);
    if constexpr (sizeof(T) <= 4) {
      cudaError_t err;
      if (use_window<T>(cols, x, y, nullptr, mask) &&
          forward_window<T, kWide>(xt, mask, yt, rows, cols, log, stream, dev, &err))
        return err;
    }
    return forward_packed<T, 1>(xt, mask, yt, rows, cols, log, stream, dev);
  });
  return cudaSuccess;
}

}  // namespace jaxops::softmax
