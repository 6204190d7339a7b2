// Bit masks of a predicate over a flattened array, one bit per element: bit j of word i is
// element 32*i+j. Built with warp collectives so every warp writes whole, coalesced words.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_util.cuh"

namespace jaxops::cuda {

// Number of uint32 words that hold one bit for each of n elements.
__host__ __device__ constexpr int64_t mask_words(int64_t n) { return (n + 31) / 32; }

// Warp-collective (all 32 lanes must call it). The warp covers a chunk of 32*P consecutive
// elements and lane l holds `bits`, the P predicate bits of elements P*l .. P*l+P-1 (bit k =
// element P*l+k). Returns word w of the chunk (elements 32w .. 32w+31) in lane w, for w < P,
// so lanes 0..P-1 store P consecutive words with one coalesced access.
template <int P>
__device__ __forceinline__ uint32_t warp_mask_words(uint32_t bits) {
  static_assert(P >= 1 && P <= 32 && 32 % P == 0, "P must divide 32");
  if constexpr (P == 1) {
    return __ballot_sync(0xffffffffu, bits != 0u);  // every lane gets the one word
  } else {
    constexpr int kLanesPerWord = 32 / P;
    const int lane = threadIdx.x % 32;
    uint32_t v = bits << ((lane % kLanesPerWord) * P);
    // OR within each group of kLanesPerWord lanes: afterwards every lane of group w holds word w.
#pragma unroll
    for (int offset = kLanesPerWord / 2; offset > 0; offset /= 2)
      v |= __shfl_xor_sync(0xffffffffu, v, offset, kLanesPerWord);
    return __shfl_sync(0xffffffffu, v, (lane % P) * kLanesPerWord);
  }
}

// The P bits of elements e .. e+P-1 (e a multiple of P, P dividing 32: they share one word).
template <int P>
__device__ __forceinline__ uint32_t mask_bits(const uint32_t* __restrict__ mask, int64_t e) {
  const uint32_t word = __ldg(mask + (e >> 5));
  if constexpr (P == 32) return word;
  else return (word >> (e & 31)) & ((1u << P) - 1u);
}

// The single bit of element e.
__device__ __forceinline__ bool mask_bit(const uint32_t* __restrict__ mask, int64_t e) {
  return (__ldg(mask + (e >> 5)) >> (e & 31)) & 1u;
}

// ---- the warp-chunk layout of masked elementwise kernels ----
// A rows x cols array is cut into chunks of 32*P elements per row; one warp owns a chunk and
// lane l its P elements starting at column c0 = chunk_start + P*l (one 16-byte pack), which is
// exactly the layout warp_mask_words expects. Rows are vmap groups; with one row the mask is that
// of the flattened array.
struct WarpChunk {
  int64_t row;  // which row (group)
  int64_t ch;   // chunk index inside the row; its words are ch*P .. ch*P+P-1
  int64_t c0;   // this lane's first column
};

template <int P>
__device__ __forceinline__ WarpChunk warp_chunk(int64_t chunk, int64_t chunks_per_row) {
  WarpChunk c;
  // Unbatched calls (one group) have every chunk in row 0: a compare, not a 64-bit division.
  c.row = chunk < chunks_per_row ? 0 : chunk / chunks_per_row;
  c.ch = chunk - c.row * chunks_per_row;
  c.c0 = c.ch * 32 * P + static_cast<int64_t>(threadIdx.x % 32) * P;
  return c;
}

// 16-byte (or 8/4-byte) vector access of P elements through an unsigned-integer vector. The
// struct copy of cuda::Pack (load_pack/store_pack) is split by nvcc into P scalar stores (PTX of
// session 2: 8 x st.global.u16 per bf16 pack, 4 x st.global.f32 per float pack), which left the
// bf16 elementwise kernels LSU-bound at a quarter of DRAM bandwidth. memcpy between registers
// costs nothing. The store goes through __stwb (an opaque st.global.wb.v4.u32): a plain
// `*(uint4*)p = w` is still split, because LLVM merges it with the scalar tail path that writes
// the same addresses.
template <int Bytes> struct VecWord;
template <> struct VecWord<16> { using type = uint4; };
template <> struct VecWord<8> { using type = uint2; };
template <> struct VecWord<4> { using type = uint32_t; };

template <class T, int P>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, T (&v)[P]) {
  using W = typename VecWord<sizeof(T) * P>::type;
  const W w = __ldg(reinterpret_cast<const W*>(p));
  memcpy(&v, &w, sizeof(W));
}

template <class T, int P>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const T (&v)[P]) {
  using W = typename VecWord<sizeof(T) * P>::type;
  W w;
  memcpy(&w, &v, sizeof(W));
  __stwb(reinterpret_cast<W*>(p), w);
}

// Loads this lane's P elements of row `p` (one vector when `vec` and the run is complete,
// else element by element with zeros past the end).
template <class T, int P>
__device__ __forceinline__ void load_run(const T* __restrict__ p, int64_t c0, int64_t cols, bool vec,
                                         T (&v)[P]) {
  if (vec && c0 + P <= cols) {
    load_vec<T, P>(p + c0, v);
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k) v[k] = c0 + k < cols ? p[c0 + k] : from_acc<T>(acc_t<T>(0));
  }
}

template <class T, int P>
__device__ __forceinline__ void store_run(T* __restrict__ p, int64_t c0, int64_t cols, bool vec,
                                          const T (&v)[P]) {
  if (vec && c0 + P <= cols) {
    store_vec<T, P>(p + c0, v);
  } else {
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (c0 + k < cols) p[c0 + k] = v[k];
  }
}

}  // namespace jaxops::cuda
