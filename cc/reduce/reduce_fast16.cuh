// Inner loops of the arg ops, max/min and logsumexp for 16-byte packs of 2-byte types (bf16,
// f16), which work on the packed element pairs instead of one float per element.
//
// Why: a 2-byte stream delivers twice the elements per byte of float32, so at 3 TB/s an H100 SM
// must retire ~6.4 elements per clock. The generic loops (bf16 -> f32 convert, then the arg ops'
// NaN/tie/compare/select chain, or logsumexp's select logic around an accurate expf) cost 10-20
// instructions per element: compute-bound at 0.6-0.8 of copy (session 4, H100).
//
// arg16_stream: 8 slots per thread, slot j taking element j of each pack (a column for column
// reductions, a residue class of the row for row reductions). Per register (2 elements): one
// packed unordered compare against the running extremum, one packed self-compare (is the
// running value NaN?), one packed max/min (NaN-propagating) and two logic ops that select the
// 16-bit pack number where each slot's value was first reached. About 3 instructions per
// element with loads and addressing (SASS), no branches. sm_90 only (native bf16x2 compares);
// sm_80 keeps the generic loop. Slots see their elements in increasing index order and only a
// strictly better element (or the first NaN) moves them, so the first index wins ties.
// Pack numbers are 16 bits, so the stream is cut into segments of kArgSegment packs, each
// folded into ArgOp states (exact indices) by ArgOp::merge.
//
// ext16_stream (max/min): one packed NaN-propagating max/min per register, 0.5 instructions an
// element instead of a convert and a NaN-aware compare/select per element.
//
// lse16_span: per U packs, the block maximum with packed NaN-propagating max instructions, one
// rescale of the running sums, then per element one FMA and one ex2.approx (relative error
// ~2^-22, far below the bf16/f16 output rounding) and one add.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "reduce/reduce_ops.h"

namespace jaxops::reduce::kernels {

template <class T> struct Vec2;
template <> struct Vec2<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct Vec2<__half> { using type = __half2; };

// Detected by members.
template <class Op, class = void> struct IsExtremumOp : std::false_type {};
template <class Op> struct IsExtremumOp<Op, std::void_t<decltype(Op::kExtremum)>> : std::true_type {};

// The packed paths apply to 16-byte packs (8 elements) of 2-byte floating types.
// arg16_types: the host's view (unroll and block shapes); arg16_path: the device code's, which
// keeps the generic loop below sm_90: sm_80 has no bf16x2 compare instruction, and its
// emulation spills the column kernel at 80 registers.
template <class Op, class T, int P>
constexpr bool arg16_types() {
  return std::is_same_v<typename Op::State, ArgState<float>> && sizeof(T) == 2 && P == 8;
}
template <class Op, class T, int P>
constexpr bool arg16_path() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return false;
#else
  return arg16_types<Op, T, P>();
#endif
}
template <class Op, class T, int P>
constexpr bool lse16_path() {
  return std::is_same_v<typename Op::State, LogSumExpState<float>> && sizeof(T) == 2 && P == 8;
}
template <class Op, class T, int P>
constexpr bool ext16_path() {
  return IsExtremumOp<Op>::value && std::is_same_v<typename Op::State, float> && sizeof(T) == 2 && P == 8;
}

constexpr int kArgSegment = 256;  // packs per segment (< 2^16; small enough for a GPU test to cross)

template <class V>
__device__ __forceinline__ V as_vec2(uint32_t w) {
  V v;
  memcpy(&v, &w, 4);
  return v;
}
template <class V>
__device__ __forceinline__ uint32_t as_word(V v) {
  uint32_t w;
  memcpy(&w, &v, 4);
  return w;
}

template <bool kMax, class V>
__device__ __forceinline__ V extremum2(V a, V b) {
  if constexpr (kMax) return __hmax2_nan(a, b);
  else return __hmin2_nan(a, b);
}

