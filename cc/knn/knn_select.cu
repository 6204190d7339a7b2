// CUDA selection kernel: merges one tile of reference columns into every query's running top-k.
//
// One block per query row (128 or 256 threads). The row's running list lives in shared memory as
// K sorted 64-bit keys (knn_key.h). Threads stream the tile row with 16-byte loads (streaming
// loads for the tile, cached loads for the reference norms every row re-reads), turn each value
// into a distance (fused GEMM epilogue ||q||^2 + ||r||^2 - 2 q.r, clamp, NaN last) and test it
// against the current k-th key with one 32-bit compare; a step in which no thread of the block
// has a possible candidate costs that compare and one barrier, so once the threshold is good
// the kernel runs at the speed of reading the tile once. Possible candidates get the exact
// 64-bit test and a slot in a shared candidate buffer of max(K, 1024) slots (a warp-aggregated
// integer shared-memory atomic picks the slots; the order they land in does not matter because
// keys are unique). When the buffer holds 2K keys (or is full) the block flushes it: a bitonic
// sort of runs of K keys, rounds of "min of an ascending and a descending run + bitonic merge"
// that keep the K smallest, and one bitonic merge into the list, which lowers the threshold.
// Candidates that find the buffer full stay pending in registers and are retried against the
// new threshold, so nothing is dropped or inserted twice. The first tile of a row (empty list)
// seeds its threshold from the minima of the first step's parts instead of admitting
// everything until the first flush. No float atomics: the result is a pure function of the
// inputs.
#include <cstdint>

#include "common/cuda_util.cuh"
#include "common/launch.cuh"
#include "knn/knn_key.h"
#include "knn/knn_select_cuda.h"

namespace jaxops::knn {
namespace {

constexpr int kUnroll = 4;  // 16-byte loads in flight per thread per step

struct Shared {
  int count;  // candidates written to buf since the last flush (may exceed K: overflow)
};

// Loads VEC consecutive floats: a 16-byte vector for VEC = 4. The tile is read once, so it
// uses streaming (evict-first) loads; the reference norms, which every row of the tile
// re-reads, use cached read-only loads and stay in L1/L2.
template <int VEC>
__device__ __forceinline__ void load_vec(float* out, const float* p, bool streaming) {
  if constexpr (VEC == 4) {
    const float4 x = streaming ? __ldcs(reinterpret_cast<const float4*>(p))
                               : __ldg(reinterpret_cast<const float4*>(p));
    out[0] = x.x; out[1] = x.y; out[2] = x.z; out[3] = x.w;
  } else {
    out[0] = streaming ? __ldcs(p) : __ldg(p);
  }
}

// Lower element of compare-exchange pair t at a power-of-two stride: 2*stride*(t/stride) +
// t%stride, with masks instead of integer division (the division dominated the flush cost).
__device__ __forceinline__ int pair_index(int t, int stride) {
  const int lo = t & (stride - 1);
  return ((t - lo) << 1) | lo;
}

// Bitonic sort stages of span 2..max_span over s[0, size) (powers of two). max_span == size:
// an ascending sort. max_span < size: runs of max_span keys, sorted ascending and descending
// alternately (run j ascending iff j is even), ready for select_smallest. Every thread calls it.
__device__ void bitonic_sort_runs(uint64_t* s, int size, int max_span) {
  const int half = size / 2;
  for (int span = 2; span <= max_span; span <<= 1) {
    for (int stride = span / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < half; t += blockDim.x) {
        const int i = pair_index(t, stride);
        const int j = i + stride;
        const bool ascending = (i & span) == 0;
        const uint64_t a = s[i], b = s[j];
        if ((a > b) == ascending) {
          s[i] = b;
          s[j] = a;
        }
      }
      __syncthreads();
    }
  }
}

// s[0, size) holds runs of K keys sorted alternately ascending/descending (size = K * 2^R).
// Leaves the K smallest keys of s sorted ascending in s[0, K), with about half the
// compare-exchanges of a full sort when size >> K (the first tile's 1024-key flushes at small
// K): each round takes min(a[i], b[i]) of a pair of runs (a ascending, b descending), which is
// bitonic and holds the K smallest of both, and sorts it with a bitonic merge, ascending or
// descending so that the next round again pairs an ascending with a descending run. Surviving
// runs stay in place, at spacing 2 * gap; every thread calls it.
__device__ void select_smallest(uint64_t* s, int size, int K, int log_k) {
  for (int gap = K; gap < size; gap <<= 1) {
    const int runs = size / (2 * gap);  // runs left after this round
    for (int e = threadIdx.x; e < runs * K; e += blockDim.x) {
      const int a = 2 * gap * (e >> log_k) + (e & (K - 1));
      const uint64_t x = s[a], y = s[a + gap];
      if (y < x) s[a] = y;
    }
    __syncthreads();
    for (int stride = K / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < runs * (K / 2); t += blockDim.x) {
        const int j = t >> (log_k - 1);  // run index
        const int i = 2 * gap * j + pair_index(t & (K / 2 - 1), stride);
        const bool ascending = (j & 1) == 0;
        const uint64_t x = s[i], y = s[i + stride];
        if ((x > y) == ascending) {
          s[i] = y;
          s[i + stride] = x;
        }
      }
      __syncthreads();
    }
  }
}

