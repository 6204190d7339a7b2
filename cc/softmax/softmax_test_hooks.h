// Test hooks of the softmax CUDA launchers.
#pragma once
#include <cstdlib>

namespace jaxops::softmax {

enum class WindowMode { kAuto, kAlways, kNever };

// JAXOPS_SOFTMAX_WINDOW (read once per process) overrides which rows that are not whole 16-byte
// packs read through their aligned windows (softmax_window.cuh): 0 none (element loads), 1
// every row the window kernels can take; unset, the launcher's measured rule. Benchmarks
// measure the kernels against each other on the same shapes with it.
inline WindowMode window_mode() {
  static const WindowMode mode = [] {
    const char* e = std::getenv("JAXOPS_SOFTMAX_WINDOW");
    if (e == nullptr || e[0] == '\0') return WindowMode::kAuto;
    return e[0] == '0' ? WindowMode::kNever : WindowMode::kAlways;
  }();
  return mode;
}

}  // namespace jaxops::softmax