// 0xffff in each half where x beats run: strictly better, or x NaN; never once run is NaN.
template <bool kMax, class V>
__device__ __forceinline__ uint32_t beats2(V x, V run) {
  const uint32_t better = kMax ? __hgtu2_mask(x, run) : __hltu2_mask(x, run);  // unordered: NaN x counts
  return better & __heq2_mask(run, run);
}

// 16 bytes (8 two-byte elements) at p. kVec: one 16-byte vector load (p 16-byte aligned); otherwise
// eight 2-byte loads into the same register image, for a base pointer that is not 16-byte
// aligned. The launcher picks kVec from the pointer, but the tile, slots and order of every
// operation are the same either way: results never depend on where XLA put the operand.
template <bool kVec, class T>
__device__ __forceinline__ uint4 load16(const T* p) {
  static_assert(sizeof(T) == 2, "16-byte packs of 2-byte elements");
  if constexpr (kVec) {
    return *reinterpret_cast<const uint4*>(p);
  } else {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = static_cast<uint32_t>(h[2 * i]) | (static_cast<uint32_t>(h[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

__device__ __forceinline__ uint32_t word(const uint4& q, int i) {
  return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// One pack into the 8 slots: pack number kv (in both halves) where x beats the running value.
template <bool kMax, class V>
__device__ __forceinline__ void arg16_update(V (&run)[4], uint32_t (&pk_no)[4], const uint4& pk, uint32_t kv) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const V x = as_vec2<V>(word(pk, w));
    const uint32_t mask = beats2<kMax>(x, run[w]);
    pk_no[w] = (pk_no[w] & ~mask) | (kv & mask);
    run[w] = extremum2<kMax>(run[w], x);
  }
}

template <class V>
__device__ __forceinline__ void arg16_seed(V (&run)[4], uint32_t (&pk_no)[4], const uint4& pk) {
#pragma unroll
  for (int w = 0; w < 4; ++w) run[w] = as_vec2<V>(word(pk, w)), pk_no[w] = 0u;
}

// Folds one segment's slots into st[0..8): slot j's pack number (from the segment's first pack,
// `seg`) gives element index idx0 + pack * idx_step + j * slot_step.
template <class Op, class V, class Idx>
__device__ __forceinline__ void arg16_flush(typename Op::State (&st)[8], const V (&run)[4], const uint32_t (&pk_no)[4],
                                            Idx seg, Idx idx0, Idx idx_step, int slot_step) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * w + h;
      const float v = h == 0 ? __low2float(run[w]) : __high2float(run[w]);
      const Idx kk = static_cast<Idx>((pk_no[w] >> (16 * h)) & 0xffffu) + seg;
      const typename Op::State c{v, static_cast<int32_t>(idx0 + kk * idx_step + j * slot_step)};
      st[j] = Op::merge(st[j], c);
    }
  }
}

// A partial round of U packs: p, p + step, ..., p + last * step (last < U), then the last pack
// again in the remaining registers, so all U loads issue at once like a whole round's (the
// caller must not count the repeats). Pointer steps, not multiplies, keep the address arithmetic
// of a whole round. `load` reads one pack (load16 here, load_pack_v in reduce_spans.cuh).
template <int U, class Pk, class T, class Idx, class Load>
__device__ __forceinline__ void load_round(Pk (&pk)[U], const T* p, Idx step, int last, Load load) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    pk[u] = load(p);
    if (u < last) p += step;
  }
}
template <bool kVec, int U, class T, class Idx>
__device__ __forceinline__ void load16_round(uint4 (&pk)[U], const T* p, Idx step, int last) {
  load_round(pk, p, step, last, [](const T* a) { return load16<kVec>(a); });
}

// The last pack of a thread's round of U packs `stride` elements apart, `rem` elements before the
// span's end: U - 1 for a whole round. Only a partial round divides, and there U * stride fits an
// int (<= 512 threads x 8 elements x U).
template <int U, class Idx>
__device__ __forceinline__ int round_last(Idx rem, Idx stride) {
  return rem > (U - 1) * stride ? U - 1 : (static_cast<int>(rem) - 1) / static_cast<int>(stride);
}

