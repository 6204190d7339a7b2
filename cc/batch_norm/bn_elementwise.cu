// The elementwise passes of batch_norm over each group's flattened R*C elements:
//   forward  — y = (x - mean) * a + b (+ residual), relu, and the bit mask;
//   backward — dx = a * dy' + b * (x - mean) + c and dresidual = dy' (dy' = dy masked by the bit).
// A tiny kernel first turns the per-channel inputs into one Coef record per channel
// (bn_math.h). Warp-chunk layout (common/bitmask.cuh): 16-byte packs, each warp writes whole
// mask words.
//
// Coefficients in registers (kFixed, one group, i.e. not under vmap): the grid stride is chosen
// as a multiple of C elements (fixed_grid), so every lane meets the same P channels on every
// iteration and loads their records once. Fetching one 16-byte record per element instead
// (the general path, kept for vmapped groups) costs 8 L1 wavefronts per bf16 pack and made
// apply/dx L1-bound (session-2 profile: bf16 apply 19% of DRAM, "Memory" 93%).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "batch_norm/bn_launch.h"
#include "batch_norm/bn_math.h"
#include "batch_norm/bn_test_hooks.h"
#include "common/bitmask.cuh"
#include "common/cuda_util.cuh"
#include "common/launch.cuh"

namespace jaxops::batch_norm {
namespace {

using cuda::acc_t;
using cuda::from_acc;
using cuda::to_acc;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <class A>
__global__ void forward_coef_kernel(const A* __restrict__ scale, const A* __restrict__ bias,
                                    const A* __restrict__ mean, const A* __restrict__ var,
                                    Coef<A>* __restrict__ coef, int64_t n, A eps) {
  cuda::enter_kernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) coef[i] = forward_coef<A>(scale[i], bias[i], mean[i], var[i], eps);
}

template <class A>
__global__ void backward_coef_kernel(const A* __restrict__ scale, const A* __restrict__ mean,
                                     const A* __restrict__ var, const A* __restrict__ sum_dy,
                                     const A* __restrict__ sum_dyxhat, const A* __restrict__ dmean,
                                     const A* __restrict__ dvar, Coef<A>* __restrict__ coef, int64_t n, A eps,
                                     A count, bool train) {
  cuda::enter_kernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n)
    coef[i] = backward_coef<A>(scale[i], mean[i], var[i], eps, sum_dy[i], sum_dyxhat[i], dmean[i], dvar[i],
                               count, train);
}

// Channel of each of the lane's P elements (element e of a group is channel e % C).
template <int P>
__device__ __forceinline__ void channels_of(int64_t e0, int64_t C, int64_t (&ch)[P]) {
  int64_t c = e0 % C;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    ch[k] = c;
    if (++c == C) c = 0;
  }
}

// Where a warp's chunks lie (all warp-uniform): first, first + stride, ... below lim. Block b runs
// segment b / vgrid of virtual block b % vgrid: the grid-stride loop of a `vgrid`-block grid cut
// into segments of `seg` strides, one block per segment. seg >= the loop's length is the
// persistent grid of session 4; a few strides per block (session 6) gives many short blocks
// that start and finish at different times (softmax/layer_norm's session-5 lesson: persistent
// grids lost 1-9 %). Every segment starts at a multiple of the stride, so under kFixed a warp
// still meets the same channels on every chunk.
struct WarpSpan {
  int64_t first, stride, lim;
};

__device__ __forceinline__ WarpSpan warp_span(int64_t chunks, int64_t vgrid, int64_t seg) {
  const unsigned vg = static_cast<unsigned>(vgrid);  // < 2^31 (a grid size): 32-bit division
  const int64_t vb = blockIdx.x % vg, sg = blockIdx.x / vg;
  WarpSpan w;
  w.stride = vgrid * kWarps;
  const int64_t base = sg * seg * w.stride;
  w.first = base + vb * kWarps + threadIdx.x / 32;
  w.lim = min(chunks, base + seg * w.stride);
  return w;
}

