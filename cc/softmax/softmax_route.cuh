// CUDA softmax / log_softmax over the last axis: what the forward (softmax_forward.cu) and the
// backward (softmax_backward.cu) launchers share.
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
#pragma once
#include <cstdint>

#include "common/cuda_util.cuh"
#include "softmax/softmax_test_hooks.h"

namespace jaxops::softmax {

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
  if (cuda::pack_size_for<T>(cols, ptrs, c ? 3 : 2) != kWide) return false;
  return mask == nullptr || reinterpret_cast<uintptr_t>(mask) % kWide == 0;
}

}  // namespace jaxops::softmax