// Folds `count` packs p, p + step, ... (16 bytes each, 8 elements) into st[0..8): element j of
// pack k has index idx0 + k * idx_step + j * slot_step. Every round loads U packs before their
// use, a thread's last round included (load16_round repeats its last pack, which the strict
// compare never takes again), so the threads of a warp whose last rounds are partial to
// different degrees run one code path instead of the whole round and a pack-at-a-time tail in
// turn. The first pack of a segment seeds the slots (so an element equal to the identity, e.g.
// -inf for argmax, still gets its index).
template <class Op, class T, int U, bool kVec, class Idx>
__device__ __forceinline__ void arg16_stream(typename Op::State (&st)[8], const T* p, Idx count, Idx step,
                                             Idx idx0, Idx idx_step, int slot_step) {
  using V = typename Vec2<T>::type;
  constexpr bool kMax = Op::kIsMax;
  for (Idx seg = 0; seg < count; seg += kArgSegment) {
    const int m = count - seg < kArgSegment ? static_cast<int>(count - seg) : kArgSegment;
    const T* q = p + seg * step;
    V run[4];
    uint32_t pk_no[4];
    {
      uint4 pk[U];
      load16_round<kVec>(pk, q, step, m < U ? m - 1 : U - 1);
      arg16_seed(run, pk_no, pk[0]);
#pragma unroll
      for (int u = 1; u < U; ++u) arg16_update<kMax>(run, pk_no, pk[u], static_cast<uint32_t>(u) * 0x00010001u);
    }
    q += U * step;
    for (int k = U; k < m; k += U, q += U * step) {
      uint4 pk[U];
      load16_round<kVec>(pk, q, step, m - k < U ? m - k - 1 : U - 1);
#pragma unroll
      for (int u = 0; u < U; ++u) arg16_update<kMax>(run, pk_no, pk[u], static_cast<uint32_t>(k + u) * 0x00010001u);
    }
    arg16_flush<Op>(st, run, pk_no, seg, idx0, idx_step, slot_step);
  }
}

// arg16_stream through a ring of shared memory: the same packs, slots and order of operations
// (so the same indices), but the loads are cp.async copies, kStages - 1 batches of kRingPacks
// ahead of the batch being folded. Why: in the register loop ptxas issues two of the eight loads
// at the top of each batch and the rest between the compares (80 registers), so a thread has ~2-4
// loads in flight; ncu (session 15, H100, the column kernel) shows its warps waiting on them:
// scoreboard stalls, 0.22 issued warps a scheduler, DRAM at 76 %. Copies hold no registers. Each
// thread reads back only the slots it filled itself, so no barrier is needed. `ring` is this
// thread's first slot, slot i at ring[i * kThreads]; 16-byte aligned p only (cp.async); count < 2^31.
constexpr int kRingPacks = 4;  // packs a batch (kArgSegment is a multiple: segments start a batch)