// 16-bit types keep session 4's launch (session 6 run 3 on the H100: with the segmented grid and
// the shared table below, bf16 apply took 142-159 us where session 4's took 126): one grid-stride
// loop over a `gridDim`-block grid, each lane fetching or computing its own P records.
template <class T>
constexpr bool kSession4Grid = sizeof(T) == 2;

__device__ __forceinline__ WarpSpan grid_span(int64_t chunks) {
  WarpSpan w;
  w.first = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  w.stride = static_cast<int64_t>(gridDim.x) * kWarps;
  w.lim = chunks;
  return w;
}

template <class T>
__device__ __forceinline__ WarpSpan span_of(int64_t chunks, int64_t vgrid, int64_t seg) {
  if constexpr (kSession4Grid<T>) return grid_span(chunks);
  else return warp_span(chunks, vgrid, seg);
}

// Channels whose coefficient records a block keeps in shared memory (kFixed, 4- and 8-byte
// types): 8 KB of float records. Each block computes (forward) or copies (backward) the C records once, cooperatively,
// instead of every lane fetching its P channels' inputs itself: with all warps of the grid
// asking for the same few hundred bytes at the same moment, the per-lane prologue was a hot
// spot on a few L2 lines (session 4: +8.6 us on f32 apply). Wider C keeps the per-lane fetch.
constexpr int64_t kSmemCoefMax = 512;

template <class A>
__device__ __forceinline__ Coef<A>* smem_coefs() {
  extern __shared__ __align__(16) unsigned char bn_smem[];
  return reinterpret_cast<Coef<A>*>(bn_smem);
}

// The records of this lane's P channels for a loop whose stride is a multiple of C elements
// (kFixed): those of the warp's first chunk, from `table` (global or shared). Untouched when the
// warp has no chunk.
template <class A, int P>
__device__ __forceinline__ void lane_coefs(const Coef<A>* __restrict__ table, int64_t C, const WarpSpan& w,
                                           Coef<A> (&q)[P]) {
  if (w.first >= w.lim) return;
  int64_t c = (w.first * 32 * P + static_cast<int64_t>(threadIdx.x % 32) * P) % C;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    q[k] = table[c];
    if (++c == C) c = 0;
  }
}

// lane_coefs for the forward pass, computed from the per-channel inputs by the lane itself
// (channels beyond kSmemCoefMax). Same formula (bn_math.h), so the same coefficients bit for bit.
template <class A, int P>
__device__ __forceinline__ void lane_forward_coefs(const A* __restrict__ scale, const A* __restrict__ bias,
                                                   const A* __restrict__ mean, const A* __restrict__ var, A eps,
                                                   int64_t C, const WarpSpan& w, Coef<A> (&q)[P]) {
  if (w.first >= w.lim) return;
  int64_t c = (w.first * 32 * P + static_cast<int64_t>(threadIdx.x % 32) * P) % C;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    q[k] = forward_coef<A>(scale[c], bias[c], mean[c], var[c], eps);
    if (++c == C) c = 0;
  }
}

// Chunks a warp loads before it processes them in apply_kernel: with one 16-byte load per lane
// per chunk (no residual) and 4 blocks per SM (64 registers for bf16), one chunk leaves only
// 16 KB in flight per SM; two give 32 KB, enough for DRAM's latency.
constexpr int kApplyUnroll = 2;

