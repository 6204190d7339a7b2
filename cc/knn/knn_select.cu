// CUDA selection kernel: merges one tile of reference columns into every query's running top-k.
//
// One block per query row (128 or 256 threads). The row's running list lives in shared memory as
// K sorted 64-bit keys (knn_key.h). Threads stream the tile row with 16-byte loads, turn each
// value into a key (fused GEMM epilogue ||q||^2 + ||r||^2 - 2 q.r, clamp, NaN last) and keep only
// keys below the current k-th key: after the first few hundred columns almost everything is
// rejected by one compare, so the kernel runs at the speed of reading the tile once. Survivors
// go to a shared candidate buffer of max(K, 1024) slots (a warp-aggregated integer shared-memory
// atomic picks the slots; the order they land in does not matter because keys are unique).
// When the buffer fills, the
// block sorts it (bitonic) and merges it into the list with one bitonic merge, which lowers the
// threshold. Candidates that find the buffer full stay pending in registers and are retried
// against the new threshold, so nothing is dropped or inserted twice. No float atomics: the
// result is a pure function of the inputs.
#include <cstdint>

#include "common/cuda_util.cuh"
#include "knn/knn_key.h"
#include "knn/knn_select_cuda.h"

namespace jaxops::knn {
namespace {

constexpr int kUnroll = 4;  // 16-byte loads in flight per thread per step

struct Shared {
  int count;  // candidates written to buf since the last flush (may exceed K: overflow)
};

// Ascending bitonic sort of s[0, size), size a power of two; every thread of the block calls it.
__device__ void bitonic_sort(uint64_t* s, int size) {
  const int half = size / 2;
  for (int span = 2; span <= size; span <<= 1) {
    for (int stride = span / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < half; t += blockDim.x) {
        const int i = 2 * stride * (t / stride) + (t % stride);
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

// Sorts a bitonic sequence s[0, size) ascending (the half-cleaner network).
__device__ void bitonic_merge(uint64_t* s, int size) {
  const int half = size / 2;
  for (int stride = half; stride > 0; stride >>= 1) {
    for (int t = threadIdx.x; t < half; t += blockDim.x) {
      const int i = 2 * stride * (t / stride) + (t % stride);
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
__device__ void flush(uint64_t* list, uint64_t* buf, int count, int K, int cap, Shared* sh) {
  const int c = count < cap ? count : cap;
  int size = 1;
  while (size < c) size <<= 1;
  for (int i = c + threadIdx.x; i < size; i += blockDim.x) buf[i] = kEmptyKey;
  __syncthreads();
  if (size > 1) bitonic_sort(buf, size);
  // With buf sorted, only its first K keys can enter the list. min(list[i], buf[K-1-i]) is
  // bitonic and holds the K smallest of both sorted lists.
  for (int i = threadIdx.x; i < K; i += blockDim.x) {
    const int j = K - 1 - i;
    const uint64_t b = j < size ? buf[j] : kEmptyKey;
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
__global__ void __launch_bounds__(256) select_kernel(SelectView v, SelectBuffers b, int K, int cap) {
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

  constexpr int kPer = kUnroll * VEC;  // elements per thread per step
  const int64_t step = static_cast<int64_t>(blockDim.x) * kPer;
  for (int64_t start = 0; start < limit; start += step) {
    float d[kPer];
    unsigned pending = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c0 = start + (static_cast<int64_t>(u) * blockDim.x + threadIdx.x) * VEC;
      if (c0 < limit) {  // c0 < limit <= cols, and cols % VEC == 0: the whole vector is in bounds
        float t[VEC], r[VEC];
        if constexpr (VEC == 4) {
          const float4 tv = *reinterpret_cast<const float4*>(tile + c0);
          t[0] = tv.x; t[1] = tv.y; t[2] = tv.z; t[3] = tv.w;
          if (!v.distances) {
            const float4 rv = *reinterpret_cast<const float4*>(rn + c0);
            r[0] = rv.x; r[1] = rv.y; r[2] = rv.z; r[3] = rv.w;
          }
        } else {
          t[0] = tile[c0];
          if (!v.distances) r[0] = rn[c0];
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float dist = v.distances ? t[e] : (qn + r[e]) - 2.0f * t[e];
          d[u * VEC + e] = clamp_distance(dist);
          if (c0 + e < limit) pending |= 1u << (u * VEC + e);
        }
      }
    }
    // Offer candidates; retry the ones that found the buffer full after each flush.
    while (true) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int bit = u * VEC + e;
          // Warp-aggregated slot allocation: one shared atomic per warp and element, not per
          // survivor (the first columns of a row nearly all survive). Loops are uniform, so
          // every lane reaches the ballot.
          const bool live = pending & (1u << bit);
          const int64_t c = start + (static_cast<int64_t>(u) * blockDim.x + threadIdx.x) * VEC + e;
          const bool want = live && make_key(d[bit], static_cast<uint32_t>(base + c)) < thr;
          const unsigned votes = __ballot_sync(0xffffffffu, want);
          if (votes) {
            const int lane = threadIdx.x & 31;
            const int leader = __ffs(votes) - 1;
            int first = 0;
            if (lane == leader) first = atomicAdd(&sh.count, __popc(votes));
            first = __shfl_sync(0xffffffffu, first, leader);
            const int slot = first + __popc(votes & ((1u << lane) - 1u));
            if (want && slot < cap) buf[slot] = make_key(d[bit], static_cast<uint32_t>(base + c));
            if (want && slot < cap) pending &= ~(1u << bit);
          }
          if (live && !want) pending &= ~(1u << bit);
        }
      }
      __syncthreads();
      const int count = sh.count;
      const int more = __syncthreads_or(pending != 0);  // also orders the read above before any reset
      if (count >= cap || more) {
        flush(list, buf, count, K, cap, &sh);
        thr = list[k - 1];
      }
      if (!more) break;
    }
  }
  __syncthreads();
  const int count = sh.count;
  __syncthreads();
  if (count > 0) flush(list, buf, count, K, cap, &sh);
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
  if (vec4) {
    select_kernel<4><<<grid, threads, smem, stream>>>(v, b, K, cap);
  } else {
    select_kernel<1><<<grid, threads, smem, stream>>>(v, b, K, cap);
  }
  return cudaGetLastError();
}

}  // namespace jaxops::knn