template <class Op, class T, int kThreads, int kStages, class Idx>
__device__ __forceinline__ void arg16_stream_ring(typename Op::State (&st)[8], const T* p, int count, Idx step,
                                                  Idx idx0, Idx idx_step, int slot_step, uint4* ring) {
  using V = typename Vec2<T>::type;
  constexpr bool kMax = Op::kIsMax;
  constexpr int S = kStages, U = kRingPacks;
  static_assert(kArgSegment % U == 0, "segments start on a batch");
  // Copies run one batch at a time into stage `put`; addresses advance, nothing is recomputed.
  const T* src = p;
  int issued = 0;
  int put = 0;
  const auto issue = [&]() {  // one commit group a batch, empty past the end
    uint4* slot = ring + put * (U * kThreads);
    if (issued + U <= count) {
#pragma unroll
      for (int u = 0; u < U; ++u) __pipeline_memcpy_async(slot + u * kThreads, src + u * step, 16);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (issued + u < count) __pipeline_memcpy_async(slot + u * kThreads, src + u * step, 16);
    }
    __pipeline_commit();
    src += U * step;
    issued += U;
    put = put == S - 1 ? 0 : put + 1;
  };
#pragma unroll
  for (int b = 0; b < S - 1; ++b) issue();
  V run[4];
  uint32_t pk_no[4];
  int get = 0;
  uint32_t in_seg = 0;  // pack number of the batch's first pack inside its segment
  int seg = 0;          // first pack of the current segment
  for (int k0 = 0; k0 < count; k0 += U) {
    if (issued < count) issue();  // into the stage folded in the previous iteration (read back already)
    else __pipeline_commit();
    __pipeline_wait_prior(S - 1);
    const uint4* slot = ring + get * (U * kThreads);
    get = get == S - 1 ? 0 : get + 1;
    uint4 pk[U];
#pragma unroll
    for (int u = 0; u < U; ++u) pk[u] = slot[u * kThreads];
    if (in_seg == kArgSegment) {  // a segment starts: flush the last one
      arg16_flush<Op>(st, run, pk_no, static_cast<Idx>(seg), idx0, idx_step, slot_step);
      seg += kArgSegment;
      in_seg = 0;
    }
    if (in_seg == 0) arg16_seed(run, pk_no, pk[0]);
    const auto fold = [&](auto whole) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (u == 0 && in_seg == 0) continue;
        if (!decltype(whole)::value && k0 + u >= count) break;
        arg16_update<kMax>(run, pk_no, pk[u], (in_seg + u) * 0x00010001u);
      }
    };
    if (k0 + U <= count) fold(std::true_type{});
    else fold(std::false_type{});
    in_seg += U;
  }
  arg16_flush<Op>(st, run, pk_no, static_cast<Idx>(seg), idx0, idx_step, slot_step);
}

// max/min of `count` packs p, p + step, ... into st[0..8) (slot j: element j of each pack): one
// packed NaN-propagating max/min per 2 elements. No index, so no seed: the identity starts it.
// Every round loads U packs at once, a partial last round too (load16_round: a repeated pack
// changes no max or min), as arg16_stream does.
template <class Op, class T, int U, bool kVec, class Idx>
__device__ __forceinline__ void ext16_stream(typename Op::State (&st)[8], const T* p, Idx count, Idx step) {
  using V = typename Vec2<T>::type;
  constexpr bool kMax = Op::kIsMax;
  const uint32_t id = as_word(V{T(Op::identity()), T(Op::identity())});
  V run[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) run[w] = as_vec2<V>(id);
  for (Idx k = 0; k < count; k += U, p += U * step) {
    uint4 pk[U];
    load16_round<kVec>(pk, p, step, count - k < U ? static_cast<int>(count - k) - 1 : U - 1);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int w = 0; w < 4; ++w) run[w] = extremum2<kMax>(run[w], as_vec2<V>(word(pk[u], w)));
  }
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    st[2 * w] = Op::merge(st[2 * w], __low2float(run[w]));
    st[2 * w + 1] = Op::merge(st[2 * w + 1], __high2float(run[w]));
  }
}

__device__ __forceinline__ float ex2_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// NaN-propagating float max (ExtremumOp's rule).
__device__ __forceinline__ float max_nan(float a, float b) { return (a != a || a > b) ? a : b; }