// One warp chunk of the apply: y = act((x - shift) * a + b (+ res)) in place of the loaded x
// pack, stored, and the chunk's mask word (both apply kernels).
template <class T, int P, bool kFixed>
__device__ __forceinline__ void apply_chunk(int64_t chunk, int64_t chunks_per_row, int64_t L, int64_t C,
                                            int lane, const Coef<acc_t<T>>* __restrict__ coef,
                                            const Coef<acc_t<T>> (&q)[kFixed ? P : 1], bool res, bool relu,
                                            bool vec, T (&v)[P], const T (&r)[P], T* __restrict__ y,
                                            uint32_t* __restrict__ mask, int64_t wpg) {
  using A = acc_t<T>;
  const cuda::WarpChunk c = cuda::warp_chunk<P>(chunk, chunks_per_row);
  const int64_t base = c.row * L;
  int64_t ch[P];
  if constexpr (!kFixed) channels_of<P>(c.c0, C, ch);
  const Coef<A>* cg = coef + c.row * C;
  uint32_t bits = 0;
  // A whole run (every chunk but a group's last) takes a copy of the loop without the bounds
  // test: with it ptxas predicated every element on a 64-bit compare, 4 of its ~12 instructions.
  const auto run = [&](auto whole) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (!decltype(whole)::value && c.c0 + k >= L) continue;  // past the end: bit stays 0
      Coef<A> qk;
      if constexpr (kFixed) qk = q[k];
      else qk = cg[ch[k]];
      A z = (to_acc(v[k]) - qk.shift) * qk.a + qk.b;
      if (res) z += to_acc(r[k]);
      if (relu) {
        const bool pos = z > A(0);
        bits |= static_cast<uint32_t>(pos) << k;
        if (!(pos || z != z)) z = A(0);  // NaN propagates like jax.nn.relu
      }
      v[k] = from_acc<T>(z);
    }
  };
  if (c.c0 + P <= L) run(std::true_type{});
  else run(std::false_type{});
  cuda::store_run<T, P>(y + base, c.c0, L, vec, v);
  if (wpg > 0) {
    const uint32_t word = cuda::warp_mask_words<P>(bits);
    const int64_t w = c.ch * P + lane;
    if (lane < P && w < wpg) mask[c.row * wpg + w] = word;
  }
}

template <class T, int P, bool kFixed>
__global__ void __launch_bounds__(kThreads, kFixed ? 4 : 1)  // kFixed bf16: 64 registers, 4 blocks per SM
apply_kernel(const T* __restrict__ x, const T* __restrict__ res, const Coef<acc_t<T>>* __restrict__ coef,
             T* __restrict__ y, uint32_t* __restrict__ mask, int64_t L, int64_t C, int64_t chunks_per_row,
             int64_t chunks, int64_t wpg, bool vec, bool relu, const acc_t<T>* __restrict__ scale,
             const acc_t<T>* __restrict__ bias, const acc_t<T>* __restrict__ mean,
             const acc_t<T>* __restrict__ var, acc_t<T> eps, int64_t vgrid, int64_t seg) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const WarpSpan ws = warp_span(chunks, vgrid, seg);
  T v[kApplyUnroll][P], r[kApplyUnroll][P];
  auto load_step = [&](int64_t chunk0) {  // all loads of one step first
#pragma unroll
    for (int u = 0; u < kApplyUnroll; ++u) {
      const int64_t chunk = chunk0 + u * ws.stride;
      if (chunk >= ws.lim) break;
      const cuda::WarpChunk c = cuda::warp_chunk<P>(chunk, chunks_per_row);
      cuda::load_run<T, P>(x + c.row * L, c.c0, L, vec, v[u]);
      if (res) cuda::load_run<T, P>(res + c.row * L, c.c0, L, vec, r[u]);
    }
  };
  // kFixed: coefficients from the per-channel inputs (no coef kernel); else records from `coef`.
  // Up to kSmemCoefMax channels the block computes one shared table, after issuing its first
  // step's loads, so the prologue overlaps the first DRAM round trip. Wide C: each lane computes
  // its own P records, before any load. (4- and 8-byte types only: 16-bit types take
  // apply_s4_kernel, whose loaded packs, live across such a prologue, spilled at 64 registers.)
  constexpr bool kHoist = kFixed;
  const bool table = kFixed && C <= kSmemCoefMax;  // block-uniform
  Coef<A> q[kFixed ? P : 1];
  if constexpr (kFixed)
    if (!table) lane_forward_coefs<A, P>(scale, bias, mean, var, eps, C, ws, q);
  if constexpr (kHoist)
    if (table) load_step(ws.first);
  if constexpr (kFixed) {
    if (table) {
      Coef<A>* t = smem_coefs<A>();
      for (int64_t c = threadIdx.x; c < C; c += kThreads)
        t[c] = forward_coef<A>(scale[c], bias[c], mean[c], var[c], eps);
      __syncthreads();
      if (ws.first < ws.lim) {  // the forward records' c is 0: three fields (fewer live registers)
        int64_t c = (ws.first * 32 * P + static_cast<int64_t>(lane) * P) % C;
#pragma unroll
        for (int k = 0; k < P; ++k) {
          q[k] = Coef<A>{t[c].shift, t[c].a, t[c].b, A(0)};
          if (++c == C) c = 0;
        }
      }
    }
  }
  // The loop bounds are per warp, so the warp collective below always sees all 32 lanes. The
  // warp's chunks are first + i * stride (kFixed: the same channels for every i).
  for (int64_t chunk0 = ws.first; chunk0 < ws.lim; chunk0 += ws.stride * kApplyUnroll) {
    if (!(kHoist && table && chunk0 == ws.first)) load_step(chunk0);
#pragma unroll
    for (int u = 0; u < kApplyUnroll; ++u) {
      const int64_t chunk = chunk0 + u * ws.stride;
      if (chunk >= ws.lim) break;  // warp-uniform
      apply_chunk<T, P, kFixed>(chunk, chunks_per_row, L, C, lane, coef, q, res != nullptr, relu, vec, v[u], r[u],
                                y, mask, wpg);
    }
  }
}

