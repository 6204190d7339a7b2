// CUDA softmax / log_softmax backward over the last axis (the paths: softmax_route.cuh).
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

// Host dispatch of the backward: the launchers of the three paths (softmax_warp.cuh,
// softmax_cached.cuh, softmax_uncached.cuh) and the rules that choose among them; plans and grids
// in softmax_plan.cuh, what the forward shares in softmax_route.cuh.

// The lean backward (16-byte packs, float32 and 16-bit types), masked (kMaskable) or not, when it
// has a plan, and a persistent one unless `any_plan`: false otherwise.
template <class T, int P, bool kWindow, bool kMaskable>
bool launch_lean_backward(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols, bool log,
                          bool any_plan, cudaStream_t stream, const DeviceInfo& dev, cudaError_t* err) {
  const int64_t plan_cols = kWindow ? window_cols<P>(cols) : cols;
  CachedPlan plan;
  const size_t col_bytes = 2 * sizeof(T) + (kMaskable ? 1 : 0);  // the mask's slice is cached too
  if (!remembered_plan(backward_cached_lean<T, P, kWindow, kMaskable>, plan_cols, P, col_bytes, dev, &plan) ||
      !(any_plan || plan.persistent)) {
    return false;
  }
  *err = launch_clustered(backward_cached_lean<T, P, kWindow, kMaskable>, cached_grid(rows, plan), plan.threads,
                          plan.smem, plan.cluster, stream, y, dy, mask, dx, rows, cols, plan.slice,
                          l2_prefetch_bytes(plan, dev, 2, sizeof(T)), log);
  return true;
}

template <class T, int P, bool kWindow>
bool launch_lean_backward(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols, bool log,
                          bool any_plan, cudaStream_t stream, const DeviceInfo& dev, cudaError_t* err) {
  return mask ? launch_lean_backward<T, P, kWindow, true>(y, dy, mask, dx, rows, cols, log, any_plan, stream, dev, err)
              : launch_lean_backward<T, P, kWindow, false>(y, dy, nullptr, dx, rows, cols, log, any_plan, stream, dev,
                                                           err);
}

// Whole-pack rows the backward warp kernel takes. float32 rows past 512 columns (8 packs of y and
// dy a lane, ~100 registers) go to the cached kernel, as the float32 window rows already did: the
// H200 measured it faster there (session 35 runs 2-3, µs warp / cached: 65536x1024 softmax 221.8 /
// 199.8, log_softmax 227.7 / 199.0; 87381x768 240.9 / 197.3), and slower at 512 (131072x512
// 191.9 / 231.7). 16-bit rows keep the warp kernel up to kWarpMaxCols (bf16 65536x1024 115.0 /
// 129.6, and 101.9 since the register cap, softmax_warp.cuh), as do rows of single elements
// (P = 1; not measured).
template <class T, int P>
constexpr int64_t backward_warp_pack_limit() {
  return sizeof(T) == 4 && P == 4 ? 512 : kWarpMaxCols;
}

template <class T, int P>
cudaError_t backward_packed(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols,
                            bool log, cudaStream_t stream, const DeviceInfo& dev) {
  if (cols <= backward_warp_pack_limit<T, P>()) {
    return with_warp_shape<P, 1>(cols, [&](auto w, auto k) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      if constexpr (kWarpBackwardCapped<T, P, K, false, false>) {
        if (mask == nullptr)
          return cuda::launch_kernel(backward_warp<T, P, W, K, false, false>, warp_grid(rows, W, dev),
                                     kWarpBlockThreads, 0, stream, y, dy, mask, dx, rows, cols, log);
      }
      return cuda::launch_kernel(backward_warp<T, P, W, K>, warp_grid(rows, W, dev), kWarpBlockThreads, 0, stream, y,
          dy, mask, dx, rows, cols, log);
    });
  }
  // 16-byte packs on a persistent plan: the lean kernel. Rows within one block's cache budget keep
  // the register-staged kernel below (0.92-0.97 of the 3-pass bound in session 5).
  if constexpr (kAsyncPack<T, P> && sizeof(T) <= 4) {
    cudaError_t err;
    if (launch_lean_backward<T, P, false>(y, dy, mask, dx, rows, cols, log, false, stream, dev, &err)) return err;
  }
  CachedPlan plan;
  if (remembered_plan(backward_cached<T, P>, cols, P, 2 * sizeof(T), dev, &plan)) {
    return launch_clustered(backward_cached<T, P>, cached_grid(rows, plan), plan.threads, plan.smem,
                            plan.cluster, stream, y, dy, mask, dx, rows, cols, plan.slice, log);
  }
  return cuda::launch_kernel(backward_uncached<T, P>, uncached_grid(rows, dev), 1024, 0, stream, y, dy, mask, dx, rows,
      cols, log);
}

// Warp-path rows read their windows only where that measured faster than element loads (H100,
// session 29 runs 1 and 3, µs window / elements, bf16 then float32): up to 64 window columns
// (524288x33 60.9 / 61.4, 76.6 / 88.8) and from 257 (65536x257 53.7 / 67.0, 77.0 / 97.5;
// 16384x1001 57.6 / 119.4, 85.5 / 179.6); between, elements (262144x77 63.5 / 51.9, 87.6 / 88.2;
// 131072x129 61.3 / 45.5, 74.2 / 73.6). Unexplained: the window warp kernels carry the edge tests
// and 54-56 registers (16-bit) against the element kernels' 20-40; not profiled. The masked
// backward follows the unmasked rule (session 30: 262144x77 79.0 / 64.3; 16384x1001 73.2 / 123.7).
constexpr int64_t kBackwardWarpWindowMaxShortCols = 64;
constexpr int64_t kBackwardWarpWindowMinCols = 257;

