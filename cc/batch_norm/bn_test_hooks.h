// Test hooks of the batch_norm CUDA launchers.
//
// JAXOPS_BN_ELEMENT_LOADS=1 (read once per process)
// makes every kernel take its element-load path, as for operands that are not 16-byte aligned.
// XLA hands out aligned buffers, so a misaligned operand cannot be built from JAX; with the hook,
// tests/test_batch_norm.py::test_gpu_results_independent_of_alignment checks in a subprocess that
// the statistics, gradient sums and outputs are bit-identical to the vector-load path's (the
// plan and the order of additions must not depend on where XLA put the operands).
#pragma once
#include <cstdlib>
#include <cstring>

#include "common/hook_mode.h"

namespace jaxops::batch_norm {

inline bool force_element_loads() {
  static const bool on = hook_mode("JAXOPS_BN_ELEMENT_LOADS") == HookMode::kAlways;
  return on;
}

// JAXOPS_BN_RESIDENT=0 (read once per process) turns off the one-kernel training forwards
// (bn_resident.cu, bn_hybrid.cu), so tests and benchmarks can run the streaming kernels on
// those shapes too.
inline bool resident_path_disabled() {
  static const bool off = hook_mode("JAXOPS_BN_RESIDENT") == HookMode::kNever;
  return off;
}

// JAXOPS_BN_MERGE=all, =spread or =chan (read once per process) forces the resident forward's
// merge of the blocks' partials (bn_resident.cu): every block summing all of them, the sums spread
// over the grid, or the Chan merge spread over the grid (what grids past 160 blocks take); unset,
// the launcher picks by shape. Returns 0 (unset), 1 (all), 2 (spread) or 3 (chan).
inline int merge_mode() {
  static const int mode = [] {
    const char* e = std::getenv("JAXOPS_BN_MERGE");
    if (e == nullptr) return 0;
    if (std::strcmp(e, "all") == 0) return 1;
    if (std::strcmp(e, "spread") == 0) return 2;
    if (std::strcmp(e, "chan") == 0) return 3;
    return 0;
  }();
  return mode;
}

// JAXOPS_BN_RESIDUAL_SMEM=0 or =1 (read once per process) forces the resident forward's staging
// of the residual slice in shared memory (bn_resident.cu) off, or on wherever it fits; unset, the
// launcher picks by slice size (kAuto). Staging moves where the residual is read from, not the
// arithmetic: results are bit-identical either way.
inline HookMode residual_stage_mode() {
  static const HookMode mode = hook_mode("JAXOPS_BN_RESIDUAL_SMEM");
  return mode;
}

// JAXOPS_BN_ONEPASS=0 (read once per process) turns off the resident forward's one-pass block
// statistics (bn_resident.cu, kOnePassShift): every block makes the exact second pass about its
// mean, as all blocks whose pivot is far from their mean do anyway.
inline bool one_pass_disabled() {
  static const bool off = hook_mode("JAXOPS_BN_ONEPASS") == HookMode::kNever;
  return off;
}

}  // namespace jaxops::batch_norm