// 16-bit types: session 4's apply kernel, unchanged (a grid-stride loop, per-lane coefficients;
// see kSession4Grid).
template <class T, int P, bool kFixed>
__global__ void __launch_bounds__(kThreads, kFixed ? 4 : 1)  // kFixed bf16: 64 registers, 4 blocks per SM
apply_s4_kernel(const T* __restrict__ x, const T* __restrict__ res, const Coef<acc_t<T>>* __restrict__ coef,
             T* __restrict__ y, uint32_t* __restrict__ mask, int64_t L, int64_t C, int64_t chunks_per_row,
             int64_t chunks, int64_t wpg, bool vec, bool relu, const acc_t<T>* __restrict__ scale,
             const acc_t<T>* __restrict__ bias, const acc_t<T>* __restrict__ mean,
             const acc_t<T>* __restrict__ var, acc_t<T> eps) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  const int lane = threadIdx.x % 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  Coef<A> q[kFixed ? P : 1];
  // kFixed: coefficients from the per-channel inputs (no coef kernel); else records from `coef`.
  if constexpr (kFixed) lane_forward_coefs<A, P>(scale, bias, mean, var, eps, C, grid_span(chunks), q);
  // The loop bounds are per warp, so the warp collective below always sees all 32 lanes. The
  // warp's chunks are still first + i * stride (kFixed: the same channels for every i).
  for (int64_t chunk0 = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; chunk0 < chunks;
       chunk0 += stride * kApplyUnroll) {
    T v[kApplyUnroll][P], r[kApplyUnroll][P];
#pragma unroll
    for (int u = 0; u < kApplyUnroll; ++u) {  // all loads first
      const int64_t chunk = chunk0 + u * stride;
      if (chunk >= chunks) break;
      const cuda::WarpChunk c = cuda::warp_chunk<P>(chunk, chunks_per_row);
      cuda::load_run<T, P>(x + c.row * L, c.c0, L, vec, v[u]);
      if (res) cuda::load_run<T, P>(res + c.row * L, c.c0, L, vec, r[u]);
    }
#pragma unroll
    for (int u = 0; u < kApplyUnroll; ++u) {
      const int64_t chunk = chunk0 + u * stride;
      if (chunk >= chunks) break;  // warp-uniform
      apply_chunk<T, P, kFixed>(chunk, chunks_per_row, L, C, lane, coef, q, res != nullptr, relu, vec, v[u], r[u],
                                y, mask, wpg);
    }
  }
}

