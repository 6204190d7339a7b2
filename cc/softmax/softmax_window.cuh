// Rows that are not whole 16-byte packs (a vocabulary of 50257, 77 or 197 tokens), read and
// written in 16-byte packs through each row's aligned window.
#pragma once
#include <cstdint>

#include <cuda_pipeline.h>

#include "common/cuda_util.cuh"

namespace jaxops::softmax {

using namespace jaxops::cuda;

// A row's aligned window: the packs of P elements from the one holding the row's first element
// to the one holding its last. The window's first and last packs may hold elements of the
// neighbouring rows: loads read them and replace them by a fill value (-inf for the forward, 0
// for the backward), stores write only this row's elements, one at a time. Only the last pack
// of the array may reach past the array's end, so every load checks against `total`.
// Element loads of the same rows read 2-16x more instructions and reach 0.33-0.67 of the copy
// bandwidth on H100 (session 28: bf16 2048x50257 forward 0.38, 262144x77 0.33).
template <int P>
struct RowWindow {
  int64_t base;  // array index of the window's first element, a multiple of P
  int lead;      // elements of the previous row before this row's first
  int64_t end;   // window index one past the row's last element: lead + cols
  int64_t packs;

  __device__ __forceinline__ RowWindow(int64_t row, int64_t cols) {
    const int64_t first = row * cols;
    lead = int(first & (P - 1));
    base = first - lead;
    end = lead + cols;
    packs = (end + P - 1) / P;
  }
  // Whether window pack j holds elements of another row (or none past the array).
  __device__ __forceinline__ bool edge(int64_t j) const { return (j == 0 && lead != 0) || (j + 1) * P > end; }
  __device__ __forceinline__ bool inside(int64_t e) const { return e >= lead && e < end; }
};

// Columns the widest window of a row of `cols` spans: what the kernels' shapes and plans hold.
template <int P>
constexpr int64_t window_cols(int64_t cols) {
  return (cols + 2 * (P - 1)) / P * P;
}

// The pack at array index g (a multiple of P); elements at or past `total` read as `fill`.
template <class T, int P>
__device__ __forceinline__ Pack<T, P> load_window_pack(const T* __restrict__ src, int64_t g, int64_t total, T fill) {
  if (g + P <= total) return load_pack<T, P>(src + g);
  Pack<T, P> pk;
#pragma unroll
  for (int p = 0; p < P; ++p) pk.v[p] = g + p < total ? src[g + p] : fill;
  return pk;
}

// Replaces the elements of window pack j that are not the row's by `fill`.
template <class T, int P>
__device__ __forceinline__ void fill_outside(Pack<T, P>& pk, const RowWindow<P>& w, int64_t j, T fill) {
  if (!w.edge(j)) return;
#pragma unroll
  for (int p = 0; p < P; ++p)
    if (!w.inside(j * P + p)) pk.v[p] = fill;
}

// Stores window pack j of the row: whole when it is the row's alone, else its row elements.
template <class T, int P>
__device__ __forceinline__ void store_window_pack(T* __restrict__ dst, const RowWindow<P>& w, int64_t j,
                                                  const Pack<T, P>& pk) {
  T* const at = dst + w.base + j * P;
  if (!w.edge(j)) {
    store_pack<T, P>(at, pk);
    return;
  }
#pragma unroll
  for (int p = 0; p < P; ++p)
    if (w.inside(j * P + p)) at[p] = pk.v[p];
}

// Requests the 16-byte pack at array index g into a shared-memory entry by cp.async; the
// array's last pack, when it reaches past the end, is copied element by element (its elements
// past the end are not the row's: fill_cached_edges replaces them).
template <class T, int P>
__device__ __forceinline__ void request_window_pack(T* entry, const T* __restrict__ src, int64_t g, int64_t total) {
  if (g + P <= total) {
    __pipeline_memcpy_async(entry, src + g, sizeof(Pack<T, P>));
    return;
  }
#pragma unroll
  for (int p = 0; p < P; ++p) entry[p] = g + p < total ? src[g + p] : src[total - 1];
}

// Requests this thread's packs [0, npacks) of a block's slice starting at window pack j0.
template <class T, int P>
__device__ __forceinline__ void request_window_slice(T* cache, const T* __restrict__ src, const RowWindow<P>& w,
                                                     int64_t j0, unsigned npacks, int64_t total) {
  for (unsigned i = threadIdx.x; i < npacks; i += blockDim.x)
    request_window_pack<T, P>(cache + i * P, src, w.base + (j0 + i) * P, total);
  __pipeline_commit();
}

// After the slice has arrived: the threads that requested the window's edge packs (the slice's
// first and last at most) replace their other rows' elements by `fill` in the cache. Each
// thread touches only packs it requested itself, so no barrier is needed.
template <class T, int P>
__device__ __forceinline__ void fill_cached_edges(T* cache, const RowWindow<P>& w, int64_t j0, unsigned npacks,
                                                  T fill) {
  if (npacks == 0) return;
  const unsigned ends[2] = {0, npacks - 1};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const unsigned i = ends[k];
    if (i % blockDim.x != threadIdx.x || (k == 1 && i == 0)) continue;
    if (!w.edge(j0 + i)) continue;
    Pack<T, P> pk = load_pack<T, P>(cache + i * P);
    fill_outside<T, P>(pk, w, j0 + i, fill);
    store_pack<T, P>(cache + i * P, pk);
  }
}

// Packs of a row's window that fall in the slice [j0, j0 + slice_packs) of window packs.
template <int P>
__device__ __forceinline__ unsigned slice_packs(const RowWindow<P>& w, int64_t j0, int64_t slice_packs_max) {
  const int64_t left = w.packs - j0;
  return left <= 0 ? 0u : unsigned(left < slice_packs_max ? left : slice_packs_max);
}

}  // namespace jaxops::softmax
