// A small host-side memo for launch plans: occupancy queries cost microseconds of host time per
// call, which small kernels would otherwise pay on every launch.
#pragma once
#include <cstdint>
#include <mutex>
#include <vector>

namespace jaxops {

// compute(value)'s result, remembered per (kernel, device, two shape numbers). Each call site (its
// lambda type) has its own memo of at most 256 entries, oldest dropped first. Failures (compute
// returns false) are not remembered.
template <class V, class F>
bool remembered(const void* kernel, int device, int64_t a, int64_t b, V* value, F&& compute) {
  struct Entry {
    const void* kernel;
    int device;
    int64_t a, b;
    V value;
  };
  static std::mutex mutex;
  static std::vector<Entry> memo;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (const Entry& e : memo) {
      if (e.kernel == kernel && e.device == device && e.a == a && e.b == b) {
        *value = e.value;
        return true;
      }
    }
  }
  if (!compute(value)) return false;
  std::lock_guard<std::mutex> lock(mutex);
  if (memo.size() >= 256) memo.erase(memo.begin());
  memo.push_back({kernel, device, a, b, *value});
  return true;
}

}  // namespace jaxops