template <class T, int P, bool kFixed>
__global__ void __launch_bounds__(kThreads)
dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const uint32_t* __restrict__ mask,
          const Coef<acc_t<T>>* __restrict__ coef, T* __restrict__ dx, T* __restrict__ dres, int64_t L,
          int64_t C, int64_t chunks_per_row, int64_t chunks, int64_t wpg, bool vec, int64_t vgrid, int64_t seg) {
  cuda::enter_kernel();
  using A = acc_t<T>;
  const WarpSpan ws = span_of<T>(chunks, vgrid, seg);
  Coef<A> q[kFixed ? P : 1];
  if constexpr (kFixed) {
    if (!kSession4Grid<T> && C <= kSmemCoefMax) {  // block-uniform: one copy of the records per block (see kSmemCoefMax)
      Coef<A>* table = smem_coefs<A>();
      for (int64_t c = threadIdx.x; c < C; c += kThreads) table[c] = coef[c];
      __syncthreads();
      lane_coefs<A, P>(table, C, ws, q);
    } else {
      lane_coefs<A, P>(coef, C, ws, q);
    }
  }
  for (int64_t chunk = ws.first; chunk < ws.lim; chunk += ws.stride) {
    const cuda::WarpChunk c = cuda::warp_chunk<P>(chunk, chunks_per_row);
    if (c.c0 >= L) continue;  // no warp collective in this kernel
    const int64_t base = c.row * L;
    T g[P], v[P];
    cuda::load_run<T, P>(dy + base, c.c0, L, vec, g);
    cuda::load_run<T, P>(x + base, c.c0, L, vec, v);
    // c0 is a multiple of P and P divides 32: the lane's bits share one word.
    const uint32_t bits = mask ? cuda::mask_bits<P>(mask + c.row * wpg, c.c0) : ~0u;
    int64_t ch[P];
    if constexpr (!kFixed) channels_of<P>(c.c0, C, ch);
    const Coef<A>* cg = coef + c.row * C;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      if (!((bits >> k) & 1u)) g[k] = from_acc<T>(A(0));  // select: a masked NaN dy gives 0
      Coef<A> qk;
      if constexpr (kFixed) qk = q[k];
      else qk = cg[ch[k]];
      v[k] = from_acc<T>(qk.a * to_acc(g[k]) + qk.b * (to_acc(v[k]) - qk.shift) + qk.c);
    }
    cuda::store_run<T, P>(dx + base, c.c0, L, vec, v);
    if (dres) cuda::store_run<T, P>(dres + base, c.c0, L, vec, g);
  }
}

// Only the load/store instruction depends on this (elementwise: same results either way).
bool aligned16(const void* p) { return !force_element_loads() && reinterpret_cast<uintptr_t>(p) % 16 == 0; }

cudaError_t chunk_grid(int64_t chunks, int* blocks) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info)) return err;
  const int64_t needed = (chunks + kWarps - 1) / kWarps;
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t(info.sm_count) * 32)));
  return cudaSuccess;
}

int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Grid of the register-coefficient path (one group of `chunks` chunks of 32*P elements, C
// channels): the warp stride S = blocks * kWarps chunks must make S*32*P a multiple of C, i.e.
// blocks a multiple of q = m / gcd(m, kWarps) with m = C / gcd(C, 32*P). With at most one chunk
// per warp any grid works. Always possible: q <= C, far below the 2^31 grid limit.
// `target` is the grid wanted when the data is large: session 3 used 32 blocks per SM (8 waves
// of 4 resident blocks, each wave boundary a stall of the DRAM stream); apply asks for one
// resident wave, and so does dx for 4- and 8-byte types (16-bit dx: the default).
cudaError_t fixed_grid(int64_t chunks, int64_t C, int P, int* blocks, int64_t target = 0) {
  cuda::DeviceInfo info;
  if (cudaError_t err = cuda::device_info(&info)) return err;
  const int64_t needed = (chunks + kWarps - 1) / kWarps;
  if (target <= 0) target = int64_t(info.sm_count) * 32;
  const int64_t m = C / gcd64(C, 32 * int64_t(P));
  const int64_t q = m / gcd64(m, kWarps);
  int64_t b;
  if (needed <= target) b = needed;         // one chunk per warp at most
  else if (q <= target) b = target / q * q;  // a few waves, stride a multiple of C
  else b = std::min(needed, q);
  *blocks = static_cast<int>(std::max<int64_t>(1, b));
  return cudaSuccess;
}

int coef_blocks(int64_t n) { return static_cast<int>((n + 255) / 256); }

// Blocks of `Kernel` (kThreads threads) that fit on the whole chip at once (queried once).
template <auto Kernel>
int64_t resident_blocks() {
  static const int64_t total = [] {
    cuda::DeviceInfo info;
    int n = 0;
    if (cuda::device_info(&info) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0) != cudaSuccess || n < 1) {
      (void)cudaGetLastError();  // do not leave the query's error for the launch check
      return int64_t(0);         // fixed_grid's default
    }
    return int64_t(n) * info.sm_count;
  }();
  return total;
}

