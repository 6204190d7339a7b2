// Session 56: the backward of rows that are not whole 16-byte packs past 256 columns (from
// kSkewBwdMinPacks packs), as backward_block<T, 1, true> (a block a slot of rows, x / dy and the
// column sums in shared memory, the same arithmetic: pack_sums / pack_dx) but reading each row as a
// head, 16-byte packs and a tail (layer_norm_skew_block.cuh). backward_block<T, 1> read one
// element a load: rms_norm_bwd 0.47-0.77x XLA past 256 columns (H200, session 51).
// A column's accumulator is touched by the thread that holds the column in this row, which moves
// with the row's head; rows are ordered by the row sums' barriers (a row's dx pass, then the next
// row's sums pass, block_sum2, its dx pass), and the accumulators get barriers of their own after
// they are zeroed and before they are written out. Loads must stay exactly a thread's own columns
// (see the dx pass).
#pragma once
#include <type_traits>

#include "layer_norm/layer_norm_bwd_kernels.cuh"
#include "layer_norm/layer_norm_skew_block.cuh"

namespace jaxops::layer_norm {

// Shared memory of backward_block_skew: nacc x cols float accumulators (rounded up to whole
// 16-byte packs), then the row's x packs and dy packs.
template <class T, int kPack>
inline size_t skew_bwd_smem(int64_t cols, int nacc) {
  return sizeof(float) * nacc * static_cast<size_t>((cols + 3) / 4 * 4) + 2 * 16 * static_cast<size_t>(cols / kPack);
}

// Calls f(kE, width) over a pack's kPack column sums, columns c0 .. c0 + kPack - 1 with
// c0 = kHead + p * kPack (so c0 % 4 == kHead % 4 is known at compile time), in the widest chunks
// (4, 2 or 1 words) whose start is aligned to their size: the accesses are exactly the pack's own
// columns, so ptxas has nothing to merge across a neighbour's words.
template <int kHead, int kPack, int kE = 0, class F>
__device__ __forceinline__ void for_each_sum_chunk(F&& f) {
  if constexpr (kE < kPack) {
    constexpr int kPos = (kHead + kE) % 4;
    constexpr int kWidth = kPos == 0 && kE + 4 <= kPack ? 4 : kPos % 2 == 0 && kE + 2 <= kPack ? 2 : 1;
    f(std::integral_constant<int, kE>{}, std::integral_constant<int, kWidth>{});
    for_each_sum_chunk<kHead, kPack, kE + kWidth>(f);
  }
}

// Loads a pack's column sums from `aligned`; single words come through `opaque` (the same address
// from a head laundered through a shuffle): ptxas could otherwise merge an edge word into a wider
// load reaching the neighbouring thread's columns.
template <int kHead, int kPack>
__device__ __forceinline__ void load_sums(const float* aligned, const float* opaque, float (&v)[kPack]) {
  for_each_sum_chunk<kHead, kPack>([&](auto e, auto width) {
    constexpr int kE = decltype(e)::value, kWidth = decltype(width)::value;
    if constexpr (kWidth == 4) {
      const float4 q = *reinterpret_cast<const float4*>(aligned + kE);
      v[kE] = q.x, v[kE + 1] = q.y, v[kE + 2] = q.z, v[kE + 3] = q.w;
    } else if constexpr (kWidth == 2) {
      const float2 q = *reinterpret_cast<const float2*>(aligned + kE);
      v[kE] = q.x, v[kE + 1] = q.y;
    } else {
      v[kE] = opaque[kE];
    }
  });
}

template <int kHead, int kPack>
__device__ __forceinline__ void store_sums(float* aligned, const float (&v)[kPack]) {
  for_each_sum_chunk<kHead, kPack>([&](auto e, auto width) {
    constexpr int kE = decltype(e)::value, kWidth = decltype(width)::value;
    if constexpr (kWidth == 4) {
      *reinterpret_cast<float4*>(aligned + kE) = make_float4(v[kE], v[kE + 1], v[kE + 2], v[kE + 3]);
    } else if constexpr (kWidth == 2) {
      *reinterpret_cast<float2*>(aligned + kE) = make_float2(v[kE], v[kE + 1]);
    } else {
      aligned[kE] = v[kE];
    }
  });
}

template <class T, int kPack>
__global__ void __launch_bounds__(1024) backward_block_skew(BackwardArgs a, int64_t used) {
  static_assert(sizeof(T) <= 4 && kPack * sizeof(T) == 16, "16-byte packs of float / 16-bit types");
  cuda::enter_kernel();
  using A = float;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A scratch[64];
  const Shape s = a.shape;
  const int nacc = num_acc(s.rms);
  const int cols = static_cast<int>(s.cols);
  const int stride = (cols + 3) / 4 * 4;  // the second accumulator's offset (16-byte aligned)
  A* acc = reinterpret_cast<A*>(smem_raw);
  T* xc = reinterpret_cast<T*>(smem_raw + sizeof(A) * nacc * stride);
  T* dyc = xc + cols / kPack * kPack;
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  for (int64_t slot = blockIdx.x; slot < s.groups * used; slot += gridDim.x) {
    const int64_t g = slot / used, j = slot % used;
    int64_t begin, end;
    slot_rows(s, g, j, used, &begin, &end);
    const T* scale = static_cast<const T*>(a.scale) + g * s.cols;
    for (int c = threadIdx.x; c < nacc * stride; c += blockDim.x) acc[c] = A(0);
    __syncthreads();
    for (int64_t row = begin; row < end; ++row) {
      A mean, rstd;
      row_stats<T>(a, row, mean, rstd);
      const int64_t start = row * s.cols;
      const int head = static_cast<int>((kPack - start % kPack) % kPack);
      const int npacks = (cols - head) / kPack;
      const int loose = cols - npacks * kPack;  // head + tail, < 2 kPack <= blockDim.x
      const int lc = threadIdx.x < head ? threadIdx.x : threadIdx.x + npacks * kPack;
      const bool has_loose = threadIdx.x < loose;
      with_head<0, kPack>(head, [&](auto h) {
        constexpr int kHead = decltype(h)::value;
        A sum_g = 0, sum_gx = 0;
        Pack<T, 1> xl, dl, sl;
        if (has_loose) {
          xl.v[0] = x[start + lc];
          dl.v[0] = dy[start + lc];
          sl.v[0] = scale[lc];
          pack_sums<T, 1>(xl, dl, sl, mean, rstd, sum_g, sum_gx);
        }
#pragma unroll 4
        for (int p = threadIdx.x; p < npacks; p += blockDim.x) {
          const auto xp = load_pack<T, kPack>(x + start + head + p * kPack);
          const auto dp = load_pack<T, kPack>(dy + start + head + p * kPack);
          store_pack(xc + p * kPack, xp);
          store_pack(dyc + p * kPack, dp);
          pack_sums<T, kPack>(xp, dp, skewed_param<kHead, T, kPack>(scale, p, cols), mean, rstd, sum_g, sum_gx);
        }
        block_sum2(sum_g, sum_gx, scratch);
        const A mg = s.rms ? A(0) : sum_g / A(s.cols), mgx = sum_gx / A(s.cols);
        // The column sums go through exact 16- and 8-byte accesses chosen by the compile-time
        // head, and single words at the row's edges through `edge_head`, the same head passed
        // through a shuffle that ptxas cannot fold. Indexed from kHead alone, ptxas merged a head-1
        // pack's loads at offsets 4, 8, 12 into one 16-byte load from offset 0, reading (and
        // dropping) the previous thread's last column while that thread wrote it: harmless, but
        // racecheck reported it (session 57: 32 hazards), and such noise hides real races. The
        // check is the SASS (tools/sass_overread.py: no widened load) and racecheck (0 hazards).
        // Session 57's fix (the head through an empty asm, scalar accesses) cost the 16-bit kernels
        // 6-10 %; this one is faster than the racy kernel. H100, session 58 run 1, us (empty asm ->
        // exact / XLA): bf16 rms_norm_bwd 65536x1001 312.0 -> 246.3 / 274.5, 16384x4095 261.9 ->
        // 198.2 / 275.2; layer_norm_bwd 429.3 -> 273.8 / 591.8, 388.4 -> 236.5 / 522.8; float32
        // rms_norm_bwd 16384x4095 355.7 -> 348.2, layer_norm_bwd 393.0 -> 367.3.
        const int edge_head = __shfl_sync(0xffffffffu, head, 0);  // == kHead
        for (int p = threadIdx.x; p < npacks; p += blockDim.x) {
          const int c0 = kHead + p * kPack, ce = edge_head + p * kPack;
          A as[kPack], ab[kPack] = {};
          load_sums<kHead, kPack>(acc + c0, acc + ce, as);
          if (nacc == 2) load_sums<kHead, kPack>(acc + stride + c0, acc + stride + ce, ab);
          store_pack(dx + start + c0,
                     pack_dx<T, kPack>(load_pack<T, kPack>(xc + p * kPack), load_pack<T, kPack>(dyc + p * kPack),
                                       skewed_param<kHead, T, kPack>(scale, p, cols), mean, rstd, mg, mgx, as, ab));
          store_sums<kHead, kPack>(acc + c0, as);
          if (nacc == 2) store_sums<kHead, kPack>(acc + stride + c0, ab);
        }
        if (has_loose) {
          A as[1] = {acc[lc]}, ab[1] = {nacc == 2 ? acc[stride + lc] : A(0)};
          dx[start + lc] = pack_dx<T, 1>(xl, dl, sl, mean, rstd, mg, mgx, as, ab).v[0];
          acc[lc] = as[0];
          if (nacc == 2) acc[stride + lc] = ab[0];
        }
      });
    }
    __syncthreads();  // every row's column sums are in
    A* out = slot_ptr<T>(a, g, j);
    for (int c = threadIdx.x; c < nacc * cols; c += blockDim.x) out[c] = acc[c < cols ? c : c - cols + stride];
    __syncthreads();  // read out before the next slot zeroes them
  }
}

}  // namespace jaxops::layer_norm
