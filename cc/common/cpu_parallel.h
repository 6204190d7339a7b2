// Row ranges of a CPU twin spread over XLA's intra-op thread pool (the FFI's ThreadPool context:
// the pool XLA:CPU runs its own fusions on, so the twins add no threads of their own).
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "common/cpu_parts.h"
#include "xla/ffi/api/ffi.h"

namespace jaxops::cpu {

// JAXOPS_CPU_THREADS=N (read on every call) caps the threads a twin uses at N, the calling one
// included: 1 keeps every twin on the calling thread (tests compare the two, bit for bit).
inline int64_t thread_cap(int64_t threads) {
  const char* e = std::getenv("JAXOPS_CPU_THREADS");
  const long cap = e != nullptr ? std::strtol(e, nullptr, 10) : 0;
  return cap >= 1 ? std::min<int64_t>(threads, cap) : threads;
}

// Calls fn(begin, end) over disjoint ranges covering [0, n), each a multiple of `align` long but
// the last. The calling thread works through the chunks too, and waits only for chunks another
// thread has already taken: the pool may run a task late, inline or never before this returns
// (XLA's contract), and a task that starts after the last chunk was taken returns at once without
// touching fn. fn must not throw. `cost` is the work of one unit in elements (columns of a row).
template <class Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t cost, int64_t align, const Fn& fn) {
  const int64_t threads = n > 0 ? thread_cap(pool.num_threads()) : 0;
  const int64_t per_grain = std::max<int64_t>(1, kParallelGrain / std::max<int64_t>(cost, 1));
  if (threads <= 1 || n <= per_grain) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  // Four chunks a thread evens out uneven rows and a thread that joins late.
  int64_t chunk = std::max(per_grain, (n + 4 * threads - 1) / (4 * threads));
  chunk = (chunk + align - 1) / align * align;
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex m;
    std::condition_variable cv;
    int64_t finished = 0;  // under m
  };
  auto shared = std::make_shared<Shared>();
  // Raw pointer to fn: dereferenced only for a chunk taken before every chunk was, and this
  // function returns only after each such chunk has finished.
  const Fn* f = &fn;
  auto work = [shared, f, n, chunk, chunks] {
    int64_t done = 0;
    for (int64_t c; (c = shared->next.fetch_add(1, std::memory_order_relaxed)) < chunks; ++done)
      (*f)(c * chunk, std::min(n, (c + 1) * chunk));
    if (done == 0) return;
    std::lock_guard<std::mutex> lock(shared->m);
    shared->finished += done;
    if (shared->finished == chunks) shared->cv.notify_all();
  };
  const int64_t helpers = std::min(threads, chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(shared->m);
  shared->cv.wait(lock, [&] { return shared->finished == chunks; });
}

// parallel_for as a ForRanges (for twins that take their ranges as an argument).
inline ForRanges on_pool(xla::ffi::ThreadPool& pool) {
  return [&pool](int64_t n, int64_t cost, const std::function<void(int64_t, int64_t)>& fn) {
    parallel_for(pool, n, cost, 1, fn);
  };
}

}  // namespace jaxops::cpu