// Launch shape of apply/dx: `vgrid` virtual blocks (the grid-stride loop's grid, from fixed_grid
// or chunk_grid), cut into segments of `seg` strides, one block each (warp_span).
struct Segments {
  int64_t vgrid, seg, blocks;
};

constexpr int64_t kSegStrides = 4;  // 4 chunks per warp, then the block ends

Segments segments(int vgrid, int64_t chunks, bool persistent) {
  Segments s;
  s.vgrid = vgrid;
  const int64_t stride = int64_t(vgrid) * kWarps;
  const int64_t steps = std::max<int64_t>(1, (chunks + stride - 1) / stride);
  s.seg = persistent ? steps : std::min(steps, kSegStrides);
  while ((steps + s.seg - 1) / s.seg * s.vgrid > INT32_MAX) s.seg *= 2;  // grid limit (never for real sizes)
  s.blocks = (steps + s.seg - 1) / s.seg * s.vgrid;
  return s;
}

// 16-bit types: session 4's grid as is (one segment per block, the grid-stride loop of span_of).
template <class T>
Segments segments_of(int vgrid, int64_t chunks) {
  return segments(vgrid, chunks, kSession4Grid<T>);
}

template <class T>
size_t coef_smem(bool fixed, int64_t C) {
  return fixed && !kSession4Grid<T> && C <= kSmemCoefMax ? static_cast<size_t>(C) * sizeof(Coef<acc_t<T>>) : 0;
}

}  // namespace

// Launched serially, like the statistics (see stats_cuda).
cudaError_t apply_cuda(cudaStream_t stream, const View& v, const void* x, const void* scale,
                       const void* bias, const void* mean, const void* var, const void* residual, void* y,
                       uint32_t* mask, void* coef, double eps, bool relu) {
  JAXOPS_DISPATCH_FLOAT(v.dtype, T, {
    using A = acc_t<T>;
    constexpr int P = 16 / sizeof(T);
    const int64_t n = v.groups * v.channels, L = v.elements_per_group();
    const bool fixed = v.groups == 1;
    if (!fixed) {  // the register path computes its coefficients itself
      if (cudaError_t err = cuda::launch_serial(forward_coef_kernel<A>, coef_blocks(n), 256, 0, stream,
          static_cast<const A*>(scale), static_cast<const A*>(bias), static_cast<const A*>(mean),
          static_cast<const A*>(var), static_cast<Coef<A>*>(coef), n, A(eps)))
        return err;
    }
    const int64_t cpr = (L + 32 * P - 1) / (32 * P);
    const bool vec = L % P == 0 && aligned16(x) && aligned16(y) && (!residual || aligned16(residual));
    // A generic lambda, so that `if constexpr` drops the other dtype class's kernels.
    auto launch = [&](auto tag) -> cudaError_t {
      using U = decltype(tag);
      int blocks = 0;
      if constexpr (kSession4Grid<U>) {  // session 4's launch: one resident wave, grid-stride
        const int64_t target = resident_blocks<apply_s4_kernel<U, P, true>>();
        if (cudaError_t err = fixed ? fixed_grid(cpr, v.channels, P, &blocks, target)
                                    : chunk_grid(v.groups * cpr, &blocks))
          return err;
        auto kernel = fixed ? apply_s4_kernel<U, P, true> : apply_s4_kernel<U, P, false>;
        return cuda::launch_serial(kernel, blocks, kThreads, 0, stream, static_cast<const U*>(x),
            static_cast<const U*>(residual), static_cast<const Coef<A>*>(coef), static_cast<U*>(y), mask, L, v.channels,
            cpr, v.groups * cpr, v.mask_words, vec, relu, static_cast<const A*>(scale), static_cast<const A*>(bias),
            static_cast<const A*>(mean), static_cast<const A*>(var), A(eps));
      } else {  // one resident wave of virtual blocks, cut into kSegStrides-chunk segments
        const int64_t target = resident_blocks<apply_kernel<U, P, true>>();
        if (cudaError_t err = fixed ? fixed_grid(cpr, v.channels, P, &blocks, target)
                                    : chunk_grid(v.groups * cpr, &blocks))
          return err;
        const Segments sg = segments(blocks, v.groups * cpr, false);
        auto kernel = fixed ? apply_kernel<U, P, true> : apply_kernel<U, P, false>;
        return cuda::launch_serial(kernel, sg.blocks, kThreads, coef_smem<U>(fixed, v.channels), stream,
            static_cast<const U*>(x), static_cast<const U*>(residual), static_cast<const Coef<A>*>(coef),
            static_cast<U*>(y), mask, L, v.channels, cpr, v.groups * cpr, v.mask_words, vec, relu,
            static_cast<const A*>(scale), static_cast<const A*>(bias), static_cast<const A*>(mean),
            static_cast<const A*>(var), A(eps), sg.vgrid, sg.seg);
      }
    };
    if (cudaError_t err = launch(T{})) return err;
  });
  return cudaGetLastError();
}