// One block of U packs into the running (m, acc[]): the block max first, then one rescale,
// then exp2(x * log2e - m * log2e) per element of the first `valid` packs (the rest repeat one
// of those: they may raise the block max, which they do not change, but add nothing).
template <class T, int U>
__device__ __forceinline__ void lse16_block(float& m, float (&acc)[4], const uint4 (&pk)[U], int valid = U) {
  using V = typename Vec2<T>::type;
  constexpr float kLog2e = 1.4426950408889634f;
  V w = as_vec2<V>(pk[0].x);
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int i = u == 0 ? 1 : 0; i < 4; ++i) w = __hmax2_nan(w, as_vec2<V>(word(pk[u], i)));
  const float bm = max_nan(__low2float(w), __high2float(w));
  const float mn = max_nan(m, bm);
  // m == mn covers -inf == -inf (whose difference is NaN); -inf -> finite scales the zero sums by 0.
  const float scale = m == mn ? 1.0f : ex2_approx((m - mn) * kLog2e);
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] *= scale;
  m = mn;
  // All -inf so far: offset 0 makes every term exp2(-inf) = 0. A NaN or +inf max makes the terms
  // garbage, which LogSumExpOp::merge/finish ignore (the max is the answer then).
  const float off = mn == -INFINITY ? 0.0f : mn * kLog2e;
  if (fabsf(off) <= 3.0e38f) {  // x * log2e - off in one FMA
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (u >= valid) continue;  // folds away for a whole round (valid == U)
        const V x = as_vec2<V>(word(pk[u], i));
        acc[(2 * i) % 4] += ex2_approx(fmaf(__low2float(x), kLog2e, -off));
        acc[(2 * i + 1) % 4] += ex2_approx(fmaf(__high2float(x), kLog2e, -off));
      }
  } else {  // |max| > 2e38 (bf16 only): mn * log2e overflows, so subtract first (rare, block-uniform)
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (u >= valid) continue;  // folds away for a whole round (valid == U)
        const V x = as_vec2<V>(word(pk[u], i));
        acc[(2 * i) % 4] += ex2_approx((__low2float(x) - mn) * kLog2e);
        acc[(2 * i + 1) % 4] += ex2_approx((__high2float(x) - mn) * kLog2e);
      }
  }
}

// logsumexp of the packs x + first, x + first + stride, ... below end, into s. Every round loads
// U packs at once, a thread's last partial round included (load16_round), and adds only its
// packs. Rows that are not whole packs leave the last thread of a row (or of each chunk of a split
// row) a partial round: bf16 4095 / 8191 columns give 64 / 128 threads 8 packs and the last 7.
// Loaded one pack at a time (until session 20), that thread kept one load in flight while its block
// waited at the merge; as a separate partial round after the loop (session 20), its warp ran the
// other lanes' whole round and then its partial one in turn (ncu, H100, 16384x4095: 41 % more
// instructions than 16384x4096). Now a warp takes the partial round's code, whose packs are
// branches, whenever one of its lanes needs it, and the whole round's otherwise: both give the same
// bits on a whole round, so which lanes vote together (__activemask) changes no result.
template <class Op, class T, int U, bool kVec, class Idx>
__device__ __forceinline__ void lse16_span(typename Op::State& s, const T* x, Idx first, Idx end, Idx stride) {
  float m = -INFINITY, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (Idx c = first; c < end; c += U * stride) {
    const Idx rem = end - c;
    uint4 pk[U];
    if (__all_sync(__activemask(), rem > (U - 1) * stride)) {
#pragma unroll
      for (int u = 0; u < U; ++u) pk[u] = load16<kVec>(x + c + u * stride);
      lse16_block<T, U>(m, acc, pk);
    } else if (rem <= stride) {  // one pack: one load (1024x50257, mostly one pack left: 41.0 vs 41.9 µs)
      const uint4 one[1] = {load16<kVec>(x + c)};
      lse16_block<T, 1>(m, acc, one);
    } else {
      const int last = round_last<U>(rem, stride);
      load16_round<kVec>(pk, x + c, stride, last);
      lse16_block<T, U>(m, acc, pk, last + 1);
    }
  }
  s = Op::merge(s, {m, (acc[0] + acc[1]) + (acc[2] + acc[3])});
}

}  // namespace jaxops::reduce::kernels
