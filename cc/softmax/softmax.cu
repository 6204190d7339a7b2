// CUDA softmax / log_softmax over the last axis, forward and backward.
//
// Three paths by row length, each reading the input once where it can (rows that are not whole
// 16-byte packs take the warp and cached paths through their aligned windows,
// softmax_window.cuh, short ones tiles of rows, softmax_tiled.cuh, or else single elements):
//  - warp: rows <= 1024 columns live in registers of a group of 1..32 lanes;
//  - cached: a block (or a Hopper thread-block cluster of up to 16 blocks) caches its slice of
//    the row in shared memory (filled by cp.async for 16-byte packs); cluster partials are
//    combined through distributed shared memory. Block sizes favour several blocks (rows) per SM
//    so one row's barriers overlap other rows' memory traffic. Rows that fit one block's cache
//    budget launch one block per row; longer rows run a persistent grid whose blocks request
//    their next row while writing the current one;
//  - uncached: rows too long for any cluster's shared memory make the fewest passes (online
//    max/sum, then the output pass).
// Masked entries are excluded by loading them as -inf (forward) or their cotangents as 0
// (backward) and forcing their outputs; math is float32 (float64 for float64).
#include <cstdint>

#include "common/cluster.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "softmax/softmax_cached.cuh"
#include "softmax/softmax_cuda.h"
#include "softmax/softmax_plan.cuh"
#include "softmax/softmax_test_hooks.h"
#include "softmax/softmax_tiled.cuh"
#include "softmax/softmax_uncached.cuh"
#include "softmax/softmax_warp.cuh"

