// Test hooks of the softmax CUDA launchers.
#pragma once
#include "common/hook_mode.h"

namespace jaxops::softmax {

using WindowMode = HookMode;

// JAXOPS_SOFTMAX_WINDOW (read once per process) overrides which rows that are not whole 16-byte
// packs read through their aligned windows (softmax_window.cuh): 0 none (element loads), 1
// every row the window kernels can take; unset, the launcher's measured rule. Benchmarks
// measure the kernels against each other on the same shapes with it.
inline WindowMode window_mode() {
  static const WindowMode mode = hook_mode("JAXOPS_SOFTMAX_WINDOW");
  return mode;
}

// JAXOPS_SOFTMAX_TILED (read once per process) overrides which short rows that are not whole
// packs are staged in shared memory by tiles of rows (softmax_tiled.cuh): 0 none (the window or
// element warp kernels), 1 every row the tiled kernels hold; unset, the launcher's rule.
inline WindowMode tiled_mode() {
  static const WindowMode mode = hook_mode("JAXOPS_SOFTMAX_TILED");
  return mode;
}

}  // namespace jaxops::softmax