cudaError_t backward_dx_cuda(cudaStream_t stream, const View& v, const void* dy, const void* x,
                             const uint32_t* mask, const void* scale, const void* mean, const void* var,
                             const void* sum_dy, const void* sum_dyxhat, const void* dmean, const void* dvar,
                             void* dx, void* dres, void* coef, double eps, bool relu, bool train, int64_t count) {
  JAXOPS_DISPATCH_FLOAT(v.dtype, T, {
    using A = acc_t<T>;
    const int64_t n = v.groups * v.channels, L = v.elements_per_group();
    if (cudaError_t err = cuda::launch_kernel(backward_coef_kernel<A>, coef_blocks(n), 256, 0, stream,
        static_cast<const A*>(scale), static_cast<const A*>(mean), static_cast<const A*>(var),
        static_cast<const A*>(sum_dy), static_cast<const A*>(sum_dyxhat), static_cast<const A*>(dmean),
        static_cast<const A*>(dvar), static_cast<Coef<A>*>(coef), n, A(eps), static_cast<A>(count), train))
      return err;
    // 16-bit types: 4 channels a lane, not 8 (lane_channels): 43 registers instead of 70, 5 blocks of
    // 256 an SM instead of 3 (session 13, H100, bf16 dx (128,28,28,256) 71.8 -> 59.6 us,
    // (256,56,56,64) 124.2 -> 115.3).
    constexpr int P = lane_channels<T>();
    const int64_t cpr = (L + 32 * P - 1) / (32 * P);
    const bool vec = L % P == 0 && aligned16(x) && aligned16(dy) && aligned16(dx) && (!dres || aligned16(dres));
    int blocks = 0;
    const bool fixed = v.groups == 1;
    // 16-bit types: session 4's grid (32 blocks per SM, grid-stride); else one resident wave of
    // virtual blocks cut into kSegStrides-chunk segments.
    const int64_t target = kSession4Grid<T> ? 0 : resident_blocks<dx_kernel<T, P, true>>();
    if (cudaError_t err = fixed ? fixed_grid(cpr, v.channels, P, &blocks, target)
                                : chunk_grid(v.groups * cpr, &blocks))
      return err;
    const Segments sg = segments_of<T>(blocks, v.groups * cpr);
    auto kernel = fixed ? dx_kernel<T, P, true> : dx_kernel<T, P, false>;
    if (cudaError_t err = cuda::launch_kernel(kernel, sg.blocks, kThreads, coef_smem<T>(fixed, v.channels), stream,
        static_cast<const T*>(dy), static_cast<const T*>(x), relu ? mask : nullptr, static_cast<const Coef<A>*>(coef),
        static_cast<T*>(dx), static_cast<T*>(dres), L, v.channels, cpr, v.groups * cpr, v.mask_words, vec, sg.vgrid,
        sg.seg)) return err;
  });
  return cudaGetLastError();
}

}  // namespace jaxops::batch_norm