namespace jaxops::softmax {
namespace {

// Host dispatch: the launchers of the three paths (softmax_warp.cuh, softmax_cached.cuh,
// softmax_uncached.cuh) and the rules that choose among them; plans and grids in softmax_plan.cuh.

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

// The lean backward (16-byte packs, float32 and 16-bit types), masked (kMaskable) or not, when it
// has a plan, and a persistent one unless `any_plan`: false otherwise.
template <class T, int P, bool kWindow, bool kMaskable>
bool launch_lean_backward(const T* y, const T* dy, const bool* mask, T* dx, int64_t rows, int64_t cols, bool log,
                          bool any_plan, cudaStream_t stream, const DeviceInfo& dev, cudaError_t* err) {
  const int64_t plan_cols = kWindow ? window_cols<P>(cols) : cols;
  CachedPlan plan;
  const size_t col_bytes = 2 * sizeof(T) + (kMaskable ? 1 : 0);  // the mask's slice is cached too
  if (!remembered_plan(backward_cached_lean<T, P, kWindow, kMaskable>, plan_cols, P, col_bytes, dev, &plan) ||
      !(any_plan || persistent_plan(plan))) {
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
// session 29 runs 1 and 3, µs window / elements, bf16 then float32). Forward: up to 128 window
// columns (524288x33 47.5 / 158.2, 57.6 / 158.2; 262144x77 48.6 / 79.5, 63.0 / 79.6); from 129
// on the element kernel's 32 lanes a row win (131072x129 47.7 / 46.1, 55.8 / 52.1; 65536x257
// 44.9 / 39.6, 65.2 / 51.2; 16384x1001 36.1 / 32.3, 65.1 / 54.1). Backward: up to 64 (524288x33
// 60.9 / 61.4, 76.6 / 88.8) and from 257 (65536x257 53.7 / 67.0, 77.0 / 97.5; 16384x1001
// 57.6 / 119.4, 85.5 / 179.6); between, elements (262144x77 63.5 / 51.9, 87.6 / 88.2; 131072x129
// 61.3 / 45.5, 74.2 / 73.6). Unexplained: the window warp kernels carry the edge tests and 54-56
// registers (16-bit) against the element kernels' 20-40; not profiled. A masked forward takes the
// window at every width: the element kernel's flag-at-a-time mask reads lost wherever measured
// (session 30, masked 16384x1001 50.9 / 116.9, 73.0 / 133.1; 262144x77 62.6 / 79.5, 73.6 / 79.9);
// the masked backward follows the unmasked rule (262144x77 79.0 / 64.3; 16384x1001 73.2 / 123.7).
constexpr int64_t kForwardWarpWindowMaxCols = 128;
constexpr int64_t kBackwardWarpWindowMaxShortCols = 64;
constexpr int64_t kBackwardWarpWindowMinCols = 257;

// Windows longer than these leave the warp kernels for the cp.async cached ones (one block a
// row). H100, session 30, µs warp / cached, window rows: float32 16384x1001 forward 54.1 / 46.6,
// masked 72.9 / 52.4, backward 85.0 / 72.9, masked 94.6 / 80.1; 16384x769 forward 38.5 / 38.2,
// masked 59.6 / 45.7, backward 65.3 / 56.8; 32768x513 forward 58.4 / 63.4, masked 84.8 / 76.5,
// backward 87.3 / 77.2, masked 98.2 / 85.0. bf16: the warp forward wins at every width (1001
// 32.7 / 47.7, masked 51.0 / 58.6; 513 49.5 / 84.5), the backward loses from ~1000 (1001 57.8 /
// 48.4, masked 73.3 / 62.1; 769 48.1 / 46.4, 61.1 / 60.2; 513 66.5 / 85.4). Rows that are whole
// packs measured within a few % either way (1024, 520, 776) and keep the warp kernels.
template <class T>
int64_t forward_warp_window_limit(bool masked) {
  if (sizeof(T) < 4) return kWarpMaxCols;
  return masked ? 512 : 768;
}
template <class T>
int64_t backward_warp_window_limit() {
  return sizeof(T) < 4 ? 768 : 512;
}

// Which rows that are not whole packs the tiled kernels take (softmax_tiled.cuh), against the
// window and element warp kernels. H100, session 31 runs 3 and 7, µs tiled / warp, 80 % masks:
//  - 16-bit backward, every width to 512: 524288x33 47.8 / 60.9, 262144x77 46.7 / 52.3,
//    131072x197 57.9 / 69.2, 65536x383 60.0 / 70.2, 32768x509 41.5 / 64.5; masked 54.4 / 64.3 (77),
//    67.6 / 102.8 (197), 48.2 / 81.5 (509).
//  - 16-bit forward to 256: 33 39.9 / 47.5, 77 41.0 / 48.8, 129 38.1 / 46.1, 197 48.1 / 51.4,
//    257 38.4 / 39.7; past it the element kernel's whole-warp rows win (383 52.2 / 41.5, 509
//    34.2 / 27.2).
//  - float32 forward to 64 (33: 52.4 / 58.1; 77 66.5 / 62.9, 509 54.4 / 47.0); masked backward to
//    512 (33 81.9 / 87.5, 197 127.4 / 135.7, 509 78.1 / 84.4). The unmasked float32 backward is
//    within a few % either way (77 90.9 / 87.9, 257 75.9 / 76.9) and keeps the warp kernels.
// The tiled kernels run close to their issue limit (ncu, run 6: bf16 262144x77 forward at 74 % of
// the SM's throughput, 53 instructions an element, the same count as the window kernel's); a
// version owning whole packs per thread, with row statistics combined from each pack's parts,
// was slower still (run 7: 77 columns 56.8 µs forward) and was dropped.
bool use_tiled_forward(int64_t cols, int elem_bytes) {
  if (tiled_mode() != WindowMode::kAuto) return tiled_mode() == WindowMode::kAlways && cols <= kTiledMaxCols;
  return cols <= (elem_bytes < 4 ? 256 : 64);
}
bool use_tiled_backward(int64_t cols, int elem_bytes, bool masked) {
  if (tiled_mode() != WindowMode::kAuto) return tiled_mode() == WindowMode::kAlways && cols <= kTiledMaxCols;
  return cols <= kTiledMaxCols && (elem_bytes < 4 || masked);
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
// windows (the limits above), else the cp.async cached kernels (the lean backward on any plan:
// the register-staged one has no window). False when neither applies.
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

// Whether a row that is not whole packs may take the window kernels: 16-byte aligned operands
// (the mask aligned to its packs of P flags), float32 or a 16-bit type, at least one pack a row.
template <class T>
bool use_window(int64_t cols, const void* a, const void* b, const void* c, const void* mask) {
  constexpr int kWide = 16 / sizeof(T);
  if (sizeof(T) > 4 || cols < kWide || window_mode() == WindowMode::kNever) return false;
  for (const void* p : {a, b, c})
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return mask == nullptr || reinterpret_cast<uintptr_t>(mask) % kWide == 0;
}

// 16-byte packs when the row length and pointers allow, else single elements.
template <class T>
bool use_wide_pack(int64_t cols, const void* a, const void* b, const void* c, const void* mask) {
  constexpr int kWide = 16 / sizeof(T);
  const void* ptrs[] = {a, b, c};
  if (pack_size_for<T>(cols, ptrs, c ? 3 : 2) != kWide) return false;
  return mask == nullptr || reinterpret_cast<uintptr_t>(mask) % kWide == 0;
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