// Sorts a bitonic sequence s[0, size) ascending (the half-cleaner network).
__device__ void bitonic_merge(uint64_t* s, int size) {
  const int half = size / 2;
  for (int stride = half; stride > 0; stride >>= 1) {
    for (int t = threadIdx.x; t < half; t += blockDim.x) {
      const int i = pair_index(t, stride);
      const int j = i + stride;
      const uint64_t a = s[i], b = s[j];
      if (a > b) {
        s[i] = b;
        s[j] = a;
      }
    }
    __syncthreads();
  }
}

// Merges the first min(count, cap) keys of buf into the sorted list of K keys, keeping the K
// smallest. Called by every thread after a barrier that made buf and count visible.
__device__ void flush(uint64_t* list, uint64_t* buf, int count, int K, int log_k, int cap,
                      Shared* sh) {
  const int c = count < cap ? count : cap;
  int size = 1;
  while (size < c) size <<= 1;
  for (int i = c + threadIdx.x; i < size; i += blockDim.x) buf[i] = kEmptyKey;
  __syncthreads();
  if (size > K) {
    bitonic_sort_runs(buf, size, K);
    select_smallest(buf, size, K, log_k);
  } else if (size > 1) {
    bitonic_sort_runs(buf, size, size);
  }
  // buf[0, sorted) is ascending and holds the smallest keys of the buffer; only they can enter
  // the list. min(list[i], buf[K-1-i]) is bitonic and holds the K smallest of both lists.
  const int sorted = size < K ? size : K;
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const int j = K - 1 - i;
    const uint64_t b = j < sorted ? buf[j] : kEmptyKey;
    const uint64_t a = list[i];
    list[i] = b < a ? b : a;
  }
  __syncthreads();
  bitonic_merge(list, K);
  if (threadIdx.x == 0) sh->count = 0;
  __syncthreads();
}

