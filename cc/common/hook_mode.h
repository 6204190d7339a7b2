// Test hooks read from the environment: one parser for the variables that force a plan on, off,
// or leave it to the launcher (softmax_test_hooks.h, bn_test_hooks.h).
#pragma once
#include <cstdlib>

namespace jaxops {

enum class HookMode { kAuto, kNever, kAlways };

// A hook's mode from its variable: unset or empty kAuto, "0..." kNever, anything else kAlways.
inline HookMode hook_mode(const char* name) {
  const char* e = std::getenv(name);
  if (e == nullptr || e[0] == '\0') return HookMode::kAuto;
  return e[0] == '0' ? HookMode::kNever : HookMode::kAlways;
}

}  // namespace jaxops