// Windows longer than this leave the warp kernels for the cp.async cached ones (one block a row).
// H100, session 30, µs warp / cached, window rows: float32 16384x1001 85.0 / 72.9, masked 94.6 /
// 80.1; 16384x769 65.3 / 56.8; 32768x513 87.3 / 77.2, masked 98.2 / 85.0. bf16 loses from ~1000
// (1001 57.8 / 48.4, masked 73.3 / 62.1; 769 48.1 / 46.4, 61.1 / 60.2; 513 66.5 / 85.4). Rows that
// are whole packs measured within a few % either way (1024, 520, 776) and keep the warp kernels.
template <class T>
int64_t backward_warp_window_limit() {
  return sizeof(T) < 4 ? 768 : 512;
}

// Which rows that are not whole packs the tiled kernels take (softmax_tiled.cuh), against the
// window and element warp kernels. H100, session 31 runs 3 and 7, µs tiled / warp, 80 % masks:
//  - 16-bit, every width to 512: 524288x33 47.8 / 60.9, 262144x77 46.7 / 52.3, 131072x197 57.9 /
//    69.2, 65536x383 60.0 / 70.2, 32768x509 41.5 / 64.5; masked 54.4 / 64.3 (77), 67.6 / 102.8
//    (197), 48.2 / 81.5 (509).
//  - float32 masked to 512 (33 81.9 / 87.5, 197 127.4 / 135.7, 509 78.1 / 84.4). The unmasked
//    float32 backward is within a few % either way (77 90.9 / 87.9, 257 75.9 / 76.9) and keeps the
//    warp kernels.
bool use_tiled_backward(int64_t cols, int elem_bytes, bool masked) {
  if (tiled_mode() != WindowMode::kAuto) return tiled_mode() == WindowMode::kAlways && cols <= kTiledMaxCols;
  return cols <= kTiledMaxCols && (elem_bytes < 4 || masked);
}

template <class T, int P>
cudaError_t backward_tiled_rows(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols,
                                bool log, cudaStream_t stream, const DeviceInfo& dev) {
  return with_tile_shape(cols, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const auto kernel = backward_tiled<T, P, W, kTiledPerLane>;
    const size_t smem = tiled_smem_bytes<T>(W, cols, 2, mask != nullptr);
    return launch_clustered(kernel, tiled_grid(kernel, rows, kTileRows<W>, kTiledBlockThreads, smem, dev),
                            kTiledBlockThreads, smem, 1, stream, y, dy, mask, dx, rows, cols, log);
  });
}

// Rows that are not whole 16-byte packs, through their aligned windows: the warp path for short
// windows (the limits above), else the lean cached backward on any plan (the register-staged one
// has no window). False when neither applies.
template <class T, int P>
bool backward_window(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols, bool log,
                     cudaStream_t stream, const DeviceInfo& dev, cudaError_t* err) {
  if (use_tiled_backward(cols, sizeof(T), mask != nullptr)) {
    *err = backward_tiled_rows<T, P>(y, dy, mask, dx, rows, cols, log, stream, dev);
    return true;
  }
  if (window_cols<P>(cols) <= backward_warp_window_limit<T>()) {
    const int64_t wcols = window_cols<P>(cols);
    if (window_mode() == WindowMode::kAuto && wcols > kBackwardWarpWindowMaxShortCols &&
        wcols < kBackwardWarpWindowMinCols) {
      return false;
    }
    *err = with_warp_shape<P, 1>(window_cols<P>(cols), [&](auto w, auto k) {
      constexpr int W = decltype(w)::value, K = decltype(k)::value;
      return cuda::launch_kernel(backward_warp<T, P, W, K, true>, warp_grid(rows, W, dev), kWarpBlockThreads, 0,
                                 stream, y, dy, mask, dx, rows, cols, log);
    });
    return true;
  }
  return launch_lean_backward<T, P, true>(y, dy, mask, dx, rows, cols, log, true, stream, dev, err);
}

}  // namespace

cudaError_t backward_cuda(Dtype dtype, const void* y, const void* dy, const bool* mask, void* dx, int64_t rows,
                          int64_t cols, bool log, cudaStream_t stream) {
  DeviceInfo dev;
  if (cudaError_t err = device_info(&dev); err != cudaSuccess) return err;
  JAXOPS_DISPATCH_FLOAT(dtype, T, {
    constexpr int kWide = 16 / sizeof(T);
    const T* yt = static_cast<const T*>(y);
    const T* gt = static_cast<const T*>(dy);
    T* dxt = static_cast<T*>(dx);
    if (use_wide_pack<T>(cols, y, dy, dx, mask))
      return backward_packed<T, kWide>(yt, gt, mask, dxt, rows, cols, log, stream, dev);
    if constexpr (sizeof(T) <= 4) {
      cudaError_t err;
      if (use_window<T>(cols, y, dy, dx, mask) &&
          backward_window<T, kWide>(yt, gt, mask, dxt, rows, cols, log, stream, dev, &err))
        return err;
    }
    return backward_packed<T, 1>(yt, gt, mask, dxt, rows, cols, log, stream, dev);
  });
  return cudaSuccess;
}

}  // namespace jaxops::softmax