// VEC = 4: the row is read as float4 (cols % 4 == 0 and 16-byte aligned rows); VEC = 1 otherwise.
template <int VEC>
__global__ void __launch_bounds__(256, 4) select_kernel(SelectView v, SelectBuffers b, int K, int cap) {
  cuda::enter_kernel();
  extern __shared__ uint64_t smem[];
  uint64_t* list = smem;     // K keys, ascending
  uint64_t* buf = smem + K;  // cap >= K candidate slots
  __shared__ Shared sh;

  const int64_t row = blockIdx.x;  // flattened (batch, rows)
  const int64_t bt = row / v.rows;
  const int64_t k = v.k;
  const int64_t cols = v.cols;
  const int64_t base = b.base[v.base_per_batch ? bt : 0];
  const int64_t limit_raw = v.n - base < cols ? v.n - base : cols;
  const int64_t limit = limit_raw > 0 ? limit_raw : 0;
  const float* tile = b.tile + row * cols;
  const float* rn = b.rn + bt * cols;
  const float qn = v.distances ? 0.0f : b.qn[row];
  const int log_k = __ffs(K) - 1;  // K is a power of two >= 32
  // Flush once the buffer holds 2K keys (at least 128, at most cap), not only when it is
  // full: while the threshold is still loose (first tile) a flush of 2K keys is cheap (one
  // selection round) and tightens the threshold early, so far fewer keys are admitted and
  // sorted later. A step may still fill the buffer up to cap before its flush.
  const int flush_at = 2 * K < 128 ? 128 : (2 * K < cap ? 2 * K : cap);

  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    uint64_t key = kEmptyKey;
    if (i < k) {
      const int32_t idx = b.prev_i[row * k + i];
      if (idx >= 0) key = make_key(clamp_distance(b.prev_d[row * k + i]), static_cast<uint32_t>(idx));
    }
    list[i] = key;
  }
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  // The running list arrives sorted: it is the previous call's output or all-empty.
  uint64_t thr = list[k - 1];
  // Seed the first tile's threshold (see below) for K <= 256 (128 threads, a pool of >= 2k
  // keys). Uniform across the block.
  const bool seed = thr == kEmptyKey && K <= 256;
  uint64_t seed_thr = kEmptyKey;  // the seed bound, kept as a cap on later thresholds

  constexpr int kPer = kUnroll * VEC;  // elements per thread per step
  const int64_t step = static_cast<int64_t>(blockDim.x) * kPer;
  for (int64_t start = 0; start < limit; start += step) {
    float d[kPer];
    unsigned pending = 0;
    if (start + step <= limit) {
      // Whole step in bounds (every step but a row's last): all loads are issued before any
      // is used, so each thread keeps kUnroll tile vectors (and norm vectors) in flight. A
      // per-vector bounds branch between them would make each load wait for the previous
      // one's arithmetic, leaving ~one load in flight per thread.
      float t[kPer], r[kPer];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        load_vec<VEC>(t + u * VEC, tile + start + (u * blockDim.x + threadIdx.x) * VEC, true);
      if (!v.distances) {  // uniform
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          load_vec<VEC>(r + u * VEC, rn + start + (u * blockDim.x + threadIdx.x) * VEC, false);
      }
#pragma unroll
      for (int bit = 0; bit < kPer; ++bit)
        d[bit] = clamp_distance(v.distances ? t[bit] : (qn + r[bit]) - 2.0f * t[bit]);
      pending = kPer == 32 ? ~0u : (1u << kPer) - 1u;
    } else {  // the row's last, partial step: per-vector bounds checks
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c0 = start + (static_cast<int64_t>(u) * blockDim.x + threadIdx.x) * VEC;
        if (c0 < limit) {  // c0 < limit <= cols and cols % VEC == 0: the vector is in bounds
          float t[VEC], r[VEC];
          load_vec<VEC>(t, tile + c0, true);
          if (!v.distances) load_vec<VEC>(r, rn + c0, false);
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            d[u * VEC + e] = clamp_distance(v.distances ? t[e] : (qn + r[e]) - 2.0f * t[e]);
            if (c0 + e < limit) pending |= 1u << (u * VEC + e);  // n - base may be odd
          }
        }
      }
    }
    // First tile of a row (empty running list, so thr is +inf): seed the threshold from this
    // step instead of admitting all of it and sorting the 1024-slot buffer. Every thread
    // offers the smallest key of each of `groups` parts of its elements, a pool of
    // groups * blockDim >= 2k keys; the k-th smallest key s of the pool has >= k keys <= s in
    // this row, so the final k-th key is <= s and "key <= s" (key < s + 1) admits every key
    // that can be in the result. For k = 32 (pool of 256 minima of 8) s is about the 1.7%
    // quantile of the step, close to the k-th of all 2048 keys (1.6%), for one sort of 256
    // keys; without the seed the first flush sorts 1024 keys and leaves the k-th of those
    // (3.1%). Emulated on the host: tile 1 at k = 32 admits ~240 keys instead of ~3100.
    if (seed && start == 0) {
      const int groups = K <= 128 ? 2 : 4;  // pool = 256 (k <= 128) or 512 (k <= 256) keys
      uint64_t g[4] = {kEmptyKey, kEmptyKey, kEmptyKey, kEmptyKey};  // minima of quarters
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int bit = u * VEC + e;
          const int64_t c = (static_cast<int64_t>(u) * blockDim.x + threadIdx.x) * VEC + e;
          const uint64_t key = (pending & (1u << bit))
                                   ? make_key(d[bit], static_cast<uint32_t>(base + c))
                                   : kEmptyKey;
          const int q = bit / (kPer / 4);
          g[q] = key < g[q] ? key : g[q];
        }
      }
      if (groups == 2) {
        g[0] = g[1] < g[0] ? g[1] : g[0];
        g[1] = g[3] < g[2] ? g[3] : g[2];
      }
      buf[threadIdx.x] = g[0];  // constant indices keep g in registers
      buf[threadIdx.x + blockDim.x] = g[1];
      if (groups == 4) {
        buf[threadIdx.x + 2 * blockDim.x] = g[2];
        buf[threadIdx.x + 3 * blockDim.x] = g[3];
      }
      __syncthreads();  // buf is empty at the first step; pool <= 512 <= cap
      const int pool = groups * blockDim.x;
      bitonic_sort_runs(buf, pool, pool);  // ends with a barrier
      const uint64_t sk = buf[k - 1];
      __syncthreads();  // every thread has read buf[k - 1] before the offers overwrite buf
      if (sk != kEmptyKey) seed_thr = sk + 1;
      thr = thr < seed_thr ? thr : seed_thr;
    }
    // Fast path: key < thr implies (raw distance bits) <= (high word of thr) -- a clamped
    // distance is +0 or positive, or NaN, whose raw bits only pass when thr's high word is
    // all ones (an empty or NaN threshold) -- so one 32-bit compare per element and one
    // barrier per step reject the whole step in the common case (no candidate in the block).
    // The exact 64-bit test follows only for steps where some thread may have a candidate.
    {
      const uint32_t thr_hi = static_cast<uint32_t>(thr >> 32);
      unsigned maybe = 0;
#pragma unroll
      for (int bit = 0; bit < kPer; ++bit)
        maybe |= static_cast<unsigned>(__float_as_uint(d[bit]) <= thr_hi) << bit;
      // Elements failing the filter fail every later (lower) threshold too: drop them now.
      pending &= maybe;
      // Invariant at every step start: sh.count < flush_at <= cap (each step ends with a
      // flush once the buffer holds flush_at keys), so skipping a step never leaves a full
      // buffer behind.
      if (!__syncthreads_or(pending != 0)) continue;
    }
    // Offer candidates; retry the ones that found the buffer full after each flush.
    while (true) {
      // Elements no lane of the warp still offers skip the ballot (uniform per warp).
      const unsigned warp_live = __reduce_or_sync(0xffffffffu, pending);
      if (warp_live) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const int bit = u * VEC + e;
            if (!(warp_live & (1u << bit))) continue;
            // Warp-aggregated slot allocation: one shared atomic per warp and element, not
            // per survivor (the first columns of a row nearly all survive). Loops are
            // uniform, so every lane reaches the ballot.
            const bool live = pending & (1u << bit);
            const int64_t c =
                start + (static_cast<int64_t>(u) * blockDim.x + threadIdx.x) * VEC + e;
            const uint64_t key = make_key(d[bit], static_cast<uint32_t>(base + c));
            const bool want = live && key < thr;
            const unsigned votes = __ballot_sync(0xffffffffu, want);
            if (votes) {
              const int lane = threadIdx.x & 31;
              const int leader = __ffs(votes) - 1;
              int first = 0;
              if (lane == leader) first = atomicAdd(&sh.count, __popc(votes));
              first = __shfl_sync(0xffffffffu, first, leader);
              const int slot = first + __popc(votes & ((1u << lane) - 1u));
              if (want && slot < cap) {
                buf[slot] = key;
                pending &= ~(1u << bit);
              }
            }
            if (live && !want) pending &= ~(1u << bit);
          }
        }
      }
      // One barrier: every offer's atomic precedes it, so count is final when read after it;
      // the only reset (end of flush) follows the flush's own barriers, and the next step's
      // atomics follow the next step's barrier, so no read below races with a write.
      const int more = __syncthreads_or(pending != 0);
      const int count = sh.count;
      if (count >= flush_at || more) {
        flush(list, buf, count, K, log_k, cap, &sh);
        thr = list[k - 1] < seed_thr ? list[k - 1] : seed_thr;
      }
      if (!more) break;
    }
  }
  __syncthreads();
  const int count = sh.count;
  __syncthreads();
  if (count > 0) flush(list, buf, count, K, log_k, cap, &sh);
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    b.out_d[row * k + i] = key_distance(list[i]);
    b.out_i[row * k + i] = key_index(list[i]);
  }
}

}  // namespace

cudaError_t select_cuda(const SelectView& v, const SelectBuffers& b, cudaStream_t stream) {
  const int64_t rows = v.batch * v.rows;
  if (rows == 0) return cudaSuccess;
  if (v.k < 1 || v.k > kMaxCudaK || rows > INT32_MAX) return cudaErrorInvalidValue;
  int K = 32;
  while (K < v.k) K <<= 1;
  const int threads = K >= 1024 ? 256 : 128;
  // A buffer of at least 1024 slots: the first tile of a row accepts nearly every column until
  // the list fills, and a small buffer would then flush after every few columns.
  const int cap = K > 1024 ? K : 1024;
  const size_t smem = static_cast<size_t>(K + cap) * sizeof(uint64_t);
  const dim3 grid(static_cast<unsigned>(rows));
  const bool vec4 = v.cols % 4 == 0 && reinterpret_cast<uintptr_t>(b.tile) % 16 == 0 &&
                    (v.distances || reinterpret_cast<uintptr_t>(b.rn) % 16 == 0);
  return cuda::launch_kernel(vec4 ? select_kernel<4> : select_kernel<1>, grid, threads, smem, stream, v, b, K, cap);
}

}  // namespace jaxops::knn
